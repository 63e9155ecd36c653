"""Checkpoint tensors -> module parameters. Each block loads itself (`load(loader, prefix)`, under
the Hugging Face module names) through the one TensorLoader every family uses."""

from __future__ import annotations

import re

import numpy as np
import torch
from torch import nn

from ignition.models.blocks.norms import RMSNorm


class TensorLoader:
    """Sets module parameters from Hugging Face-named checkpoint tensors and records which names
    were used (for `check_fully_loaded`). `take` of several names concatenates them (fused
    projections); `put` swaps a parameter (or buffer) for the tensor after checking its shape."""

    def __init__(self, tensors: dict[str, np.ndarray], copy: bool = True) -> None:
        self.tensors = tensors
        self.copy = copy  # False: share the numpy memory when it is C-contiguous and writable
        self.used: set[str] = set()

    def has(self, name: str) -> bool:
        return name in self.tensors

    def take(self, *names: str) -> torch.Tensor:
        parts = []
        for name in names:
            if name not in self.tensors:
                raise KeyError(f"checkpoint has no tensor {name!r}")
            self.used.add(name)
            array = np.asarray(self.tensors[name], dtype=np.float32)
            if self.copy or not (array.flags.c_contiguous and array.flags.writeable):
                array = np.array(array, dtype=np.float32, order="C")
            parts.append(torch.from_numpy(array))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def put(self, module: nn.Module, attr: str, value: torch.Tensor) -> None:
        current = getattr(module, attr)
        if tuple(current.shape) != tuple(value.shape):
            raise ValueError(
                f"{attr} of {type(module).__name__}: checkpoint shape {tuple(value.shape)} != {tuple(current.shape)}"
            )
        if attr in dict(module.named_buffers(recurse=False)):
            setattr(module, attr, value)
        else:
            setattr(module, attr, nn.Parameter(value, requires_grad=False))

    def linear(self, module: nn.Linear, name: str) -> None:
        """`name`.weight, and `name`.bias when the module has one."""
        self.put(module, "weight", self.take(name + ".weight"))
        if module.bias is not None:
            self.put(module, "bias", self.take(name + ".bias"))

    def norm(self, module: nn.Module, name: str) -> None:
        """A norm's `name`.weight (none for an unscaled norm)."""
        if isinstance(module, RMSNorm) and not module.weighted:
            return
        self.put(module, "weight", self.take(name + ".weight"))

    def lm_head(self, model: nn.Module) -> None:
        """The checkpoint's lm_head.weight, or the token embedding when the architecture ties them."""
        if self.has("lm_head.weight"):
            self.put(model.lm_head, "weight", self.take("lm_head.weight"))
        elif model.arch.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        else:
            raise KeyError("checkpoint has no lm_head.weight and the architecture is not tied")


def check_fully_loaded(model: nn.Module, tensors: dict[str, np.ndarray], used: set[str]) -> None:
    """Every checkpoint tensor used and every parameter set: a silent leftover is a naming bug.
    Precomputed rotary tables some writers store are recomputed in-graph, never loaded."""
    leftover = sorted(n for n in set(tensors) - used if not n.endswith("rotary_emb.inv_freq"))
    if leftover:
        raise ValueError(f"checkpoint tensors not used by the {model.arch.family} model: {leftover[:5]}")
    meta = [n for n, t in model.state_dict().items() if t.is_meta]
    if meta:
        raise ValueError(f"parameters not set from the checkpoint: {meta[:5]}")


# Multimodal checkpoints: the text model's tensors under these prefixes become model.* / lm_head.
_TEXT_PREFIXES = (
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),
)
_NON_TEXT = re.compile(
    r"^(vision_tower|mm_projector|multi_modal_projector|visual|model\.visual|model\.vision_tower"
    r"|model\.multi_modal_projector|audio_tower|model\.audio_tower)\."
)


def text_tensors(tensors: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], list[str]]:
    """Tensors renamed to the text model's names, and the names of the dropped non-text towers."""
    out, dropped = {}, []
    for name, value in tensors.items():
        if _NON_TEXT.match(name):
            dropped.append(name)
            continue
        for old, new in _TEXT_PREFIXES:
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        out[name] = value
    return out, dropped

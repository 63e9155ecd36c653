"""What one export carries from stage to stage (pipeline.py runs the stages over it)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from helios.manifest import Engine, KVLayout, Limits, Manifest, StateLayout, Vision
from ignition.checkpoints.base import Checkpoint
from ignition.models import DecoderLM
from ignition.recipes import Recipe

Progress = Callable[[str, str], None]  # (stage, detail)
SCRATCH_DIR = "fp32"  # in the work folder: the fp32 step graph when the export cache does not keep it
CORE_DIR = "core"  # in the work folder: the core being assembled, renamed to --out at the end


class ExportError(RuntimeError):
    pass


TARGETS = ("cpu", "cuda")


def parse_targets(text: str) -> tuple[str, ...]:
    """--target's comma-separated engines, in TARGETS order; "cpu" is always among them (the ONNX
    graph is what export validates first and what the score graph and drafter build on)."""
    named = {part.strip() for part in text.split(",") if part.strip()}
    unknown = sorted(named - set(TARGETS))
    if unknown or not named:
        raise ExportError(
            f"unknown --target {', '.join(unknown) or repr(text)} (choose from {', '.join(TARGETS)}, comma-separated)"
        )
    return tuple(t for t in TARGETS if t in named or t == "cpu")


@dataclass
class ExportOptions:
    recipe: Recipe
    checkpoint: str  # packaged name, .gguf file or Hugging Face folder
    out: Path
    precision: str = "int4"
    prompt_logprobs: bool = False
    force: bool = False
    cache: bool = True  # reuse/populate the export cache ($FLARE_CACHE/export)
    context_length: int | None = None  # narrows the checkpoint's native context (--context-length)
    drafter: str | None = None  # a smaller checkpoint with the same tokenizer, compiled in (--drafter)
    # Engines to write (--target): "cpu" (the ONNX step graph, always written: validation, the
    # score graph and the drafter build on it) and "cuda" (the torch step program beside it).
    targets: tuple[str, ...] = ("cpu",)
    torch_dtype: str = "bfloat16"  # the torch program's weights (--torch-dtype)


class Reference(Protocol):
    """What validation compares the engine with: the torch model, or logits replayed from the cache."""

    def reference(self, tokens: torch.Tensor) -> torch.Tensor: ...


@dataclass
class ExportState:
    """Each stage reads what earlier stages set and sets its own fields (None until then)."""

    options: ExportOptions
    progress: Progress
    work: Path  # the hidden partial sibling of --out: everything is written under it
    # Where trace writes the fp32 step graph: scratch, unless the export cache keeps it.
    fp32_dir: Path = field(init=False)
    # read
    checkpoint: Checkpoint | None = None
    # convert
    model: DecoderLM | None = None
    reference: Reference | None = None
    # trace (or the export cache in its place)
    kv: KVLayout | None = None
    state_layout: StateLayout | None = None
    fp32_engine: Engine | None = None  # the step engine as the fp32 graph has it
    fp32_graph: Path | None = None
    # limits, set after trace: --context-length is checked against the checkpoint's native context
    limits: Limits | None = None
    # quantize and score: the core's engines, step first
    engines: list[Engine] = field(default_factory=list)
    # the manifest (ignition/export/manifest.py), sealed by write once validate set its parity
    manifest: Manifest | None = None
    # --drafter: the drafter's own manifest (its step engine is already among `engines`)
    drafter: Manifest | None = None
    # a checkpoint with a vision tower: the manifest's image section (its engine is among `engines`)
    vision: Vision | None = None

    def __post_init__(self) -> None:
        self.fp32_dir = self.scratch_dir

    @property
    def recipe(self) -> Recipe:
        return self.options.recipe

    @property
    def scratch_dir(self) -> Path:
        return self.work / SCRATCH_DIR

    @property
    def core_dir(self) -> Path:
        return self.work / CORE_DIR

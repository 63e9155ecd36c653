"""The neutral checkpoint every reader produces and every model family consumes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from helios.manifest import Architecture


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or used, with a message naming what is wrong."""


@dataclass
class Checkpoint:
    """Weights, tokenizer and template of one model, independent of the file format.

    `tensors` uses Hugging Face parameter names (model.layers.{i}.self_attn.q_proj.weight, ...)
    with Hugging Face orientation ([out_features, in_features] for linear weights), already
    de-permuted for llama-style rotary, as float32 numpy arrays (dequantized).
    """

    checkpoint_id: str
    sha256: str
    architecture: Architecture
    tensors: dict[str, np.ndarray]
    tokenizer_json: str  # a Hugging Face tokenizers JSON document
    chat_template: str | None
    bos_token_id: int | None
    eos_token_ids: list[int]  # every id that ends generation
    pad_token_id: int | None
    add_bos: bool
    special_tokens: dict[str, int] = field(default_factory=dict)  # content -> id for control tokens
    source_format: str = "gguf"  # "gguf" | "safetensors"
    source_quantization: str = ""  # e.g. "Q4_K_M" when known
    # The Hugging Face config.json of configured families: their layer plan (MLA, MoE routing,
    # windows, ...) is derived from it (each family's module in ignition/models). Empty for qwen2/llama.
    model_config: dict[str, Any] = field(default_factory=dict)
    # The checkpoint's image processor settings (preprocessor_config.json), empty without one.
    image_processor: dict[str, Any] = field(default_factory=dict)

    def model_inputs(self) -> tuple[Architecture, dict[str, Any], dict[str, np.ndarray]]:
        """The arguments of `ignition.models.build_model`."""
        return self.architecture, self.model_config, self.tensors

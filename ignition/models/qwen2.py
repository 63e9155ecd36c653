"""Qwen2 / Qwen2.5 (incl. -Coder): llama-style decoder with a bias on the q/k/v projections."""

from __future__ import annotations

from helios.manifest import Architecture
from ignition.models.decoder import DecoderLM


class Qwen2ForCausalLM(DecoderLM):
    family = "qwen2"  # the checkpoint readers name it directly (no model_type mapping)

    def __init__(self, arch: Architecture) -> None:
        if not arch.attention_bias:
            raise ValueError("qwen2 checkpoints carry q/k/v biases (attention_bias must be true)")
        super().__init__(arch)

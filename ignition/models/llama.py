"""Llama-architecture decoders (SmolLM2): no projection biases, usually tied embeddings.

Checkpoint readers have already undone llama.cpp's Q/K permutation, so the HF rotate-half
rotary of the shared decoder applies unchanged.
"""

from __future__ import annotations

from helios.manifest import Architecture
from ignition.models.decoder import DecoderLM


class LlamaForCausalLM(DecoderLM):
    family = "llama"  # the checkpoint readers name it directly (no model_type mapping)

    def __init__(self, arch: Architecture) -> None:
        if arch.attention_bias:
            raise ValueError("llama checkpoints have no q/k/v biases (attention_bias must be false)")
        super().__init__(arch)

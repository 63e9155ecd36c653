"""Llama-architecture decoders (SmolLM2): no projection biases, usually tied embeddings.

Checkpoint readers have already undone llama.cpp's Q/K permutation, so the HF rotate-half
rotary in common.py applies unchanged.
"""

from __future__ import annotations

from helios.manifest import Architecture
from ignition.models.common import DecoderLM


class LlamaForCausalLM(DecoderLM):
    def __init__(self, arch: Architecture) -> None:
        if arch.attention_bias:
            raise ValueError("llama checkpoints have no q/k/v biases (attention_bias must be false)")
        super().__init__(arch)

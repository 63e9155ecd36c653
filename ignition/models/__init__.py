"""Model families: one file each; `build_model` picks the class from `Architecture.family`.

Adding a family = one module with a `DecoderLM` subclass plus one line in `FAMILIES`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ignition.checkpoints.base import Architecture
from ignition.models.common import TOP_K, DecoderLM, logprob_stats
from ignition.models.configured import ConfiguredLM
from ignition.models.deepseek_v4 import DeepseekV4LM, build_deepseek_v4
from ignition.models.families import (
    MODEL_TYPES, PLANNED, PLANNED_MODEL_TYPES, PLANNERS, FamilyError, architecture, build_configured, cache_layout,
    logit_postprocessing,
)
from ignition.models.llama import LlamaForCausalLM
from ignition.models.qwen2 import Qwen2ForCausalLM

FAMILIES: dict[str, type[DecoderLM]] = {
    "qwen2": Qwen2ForCausalLM,
    "llama": LlamaForCausalLM,
}


def build_model(
    arch: Architecture, config: dict[str, Any], tensors: dict[str, np.ndarray]
) -> DecoderLM | ConfiguredLM | DeepseekV4LM:
    """A float32 eval-mode model holding a checkpoint's weights (q/k/v and gate/up fused)."""
    if arch.family in PLANNED:
        raise ValueError(f"the {arch.family!r} family cannot be compiled yet: missing {PLANNED[arch.family]}")
    if arch.family == "deepseek_v4":  # its own step model, stateless over the paged pool
        return build_deepseek_v4(config, tensors)
    if arch.family in PLANNERS:
        return build_configured(arch, config, tensors)
    if arch.family not in FAMILIES:
        raise ValueError(f"unknown model family {arch.family!r}; known: {sorted(FAMILIES)}")
    if arch.num_heads % arch.num_kv_heads:
        raise ValueError(f"num_heads {arch.num_heads} is not a multiple of num_kv_heads {arch.num_kv_heads}")
    # Built on the meta device (no random init, no allocation): load_hf_tensors then swaps in
    # the checkpoint tensors and checks that none is left on meta.
    with torch.device("meta"):
        model = FAMILIES[arch.family](arch)
    model.rotary.reset_parameters()  # the rotary table is computed on CPU, not loaded
    model.load_hf_tensors(tensors)
    return model.eval().requires_grad_(False)


__all__ = [
    "FAMILIES", "MODEL_TYPES", "PLANNED", "PLANNED_MODEL_TYPES", "PLANNERS", "TOP_K", "ConfiguredLM", "DecoderLM",
    "FamilyError", "architecture", "build_model", "cache_layout", "logit_postprocessing", "logprob_stats",
]

"""SmolLM3: Llama-style GQA layers and SwiGLU MLPs where every `no_rope_layer_interval`-th layer
(`no_rope_layers[i] == 0`) attends without rotary positions (NoPE); tied embeddings."""

from __future__ import annotations

from typing import Any

from ignition.models.base import FamilyError
from ignition.models.configured import ConfiguredLM
from ignition.models.plans import ModelPlan, config_scaling, dense_gqa_layer


def plan_smollm3(cfg: dict[str, Any]) -> ModelPlan:
    if cfg.get("hidden_act", "silu") != "silu" or cfg.get("mlp_bias"):
        raise FamilyError("only SiLU MLPs without bias are supported")
    if cfg.get("use_sliding_window"):
        raise FamilyError("SmolLM3 sliding-window attention (use_sliding_window) is not supported")
    n = int(cfg["num_hidden_layers"])
    interval = int(cfg.get("no_rope_layer_interval") or 4)
    uses_rope = cfg.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n)]
    if len(uses_rope) != n:
        raise FamilyError(f"no_rope_layers lists {len(uses_rope)} layers, the model has {n}")
    layers = [dense_gqa_layer(cfg) if rope else dense_gqa_layer(cfg, rotary_dim=0) for rope in uses_rope]
    return ModelPlan(layers=layers, rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_scaling=config_scaling(cfg))


class SmolLM3LM(ConfiguredLM):
    family = "smollm3"
    model_types = ("smollm3",)
    planner = staticmethod(plan_smollm3)

"""Mistral and Ministral dense: Llama-style GQA layers and SwiGLU MLPs, with a sliding attention
window on every layer where the config has one (Mistral 7B v0.1: 4096; later releases: none),
served on the paged pool by the configured blocks' windowed attention."""

from __future__ import annotations

from typing import Any

from ignition.models.base import FamilyError
from ignition.models.configured import ConfiguredLM
from ignition.models.plans import ModelPlan, config_scaling, dense_gqa_layer


def plan_mistral(cfg: dict[str, Any]) -> ModelPlan:
    if cfg.get("hidden_act", "silu") != "silu":
        raise FamilyError("only SiLU MLPs are supported")
    window = int(cfg["sliding_window"]) if cfg.get("sliding_window") else None
    n = int(cfg["num_hidden_layers"])
    # Ministral names each layer's kind; Mistral windows every layer when it has a window.
    layer_types = cfg.get("layer_types") or ["sliding_attention"] * n
    unknown = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
    if unknown or len(layer_types) != n:
        raise FamilyError(f"mistral layer types {unknown or layer_types} are not supported")
    return ModelPlan(
        layers=[dense_gqa_layer(cfg, window=window if kind == "sliding_attention" else None) for kind in layer_types],
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        rope_scaling=config_scaling(cfg),
    )


class MistralLM(ConfiguredLM):
    family = "mistral"
    model_types = ("mistral", "ministral")
    planner = staticmethod(plan_mistral)

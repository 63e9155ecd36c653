"""Mistral and Ministral dense: Llama-style GQA layers and SwiGLU MLPs, with a sliding attention
window on every layer where the config has one (Mistral 7B v0.1: 4096; later releases: none),
served on the paged pool by the configured blocks' windowed attention."""

from __future__ import annotations

from typing import Any

from ignition.models.base import FamilyError
from ignition.models.configured import ConfiguredLM
from ignition.models.plans import LayerPlan, ModelPlan, default_rope


def plan_mistral(cfg: dict[str, Any]) -> ModelPlan:
    if cfg.get("hidden_act", "silu") != "silu":
        raise FamilyError("only SiLU MLPs are supported")
    theta, partial = default_rope(cfg)
    window = int(cfg["sliding_window"]) if cfg.get("sliding_window") else None
    n = int(cfg["num_hidden_layers"])
    # Ministral names each layer's kind; Mistral windows every layer when it has a window.
    layer_types = cfg.get("layer_types") or ["sliding_attention"] * n
    unknown = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
    if unknown or len(layer_types) != n:
        raise FamilyError(f"mistral layer types {unknown or layer_types} are not supported")
    return ModelPlan(
        layers=[_layer(cfg, theta, partial, window if kind == "sliding_attention" else None) for kind in layer_types],
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
    )


def _layer(cfg: dict[str, Any], theta: float, partial: float, window: int | None) -> LayerPlan:
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    return LayerPlan(
        kind="gqa",
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        v_head_dim=head_dim,
        rotary_dim=int(head_dim * partial),
        rope_theta=theta,
        window=window,
        o_bias=False,
        intermediate=int(cfg["intermediate_size"]),
    )


class MistralLM(ConfiguredLM):
    family = "mistral"
    model_types = ("mistral", "ministral")
    planner = staticmethod(plan_mistral)

"""Gemma 2: Gemma 3's sandwich layer without QK norms, sliding and global layers alternating
(the first sliding), one rotary base for both, and tanh soft-capping of the attention scores
(attn_logit_softcapping, 50) and of the final logits (final_logit_softcapping, 30). Soft-capped
layers attend on the plain path: the pool kernel has no soft-cap."""

from __future__ import annotations

from typing import Any

from ignition.models.gemma3 import Gemma3LM, gemma_activation, gemma_layer, layer_kinds
from ignition.models.plans import ModelPlan, default_rope


def plan_gemma2(cfg: dict[str, Any]) -> ModelPlan:
    act = gemma_activation(cfg)
    eps = float(cfg.get("rms_norm_eps", 1e-6))
    window = int(cfg["sliding_window"]) if cfg.get("sliding_window") else None
    theta, _ = default_rope(cfg)
    softcap = float(cfg.get("attn_logit_softcapping") or 0.0)
    layers = [
        gemma_layer(cfg, kind, window, act, rope_theta=theta, qk_norm=False, attn_softcap=softcap)
        for kind in layer_kinds(cfg, default_pattern=2)
    ]
    return ModelPlan(
        layers=layers,
        rms_norm_eps=eps,
        head_norm_eps=eps,
        final_softcap=float(cfg.get("final_logit_softcapping") or 0.0),
        embed_scale=float(cfg["hidden_size"]) ** 0.5,
        final_norm_offset=1.0,
    )


class Gemma2LM(Gemma3LM):
    family = "gemma2"
    model_types = ("gemma2",)
    planner = staticmethod(plan_gemma2)

"""Qwen3 dense: Llama-style GQA layers with per-head RMSNorm on q and k (before rotary), SwiGLU
MLPs, rotary as the config scales it (Qwen3's documented YaRN); no attention bias unless the config says so. Its sliding-window variant
(`use_sliding_window`) is refused: no released Qwen3 checkpoint turns it on."""

from __future__ import annotations

from typing import Any

from ignition.models.base import FamilyError
from ignition.models.configured import ConfiguredLM
from ignition.models.plans import ModelPlan, config_scaling, dense_gqa_layer


def plan_qwen3(cfg: dict[str, Any]) -> ModelPlan:
    if cfg.get("hidden_act", "silu") != "silu":
        raise FamilyError("only SiLU MLPs are supported")
    if cfg.get("use_sliding_window"):
        raise FamilyError("Qwen3 sliding-window attention (use_sliding_window) is not supported")
    eps = float(cfg.get("rms_norm_eps", 1e-6))
    layers = [dense_gqa_layer(cfg, qk_norm=True) for _ in range(int(cfg["num_hidden_layers"]))]
    return ModelPlan(layers=layers, rms_norm_eps=eps, head_norm_eps=eps, rope_scaling=config_scaling(cfg))


class Qwen3LM(ConfiguredLM):
    family = "qwen3"
    model_types = ("qwen3",)
    planner = staticmethod(plan_qwen3)

"""Qwen 3.5 (dense and MoE): `linear_attention` layers (gated DeltaNet, recurrent state) and
`full_attention` layers (q_proj yields query and a sigmoid output gate per head, (1 + w) QK
norms, partial rotary), every RMSNorm of the (1 + w) form; a dense SwiGLU (qwen3_5) or
softmax-routed experts with a sigmoid-gated shared expert on every layer (qwen3_5_moe).

Text-only positions: transformers' interleaved multimodal rotary (mrope) gives every section the
same position for text, which is plain rotate-half rotary over the rotary dims. A checkpoint with
its vision tower gets a multimodal step graph (image features at placeholder slots, per-axis
positions) and a vision graph (qwen3_5_vision.py)."""

from __future__ import annotations

from typing import Any

import numpy as np

from helios.manifest import Architecture
from ignition.models.base import FamilyError, text_config
from ignition.models.blocks.mlp import MoEPlan
from ignition.models.configured import ConfiguredLM
from ignition.models.plans import LayerPlan, ModelPlan, default_rope
from ignition.models.qwen3_5_vision import vision_tensors


def plan_qwen3_5(cfg: dict[str, Any]) -> ModelPlan:
    n = int(cfg["num_hidden_layers"])
    interval = int(cfg.get("full_attention_interval") or 4)
    layer_types = list(
        cfg.get("layer_types") or ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]
    )
    unknown = sorted(set(layer_types) - {"linear_attention", "full_attention"})
    if unknown or len(layer_types) != n:
        raise FamilyError(f"qwen3_5 layer types {unknown or layer_types} are not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise FamilyError("only SiLU MLPs are supported")
    theta, partial = default_rope(cfg)
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    moe = None
    if cfg.get("num_experts"):
        moe = MoEPlan(
            num_experts=int(cfg["num_experts"]),
            top_k=int(cfg["num_experts_per_tok"]),
            intermediate=int(cfg["moe_intermediate_size"]),
            scoring="softmax",
            norm_eps=0.0,
            shared_intermediate=int(cfg.get("shared_expert_intermediate_size") or 0),
            shared_gate=bool(cfg.get("shared_expert_intermediate_size")),
        )
    mixer = {
        "key_heads": int(cfg["linear_num_key_heads"]),
        "value_heads": int(cfg["linear_num_value_heads"]),
        "key_dim": int(cfg["linear_key_head_dim"]),
        "value_dim": int(cfg["linear_value_head_dim"]),
        "kernel": int(cfg.get("linear_conv_kernel_dim") or 4),
    }
    if mixer["value_heads"] % mixer["key_heads"]:
        raise FamilyError("linear_num_value_heads must be a multiple of linear_num_key_heads")
    layers = []
    for kind in layer_types:
        linear = kind == "linear_attention"
        layers.append(
            LayerPlan(
                kind="gated_deltanet" if linear else "gqa",
                num_heads=int(cfg["num_attention_heads"]),
                num_kv_heads=int(cfg["num_key_value_heads"]),
                head_dim=head_dim,
                v_head_dim=head_dim,
                rotary_dim=int(head_dim * partial),
                rope_theta=theta,
                qk_norm=True,
                norm_offset=1.0,
                out_gate="query",
                attention_bias=bool(cfg.get("attention_bias", False)),
                intermediate=0 if moe else int(cfg["intermediate_size"]),
                moe=moe,
                mixer=dict(mixer) if linear else {},
            )
        )
    eps = float(cfg.get("rms_norm_eps", 1e-6))
    return ModelPlan(layers=layers, rms_norm_eps=eps, head_norm_eps=eps, final_norm_offset=1.0)


def mrope_section(config: dict[str, Any], tensors: dict[str, np.ndarray]) -> list[int] | None:
    """The interleaved multimodal rotary's (t, h, w) frequency counts when the checkpoint carries
    a vision tower (its step graph then takes image features and mrope positions), else None."""
    if not isinstance(config.get("vision_config"), dict) or not vision_tensors(tensors):
        return None
    return mrope_axes(config)


def mrope_axes(config: dict[str, Any]) -> list[int]:
    """The config's interleaved three-axis mrope_section (FamilyError for any other rotary)."""
    rope = text_config(config).get("rope_parameters") or {}
    section = rope.get("mrope_section")
    if not section or len(section) != 3 or not rope.get("mrope_interleaved", True):
        raise FamilyError(f"qwen3_5 vision needs an interleaved three-axis mrope_section, not {section!r}")
    return [int(n) for n in section]


class Qwen35LM(ConfiguredLM):
    family = "qwen3_5"
    model_types = ("qwen3_5", "qwen3_5_text")
    planner = staticmethod(plan_qwen3_5)

    @classmethod
    def build(cls, arch: Architecture, config: dict[str, Any], tensors: dict[str, np.ndarray]) -> ConfiguredLM:
        model = super().build(arch, config, tensors)
        model.mrope_section = mrope_section(config, tensors)
        return model


class Qwen35MoeLM(Qwen35LM):
    family = "qwen3_5_moe"
    model_types = ("qwen3_5_moe", "qwen3_5_moe_text")

"""Step 3.5 / 3.7 text: full and sliding GQA layers with (1 + w) QK and layer norms, per-head
(g_proj) or per-element sigmoid output gates, per-layer rotary theta / partial factor, clamped
SwiGLU (dense, experts and shared expert, per-layer limits), sigmoid experts whose routed scaling
applies to the experts' sum. Checkpoints in the hub's original layout (stacked `moe.*`,
`share_expert.*`) or transformers' names."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ignition.models.base import FamilyError
from ignition.models.blocks.mlp import GLU, MoEPlan
from ignition.models.configured import ConfiguredLM
from ignition.models.plans import LayerPlan, ModelPlan, per_layer_overrides


@dataclass(frozen=True)
class ClampedGLU(GLU):
    """min(act(gate), limit) * clamp(up, -limit, limit)."""

    limit: float = 0.0

    def unit(self) -> tuple[str, float, float]:
        return "clamp_after", self.limit, 0.0


def clamped(limit: float | None) -> GLU:
    """The SwiGLU of a `swiglu_limits` entry (None or 0: unclamped)."""
    return ClampedGLU(limit=float(limit)) if limit else GLU()


def plan_step3p7(cfg: dict[str, Any]) -> ModelPlan:
    n = int(cfg["num_hidden_layers"])
    layer_types = list(cfg.get("layer_types") or ["full_attention"] * n)
    unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise FamilyError(f"step3p7 layer types {unknown} (the sparse indexer) are not supported yet")
    if cfg.get("use_bidirectional_attention"):
        raise FamilyError("bidirectional step3p7 attention is not a causal decoder")
    mlp_types = list(cfg.get("mlp_layer_types") or ["sparse"] * n)
    limits = cfg.get("swiglu_limits") or [None] * n
    shared_limits = cfg.get("swiglu_limits_shared") or [None] * n
    head_dim = int(cfg.get("head_dim") or 128)
    gating = cfg.get("gating", True)
    rope = cfg.get("rope_parameters") or {}
    layers = []
    legacy_heads = (cfg.get("attention_other_setting") or {}).get("num_attention_heads")
    for i in range(n):
        kind = layer_types[i]
        params = rope.get(kind) or {}
        if not rope:  # hub configs: per-layer rope_theta / partial_rotary_factors lists
            theta, partial = cfg.get("rope_theta", 10000.0), cfg.get("partial_rotary_factors")
            params = {
                "rope_theta": theta[i] if isinstance(theta, list) else theta,
                "partial_rotary_factor": partial[i] if isinstance(partial, list) else 1.0,
            }
        if params.get("rope_type", "default") != "default":
            raise FamilyError(f"rope type {params.get('rope_type')!r} is not supported yet")
        over = dict(per_layer_overrides(cfg, i))
        if legacy_heads and kind == "sliding_attention":
            over.setdefault("num_attention_heads", legacy_heads)
        moe = None
        if mlp_types[i] == "sparse":
            moe = MoEPlan(
                num_experts=int(cfg["n_routed_experts"]),
                top_k=int(cfg["num_experts_per_tok"]),
                intermediate=int(cfg["moe_intermediate_size"]),
                scoring="sigmoid",
                correction_bias=True,
                scaling=float(cfg.get("moe_router_scaling_factor", 1.0)),
                scale_output=True,
                norm_eps=0.0,
                shared_intermediate=int(cfg.get("share_expert_dim") or 0),
                glu=clamped(limits[i]),
                shared_glu=clamped(shared_limits[i]),
            )
        layers.append(
            LayerPlan(
                kind="gqa",
                num_heads=int(over.get("num_attention_heads", cfg["num_attention_heads"])),
                num_kv_heads=int(cfg["num_key_value_heads"]),
                head_dim=head_dim,
                v_head_dim=head_dim,
                rotary_dim=int(head_dim * float(params.get("partial_rotary_factor", 1.0))),
                rope_theta=float(params.get("rope_theta", 10000.0)),
                window=int(cfg["sliding_window"]) if kind == "sliding_attention" else None,
                qk_norm=True,
                norm_offset=1.0,
                out_gate="head" if gating is True or gating == "per-head" else "full",
                scale=float(cfg.get("query_pre_attn_scalar") or head_dim) ** -0.5,
                attention_bias=bool(cfg.get("attention_bias", False)),
                intermediate=int(cfg["intermediate_size"]),
                glu=clamped(shared_limits[i]),
                moe=moe,
            )
        )
    eps = float(cfg.get("rms_norm_eps", 1e-5))
    return ModelPlan(layers=layers, rms_norm_eps=eps, head_norm_eps=eps, final_norm_offset=1.0)


# The hub layout -> transformers' module names (experts stacked [E, ...] per projection).
_RENAMES = [
    (re.compile(a), b)
    for a, b in (
        (r"\.moe\.gate\.weight$", ".mlp.gate.weight"),
        (r"\.moe\.router_bias$", ".mlp.gate.e_score_correction_bias"),
        (r"\.moe\.(gate|up|down)_proj\.weight$", r".mlp.experts.\1_proj"),
        (r"\.share_expert\.", ".mlp.shared_experts."),
    )
]


class Step3p7LM(ConfiguredLM):
    family = "step3p7"
    model_types = ("step3p7", "step3p5")
    planner = staticmethod(plan_step3p7)

    @staticmethod
    def rename(name: str) -> str:
        for pattern, target in _RENAMES:
            name = pattern.sub(target, name)
        return name

"""MiMo-V2-Flash: full and sliding-window (sinks, doubled KV heads) GQA layers with partial rotary
and a per-layer-type theta, q/k heads wider than v heads, values scaled by
`attention_value_scale`, sigmoid group-limited experts without shared experts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ignition.models.blocks.attention import GQAttention
from ignition.models.configured import ConfiguredLM
from ignition.models.plans import LayerPlan, ModelPlan, default_rope, grouped_sigmoid_moe


@dataclass
class MiMoLayerPlan(LayerPlan):
    value_scale: float = 1.0


def plan_mimo_v2_flash(cfg: dict[str, Any]) -> ModelPlan:
    n = int(cfg["num_hidden_layers"])
    layer_types = cfg.get("layer_types") or [
        "full_attention" if (i == 0 or not ((i + 1) % 6)) else "sliding_attention" for i in range(n)
    ]
    mlp_types = cfg.get("mlp_layer_types") or ["dense"] + ["sparse"] * (n - 1)
    head_dim = int(cfg.get("head_dim") or 192)
    window = int(cfg["sliding_window"]) if cfg.get("sliding_window") else None
    layers = []
    for i in range(n):
        swa = layer_types[i] == "sliding_attention"
        theta, partial = default_rope(cfg, layer_types[i])
        moe = None
        if mlp_types[i] == "sparse":
            moe = grouped_sigmoid_moe(cfg, int(cfg["n_routed_experts"]))
        kv_heads = int(cfg["num_key_value_heads"]) * (2 if swa else 1)
        layers.append(
            MiMoLayerPlan(
                kind="gqa",
                num_heads=int(cfg["num_attention_heads"]),
                num_kv_heads=kv_heads,
                head_dim=head_dim,
                v_head_dim=int(cfg.get("v_head_dim") or head_dim),
                rotary_dim=int(head_dim * partial),
                rope_theta=theta,
                window=window if swa else None,
                sinks=swa,
                o_bias=False,
                value_scale=float(cfg.get("attention_value_scale") or 1.0),
                attention_bias=bool(cfg.get("attention_bias", False)),
                intermediate=int(cfg["intermediate_size"]),
                moe=moe,
            )
        )
    return ModelPlan(layers=layers, rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)))


class MiMoAttention(GQAttention):
    def keys_values(self, x, step):
        k, v = super().keys_values(x, step)
        return k, (v * self.plan.value_scale if self.plan.value_scale != 1.0 else v)


class MiMoV2FlashLM(ConfiguredLM):
    family = "mimo_v2_flash"
    model_types = ("mimo_v2_flash",)
    attention = MiMoAttention
    planner = staticmethod(plan_mimo_v2_flash)

    @staticmethod
    def rename(name: str) -> str:
        """Its checkpoints name the sinks attention_sink_bias (transformers renames them to sinks)."""
        return name.replace(".self_attn.attention_sink_bias", ".self_attn.sinks")

"""DeepSeek V3 / Kimi K2 / K2.5 text: absorbed multi-head latent attention (q LoRA or plain q_proj,
interleaved rotary, default or YaRN) and sigmoid group-limited experts with shared experts,
the first `first_k_dense_replace` layers dense."""

from __future__ import annotations

from typing import Any

from ignition.models.base import FamilyError
from ignition.models.blocks.attention import MLAttention
from ignition.models.blocks.rotary import yarn_attention_factor, yarn_mscale
from ignition.models.configured import ConfiguredLM
from ignition.models.plans import LayerPlan, ModelPlan, grouped_sigmoid_moe


def mla_rope(cfg: dict[str, Any]) -> dict[str, Any]:
    """LayerPlan rotary fields and softmax scale of MLA: default rotary, or YaRN (`rope_scaling`
    {"type": "yarn", ...} or rope_parameters) with transformers' attention factor on cos/sin and
    the mscale_all_dim correction of the scale."""
    rope = dict(cfg.get("rope_parameters") or {})
    legacy = dict(cfg.get("rope_scaling") or {})
    if legacy:
        legacy.setdefault("rope_type", legacy.get("type", "default"))
        rope = {**rope, **legacy}
    kind = rope.get("rope_type", rope.get("type", "default"))
    theta = float(rope.get("rope_theta") or cfg.get("rope_theta") or 10000.0)
    scale = (int(cfg["qk_nope_head_dim"]) + int(cfg["qk_rope_head_dim"])) ** -0.5
    if kind == "default":
        return {"rope_theta": theta, "scale": scale}
    if kind != "yarn":
        raise FamilyError(f"rope type {kind!r} is not supported yet (default and yarn are)")
    factor = float(rope.get("factor") or cfg["max_position_embeddings"] / rope["original_max_position_embeddings"])
    mscale_all = rope.get("mscale_all_dim")
    attention = rope.get("attention_factor")
    if attention is None:
        attention = yarn_attention_factor(factor, rope.get("mscale"), mscale_all)
    if mscale_all:
        scale *= yarn_mscale(factor, mscale_all) ** 2
    yarn = (
        factor,
        float(rope.get("beta_fast") or 32),
        float(rope.get("beta_slow") or 1),
        int(rope["original_max_position_embeddings"]),
        bool(rope.get("truncate", True)),
    )
    return {
        "rope_theta": theta,
        "scale": scale,
        "rope_kind": "yarn",
        "rope_yarn": yarn,
        "rope_attention": float(attention),
    }


def plan_deepseek_v3(cfg: dict[str, Any], layer_plan: type[LayerPlan] = LayerPlan) -> ModelPlan:
    """layer_plan: the LayerPlan class to build (a family extending this plan passes its own)."""
    rope = mla_rope(cfg)
    if cfg.get("num_key_value_heads", cfg["num_attention_heads"]) != cfg["num_attention_heads"]:
        raise FamilyError("deepseek_v3 MLA expects num_key_value_heads == num_attention_heads")
    if cfg.get("hidden_act", "silu") != "silu":
        raise FamilyError("only SiLU experts are supported")
    experts = int(cfg["n_routed_experts"])
    layers = []
    for i in range(int(cfg["num_hidden_layers"])):
        moe = None
        if i >= int(cfg.get("first_k_dense_replace", 0)) and experts:
            shared = int(cfg["moe_intermediate_size"]) * int(cfg.get("n_shared_experts") or 0)
            moe = grouped_sigmoid_moe(cfg, experts, shared_intermediate=shared)
        layers.append(
            layer_plan(
                kind="mla",
                num_heads=int(cfg["num_attention_heads"]),
                num_kv_heads=1,
                head_dim=int(cfg["qk_nope_head_dim"]) + int(cfg["qk_rope_head_dim"]),
                v_head_dim=int(cfg["v_head_dim"]),
                rotary_dim=int(cfg["qk_rope_head_dim"]),
                **rope,
                rope_interleave=bool(cfg.get("rope_interleave", True)),
                attention_bias=bool(cfg.get("attention_bias", False)),
                q_lora_rank=cfg.get("q_lora_rank"),
                kv_lora_rank=int(cfg["kv_lora_rank"]),
                qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
                intermediate=int(cfg["intermediate_size"]),
                moe=moe,
            )
        )
    return ModelPlan(layers=layers, rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)))


class DeepseekV3LM(ConfiguredLM):
    family = "deepseek_v3"
    model_types = ("deepseek_v3", "kimi_k2", "kimi_k25")
    attention = MLAttention
    planner = staticmethod(plan_deepseek_v3)

"""Family adapters for `ConfiguredLM`: Hugging Face config -> ModelPlan, checkpoint names -> params.

Each adapter reads the (text) config the way the transformers reference implementation does
and maps the checkpoint's tensor names (the layout the model's own safetensors index uses:
per-expert `mlp.experts.N.{gate,up,down}_proj.weight`, `mlp.gate.weight`, ...) onto the module.
docs/recipes.md lists which recipe compiles which family and what each family still lacks.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from helios.manifest import Architecture, StateLayer, StateLayout
from ignition.models.common import TensorLoader, check_fully_loaded, load_lm_head
from ignition.models.configured import (
    ConfiguredLM,
    LayerPlan,
    ModelPlan,
    MoEPlan,
    kv_layer_indices,
    plan_cache_dims,
    state_layers,
)

# Hugging Face model_type -> flare family. Multimodal wrappers compile their text model
# (their `text_config`); vision/audio towers are not part of the text step graph.
MODEL_TYPES: dict[str, str] = {
    "deepseek_v3": "deepseek_v3",
    "kimi_k2": "deepseek_v3",
    "kimi_k25": "deepseek_v3",
    "mimo_v2_flash": "mimo_v2_flash",
    "gemma4": "gemma4",
    "gemma4_text": "gemma4",
    "step3p7": "step3p7",
    "step3p5": "step3p7",
    "muse_spark": "muse_spark",
    "muse_spark_text": "muse_spark",
    "glm_moe_dsa": "glm_moe_dsa",
    "minimax_m3_vl": "minimax_m3_vl",
    "minimax_m3_vl_text": "minimax_m3_vl",
    "qwen3_5_moe": "qwen3_5_moe",
    "qwen3_5_moe_text": "qwen3_5_moe",
    "qwen3_5": "qwen3_5",
    "qwen3_5_text": "qwen3_5",
    "deepseek_v4": "deepseek_v4",  # its own step model (ignition/models/deepseek_v4.py), not a plan
    "nemotron_h": "nemotron_h",
}

# Families recipes name whose architecture the exporter cannot compile yet, with what is missing.
# `ignition export` refuses them up front with this text (docs/recipes.md has the details).
PLANNED: dict[str, str] = {}
PLANNED_MODEL_TYPES: dict[str, str] = {}


class FamilyError(ValueError):
    pass


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The decoder's config: a multimodal wrapper's `text_config`, else the config itself."""
    inner = config.get("text_config")
    return inner if isinstance(inner, dict) and inner else config


def _rope_theta(cfg: dict[str, Any], layer_type: str | None = None) -> tuple[float, float]:
    """(theta, partial_rotary_factor) for a layer type; non-default rope types are refused."""
    rope = cfg.get("rope_parameters") or {}
    if layer_type is not None and isinstance(rope.get(layer_type), dict):
        rope = rope[layer_type]
    scaling = cfg.get("rope_scaling") or {}
    for params in (rope, scaling):
        kind = params.get("rope_type", params.get("type", "default"))
        if kind != "default":
            raise FamilyError(f"rope type {kind!r} is not supported yet (only default rotary)")
    theta = float(rope.get("rope_theta") or cfg.get("rope_theta") or 10000.0)
    return theta, float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor")) or 1.0)


# -- deepseek_v3 (Kimi K2 / K2.5 text) -----------------------------------------------------------


def plan_glm_moe_dsa(cfg: dict[str, Any]) -> ModelPlan:
    """GLM-5: DeepSeek-V3-style MLA + MoE with the DSA indexer (full / shared per layer)."""
    n = int(cfg["num_hidden_layers"])
    layer_types = list(cfg.get("layer_types") or ["indexed_attention"] * n)
    if set(layer_types) - {"indexed_attention"}:
        raise FamilyError(f"glm_moe_dsa layer types {sorted(set(layer_types))} are not supported yet")
    indexers = list(cfg.get("indexer_types") or ["full"] * n)
    if indexers and indexers[0] != "full":
        raise FamilyError("the first glm_moe_dsa layer must run its own indexer")
    mlp_types = list(cfg.get("mlp_layer_types") or [])
    dense = mlp_types.index("sparse") if "sparse" in mlp_types else n
    if mlp_types != ["dense"] * dense + ["sparse"] * (n - dense):
        raise FamilyError("glm_moe_dsa expects dense layers first, then sparse ones")
    plan = plan_deepseek_v3({**cfg, "first_k_dense_replace": dense, "rope_interleave": True})
    for layer, kind in zip(plan.layers, indexers):
        layer.indexer = kind
        layer.index_heads = int(cfg["index_n_heads"])
        layer.index_head_dim = int(cfg["index_head_dim"])
        layer.index_topk = int(cfg["index_topk"])
    return plan


def _mla_rope(cfg: dict[str, Any]) -> dict[str, Any]:
    """LayerPlan rotary fields and softmax scale of DeepSeek MLA: default rotary, or YaRN (Kimi K2 /
    DeepSeek V3 checkpoints: `rope_scaling` {"type": "yarn", ...} or rope_parameters) with
    transformers' attention factor on cos/sin and the mscale_all_dim correction of the scale."""
    import math

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

    def get_mscale(scale_: float, mscale: float = 1.0) -> float:
        return 1.0 if scale_ <= 1 else 0.1 * mscale * math.log(scale_) + 1.0

    mscale, mscale_all = rope.get("mscale"), rope.get("mscale_all_dim")
    attention = rope.get("attention_factor")
    if attention is None:
        attention = get_mscale(factor, mscale) / get_mscale(factor, mscale_all) if mscale and mscale_all else get_mscale(factor)
    if mscale_all:
        scale *= get_mscale(factor, mscale_all) ** 2
    yarn = (factor, float(rope.get("beta_fast") or 32), float(rope.get("beta_slow") or 1),
            int(rope["original_max_position_embeddings"]), bool(rope.get("truncate", True)))  # fmt: skip
    return {"rope_theta": theta, "scale": scale, "rope_kind": "yarn", "rope_yarn": yarn, "rope_attention": float(attention)}


def _grouped_sigmoid_moe(cfg: dict[str, Any], experts: int, shared_intermediate: int = 0) -> MoEPlan:
    """DeepSeek-V3-style routing (sigmoid scores, correction bias, grouped top-k), which the
    DeepSeek V3 / Kimi and MiMo configs spell with the same keys."""
    return MoEPlan(
        num_experts=experts,
        top_k=int(cfg["num_experts_per_tok"]),
        intermediate=int(cfg["moe_intermediate_size"]),
        scoring="sigmoid",
        correction_bias=True,
        n_group=int(cfg.get("n_group") or 1),
        topk_group=int(cfg.get("topk_group") or 1),
        norm_topk=bool(cfg.get("norm_topk_prob", True)),
        scaling=float(cfg.get("routed_scaling_factor") or 1.0),
        shared_intermediate=shared_intermediate,
    )


def plan_deepseek_v3(cfg: dict[str, Any]) -> ModelPlan:
    rope = _mla_rope(cfg)
    if cfg.get("num_key_value_heads", cfg["num_attention_heads"]) != cfg["num_attention_heads"]:
        raise FamilyError("deepseek_v3 MLA expects num_key_value_heads == num_attention_heads")
    if cfg.get("hidden_act", "silu") != "silu":
        raise FamilyError("only SiLU experts are supported")
    experts = int(cfg["n_routed_experts"])
    layers = []
    for i in range(int(cfg["num_hidden_layers"])):
        moe = None
        if i >= int(cfg.get("first_k_dense_replace", 0)) and experts:
            moe = _grouped_sigmoid_moe(
                cfg, experts, shared_intermediate=int(cfg["moe_intermediate_size"]) * int(cfg.get("n_shared_experts") or 0)
            )
        layers.append(
            LayerPlan(
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
    return ModelPlan(
        layers=layers,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        mtp_layers=int(cfg.get("num_nextn_predict_layers") or 0),
    )


# -- mimo_v2_flash ---------------------------------------------------------------------------------


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
        theta, partial = _rope_theta(cfg, layer_types[i])
        moe = None
        if mlp_types[i] == "sparse":
            moe = _grouped_sigmoid_moe(cfg, int(cfg["n_routed_experts"]))
        kv_heads = int(cfg["num_key_value_heads"]) * (2 if swa else 1)
        layers.append(
            LayerPlan(
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


# -- gemma4 ------------------------------------------------------------------------------------------


def _per_layer(cfg: dict[str, Any], i: int) -> dict[str, Any]:
    for key, values in (cfg.get("per_layer_config") or {}).items():
        if str(key).isdigit() and int(key) == i:
            return values
    return {}


def plan_gemma4(cfg: dict[str, Any]) -> ModelPlan:
    n = int(cfg["num_hidden_layers"])
    layer_types = list(cfg.get("layer_types") or [])
    if len(layer_types) != n:
        raise FamilyError("gemma4 configs must list layer_types")
    if cfg.get("use_bidirectional_attention") == "all":
        raise FamilyError("bidirectional gemma4 attention is not a causal decoder")
    act = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh", "silu": "silu"}.get(cfg.get("hidden_activation", "gelu_pytorch_tanh"))
    if act is None:
        raise FamilyError(f"activation {cfg.get('hidden_activation')!r} is not supported")
    if cfg.get("use_double_wide_mlp"):
        raise FamilyError("use_double_wide_mlp is not supported yet")
    shared_from = n - int(cfg.get("num_kv_shared_layers") or 0)
    rope = cfg.get("rope_parameters") or {}
    layers = []
    for i in range(n):
        kind = layer_types[i]
        params = rope.get(kind) or {}
        rope_type = params.get("rope_type", "default")
        if rope_type not in ("default", "proportional"):
            raise FamilyError(f"gemma4 rope type {rope_type!r} is not supported")
        over = _per_layer(cfg, i)
        head_dim = int(over.get("head_dim", cfg.get("head_dim") or 256))
        kv_heads = int(over.get("num_key_value_heads", cfg["num_key_value_heads"]))
        source = None
        if i >= shared_from:  # the last non-shared layer of the same type produces the cache
            source = max(j for j in range(shared_from) if layer_types[j] == kind)
        moe = None
        if cfg.get("enable_moe_block"):
            moe = MoEPlan(num_experts=int(cfg["num_experts"]), top_k=int(cfg["top_k_experts"]),
                          intermediate=int(cfg["moe_intermediate_size"]), scoring="softmax")  # fmt: skip
        sliding = kind == "sliding_attention"
        layers.append(
            LayerPlan(
                kind="gqa", style="gemma4", num_heads=int(cfg["num_attention_heads"]), num_kv_heads=kv_heads,
                head_dim=head_dim, v_head_dim=head_dim, rotary_dim=head_dim, rope_theta=float(params.get("rope_theta", 10000.0)),
                rope_kind=rope_type, rope_partial=float(params.get("partial_rotary_factor", 1.0)) if rope_type == "proportional" else 1.0,
                window=int(cfg["sliding_window"]) if sliding else None, qk_norm="head", v_norm=True,
                k_eq_v=bool(cfg.get("attention_k_eq_v")) and not sliding, scale=1.0, kv_source=source,
                attention_bias=bool(cfg.get("attention_bias", False)), intermediate=int(cfg["intermediate_size"]),
                moe=moe, act=act,
            )  # fmt: skip
        )
        if float(params.get("factor", 1.0)) != 1.0:
            raise FamilyError("scaled proportional rope is not supported yet")
    ple = int(cfg.get("hidden_size_per_layer_input") or 0)
    return ModelPlan(
        layers=layers,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        head_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        final_softcap=float(cfg.get("final_logit_softcapping") or 0.0),
        embed_scale=float(cfg["hidden_size"]) ** 0.5,
        ple_dim=ple,
        ple_vocab=int(cfg.get("vocab_size_per_layer_input") or cfg["vocab_size"]) if ple else 0,
    )


# -- step3p7 (Step 3.5 / 3.7 text) ---------------------------------------------------------------


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
            params = {"rope_theta": theta[i] if isinstance(theta, list) else theta,
                      "partial_rotary_factor": partial[i] if isinstance(partial, list) else 1.0}  # fmt: skip
        if params.get("rope_type", "default") != "default":
            raise FamilyError(f"rope type {params.get('rope_type')!r} is not supported yet")
        over = dict(_per_layer(cfg, i))
        if legacy_heads and kind == "sliding_attention":
            over.setdefault("num_attention_heads", legacy_heads)
        moe = None
        if mlp_types[i] == "sparse":
            moe = MoEPlan(
                num_experts=int(cfg["n_routed_experts"]), top_k=int(cfg["num_experts_per_tok"]),
                intermediate=int(cfg["moe_intermediate_size"]), scoring="sigmoid", correction_bias=True,
                scaling=float(cfg.get("moe_router_scaling_factor", 1.0)), scale_after=True, norm_eps=0.0,
                shared_intermediate=int(cfg.get("share_expert_dim") or 0), limit=float(limits[i] or 0.0),
                shared_limit=float(shared_limits[i] or 0.0),
            )  # fmt: skip
        layers.append(
            LayerPlan(
                kind="gqa", num_heads=int(over.get("num_attention_heads", cfg["num_attention_heads"])),
                num_kv_heads=int(cfg["num_key_value_heads"]), head_dim=head_dim, v_head_dim=head_dim,
                rotary_dim=int(head_dim * float(params.get("partial_rotary_factor", 1.0))),
                rope_theta=float(params.get("rope_theta", 10000.0)),
                window=int(cfg["sliding_window"]) if kind == "sliding_attention" else None, qk_norm="head",
                norm_offset=1.0, out_gate="head" if gating is True or gating == "per-head" else "full",
                scale=float(cfg.get("query_pre_attn_scalar") or head_dim) ** -0.5,
                attention_bias=bool(cfg.get("attention_bias", False)), intermediate=int(cfg["intermediate_size"]),
                mlp_limit=float(shared_limits[i] or 0.0), moe=moe,
            )  # fmt: skip
        )
    eps = float(cfg.get("rms_norm_eps", 1e-5))
    return ModelPlan(layers=layers, rms_norm_eps=eps, head_norm_eps=eps, final_norm_offset=1.0,
                     mtp_layers=int(cfg.get("num_nextn_predict_layers") or 0))  # fmt: skip


# -- muse_spark ------------------------------------------------------------------------------------


def plan_muse_spark(cfg: dict[str, Any]) -> ModelPlan:
    n = int(cfg["num_hidden_layers"])
    layer_types = list(cfg.get("layer_types") or [])
    mlp_types = list(cfg.get("mlp_layer_types") or ["sparse"] * n)
    thetas = list(cfg.get("layer_rope_theta") or [1.0] * n)
    if len(layer_types) != n or len(thetas) != n:
        raise FamilyError("muse_spark configs must list layer_types and layer_rope_theta")
    theta, partial = _rope_theta(cfg)
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    if cfg.get("hidden_act", "silu") != "silu":
        raise FamilyError("only SiLU MLPs are supported")
    layers = []
    for i in range(n):
        moe = None
        if mlp_types[i] == "sparse":
            moe = MoEPlan(num_experts=int(cfg["num_local_experts"]), top_k=int(cfg["num_experts_per_tok"]),
                          intermediate=int(cfg["moe_intermediate_size"]), correction_bias=True, norm_eps=1e-15,
                          scaling=float(cfg.get("routed_scaling_factor", 1.0)))  # fmt: skip
        layers.append(
            LayerPlan(
                kind="gqa", style="muse", num_heads=int(cfg["num_attention_heads"]),
                num_kv_heads=int(cfg["num_key_value_heads"]), head_dim=head_dim, v_head_dim=head_dim,
                rotary_dim=int(head_dim * partial) if thetas[i] else 0, rope_theta=theta,
                window=int(cfg["sliding_window"]) if layer_types[i] == "sliding_attention" else None,
                qk_norm="head", q_norm_weighted=False, q_scale=float(cfg.get("qk_scale_factor", 1.0)),
                o_norm=True, out_gate="full", attention_bias=bool(cfg.get("attention_bias", False)),
                intermediate=int(cfg["intermediate_size"]), moe=moe,
            )  # fmt: skip
        )
    eps = float(cfg.get("rms_norm_eps", 1e-5))
    return ModelPlan(
        layers=layers, rms_norm_eps=eps, head_norm_eps=eps, embed_norm=True,
        final_softcap=float(cfg.get("final_logit_softcapping") or 0.0),
        logit_multiplier=float(cfg.get("output_multiplier", 1.0)),
        extra={"post_norm_eps": float(cfg.get("post_norm_eps", 1e-8)), "moe_hidden_size": int(cfg.get("moe_hidden_size") or cfg["hidden_size"]),
               "output_multiplier": float(cfg.get("output_multiplier", 1.0)),
               "residual_gate_temperature": float(cfg.get("residual_gate_temperature", 1.0))},
    )  # fmt: skip


# -- minimax_m3_vl (MiniMax M3 text) -----------------------------------------------------------------


def plan_minimax_m3(cfg: dict[str, Any]) -> ModelPlan:
    n = int(cfg["num_hidden_layers"])
    layer_types = list(cfg.get("layer_types") or ["full_attention"] * n)
    unknown = sorted(set(layer_types) - {"full_attention", "minimax_m3_sparse"})
    if unknown:
        raise FamilyError(f"minimax_m3_vl layer types {unknown} are not supported")
    mlp_types = list(cfg.get("mlp_layer_types") or ["sparse"] * n)
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    # As transformers builds it from config.json: partial rotary only through rope_parameters.
    theta, partial = _rope_theta(cfg)
    rotary = int(head_dim * partial)
    alpha, limit = float(cfg.get("swiglu_alpha", 1.702)), float(cfg.get("swiglu_limit", 7.0))
    index_dim = int(cfg.get("index_head_dim") or 0)
    if "minimax_m3_sparse" in layer_types and index_dim < rotary:
        raise FamilyError("an index_head_dim narrower than the rotary width is not supported")
    layers = []
    for i in range(n):
        moe = None
        if mlp_types[i] == "sparse":
            moe = MoEPlan(
                num_experts=int(cfg["num_local_experts"]), top_k=int(cfg["num_experts_per_tok"]),
                intermediate=int(cfg["intermediate_size"]), correction_bias=True, norm_eps=0.0,
                scaling=float(cfg.get("routed_scaling_factor", 1.0)), scale_after=True,
                shared_intermediate=int(cfg.get("shared_intermediate_size") or 0), act="oai", glu_alpha=alpha,
                limit=limit, shared_limit=limit,
            )  # fmt: skip
        sparse = layer_types[i] == "minimax_m3_sparse"
        layers.append(
            LayerPlan(
                kind="gqa", num_heads=int(cfg["num_attention_heads"]), num_kv_heads=int(cfg["num_key_value_heads"]),
                head_dim=head_dim, v_head_dim=head_dim, rotary_dim=rotary, rope_theta=theta, qk_norm="head",
                norm_offset=1.0, o_bias=False, intermediate=int(cfg.get("dense_intermediate_size") or 0),
                act="oai", glu_alpha=alpha, mlp_limit=limit, moe=moe,
                indexer="block" if sparse else "", index_heads=int(cfg.get("index_n_heads") or 0),
                index_head_dim=index_dim, index_block=int(cfg.get("index_block_size") or 0),
                index_blocks=int(cfg.get("index_topk_blocks") or 0), index_local=int(cfg.get("index_local_blocks") or 0),
            )  # fmt: skip
        )
    eps = float(cfg.get("rms_norm_eps", 1e-6))
    return ModelPlan(layers=layers, rms_norm_eps=eps, head_norm_eps=eps, final_norm_offset=1.0)


# -- qwen3_5 / qwen3_5_moe (Qwen 3.5 hybrid: gated DeltaNet + gated attention) ------------------------


def plan_qwen3_5(cfg: dict[str, Any]) -> ModelPlan:
    """Qwen 3.5: `linear_attention` layers (gated DeltaNet, recurrent state) and `full_attention`
    layers (q_proj yields query and a sigmoid output gate per head, (1 + w) QK norms, partial
    rotary), every RMSNorm of the (1 + w) form; a dense SwiGLU (qwen3_5) or softmax-routed experts
    with a sigmoid-gated shared expert on every layer (qwen3_5_moe).

    Text-only positions: transformers' interleaved multimodal rotary (mrope) gives every section
    the same position for text, which is plain rotate-half rotary over the rotary dims."""
    n = int(cfg["num_hidden_layers"])
    interval = int(cfg.get("full_attention_interval") or 4)
    layer_types = list(cfg.get("layer_types") or
                       ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)])  # fmt: skip
    unknown = sorted(set(layer_types) - {"linear_attention", "full_attention"})
    if unknown or len(layer_types) != n:
        raise FamilyError(f"qwen3_5 layer types {unknown or layer_types} are not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise FamilyError("only SiLU MLPs are supported")
    theta, partial = _rope_theta(cfg)
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    moe = None
    if cfg.get("num_experts"):
        moe = MoEPlan(num_experts=int(cfg["num_experts"]), top_k=int(cfg["num_experts_per_tok"]),
                      intermediate=int(cfg["moe_intermediate_size"]), scoring="softmax", norm_eps=0.0,
                      shared_intermediate=int(cfg.get("shared_expert_intermediate_size") or 0),
                      shared_gate=bool(cfg.get("shared_expert_intermediate_size")))  # fmt: skip
    mixer = {"key_heads": int(cfg["linear_num_key_heads"]), "value_heads": int(cfg["linear_num_value_heads"]),
             "key_dim": int(cfg["linear_key_head_dim"]), "value_dim": int(cfg["linear_value_head_dim"]),
             "kernel": int(cfg.get("linear_conv_kernel_dim") or 4)}  # fmt: skip
    if mixer["value_heads"] % mixer["key_heads"]:
        raise FamilyError("linear_num_value_heads must be a multiple of linear_num_key_heads")
    layers = []
    for kind in layer_types:
        linear = kind == "linear_attention"
        layers.append(
            LayerPlan(
                kind="gated_deltanet" if linear else "gqa", num_heads=int(cfg["num_attention_heads"]),
                num_kv_heads=int(cfg["num_key_value_heads"]), head_dim=head_dim, v_head_dim=head_dim,
                rotary_dim=int(head_dim * partial), rope_theta=theta, qk_norm="head", norm_offset=1.0,
                out_gate="query", attention_bias=bool(cfg.get("attention_bias", False)),
                intermediate=0 if moe else int(cfg["intermediate_size"]), moe=moe,
                mixer=dict(mixer) if linear else {},
            )  # fmt: skip
        )
    eps = float(cfg.get("rms_norm_eps", 1e-6))
    return ModelPlan(layers=layers, rms_norm_eps=eps, head_norm_eps=eps, final_norm_offset=1.0,
                     mtp_layers=int(cfg.get("mtp_num_hidden_layers") or 0))  # fmt: skip


# -- nemotron_h (Nemotron-H: Mamba-2 / attention / MLP / MoE single-mixer layers) ---------------------


def plan_nemotron_h(cfg: dict[str, Any]) -> ModelPlan:
    """Nemotron-H (transformers 5.24 `nemotron_h`): every layer is x + mixer(rms_norm(x)) with one
    mixer per `hybrid_override_pattern` / `layers_block_type` entry: "M" Mamba-2 (recurrent state,
    ignition/models/mamba2.py), "*" GQA attention with no positional encoding at all (no rotary,
    no QK norm, no biases, scale head_dim^-0.5), "-" a squared-ReLU MLP (no gate), "E" sigmoid
    group-routed squared-ReLU experts (optionally in a latent width) plus a shared expert. Plain
    RMSNorms with eps `layer_norm_epsilon`."""
    from ignition.models.nemotron_h import layer_kinds, mamba2_spec

    try:
        kinds = layer_kinds(cfg)
        spec = mamba2_spec(cfg) if "mamba" in kinds else None
    except (KeyError, ValueError) as exc:
        raise FamilyError(f"nemotron_h: {exc}") from None
    if "attention" not in kinds:
        raise FamilyError("nemotron_h without attention layers is not supported (the paged pool needs one)")
    act = cfg.get("mlp_hidden_act", "relu2")
    if act != "relu2" and ({"mlp", "moe"} & set(kinds)):
        raise FamilyError(f"nemotron_h MLP activation {act!r} is not supported (only relu2)")
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    bias = bool(cfg.get("mlp_bias", False))
    moe = None
    if "moe" in kinds:
        experts = int(cfg.get("n_routed_experts") or cfg.get("num_local_experts") or 8)
        n_group = int(cfg.get("n_group") or 1)
        if experts % n_group:
            raise FamilyError("nemotron_h n_routed_experts must be a multiple of n_group")
        moe = MoEPlan(
            num_experts=experts, top_k=int(cfg.get("num_experts_per_tok") or 2),
            intermediate=int(cfg.get("moe_intermediate_size") or 7688), scoring="sigmoid", correction_bias=True,
            n_group=n_group, topk_group=int(cfg.get("topk_group") or 1), norm_topk=bool(cfg.get("norm_topk_prob", True)),
            scaling=float(cfg.get("routed_scaling_factor") or 1.0),
            shared_intermediate=int(cfg.get("moe_shared_expert_intermediate_size") or 7688), act="relu2",
            gated=False, latent=int(cfg.get("moe_latent_size") or 0), bias=bias,
        )  # fmt: skip
    mixer = dataclasses.asdict(spec) if spec is not None else {}
    layers = []
    for kind in kinds:
        layers.append(
            LayerPlan(
                kind={"mamba": "mamba2", "attention": "gqa"}.get(kind, "ffn"), style="single", num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads), head_dim=head_dim, v_head_dim=head_dim,
                rotary_dim=0, rope_theta=10000.0, scale=head_dim**-0.5,
                intermediate=int(cfg.get("intermediate_size") or 0) if kind == "mlp" else 0,
                moe=moe if kind == "moe" else None, act="relu2", mlp_bias=bias,
                mixer=dict(mixer) if kind == "mamba" else {},
            )  # fmt: skip
        )
    return ModelPlan(layers=layers, rms_norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
                     mtp_layers=int(cfg.get("num_nextn_predict_layers") or 0))  # fmt: skip


PLANNERS: dict[str, Callable[[dict[str, Any]], ModelPlan]] = {
    "deepseek_v3": plan_deepseek_v3,
    "mimo_v2_flash": plan_mimo_v2_flash,
    "gemma4": plan_gemma4,
    "step3p7": plan_step3p7,
    "muse_spark": plan_muse_spark,
    "glm_moe_dsa": plan_glm_moe_dsa,
    "minimax_m3_vl": plan_minimax_m3,
    "qwen3_5": plan_qwen3_5,
    "qwen3_5_moe": plan_qwen3_5,
    "nemotron_h": plan_nemotron_h,
}


def cache_layout(family: str, config: dict[str, Any], num_layers: int) -> tuple[int, StateLayout | None]:
    """(layers with K/V rows in the pool, the recurrent state layout or None) of a checkpoint's
    family and config: every layer and no state for the attention-only families."""
    if family not in PLANNERS:
        return num_layers, None
    cfg = text_config(config)
    plan = PLANNERS[family](cfg)
    slices = state_layers(plan, int(cfg["hidden_size"]))
    if not slices:
        return len(kv_layer_indices(plan)), None
    layers = [StateLayer(layer=i, kind=kind, offset=offset, size=size) for i, kind, offset, size in slices]
    return len(kv_layer_indices(plan)), StateLayout(width=sum(s.size for s in layers), layers=layers)


def logit_postprocessing(family: str, config: dict[str, Any]) -> str | None:
    """What a family does to its logits after the lm_head, from the config alone (None: nothing).

    The prompt-scoring graph is the bare lm_head, so such a family cannot score prompts: export
    refuses --prompt-logprobs before any tensor is read."""
    if family not in PLANNERS:
        return None
    plan = PLANNERS[family](text_config(config))
    if plan.final_softcap:
        return f"it soft-caps its logits after the lm_head (final_logit_softcapping={plan.final_softcap:g})"
    if plan.logit_multiplier != 1.0:
        return f"it scales its logits after the lm_head (by {plan.logit_multiplier:g})"
    return None


def architecture(family: str, config: dict[str, Any]) -> Architecture:
    """The manifest Architecture of a configured family: the pool geometry is the widest layer's."""
    if family == "deepseek_v4":  # stateless over the paged pool: every layer has K/V rows
        from ignition.models.deepseek_v4 import architecture_of, inv_freq_of, plan_of

        try:
            plan = plan_of(config)
            inv_freq_of(plan, "compress")  # refuses unsupported rotary before any tensor is read
        except ValueError as exc:
            raise FamilyError(str(exc)) from None
        return architecture_of(plan)
    cfg = text_config(config)
    plan = PLANNERS[family](cfg)
    kv_heads, head_dim = plan_cache_dims(plan)
    first = plan.layers[0]
    theta = first.rope_theta
    return Architecture(
        family=family,
        num_layers=len(plan.layers),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg.get("intermediate_size") or 0),
        num_heads=first.num_heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=int(cfg["vocab_size"]),
        rope_theta=theta,
        rms_norm_eps=plan.rms_norm_eps,
        max_position_embeddings=int(cfg.get("max_position_embeddings") or 4096),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", config.get("tie_word_embeddings", False))),
        attention_bias=False,
    )


# -- tensor names ----------------------------------------------------------------------------------

# Multimodal checkpoints: the text model's tensors under these prefixes become model.* / lm_head.
_TEXT_PREFIXES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                  ("model.language_model.", "model."))  # fmt: skip
_NON_TEXT = re.compile(r"^(vision_tower|mm_projector|multi_modal_projector|visual|model\.visual|model\.vision_tower"
                       r"|model\.multi_modal_projector|audio_tower|model\.audio_tower)\.")  # fmt: skip


def text_tensors(tensors: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], list[str]]:
    """Tensors renamed to the text model's names, and the names of the dropped non-text towers."""
    out, dropped = {}, []
    for name, value in tensors.items():
        if _NON_TEXT.match(name):
            dropped.append(name)
            continue
        for old, new in _TEXT_PREFIXES:
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        out[name] = value
    return out, dropped


def load_configured(model: ConfiguredLM, tensors: dict[str, np.ndarray]) -> None:
    """Set every parameter from HF-named tensors; MTP layers (model.layers.N.* for N >= the decoder's
    layer count) are kept aside in model.mtp_tensors. Every other tensor must be used."""
    tensors, _ = text_tensors(tensors)
    loader = TensorLoader(tensors)
    take, put, linear, used = loader.take, loader.put, loader.linear, loader.used

    put(model.embed_tokens, "weight", take("model.embed_tokens.weight"))
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        if layer.plan.recurrent:
            _load_recurrent_layer(layer, p, take, put, linear, tensors)
            continue
        put(layer.input_layernorm, "weight", take(p + "input_layernorm.weight"))
        if layer.post_attention_layernorm.weighted:  # Muse Spark's is unscaled
            put(layer.post_attention_layernorm, "weight", take(p + "post_attention_layernorm.weight"))
        attn, plan = layer.self_attn, layer.plan
        if plan.kind == "mla":
            if plan.q_lora_rank:
                linear(attn.q_a_proj, p + "self_attn.q_a_proj")
                put(attn.q_a_layernorm, "weight", take(p + "self_attn.q_a_layernorm.weight"))
                linear(attn.q_b_proj, p + "self_attn.q_b_proj")
            else:
                linear(attn.q_proj, p + "self_attn.q_proj")
            linear(attn.kv_a_proj_with_mqa, p + "self_attn.kv_a_proj_with_mqa")
            put(attn.kv_a_layernorm, "weight", take(p + "self_attn.kv_a_layernorm.weight"))
            linear(attn.kv_b_proj, p + "self_attn.kv_b_proj")
            if plan.indexer == "full":
                ix = p + "self_attn.indexer."
                for name in ("wq_b", "wk", "weights_proj"):
                    linear(getattr(attn.indexer, name), ix + name)
                put(attn.indexer.k_norm, "weight", take(ix + "k_norm.weight"))
                put(attn.indexer.k_norm, "bias", take(ix + "k_norm.bias"))
        else:
            linear(attn.q_proj, p + "self_attn.q_proj")
            if plan.qk_norm == "head" and plan.q_norm_weighted:
                put(attn.q_norm, "weight", take(p + "self_attn.q_norm.weight"))
            if plan.kv_source is None:
                linear(attn.k_proj, p + "self_attn.k_proj")
                if not plan.k_eq_v:
                    linear(attn.v_proj, p + "self_attn.v_proj")
                if plan.qk_norm == "head" and plan.q_norm_weighted:
                    put(attn.k_norm, "weight", take(p + "self_attn.k_norm.weight"))
            else:  # KV-shared layers: checkpoints may still carry unused k/v weights
                used.update(n for n in tensors if re.match(re.escape(p) + r"self_attn\.(k_proj|v_proj|k_norm|v_norm)\.", n))
            if plan.out_gate == "full":
                linear(attn.gate_proj, p + "self_attn.gate_proj")
            elif plan.out_gate == "head":
                linear(attn.g_proj, p + "self_attn.g_proj")
            if plan.indexer == "block":
                ix = p + "self_attn.indexer."
                linear(attn.indexer.q_proj, ix + "q_proj")
                linear(attn.indexer.k_proj, ix + "k_proj")
                put(attn.indexer.q_norm, "weight", take(ix + "q_norm.weight"))
                put(attn.indexer.k_norm, "weight", take(ix + "k_norm.weight"))
            if plan.sinks:
                # MiMo's checkpoints name them attention_sink_bias (transformers renames to sinks)
                sink = p + "self_attn.attention_sink_bias"
                put(attn, "sinks", take(sink if sink in tensors else p + "self_attn.sinks"))
        linear(attn.o_proj, p + "self_attn.o_proj")
        if plan.style == "gemma4":
            _load_gemma4_layer(layer, p, take, put, linear, tensors)
            continue
        if plan.style == "muse":
            _load_muse_layer(layer, p, take, put, linear)
            continue
        mlp = layer.mlp
        if plan.moe is None:
            _load_glu(mlp, p + "mlp.", take, put, linear, tensors)
            continue
        _load_moe(mlp, plan.moe, p, take, put, linear, tensors)
    if model.plan.ple_dim:
        put(model.embed_tokens_per_layer, "weight", take("model.embed_tokens_per_layer.weight"))
        put(model.per_layer_model_projection, "weight", take("model.per_layer_model_projection.weight"))
        put(model.per_layer_projection_norm, "weight", take("model.per_layer_projection_norm.weight"))
    put(model.norm, "weight", take("model.norm.weight"))
    load_lm_head(model, tensors, take, put)
    n = model.arch.num_layers
    # model.layers.N past the decoder, model.mtp.* or (Qwen 3.5) top-level mtp.*
    mtp = re.compile(r"^(?:model\.layers\.(\d+)\.|(model\.)?mtp\.)")
    for name in set(tensors) - used:
        match = mtp.match(name)
        if match and (match.group(1) is None or int(match.group(1)) >= n):
            model.mtp_tensors[name] = np.asarray(tensors[name])
            used.add(name)
    check_fully_loaded(model, tensors, used)


def _load_moe(mlp, moe: MoEPlan, p: str, take, put, linear, tensors) -> None:  # noqa: ANN001
    """Routed experts in any of the layouts checkpoints use: per-expert tensors
    (`mlp.experts.N.{gate,up,down}_proj.weight`, DeepSeek/Kimi/MiMo), Step's stacked originals
    (`moe.{gate,up,down}_proj.weight` [E, ...], `moe.gate.weight`, `moe.router_bias`,
    `share_expert.*`), or transformers' fused `mlp.experts.gate_up_proj` [E, 2I, H]."""
    step = p + "moe.gate.weight" in tensors
    put(mlp, "gate_weight", take(p + ("moe.gate.weight" if step else "mlp.gate.weight")))
    if moe.correction_bias:
        put(mlp, "correction_bias", take(p + ("moe.router_bias" if step else "mlp.gate.e_score_correction_bias")))
    if step:
        for n in ("gate", "up", "down"):
            put(mlp, f"experts_{n}", take(p + f"moe.{n}_proj.weight"))
    elif p + "mlp.experts.gate_up_proj" in tensors:
        gate_up = take(p + "mlp.experts.gate_up_proj")
        put(mlp, "experts_gate", gate_up[:, : moe.intermediate].contiguous())
        put(mlp, "experts_up", gate_up[:, moe.intermediate :].contiguous())
        put(mlp, "experts_down", take(p + "mlp.experts.down_proj"))
    else:
        for n in ("gate", "up", "down"):
            stacked = torch.stack([take(p + f"mlp.experts.{e}.{n}_proj.weight") for e in range(moe.num_experts)])
            put(mlp, f"experts_{n}", stacked)
    if moe.shared_intermediate:
        shared = "share_expert." if step else "mlp.shared_experts."
        if p + "mlp.shared_expert.down_proj.weight" in tensors:  # Qwen's singular name
            shared = "mlp.shared_expert."
        _load_glu(mlp.shared_experts, p + shared, take, put, linear, tensors)
    if moe.shared_gate:
        linear(mlp.shared_expert_gate, p + "mlp.shared_expert_gate")


def _load_recurrent_layer(layer, p: str, take, put, linear, tensors) -> None:  # noqa: ANN001
    """A recurrent layer: Qwen3.5 gated DeltaNet (`linear_attn.*`), its norms and MLP."""
    plan = layer.plan
    put(layer.input_layernorm, "weight", take(p + "input_layernorm.weight"))
    if plan.kind != "gated_deltanet":
        raise ValueError(f"no checkpoint layout for recurrent kind {plan.kind!r}")
    mixer, q = layer.mixer, p + "linear_attn."
    for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"):
        linear(getattr(mixer, name), q + name)
    put(mixer, "conv_weight", take(q + "conv1d.weight").reshape(mixer.conv_dim, mixer.kernel).contiguous())
    put(mixer, "dt_bias", take(q + "dt_bias"))
    put(mixer, "A_log", take(q + "A_log"))
    put(mixer.norm, "weight", take(q + "norm.weight"))
    if layer.has_mlp:
        put(layer.post_attention_layernorm, "weight", take(p + "post_attention_layernorm.weight"))
        if plan.moe is None:
            _load_glu(layer.mlp, p + "mlp.", take, put, linear, tensors)
        else:
            _load_moe(layer.mlp, plan.moe, p, take, put, linear, tensors)


def _load_glu(mlp, prefix: str, take, put, linear, tensors) -> None:  # noqa: ANN001
    """A gated MLP: separate gate/up projections, or one fused gate_up_proj (gate rows first)."""
    if prefix + "gate_up_proj.weight" in tensors:
        fused = take(prefix + "gate_up_proj.weight")
        inter = fused.shape[0] // 2
        put(mlp.gate_proj, "weight", fused[:inter].contiguous())
        put(mlp.up_proj, "weight", fused[inter:].contiguous())
    else:
        linear(mlp.gate_proj, prefix + "gate_proj")
        linear(mlp.up_proj, prefix + "up_proj")
    linear(mlp.down_proj, prefix + "down_proj")


def _load_muse_layer(layer, p, take, put, linear) -> None:  # noqa: ANN001
    for name in ("input_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"):
        put(getattr(layer, name), "weight", take(p + name + ".weight"))
    for name in ("post_attention_residual_gate", "post_feedforward_residual_gate"):
        put(getattr(layer, name), "gate", take(p + name + ".gate"))
    mlp, moe = layer.mlp, layer.plan.moe
    if moe is None:
        for n in ("gate", "up", "down"):
            linear(getattr(mlp, f"{n}_proj"), p + f"mlp.{n}_proj")
        return
    put(mlp, "gate_weight", take(p + "mlp.gate.weight"))
    put(mlp, "correction_bias", take(p + "mlp.gate.e_score_correction_bias"))
    linear(mlp.pre_expert_proj, p + "mlp.pre_expert_proj")
    put(mlp.pre_expert_norm, "weight", take(p + "mlp.pre_expert_norm.weight"))
    gate_up = take(p + "mlp.experts.gate_up_proj")
    put(mlp, "experts_gate", gate_up[:, : moe.intermediate].contiguous())
    put(mlp, "experts_up", gate_up[:, moe.intermediate :].contiguous())
    put(mlp, "experts_down", take(p + "mlp.experts.down_proj"))
    put(mlp.post_expert_norm, "weight", take(p + "mlp.experts.post_expert_norm.weight"))
    linear(mlp.post_expert_proj, p + "mlp.post_expert_proj")


def _load_gemma4_layer(layer, p, take, put, linear, tensors) -> None:  # noqa: ANN001
    for name in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):
        put(getattr(layer, name), "weight", take(p + name + ".weight"))
    for n in ("gate", "up", "down"):
        linear(getattr(layer.mlp, f"{n}_proj"), p + f"mlp.{n}_proj")
    plan = layer.plan
    if plan.moe:
        moe = layer.moe
        put(moe, "gate_weight", take(p + "router.proj.weight"))
        put(moe, "router_scale", take(p + "router.scale"))
        put(moe, "per_expert_scale", take(p + "router.per_expert_scale"))
        gate_up = take(p + "experts.gate_up_proj")  # [E, 2I, H]: gate rows, then up rows
        inter = plan.moe.intermediate
        put(moe, "experts_gate", gate_up[:, :inter].contiguous())
        put(moe, "experts_up", gate_up[:, inter:].contiguous())
        put(moe, "experts_down", take(p + "experts.down_proj"))
        for name in ("post_feedforward_layernorm_1", "post_feedforward_layernorm_2", "pre_feedforward_layernorm_2"):
            put(getattr(layer, name), "weight", take(p + name + ".weight"))
    if hasattr(layer, "per_layer_input_gate"):
        linear(layer.per_layer_input_gate, p + "per_layer_input_gate")
        linear(layer.per_layer_projection, p + "per_layer_projection")
        put(layer.post_per_layer_input_norm, "weight", take(p + "post_per_layer_input_norm.weight"))
    put(layer, "layer_scalar", take(p + "layer_scalar"))


def load_nemotron_h(model: ConfiguredLM, tensors: dict[str, np.ndarray]) -> None:
    """Nemotron-H's names, as its checkpoints and transformers' save_pretrained write them:
    `backbone.embeddings.weight`, `backbone.layers.N.norm.weight`, `backbone.layers.N.mixer.*`,
    `backbone.norm_f.weight`, `lm_head.weight` (transformers' own module names, `model.*`, are
    accepted too). Experts per expert (`mixer.experts.E.{up,down}_proj.weight`) or stacked
    (`mixer.experts.{up,down}_proj` [E, ...]). `mtp.*` tensors are kept aside."""
    from ignition.models.mamba2 import load_mamba2

    renamed = {("backbone." + name[len("model."):] if name.startswith("model.") else name): name for name in tensors}
    names = {new: tensors[old] for new, old in renamed.items()}
    loader = TensorLoader(names)
    take, put, linear, used = loader.take, loader.put, loader.linear, loader.used

    put(model.embed_tokens, "weight", take("backbone.embeddings.weight"))
    for i, layer in enumerate(model.layers):
        p, plan = f"backbone.layers.{i}.", layer.plan
        put(layer.input_layernorm, "weight", take(p + "norm.weight"))
        m = p + "mixer."
        if plan.kind == "mamba2":
            used.update(load_mamba2(layer.mixer, names, m))
        elif plan.kind == "gqa":
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                linear(getattr(layer.self_attn, proj), m + proj)
        elif plan.moe is None:
            linear(layer.mlp.up_proj, m + "up_proj")
            linear(layer.mlp.down_proj, m + "down_proj")
        else:
            mlp, moe = layer.mlp, plan.moe
            put(mlp, "gate_weight", take(m + "gate.weight"))
            put(mlp, "correction_bias", take(m + "gate.e_score_correction_bias"))
            for n in ("up", "down"):
                if f"{m}experts.{n}_proj" in names:  # stacked [E, ...], as transformers holds them
                    put(mlp, f"experts_{n}", take(f"{m}experts.{n}_proj"))
                else:
                    stacked = [take(f"{m}experts.{e}.{n}_proj.weight") for e in range(moe.num_experts)]
                    put(mlp, f"experts_{n}", torch.stack(stacked))
            if moe.latent:
                linear(mlp.fc1_latent_proj, m + "fc1_latent_proj")
                linear(mlp.fc2_latent_proj, m + "fc2_latent_proj")
            if moe.shared_intermediate:
                linear(mlp.shared_experts.up_proj, m + "shared_experts.up_proj")
                linear(mlp.shared_experts.down_proj, m + "shared_experts.down_proj")
    put(model.norm, "weight", take("backbone.norm_f.weight"))
    load_lm_head(model, names, take, put)
    for name in set(names) - used:  # multi-token prediction heads: kept for speculative decoding
        if re.match(r"^(backbone\.)?mtp\.", name):
            model.mtp_tensors[renamed[name]] = np.asarray(names[name])
            used.add(name)
    check_fully_loaded(model, names, used)


def build_configured(arch: Architecture, config: dict[str, Any], tensors: dict[str, np.ndarray]) -> ConfiguredLM:
    plan = PLANNERS[arch.family](text_config(config))
    with torch.device("meta"):
        model = ConfiguredLM(arch, plan)
    for module in model.modules():  # rotary frequencies are computed, never loaded
        if hasattr(module, "inv_freq"):
            module.inv_freq = _inv_freq_of(module.plan)
    if arch.family == "nemotron_h":
        load_nemotron_h(model, tensors)
    else:
        load_configured(model, tensors)
    return model.eval().requires_grad_(False)


def _inv_freq_of(plan: LayerPlan) -> torch.Tensor:
    from ignition.models.configured import layer_inv_freq

    return layer_inv_freq(plan)

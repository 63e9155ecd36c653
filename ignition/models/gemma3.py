"""Gemma 3 (text; Gemma 2's layout without soft-capping, with QK norms): sliding and global GQA
layers (a local rotary base on sliding ones) with (1 + w) QK norms and a query_pre_attn_scalar
softmax scale, sandwich norms around attention and the GELU-tanh MLP (every norm of the (1 + w)
form), scaled embeddings, tied lm_head; the global layers' linear-scaled rotary of Gemma 3 4B and
larger. The layer and its plan are shared with Gemma 2 (ignition/models/gemma2.py)."""

from __future__ import annotations

from typing import Any

from ignition.models.base import FamilyError
from ignition.models.blocks.loading import TensorLoader
from ignition.models.blocks.mlp import GLU
from ignition.models.blocks.norms import RMSNorm
from ignition.models.configured import ConfiguredLM, PreNormLayer
from ignition.models.plans import LayerPlan, ModelPlan

ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def layer_kinds(cfg: dict[str, Any], default_pattern: int = 6) -> list[str]:
    """Each layer's attention kind: `layer_types`, else every `sliding_window_pattern`-th global
    (Gemma 3: 6; Gemma 2 alternates, 2)."""
    n = int(cfg["num_hidden_layers"])
    if cfg.get("layer_types"):
        kinds = list(cfg["layer_types"])
    else:
        pattern = int(cfg.get("sliding_window_pattern") or default_pattern)
        kinds = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)]
    if len(kinds) != n or set(kinds) - {"sliding_attention", "full_attention"}:
        raise FamilyError(f"Gemma layer types {kinds} are not supported")
    return kinds


def gemma_activation(cfg: dict[str, Any]) -> str:
    act = ACTIVATIONS.get(cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh")
    if act is None:
        raise FamilyError(f"activation {cfg.get('hidden_activation')!r} is not supported")
    if cfg.get("use_bidirectional_attention"):
        raise FamilyError("bidirectional attention is not a causal decoder")
    return act


def rope_of(cfg: dict[str, Any], kind: str) -> tuple[float, str, float]:
    """(base, rotary kind, linear factor) of a layer kind: transformers 5's per-kind
    rope_parameters, or the older rope_theta / rope_local_base_freq pair with `rope_scaling` on
    the global layers (Gemma 3 4B and larger: linear, factor 8)."""
    params = (cfg.get("rope_parameters") or {}).get(kind) or {}
    scaling = params
    if not params and kind == "full_attention":  # older configs scale the global layers only
        scaling = cfg.get("rope_scaling") or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in ("default", "linear"):
        raise FamilyError(f"gemma3 {kind} rope scaling {scaling} is not supported")
    factor = float(scaling.get("factor") or 1.0) if rope_type == "linear" else 1.0
    if params.get("rope_theta"):
        theta = float(params["rope_theta"])
    elif kind == "sliding_attention":
        theta = float(cfg.get("rope_local_base_freq") or 10000.0)
    else:
        theta = float(cfg.get("rope_theta") or 1000000.0)
    return theta, rope_type, factor


def plan_gemma3(cfg: dict[str, Any]) -> ModelPlan:
    act = gemma_activation(cfg)
    for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(cap):
            raise FamilyError(f"{cap} is Gemma 2's (model_type gemma2), not Gemma 3's")
    eps = float(cfg.get("rms_norm_eps", 1e-6))
    window = int(cfg["sliding_window"])
    layers = []
    for kind in layer_kinds(cfg):
        theta, rope_kind, factor = rope_of(cfg, kind)
        layers.append(gemma_layer(cfg, kind, window, act, rope_theta=theta, rope_kind=rope_kind, rope_factor=factor))
    return ModelPlan(
        layers=layers,
        rms_norm_eps=eps,
        head_norm_eps=eps,
        embed_scale=float(cfg["hidden_size"]) ** 0.5,
        final_norm_offset=1.0,
    )


def gemma_layer(cfg: dict[str, Any], kind: str, window: int | None, act: str, **overrides: Any) -> LayerPlan:
    """A Gemma layer of `kind` (sliding or full attention): (1 + w) norms, the
    query_pre_attn_scalar softmax scale, the GELU-tanh MLP; `overrides` carry the family's
    rotary, QK norms and soft-cap."""
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or 256)
    fields: dict[str, Any] = dict(
        kind="gqa",
        num_heads=heads,
        num_kv_heads=int(cfg["num_key_value_heads"]),
        head_dim=head_dim,
        v_head_dim=head_dim,
        rotary_dim=head_dim,
        rope_theta=10000.0,
        window=window if kind == "sliding_attention" else None,
        qk_norm=True,
        scale=float(cfg.get("query_pre_attn_scalar") or head_dim) ** -0.5,
        attention_bias=bool(cfg.get("attention_bias", False)),
        o_bias=False,
        norm_offset=1.0,
        intermediate=int(cfg["intermediate_size"]),
        glu=GLU(act),
    )
    return LayerPlan(**{**fields, **overrides})


class SandwichLayer(PreNormLayer):
    """x + post_norm(attn(norm(x))), then + post_ff_norm(mlp(pre_ff_norm(x)))."""

    def __init__(self, plan: LayerPlan, hidden: int, eps: float, head_eps: float, attention) -> None:
        super().__init__(plan, hidden, eps, head_eps, attention)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps, offset=plan.norm_offset, fusable=True)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, offset=plan.norm_offset, fusable=True)

    def forward(self, x, step, past_k, past_v, shared=None, per_layer_input=None):
        attn, k, v = self.self_attn(self.input_layernorm(x), step, past_k, past_v, shared)
        x = x + self.post_attention_layernorm(attn)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x))), k, v

    def load(self, loader: TensorLoader, p: str) -> None:
        super().load(loader, p)
        loader.norm(self.pre_feedforward_layernorm, p + "pre_feedforward_layernorm")
        loader.norm(self.post_feedforward_layernorm, p + "post_feedforward_layernorm")


class Gemma3LM(ConfiguredLM):
    family = "gemma3"
    model_types = ("gemma3", "gemma3_text")
    planner = staticmethod(plan_gemma3)

    def make_layer(self, plan: LayerPlan) -> SandwichLayer:
        return SandwichLayer(
            plan, self.arch.hidden_size, self.plan.rms_norm_eps, self.plan.head_norm_eps, self.attention
        )

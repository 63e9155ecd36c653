"""Gemma 4 (text): sliding and global GQA layers with QK norms and unscaled value norms, K = V
on global layers (`attention_k_eq_v`: no v_proj), KV-shared trailing layers, proportional rotary
on global layers; sandwich norms around attention and the MLP, an expert block in parallel with
the dense MLP (normed/scaled softmax router with per-expert scales), per-layer input embeddings
(PLE), per-layer output scalars, scaled embeddings and a final logit soft-cap."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ignition.models.base import FamilyError
from ignition.models.blocks.attention import GQAttention
from ignition.models.blocks.loading import TensorLoader
from ignition.models.blocks.mlp import GLU, Experts, MoEPlan, SwiGLU, activation
from ignition.models.blocks.norms import RMSNorm
from ignition.models.configured import ConfiguredLM
from ignition.models.plans import LayerPlan, ModelPlan, per_layer_overrides


@dataclass
class Gemma4LayerPlan(LayerPlan):
    k_eq_v: bool = False  # values are the raw key projection (no v_proj)


@dataclass
class Gemma4ModelPlan(ModelPlan):
    ple_dim: int = 0  # per-layer input embeddings width (0: none)
    ple_vocab: int = 0


def plan_gemma4(cfg: dict[str, Any]) -> Gemma4ModelPlan:
    n = int(cfg["num_hidden_layers"])
    layer_types = list(cfg.get("layer_types") or [])
    if len(layer_types) != n:
        raise FamilyError("gemma4 configs must list layer_types")
    if cfg.get("use_bidirectional_attention") == "all":
        raise FamilyError("bidirectional gemma4 attention is not a causal decoder")
    act = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh", "silu": "silu"}.get(
        cfg.get("hidden_activation", "gelu_pytorch_tanh")
    )
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
        over = per_layer_overrides(cfg, i)
        head_dim = int(over.get("head_dim", cfg.get("head_dim") or 256))
        kv_heads = int(over.get("num_key_value_heads", cfg["num_key_value_heads"]))
        source = None
        if i >= shared_from:  # the last non-shared layer of the same type produces the cache
            source = max(j for j in range(shared_from) if layer_types[j] == kind)
        moe = None
        if cfg.get("enable_moe_block"):
            moe = MoEPlan(
                num_experts=int(cfg["num_experts"]),
                top_k=int(cfg["top_k_experts"]),
                intermediate=int(cfg["moe_intermediate_size"]),
                scoring="softmax",
                glu=GLU(act),
            )
        sliding = kind == "sliding_attention"
        layers.append(
            Gemma4LayerPlan(
                kind="gqa",
                num_heads=int(cfg["num_attention_heads"]),
                num_kv_heads=kv_heads,
                head_dim=head_dim,
                v_head_dim=head_dim,
                rotary_dim=head_dim,
                rope_theta=float(params.get("rope_theta", 10000.0)),
                rope_kind=rope_type,
                rope_partial=float(params.get("partial_rotary_factor", 1.0)) if rope_type == "proportional" else 1.0,
                window=int(cfg["sliding_window"]) if sliding else None,
                qk_norm=True,
                k_eq_v=bool(cfg.get("attention_k_eq_v")) and not sliding,
                scale=1.0,
                kv_source=source,
                attention_bias=bool(cfg.get("attention_bias", False)),
                intermediate=int(cfg["intermediate_size"]),
                moe=moe,
                glu=GLU(act),
            )
        )
        if float(params.get("factor", 1.0)) != 1.0:
            raise FamilyError("scaled proportional rope is not supported yet")
    ple = int(cfg.get("hidden_size_per_layer_input") or 0)
    return Gemma4ModelPlan(
        layers=layers,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        head_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        final_softcap=float(cfg.get("final_logit_softcapping") or 0.0),
        embed_scale=float(cfg["hidden_size"]) ** 0.5,
        ple_dim=ple,
        ple_vocab=int(cfg.get("vocab_size_per_layer_input") or cfg["vocab_size"]) if ple else 0,
    )


class Gemma4Attention(GQAttention):
    def __init__(self, plan: Gemma4LayerPlan, hidden: int, eps: float) -> None:
        super().__init__(plan, hidden, eps)
        if plan.k_eq_v and plan.kv_source is None:
            self.v_proj = None
        self.v_norm = RMSNorm(plan.v_head_dim, eps, weighted=False)

    def keys_values(self, x, step):
        p = self.plan
        batch, length, _ = x.shape
        k = self.k_proj(x).reshape(batch, length, p.num_kv_heads, p.head_dim)
        v = k if p.k_eq_v else self.v_proj(x).reshape(batch, length, p.num_kv_heads, p.v_head_dim)
        return self.rotate(self.k_norm(k), step), self.v_norm(v)


class Gemma4Router(nn.Module):
    """Softmax over the unscaled-normed input (times a learned scale and hidden^-0.5), top-k
    renormalised, times per-expert scales."""

    def __init__(self, plan: MoEPlan, hidden: int, eps: float) -> None:
        super().__init__()
        self.plan = plan
        self.norm = RMSNorm(hidden, eps, weighted=False)
        self.scale = nn.Parameter(torch.ones(hidden))
        self.weight = nn.Parameter(torch.zeros(plan.num_experts, hidden))
        self.per_expert_scale = nn.Parameter(torch.ones(plan.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.norm(x) * self.scale * (x.shape[-1] ** -0.5)
        probs = torch.softmax(h @ self.weight.t(), dim=-1)
        weights, idx = probs.topk(self.plan.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        return idx, weights * self.per_expert_scale[idx]


class Gemma4Layer(nn.Module):
    def __init__(self, plan: Gemma4LayerPlan, hidden: int, eps: float, ple_dim: int) -> None:
        super().__init__()
        self.plan = plan
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps)
        self.self_attn = Gemma4Attention(plan, hidden, eps)
        self.mlp = SwiGLU(hidden, plan.intermediate, plan.glu)
        if plan.moe:
            self.router = Gemma4Router(plan.moe, hidden, eps)
            self.experts = Experts(plan.moe.num_experts, plan.moe.intermediate, hidden, plan.moe.glu)
            self.post_feedforward_layernorm_1 = RMSNorm(hidden, eps)
            self.post_feedforward_layernorm_2 = RMSNorm(hidden, eps)
            self.pre_feedforward_layernorm_2 = RMSNorm(hidden, eps)
        if ple_dim:
            self.per_layer_input_gate = nn.Linear(hidden, ple_dim, bias=False)
            self.per_layer_projection = nn.Linear(ple_dim, hidden, bias=False)
            self.post_per_layer_input_norm = RMSNorm(hidden, eps)
        self.layer_scalar = nn.Parameter(torch.ones(1))

    def forward(self, x, step, past_k, past_v, shared=None, per_layer_input=None):
        attn, k, v = self.self_attn(self.input_layernorm(x), step, past_k, past_v, shared)
        x = x + self.post_attention_layernorm(attn)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        if self.plan.moe:  # the expert block runs in parallel with the dense MLP
            flat = x.reshape(-1, x.shape[-1])
            idx, weights = self.router(flat)
            experts = self.experts(self.pre_feedforward_layernorm_2(flat), idx, weights)
            h = self.post_feedforward_layernorm_1(h) + self.post_feedforward_layernorm_2(experts.reshape(x.shape))
        x = x + self.post_feedforward_layernorm(h)
        if per_layer_input is not None:
            g = activation(self.plan.glu.act, self.per_layer_input_gate(x)) * per_layer_input
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(g))
        return x * self.layer_scalar, k, v

    def load(self, loader: TensorLoader, p: str) -> None:
        for name in (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        ):
            loader.norm(getattr(self, name), p + name)
        self.self_attn.load(loader, p + "self_attn.")
        self.mlp.load(loader, p + "mlp.")
        if self.plan.moe:
            loader.put(self.router, "weight", loader.take(p + "router.proj.weight"))
            loader.put(self.router, "scale", loader.take(p + "router.scale"))
            loader.put(self.router, "per_expert_scale", loader.take(p + "router.per_expert_scale"))
            self.experts.load(loader, p + "experts.")
            for name in ("post_feedforward_layernorm_1", "post_feedforward_layernorm_2", "pre_feedforward_layernorm_2"):
                loader.norm(getattr(self, name), p + name)
        if hasattr(self, "per_layer_input_gate"):
            loader.linear(self.per_layer_input_gate, p + "per_layer_input_gate")
            loader.linear(self.per_layer_projection, p + "per_layer_projection")
            loader.norm(self.post_per_layer_input_norm, p + "post_per_layer_input_norm")
        loader.put(self, "layer_scalar", loader.take(p + "layer_scalar"))


class Gemma4LM(ConfiguredLM):
    family = "gemma4"
    model_types = ("gemma4", "gemma4_text")
    planner = staticmethod(plan_gemma4)
    plan: Gemma4ModelPlan

    def __init__(self, arch, plan: Gemma4ModelPlan) -> None:
        super().__init__(arch, plan)
        if plan.ple_dim:  # per-layer inputs: a token table and a projection of the embedding
            n = len(plan.layers)
            self.embed_tokens_per_layer = nn.Embedding(plan.ple_vocab, n * plan.ple_dim)
            self.per_layer_model_projection = nn.Linear(arch.hidden_size, n * plan.ple_dim, bias=False)
            self.per_layer_projection_norm = RMSNorm(plan.ple_dim, plan.rms_norm_eps)

    def make_layer(self, plan: LayerPlan) -> nn.Module:
        return Gemma4Layer(plan, self.arch.hidden_size, self.plan.rms_norm_eps, self.plan.ple_dim)

    def embed(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        x, _ = super().embed(input_ids)
        plan = self.plan
        if not plan.ple_dim:
            return x, None
        n = len(plan.layers)
        tokens = self.embed_tokens_per_layer(input_ids) * torch.tensor(plan.ple_dim**0.5, dtype=torch.float32)
        tokens = tokens.reshape(*input_ids.shape, n, plan.ple_dim)
        context = self.per_layer_model_projection(x) * (self.arch.hidden_size**-0.5)
        context = self.per_layer_projection_norm(context.reshape(*input_ids.shape, n, plan.ple_dim))
        return x, (context + tokens) * (2.0**-0.5)

    def load_embeddings(self, loader: TensorLoader) -> None:
        super().load_embeddings(loader)
        if self.plan.ple_dim:
            loader.put(self.embed_tokens_per_layer, "weight", loader.take("model.embed_tokens_per_layer.weight"))
            loader.linear(self.per_layer_model_projection, "model.per_layer_model_projection")
            loader.norm(self.per_layer_projection_norm, "model.per_layer_projection_norm")

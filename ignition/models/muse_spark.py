"""Muse Spark (text): GQA with unscaled QK norms and a query scale (`qk_scale_factor`), unscaled
per-head output norms before a per-element sigmoid gate, NoPE layers (layer_rope_theta 0); (1 + w)
pre-norms, unscaled post-norms / an input-scaled post-FFN norm and learned residual gates instead
of plain residual adds; sigmoid experts in a projected width; an unscaled embedding norm and an
output multiplier before the final logit soft-cap."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ignition.models.base import FamilyError
from ignition.models.blocks.attention import GQAttention
from ignition.models.blocks.loading import TensorLoader
from ignition.models.blocks.mlp import Experts, MoE, MoEPlan, SwiGLU
from ignition.models.blocks.norms import RMSNorm
from ignition.models.configured import ConfiguredLM
from ignition.models.moe_ops import ACTIVATIONS, experts
from ignition.models.plans import LayerPlan, ModelPlan, default_rope


@dataclass
class MuseLayerPlan(LayerPlan):
    q_scale: float = 1.0  # multiplier on the normed query


@dataclass
class MuseModelPlan(ModelPlan):
    post_norm_eps: float = 1e-8
    moe_hidden: int = 0  # the experts' projected width
    residual_gate_temperature: float = 1.0


def plan_muse_spark(cfg: dict[str, Any]) -> MuseModelPlan:
    n = int(cfg["num_hidden_layers"])
    layer_types = list(cfg.get("layer_types") or [])
    mlp_types = list(cfg.get("mlp_layer_types") or ["sparse"] * n)
    thetas = list(cfg.get("layer_rope_theta") or [1.0] * n)
    if len(layer_types) != n or len(thetas) != n:
        raise FamilyError("muse_spark configs must list layer_types and layer_rope_theta")
    theta, partial = default_rope(cfg)
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    if cfg.get("hidden_act", "silu") != "silu":
        raise FamilyError("only SiLU MLPs are supported")
    multiplier = float(cfg.get("output_multiplier", 1.0))
    layers = []
    for i in range(n):
        moe = None
        if mlp_types[i] == "sparse":  # the router's logits are scaled by the output multiplier too
            moe = MoEPlan(
                num_experts=int(cfg["num_local_experts"]),
                top_k=int(cfg["num_experts_per_tok"]),
                intermediate=int(cfg["moe_intermediate_size"]),
                correction_bias=True,
                norm_eps=1e-15,
                scaling=float(cfg.get("routed_scaling_factor", 1.0)),
                logit_scale=multiplier,
            )
        layers.append(
            MuseLayerPlan(
                kind="gqa",
                num_heads=int(cfg["num_attention_heads"]),
                num_kv_heads=int(cfg["num_key_value_heads"]),
                head_dim=head_dim,
                v_head_dim=head_dim,
                rotary_dim=int(head_dim * partial) if thetas[i] else 0,
                rope_theta=theta,
                window=int(cfg["sliding_window"]) if layer_types[i] == "sliding_attention" else None,
                qk_norm=True,
                q_scale=float(cfg.get("qk_scale_factor", 1.0)),
                out_gate="full",
                attention_bias=bool(cfg.get("attention_bias", False)),
                intermediate=int(cfg["intermediate_size"]),
                moe=moe,
            )
        )
    eps = float(cfg.get("rms_norm_eps", 1e-5))
    return MuseModelPlan(
        layers=layers,
        rms_norm_eps=eps,
        head_norm_eps=eps,
        final_softcap=float(cfg.get("final_logit_softcapping") or 0.0),
        logit_multiplier=multiplier,
        post_norm_eps=float(cfg.get("post_norm_eps", 1e-8)),
        moe_hidden=int(cfg.get("moe_hidden_size") or cfg["hidden_size"]),
        residual_gate_temperature=float(cfg.get("residual_gate_temperature", 1.0)),
    )


class InputScaledRMSNorm(nn.Module):
    """rms_norm(x * (1 + w)) (the scale before the norm)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * (1.0 + self.weight)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class ResidualGate(nn.Module):
    """alpha * residual + beta * h with beta = sigmoid(g / T) and
    alpha = sqrt(max(sigmoid(-g / T) * (1 + beta), 1e-3))."""

    def __init__(self, hidden: int, temperature: float) -> None:
        super().__init__()
        self.temperature = temperature
        self.gate = nn.Parameter(torch.zeros(hidden))

    def forward(self, residual: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        w = self.gate / self.temperature
        beta = torch.sigmoid(w)
        alpha = torch.sqrt(torch.clamp(torch.sigmoid(-w) * (1.0 + beta), min=1e-3))
        return alpha * residual + beta * h


class MuseAttention(GQAttention):
    def __init__(self, plan: MuseLayerPlan, hidden: int, eps: float) -> None:
        super().__init__(plan, hidden, eps)
        self.q_norm = RMSNorm(plan.head_dim, eps, weighted=False)
        self.k_norm = RMSNorm(plan.head_dim, eps, weighted=False)
        self.o_norm = RMSNorm(plan.v_head_dim, eps, weighted=False)

    def queries(self, x, step):
        p = self.plan
        batch, length, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(batch, length, p.num_heads, p.head_dim))
        return self.rotate(q * p.q_scale if p.q_scale != 1.0 else q, step), None

    def gate_output(self, out, x, gate):
        return super().gate_output(self.o_norm(out), x, gate)


class MuseExperts(Experts):
    """Each expert's output input-scale-normed before the weighted sum. Routed: one experts call
    per routing column with unit weights (each reads only its column's experts), each column's
    outputs normed, then weighed; eager torch computes the same thing densely."""

    def __init__(self, plan: MoEPlan, width: int, eps: float) -> None:
        super().__init__(plan.num_experts, plan.intermediate, width, plan.glu)
        self.post_expert_norm = InputScaledRMSNorm(width, eps)

    def outputs(self, h: torch.Tensor) -> torch.Tensor:
        return self.post_expert_norm(super().outputs(h))

    def forward(self, h: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if self.glu is None or self.glu.act not in ACTIVATIONS:
            return super().forward(h, idx, weights)
        ones = torch.ones_like(weights[:, :1])
        total = torch.zeros_like(h)
        for j in range(idx.shape[1]):
            out = experts(h, idx[:, j : j + 1], ones, self.up, self.down, self.gate, self.glu.act, *self.glu.unit())
            total = total + weights[:, j : j + 1] * self.post_expert_norm(out)
        return total

    def load(self, loader: TensorLoader, prefix: str) -> None:
        super().load(loader, prefix)
        loader.norm(self.post_expert_norm, prefix + "post_expert_norm")


class MuseMoE(MoE):
    """Routed on the layer input; the experts run in `moe_hidden` width: pre_expert_proj -> (1 + w)
    norm -> experts -> weighted sum -> post_expert_proj."""

    def __init__(self, plan: MoEPlan, hidden: int, model: MuseModelPlan) -> None:
        super().__init__(plan, hidden, model.moe_hidden)
        self.experts = MuseExperts(plan, model.moe_hidden, model.post_norm_eps)
        self.pre_expert_proj = nn.Linear(hidden, model.moe_hidden, bias=False)
        self.pre_expert_norm = RMSNorm(model.moe_hidden, model.rms_norm_eps, offset=1.0)
        self.post_expert_proj = nn.Linear(model.moe_hidden, hidden, bias=False)

    def expert_input(self, flat: torch.Tensor) -> torch.Tensor:
        return self.pre_expert_norm(self.pre_expert_proj(flat))

    def expert_output(self, out: torch.Tensor) -> torch.Tensor:
        return self.post_expert_proj(out)

    def load(self, loader: TensorLoader, prefix: str) -> None:
        super().load(loader, prefix)
        loader.linear(self.pre_expert_proj, prefix + "pre_expert_proj")
        loader.norm(self.pre_expert_norm, prefix + "pre_expert_norm")
        loader.linear(self.post_expert_proj, prefix + "post_expert_proj")


class MuseLayer(nn.Module):
    def __init__(self, plan: MuseLayerPlan, hidden: int, model: MuseModelPlan) -> None:
        super().__init__()
        self.plan = plan
        eps, post_eps, temperature = model.rms_norm_eps, model.post_norm_eps, model.residual_gate_temperature
        self.input_layernorm = RMSNorm(hidden, eps, offset=1.0)
        self.self_attn = MuseAttention(plan, hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, post_eps, weighted=False)
        self.post_attention_residual_gate = ResidualGate(hidden, temperature)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps, offset=1.0)
        self.mlp = MuseMoE(plan.moe, hidden, model) if plan.moe else SwiGLU(hidden, plan.intermediate, plan.glu)
        self.post_feedforward_layernorm = InputScaledRMSNorm(hidden, post_eps)
        self.post_feedforward_residual_gate = ResidualGate(hidden, temperature)

    def forward(self, x, step, past_k, past_v, shared=None, per_layer_input=None):
        attn, k, v = self.self_attn(self.input_layernorm(x), step, past_k, past_v, shared)
        x = self.post_attention_residual_gate(x, self.post_attention_layernorm(attn))
        h = self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return self.post_feedforward_residual_gate(x, h), k, v

    def load(self, loader: TensorLoader, p: str) -> None:
        for name in (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        ):
            loader.norm(getattr(self, name), p + name)
        for name in ("post_attention_residual_gate", "post_feedforward_residual_gate"):
            loader.put(getattr(self, name), "gate", loader.take(p + name + ".gate"))
        self.self_attn.load(loader, p + "self_attn.")
        self.mlp.load(loader, p + "mlp.")


class MuseSparkLM(ConfiguredLM):
    family = "muse_spark"
    model_types = ("muse_spark", "muse_spark_text")
    planner = staticmethod(plan_muse_spark)
    plan: MuseModelPlan

    def __init__(self, arch, plan: MuseModelPlan) -> None:
        super().__init__(arch, plan)
        self.embed_norm = RMSNorm(arch.hidden_size, plan.rms_norm_eps, weighted=False)

    def make_layer(self, plan: LayerPlan) -> nn.Module:
        return MuseLayer(plan, self.arch.hidden_size, self.plan)

    def embed(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        x, _ = super().embed(input_ids)
        return self.embed_norm(x), None

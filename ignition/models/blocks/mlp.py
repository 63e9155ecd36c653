"""Feed-forward blocks: gated (GLU) and plain MLPs, and one mixture of experts whose routing
and expert activation are data (MoEPlan) and small strategy objects (GLU variants; routers
subclass TopKRouter). Families subclass MoE for projected expert widths (`expert_input` /
`expert_output`) and define their own GLU variants."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ignition.models.blocks.loading import TensorLoader
from ignition.models.moe_ops import ACTIVATIONS, activation, experts, gated


@dataclass(frozen=True)
class GLU:
    """The gated unit act(gate) * up; families subclass it for clamped variants, each one of
    moe_ops.UNITS (which flare's routed-expert kernels compute too)."""

    act: str = "silu"

    def unit(self) -> tuple[str, float, float]:
        """(moe_ops unit, limit, alpha)."""
        return "glu", 0.0, 0.0

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return gated(self.act, *self.unit(), gate, up)


class SwiGLU(nn.Module):
    """Gated MLP: down(glu(gate(x), up(x)))."""

    def __init__(self, hidden: int, intermediate: int, glu: GLU = GLU()) -> None:
        super().__init__()
        self.glu = glu
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.gate_up_proj: nn.Linear | None = None  # fuse_gate_up's one projection (gate rows first)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:  # fuse_gate_up: the form the int4 kernel fuses whole
            gate, up = self.gate_up_proj(x).split(self.gate_up_proj.out_features // 2, dim=-1)
            return self.down_proj(self.glu(gate, up))
        return self.down_proj(self.glu(self.gate_proj(x), self.up_proj(x)))

    @torch.no_grad()
    def fuse_gate_up(self) -> bool:
        """With a plain SiLU unit, replace gate_proj and up_proj by one gate_up_proj (gate rows
        first): the exported Split -> silu(gate) * up is what ai.flare.MatMulInt4 computes as one
        node (activation "swiglu"), three nodes fewer. Returns whether it fused."""
        if type(self.glu) is not GLU or self.glu.act != "silu":  # a GLU subclass is a clamped unit
            return False
        gate_up = nn.Linear(self.gate_proj.in_features, 2 * self.gate_proj.out_features, bias=False, device="cpu")
        gate_up.weight = nn.Parameter(torch.cat([self.gate_proj.weight, self.up_proj.weight]), requires_grad=False)
        self.gate_up_proj = gate_up
        del self.gate_proj, self.up_proj
        return True

    def load(self, loader: TensorLoader, prefix: str) -> None:
        """Separate gate/up projections, or one fused gate_up_proj (gate rows first)."""
        if loader.has(prefix + "gate_up_proj.weight"):
            fused = loader.take(prefix + "gate_up_proj.weight")
            inter = fused.shape[0] // 2
            loader.put(self.gate_proj, "weight", fused[:inter].contiguous())
            loader.put(self.up_proj, "weight", fused[inter:].contiguous())
        else:
            loader.linear(self.gate_proj, prefix + "gate_proj")
            loader.linear(self.up_proj, prefix + "up_proj")
        loader.linear(self.down_proj, prefix + "down_proj")


class PlainMLP(nn.Module):
    """Non-gated MLP: down(act(up(x)))."""

    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool = False) -> None:
        super().__init__()
        self.act = act
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(activation(self.act, self.up_proj(x)))

    def load(self, loader: TensorLoader, prefix: str) -> None:
        loader.linear(self.up_proj, prefix + "up_proj")
        loader.linear(self.down_proj, prefix + "down_proj")


@dataclass
class MoEPlan:
    num_experts: int
    top_k: int
    intermediate: int
    scoring: str = "sigmoid"  # "sigmoid" | "softmax" | "sqrtsoftplus"
    correction_bias: bool = False  # e_score_correction_bias added for the choice only
    n_group: int = 1  # group-limited top-k: the best `topk_group` of `n_group` groups (top-2 sums)
    topk_group: int = 1
    norm_topk: bool = True
    norm_eps: float = 1e-20  # added to the top-k weight sum when renormalising
    scaling: float = 1.0
    scale_output: bool = False  # routed scaling on the experts' weighted sum rather than the weights
    logit_scale: float = 1.0  # router logits times this before scoring
    glu: GLU = GLU()
    shared_intermediate: int = 0  # 0: no shared expert
    shared_glu: GLU = GLU()
    shared_gate: bool = False  # sigmoid(shared_expert_gate(x)) scales the shared expert


class TopKRouter(nn.Module):
    """Scores from one linear map, the top-k choice (optionally over score + correction bias,
    group-limited), weights gathered from the scores, renormalised and scaled."""

    def __init__(self, plan: MoEPlan, hidden: int) -> None:
        super().__init__()
        self.plan = plan
        self.weight = nn.Parameter(torch.zeros(plan.num_experts, hidden))
        if plan.correction_bias:
            self.correction_bias = nn.Parameter(torch.zeros(plan.num_experts))

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        p = self.plan
        logits = x @ self.weight.t()
        if p.logit_scale != 1.0:
            logits = logits * p.logit_scale
        if p.scoring == "sigmoid":
            return logits.sigmoid()
        if p.scoring == "softmax":
            return logits.softmax(-1)
        if p.scoring == "sqrtsoftplus":
            return torch.sqrt(F.softplus(logits))
        raise ValueError(f"unknown router scoring {p.scoring!r}")

    def choose(self, scores: torch.Tensor) -> torch.Tensor:
        """The chosen experts [N, top_k]."""
        p = self.plan
        choice = scores + self.correction_bias if p.correction_bias else scores
        if p.n_group > 1:
            n = choice.shape[0]
            grouped = choice.reshape(n, p.n_group, p.num_experts // p.n_group)
            group_scores = grouped.topk(2, dim=-1)[0].sum(-1)
            group_idx = group_scores.topk(p.topk_group, dim=-1)[1]
            keep = torch.zeros_like(group_scores).scatter(1, group_idx, 1.0) > 0
            keep = keep.unsqueeze(-1).expand_as(grouped).reshape(n, p.num_experts)
            choice = choice.masked_fill(~keep, float("-inf"))
        return choice.topk(p.top_k, dim=-1)[1]

    def weigh(self, scores: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        p = self.plan
        weights = scores.gather(1, idx)
        if p.norm_topk:
            weights = weights / (weights.sum(-1, keepdim=True) + p.norm_eps)
        return idx, weights if p.scale_output else weights * p.scaling

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] -> (expert ids [N, top_k], their weights [N, top_k])."""
        scores = self.scores(x)
        return self.weigh(scores, self.choose(scores))


class Experts(nn.Module):
    """Stacked expert weights. Gated (glu(gate h, up h)) or, with glu None, plain (act(up h)).
    Eager torch computes every expert and combines them with the sparse routing weights (exact);
    the exported graph computes only the routed ones (moe_ops: flare's ai.flare.MoE) unless a
    subclass computes its own `outputs` (those keep the dense einsums)."""

    def __init__(self, num: int, intermediate: int, width: int, glu: GLU | None, act: str = "silu") -> None:
        super().__init__()
        self.num, self.glu, self.act = num, glu, act
        if glu is not None:
            self.gate = nn.Parameter(torch.zeros(num, intermediate, width))
        self.up = nn.Parameter(torch.zeros(num, intermediate, width))
        self.down = nn.Parameter(torch.zeros(num, width, intermediate))

    def outputs(self, h: torch.Tensor) -> torch.Tensor:
        """Every expert's output [E, N, width] for h [N, width]."""
        up = torch.einsum("nh,eih->eni", h, self.up)
        if self.glu is None:
            return torch.einsum("eni,ehi->enh", activation(self.act, up), self.down)
        gate = torch.einsum("nh,eih->eni", h, self.gate)
        return torch.einsum("eni,ehi->enh", self.glu(gate, up), self.down)

    def routed_activation(self) -> str | None:
        """The activation flare's MoE kernel computes this unit with, or None when it cannot
        (a subclass with its own `outputs`)."""
        if type(self).outputs is not Experts.outputs:
            return None
        act = self.act if self.glu is None else self.glu.act
        return act if act in ACTIVATIONS else None

    def forward(self, h: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        act = self.routed_activation()
        if act is not None:
            if self.glu is None:
                return experts(h, idx, weights, self.up, self.down, None, act)
            return experts(h, idx, weights, self.up, self.down, self.gate, act, *self.glu.unit())
        # scatter_add: a routing table may name one expert twice (its weight then counts twice)
        dense = torch.zeros(h.shape[0], self.num).scatter_add(1, idx, weights)  # [N, E]
        return (self.outputs(h) * dense.t().unsqueeze(-1)).sum(0)

    def load(self, loader: TensorLoader, prefix: str) -> None:
        """Any layout checkpoints use: transformers' fused `gate_up_proj` [E, 2I, H] and `down_proj`,
        stacked `{gate,up,down}_proj` [E, ...], or per expert `N.{gate,up,down}_proj.weight`."""
        if loader.has(prefix + "gate_up_proj"):
            gate_up = loader.take(prefix + "gate_up_proj")
            inter = self.up.shape[1]
            loader.put(self, "gate", gate_up[:, :inter].contiguous())
            loader.put(self, "up", gate_up[:, inter:].contiguous())
            loader.put(self, "down", loader.take(prefix + "down_proj"))
            return
        for n in ("up", "down") if self.glu is None else ("gate", "up", "down"):
            if loader.has(f"{prefix}{n}_proj"):
                loader.put(self, n, loader.take(f"{prefix}{n}_proj"))
            else:
                loader.put(self, n, torch.stack([loader.take(f"{prefix}{e}.{n}_proj.weight") for e in range(self.num)]))


class MoE(nn.Module):
    """Routed experts plus an optional (optionally sigmoid-gated) shared expert on the input. The
    experts run in `width` (default: hidden); a subclass then maps in and out (`expert_input`,
    `expert_output`)."""

    def __init__(self, plan: MoEPlan, hidden: int, width: int | None = None) -> None:
        super().__init__()
        self.plan = plan
        self.router = TopKRouter(plan, hidden)
        self.experts = Experts(plan.num_experts, plan.intermediate, width or hidden, plan.glu)
        if plan.shared_intermediate:
            self.shared_experts = SwiGLU(hidden, plan.shared_intermediate, plan.shared_glu)
        if plan.shared_gate:
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def expert_input(self, flat: torch.Tensor) -> torch.Tensor:
        """What the experts see (the router always sees the layer input)."""
        return flat

    def expert_output(self, out: torch.Tensor) -> torch.Tensor:
        """The experts' weighted sum back to the layer's width."""
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        idx, weights = self.router(flat)
        out = self.expert_output(self.experts(self.expert_input(flat), idx, weights))
        if self.plan.scale_output:
            out = out * self.plan.scaling
        if self.plan.shared_intermediate:
            shared = self.shared_experts(flat)
            if self.plan.shared_gate:
                shared = torch.sigmoid(self.shared_expert_gate(flat)) * shared
            out = out + shared
        return out.reshape(x.shape)

    def load(self, loader: TensorLoader, prefix: str) -> None:
        """`{prefix}gate.weight` (+ `gate.e_score_correction_bias`), `experts.*`, and the shared
        expert (`shared_experts.*` or `shared_expert.*`, `shared_expert_gate`)."""
        loader.put(self.router, "weight", loader.take(prefix + "gate.weight"))
        if self.plan.correction_bias:
            loader.put(self.router, "correction_bias", loader.take(prefix + "gate.e_score_correction_bias"))
        self.experts.load(loader, prefix + "experts.")
        if self.plan.shared_intermediate:
            singular = loader.has(prefix + "shared_expert.down_proj.weight")
            self.shared_experts.load(loader, prefix + ("shared_expert." if singular else "shared_experts."))
        if self.plan.shared_gate:
            loader.linear(self.shared_expert_gate, prefix + "shared_expert_gate")

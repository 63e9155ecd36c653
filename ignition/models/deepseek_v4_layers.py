"""The modules of a DeepSeek-V4 layer (see deepseek_v4.py for the pool layout): the per-step merged
history, the compressors of the compressed (CSA/HCA) layers, the CSA lightning indexer, the
shared-KV MQA with sinks and a grouped low-rank output projection, hyper-connections, and the
hash- or top-k-routed experts."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ignition.models.blocks.indexer import lightning_select
from ignition.models.blocks.loading import TensorLoader
from ignition.models.blocks.mlp import GLU, MoE, MoEPlan, TopKRouter
from ignition.models.blocks.norms import RMSNorm
from ignition.models.blocks.rotary import rotate_trailing_pairs

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


@dataclass
class V4Plan:
    """What the step graph needs from a DeepSeek-V4 config (normalised as transformers does)."""

    vocab_size: int
    hidden: int
    num_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    eps: float
    window: int
    hc_mult: int
    hc_iters: int
    hc_eps: float
    layer_types: list[str]
    mlp_types: list[str]
    rates: dict[str, int]
    index_heads: int
    index_dim: int
    index_topk: int
    num_experts: int
    top_k: int
    moe_intermediate: int
    routed_scaling: float
    swiglu_limit: float
    main_theta: float
    compress_rope: dict[str, Any]
    max_positions: int
    tie_word_embeddings: bool

    def channels(self, layer_type: str) -> int:
        """Pool channels per token of one layer (see the module docstring)."""
        d = self.head_dim
        if layer_type == HCA:
            return 3 * d
        if layer_type == CSA:
            return 5 * d + 4 * self.index_dim
        return d

    def cache_dims(self) -> tuple[int, int]:
        """(kv_heads, head_dim) of the pool: a slot's K and V heads hold the widest layer's channels."""
        widest = max(self.channels(t) for t in self.layer_types)
        return -(-widest // (2 * self.head_dim)), self.head_dim


# -- per-step state -------------------------------------------------------------------------------


class V4Step:
    """Per-step tensors shared by every layer: the merged history + new sequence layout, masks,
    and rotary tables (built once per step)."""

    def __init__(
        self,
        window: int,
        cos_sin: Callable[[str, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
        positions: torch.Tensor,
        history_lens: torch.Tensor,
        hist: int,
    ) -> None:
        self.cos_sin = cos_sin  # the model's rotary tables: (kind, positions) -> cos, sin
        self.positions = positions
        length = positions.shape[1]
        total = hist + length
        # Merged sequence: slot j holds position j (history slot j while j < history_lens, else
        # new token j - history_lens); slots past each row's last token are never visible.
        slot = torch.arange(total).unsqueeze(0)  # [1, T]
        rel = (slot - history_lens.unsqueeze(1)).clamp(min=0)  # [B, T]
        self.from_new = torch.minimum(rel, torch.full_like(rel, length - 1))
        self.is_history = (slot < history_lens.unsqueeze(1)).unsqueeze(-1)  # [B, T, 1]
        q = positions.unsqueeze(-1)  # [B, L, 1]
        self.sliding = (slot.unsqueeze(0) <= q) & (q - slot.unsqueeze(0) < window)  # [B, L, T]
        self.total = total
        self._rope: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._windows: dict[int, tuple] = {}

    def merge(self, past: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """past [B, S, C] (pool slots) and new [B, L, C] -> [B, S+L, C] in position order."""
        padded = torch.cat([past, torch.zeros_like(new)], dim=1)
        gathered = torch.gather(new, 1, self.from_new.unsqueeze(-1).expand(-1, -1, new.shape[-1]))
        return torch.where(self.is_history, padded, gathered)

    def rope(self, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, L, 1, rope/2] of the new tokens' positions."""
        if kind not in self._rope:
            self._rope[kind] = self.cos_sin(kind, self.positions.unsqueeze(-1))
        return self._rope[kind]

    def windows(self, rate: int) -> tuple[int, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """(n_w * rate: the merged length padded to whole windows, entry visibility [B, L, n_w]:
        window w complete at the query, and cos/sin [1, n_w, rope/2] of the entries' positions w * rate)."""
        if rate not in self._windows:
            count = (self.total + rate - 1) // rate
            entry = torch.arange(count)
            visible = entry.view(1, 1, -1) < torch.div(self.positions + 1, rate, rounding_mode="floor").unsqueeze(-1)
            cos_sin = self.cos_sin("compress", (entry * rate).view(1, -1))  # [1, n_w, rope/2]
            self._windows[rate] = (count * rate, visible, cos_sin)
        return self._windows[rate]


# -- modules --------------------------------------------------------------------------------------


class Compressor(nn.Module):
    """One compressed series (the CSA/HCA compressor, or the CSA indexer's keys): softmax-gated
    sums of per-token projections over each window, normed and rotated at the window start."""

    def __init__(self, hidden: int, dim: int, rate: int, overlap: bool, eps: float) -> None:
        super().__init__()
        self.dim, self.rate, self.overlap = dim, rate, overlap
        width = 2 * dim if overlap else dim
        self.kv_proj = nn.Linear(hidden, width, bias=False)
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(rate, width))
        self.kv_norm = RMSNorm(dim, eps)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """Per-token channels kept in the pool: [kv | raw gate]."""
        return torch.cat([self.kv_proj(x), self.gate_proj(x)], dim=-1)

    def entries(self, merged: torch.Tensor, step: V4Step) -> torch.Tensor:
        """merged [B, T, 2*width] (project() of every position) -> entries [B, n_w, dim]."""
        padded_len, _, (cos, sin) = step.windows(self.rate)
        batch, total, channels = merged.shape
        windows = F.pad(merged, (0, 0, 0, padded_len - total)).reshape(batch, -1, self.rate, channels)
        kv, gate = windows.chunk(2, dim=-1)
        gate = gate + self.position_bias
        if self.overlap:
            # Entry w mixes 2 * rate slots: window w-1's first series (channels :d) then window w's
            # second series (channels d:); entry 0 has no previous window (gate -inf: weight 0).
            d = self.dim
            prev_kv = torch.cat([torch.zeros_like(kv[:, :1, :, :d]), kv[:, :-1, :, :d]], dim=1)
            prev_gate = torch.cat([torch.full_like(gate[:, :1, :, :d], float("-inf")), gate[:, :-1, :, :d]], dim=1)
            kv = torch.cat([prev_kv, kv[..., d:]], dim=2)
            gate = torch.cat([prev_gate, gate[..., d:]], dim=2)
        pooled = self.kv_norm((kv * gate.softmax(dim=2)).sum(dim=2))  # [B, n_w, dim]
        return rotate_trailing_pairs(pooled, cos, sin)

    def load(self, loader: TensorLoader, prefix: str) -> None:
        loader.linear(self.kv_proj, prefix + "kv_proj")
        loader.linear(self.gate_proj, prefix + "gate_proj")
        loader.put(self, "position_bias", loader.take(prefix + "position_bias"))
        loader.norm(self.kv_norm, prefix + "kv_norm")


class Indexer(nn.Module):
    """CSA lightning indexer: score(query, entry) = sum_h w_h(x) * relu(q_h . k) / sqrt(Di); each
    query keeps its top `index_topk` visible entries (all of them while fewer are visible)."""

    def __init__(self, plan: V4Plan) -> None:
        super().__init__()
        self.plan = plan
        self.compressor = Compressor(plan.hidden, plan.index_dim, plan.rates[CSA], True, plan.eps)
        self.q_b_proj = nn.Linear(plan.q_lora_rank, plan.index_heads * plan.index_dim, bias=False)
        self.weights_proj = nn.Linear(plan.hidden, plan.index_heads, bias=False)

    def select(self, x, q_resid, merged, step, visible):
        p = self.plan
        batch, length, _ = x.shape
        keys = self.compressor.entries(merged, step)  # [B, n_w, Di]
        cos, sin = step.rope("compress")
        q = rotate_trailing_pairs(self.q_b_proj(q_resid).reshape(batch, length, p.index_heads, p.index_dim), cos, sin)
        weights = self.weights_proj(x) * p.index_heads**-0.5
        return lightning_select(q, keys, weights, visible, p.index_topk)

    def load(self, loader: TensorLoader, prefix: str) -> None:
        self.compressor.load(loader, prefix)
        loader.linear(self.q_b_proj, prefix + "q_b_proj")
        loader.linear(self.weights_proj, prefix + "scorer.weights_proj")


class Attention(nn.Module):
    def __init__(self, plan: V4Plan, layer_type: str) -> None:
        super().__init__()
        self.plan, self.layer_type = plan, layer_type
        h, d = plan.num_heads, plan.head_dim
        self.rope_kind = "main" if layer_type == SLIDING else "compress"
        self.q_a_proj = nn.Linear(plan.hidden, plan.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(plan.q_lora_rank, plan.eps)
        self.q_b_proj = nn.Linear(plan.q_lora_rank, h * d, bias=False)
        self.q_b_norm = RMSNorm(d, plan.eps, weighted=False)
        self.kv_proj = nn.Linear(plan.hidden, d, bias=False)
        self.kv_norm = RMSNorm(d, plan.eps)
        self.o_a_weight = nn.Parameter(torch.zeros(plan.o_groups * plan.o_lora_rank, h * d // plan.o_groups))
        self.o_b_proj = nn.Linear(plan.o_groups * plan.o_lora_rank, plan.hidden, bias=False)
        self.sinks = nn.Parameter(torch.zeros(h))
        if layer_type != SLIDING:
            self.compressor = Compressor(plan.hidden, d, plan.rates[layer_type], layer_type == CSA, plan.eps)
        if layer_type == CSA:
            self.indexer = Indexer(plan)

    def forward(self, x: torch.Tensor, step: V4Step, past: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, L, H], past [B, S, pool channels] -> (output [B, L, H], new channels [B, L, C])."""
        p = self.plan
        batch, length, _ = x.shape
        cos, sin = step.rope(self.rope_kind)
        q_resid = self.q_a_norm(self.q_a_proj(x))
        q = self.q_b_norm(self.q_b_proj(q_resid).reshape(batch, length, p.num_heads, p.head_dim))
        q = rotate_trailing_pairs(q, cos, sin)
        kv = rotate_trailing_pairs(self.kv_norm(self.kv_proj(x)).unsqueeze(2), cos, sin).squeeze(2)  # [B, L, D]
        parts = [kv]
        if self.layer_type != SLIDING:
            parts.append(self.compressor.project(x))
        if self.layer_type == CSA:
            parts.append(self.indexer.compressor.project(x))
        new = torch.cat(parts, dim=-1)
        merged = step.merge(past[..., : new.shape[-1]], new)  # [B, T, C]
        d = p.head_dim
        keys, visible = merged[..., :d], step.sliding  # [B, T, D], [B, L, T]
        if self.layer_type != SLIDING:
            wide = 4 * d if self.layer_type == CSA else 2 * d
            entries = self.compressor.entries(merged[..., d : d + wide], step)
            _, seen, _ = step.windows(self.compressor.rate)
            if self.layer_type == CSA:
                seen = self.indexer.select(x, q_resid, merged[..., d + wide :], step, seen)
            keys = torch.cat([keys, entries], dim=1)
            visible = torch.cat([visible, seen], dim=-1)
        scores = torch.einsum("blhd,btd->bhlt", q, keys) * d**-0.5
        scores = scores.masked_fill(~visible.unsqueeze(1), torch.finfo(torch.float32).min)
        sink = self.sinks.view(1, -1, 1, 1).expand(batch, -1, length, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        out = torch.einsum("bhlt,btd->blhd", probs, keys)
        out = rotate_trailing_pairs(out, cos, -sin)  # K=V carried rotary into the values: undo it at the query
        groups = out.reshape(batch, length, p.o_groups, -1)
        weight = self.o_a_weight.view(p.o_groups, p.o_lora_rank, -1)
        out = self.o_b_proj(torch.einsum("blgi,gri->blgr", groups, weight).reshape(batch, length, -1))
        return out, new

    def load(self, loader: TensorLoader, prefix: str) -> None:
        for proj in ("q_a_proj", "q_b_proj", "kv_proj", "o_b_proj"):
            loader.linear(getattr(self, proj), prefix + proj)
        loader.norm(self.q_a_norm, prefix + "q_a_norm")
        loader.norm(self.kv_norm, prefix + "kv_norm")
        loader.put(self, "o_a_weight", loader.take(prefix + "o_a_proj.weight"))
        loader.put(self, "sinks", loader.take(prefix + "sinks"))
        if self.layer_type != SLIDING:
            self.compressor.load(loader, prefix + "compressor.")
        if self.layer_type == CSA:
            self.indexer.load(loader, prefix + "compressor.indexer.")


# -- experts, hyper-connections, the layer ---------------------------------------------------------


@dataclass(frozen=True)
class ClampedSiLUGLU(GLU):
    """silu(min(gate, limit)) * clamp(up, -limit, limit)."""

    limit: float = 10.0

    def unit(self) -> tuple[str, float, float]:  # act is silu
        return "clamp_before", self.limit, 0.0


class HashRouter(TopKRouter):
    """The experts of a token come from a table (tid2eid[token id]); weights as TopKRouter's."""

    def __init__(self, plan: MoEPlan, hidden: int, vocab: int) -> None:
        super().__init__(plan, hidden)
        self.register_buffer("tid2eid", torch.zeros(vocab, plan.top_k, dtype=torch.int64))

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.weigh(self.scores(x), self.tid2eid[input_ids.reshape(-1)])


def moe_plan(plan: V4Plan, hashed: bool) -> MoEPlan:
    """sqrt(softplus) scores; hash-routed or top-k over scores + correction bias; renormalised and
    scaled; clamped SwiGLU experts and shared expert."""
    glu = ClampedSiLUGLU(limit=plan.swiglu_limit)
    return MoEPlan(
        num_experts=plan.num_experts,
        top_k=plan.top_k,
        intermediate=plan.moe_intermediate,
        scoring="sqrtsoftplus",
        correction_bias=not hashed,
        scaling=plan.routed_scaling,
        glu=glu,
        shared_intermediate=plan.moe_intermediate,
        shared_glu=glu,
    )


class DeepseekV4MoE(MoE):
    def __init__(self, plan: V4Plan, hashed: bool) -> None:
        super().__init__(moe_plan(plan, hashed), plan.hidden)
        self.hashed = hashed
        if hashed:
            self.router = HashRouter(self.plan, plan.hidden, plan.vocab_size)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        idx, weights = self.router(flat, input_ids) if self.hashed else self.router(flat)
        return (self.experts(flat, idx, weights) + self.shared_experts(flat)).reshape(x.shape)

    def load(self, loader: TensorLoader, prefix: str) -> None:
        loader.put(self.router, "weight", loader.take(prefix + "gate.weight"))
        if self.hashed:
            loader.put(self.router, "tid2eid", loader.take(prefix + "gate.tid2eid").round().to(torch.int64))
        else:
            loader.put(self.router, "correction_bias", loader.take(prefix + "gate.e_score_correction_bias"))
        self.experts.load(loader, prefix + "experts.")
        self.shared_experts.load(loader, prefix + "shared_experts.")


class HyperConnection(nn.Module):
    """mHC: (post [.., N], comb [.., N, N] Sinkhorn-normalised, collapsed input [.., H])."""

    def __init__(self, plan: V4Plan) -> None:
        super().__init__()
        self.plan = plan
        n = plan.hc_mult
        self.fn = nn.Parameter(torch.zeros((2 + n) * n, n * plan.hidden))
        self.base = nn.Parameter(torch.zeros((2 + n) * n))
        self.scale = nn.Parameter(torch.ones(3))
        self.norm = RMSNorm(n * plan.hidden, plan.eps, weighted=False)

    def forward(self, streams: torch.Tensor):
        n, eps = self.plan.hc_mult, self.plan.hc_eps
        batch, length = streams.shape[:2]
        mix = F.linear(self.norm(streams.reshape(batch, length, -1)), self.fn)
        pre_w, post_w, comb_w = mix.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre = torch.sigmoid(pre_w * self.scale[0] + pre_b) + eps
        post = 2 * torch.sigmoid(post_w * self.scale[1] + post_b)
        comb = torch.softmax(comb_w.reshape(batch, length, n, n) * self.scale[2] + comb_b.view(n, n), dim=-1) + eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
        for _ in range(self.plan.hc_iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
        return post, comb, (pre.unsqueeze(-1) * streams).sum(dim=2)


class HyperHead(nn.Module):
    def __init__(self, plan: V4Plan) -> None:
        super().__init__()
        self.plan = plan
        n = plan.hc_mult
        self.fn = nn.Parameter(torch.zeros(n, n * plan.hidden))
        self.base = nn.Parameter(torch.zeros(n))
        self.scale = nn.Parameter(torch.ones(1))
        self.norm = RMSNorm(n * plan.hidden, plan.eps, weighted=False)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        batch, length = streams.shape[:2]
        mix = F.linear(self.norm(streams.reshape(batch, length, -1)), self.fn)
        pre = torch.sigmoid(mix * self.scale + self.base) + self.plan.hc_eps
        return (pre.unsqueeze(-1) * streams).sum(dim=2)


class Layer(nn.Module):
    def __init__(self, plan: V4Plan, index: int) -> None:
        super().__init__()
        self.attn_hc = HyperConnection(plan)
        self.ffn_hc = HyperConnection(plan)
        self.input_layernorm = RMSNorm(plan.hidden, plan.eps)
        self.post_attention_layernorm = RMSNorm(plan.hidden, plan.eps)
        self.self_attn = Attention(plan, plan.layer_types[index])
        self.mlp = DeepseekV4MoE(plan, plan.mlp_types[index] == "hash_moe")

    def forward(self, streams, input_ids, step, past):
        # comb mixes the input streams transposed: out_k = sum_j comb[j, k] * in_j
        post, comb, collapsed = self.attn_hc(streams)
        attn, new = self.self_attn(self.input_layernorm(collapsed), step, past)
        streams = post.unsqueeze(-1) * attn.unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), streams)
        post, comb, collapsed = self.ffn_hc(streams)
        mlp = self.mlp(self.post_attention_layernorm(collapsed), input_ids)
        return post.unsqueeze(-1) * mlp.unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), streams), new

    def load(self, loader: TensorLoader, p: str) -> None:
        for hc in ("attn_hc", "ffn_hc"):
            for attr in ("fn", "base", "scale"):
                loader.put(getattr(self, hc), attr, loader.take(f"{p}{hc}.{attr}"))
        loader.norm(self.input_layernorm, p + "input_layernorm")
        loader.norm(self.post_attention_layernorm, p + "post_attention_layernorm")
        self.self_attn.load(loader, p + "self_attn.")
        self.mlp.load(loader, p + "mlp.")

"""DeepSeek-V4 (transformers `deepseek_v4`) as a step graph over the paged KV pool.

The architecture (transformers 5.24 `modeling_deepseek_v4.py`):
- shared-KV MQA (one K=V head, interleaved partial rotary on the trailing dims, per-head sinks),
  over a sliding window of `sliding_window` tokens on every layer;
- compressed attention layers add compressed KV entries, one per window of `m` tokens:
  HCA ("heavily compressed", non-overlapping windows) and CSA ("compressed sparse": entry w mixes
  window w-1's first series with window w's second one, and a lightning indexer keeps each
  query's top `index_topk` entries);
- hyper-connections (`hc_mult` residual streams mixed by Sinkhorn-normalised weights, collapsed
  by a hyper head before the final norm), grouped low-rank output projection, and hash-routed
  (token id -> experts table) or top-k routed MoE with clamped SwiGLU and a shared expert.

Stateless paging. transformers keeps a compressor cache (buffered tokens, emitted entries, the
overlap slice). Here every compressed entry is a deterministic function of per-token projections
of its window (and of the previous window for CSA), so the pool stores, per layer and token, a
vector of "channels" and each step recomputes the entries from the gathered history plus the new
tokens (O(T) per step; the reference emits them once):

  sliding layers  [kv (D)]                                  kv: normed, rotated K=V
  HCA layers      [kv (D) | ckv (D) | cgate (D)]            compressor projections (raw gate)
  CSA layers      [kv (D) | ckv (2D) | cgate (2D) | ikv (2Di) | igate (2Di)]   + the indexer's

The pool keeps the contract's uniform geometry: head_dim = D and kv_heads = ceil(widest / 2D);
a token's channels fill K's heads then V's heads of its slot (the rest stays zero). A query at
position p sees history/new keys at positions j <= p with p - j < sliding_window, and compressed
entry w iff its window is complete, (w + 1) * m <= p + 1 (transformers' causal threshold); the
entry carries rotary position w * m. A buffered (incomplete) window is simply not visible yet.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from helios.manifest import Architecture
from ignition.models.common import check_fully_loaded, load_lm_head, logprob_stats
from ignition.models.configured import yarn_inv_freq

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
_RATIO_TYPES = {0: SLIDING, 4: CSA, 128: HCA}  # legacy per-layer `compress_ratios`


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


def plan_of(config: dict[str, Any]) -> V4Plan:
    """A V4Plan from a config.json dict (its `text_config` when nested), with the legacy keys
    DeepseekV4Config.__post_init__ folds in (compress_ratios, compress_rate_csa/hca,
    num_hash_layers, qk_rope_head_dim, flat rope_parameters / rope_scaling)."""
    inner = config.get("text_config")
    cfg = inner if isinstance(inner, dict) and inner else config
    n = int(cfg.get("num_hidden_layers", 43))
    rates = {CSA: 4, HCA: 128, **(cfg.get("compress_rates") or {})}
    rates[CSA] = int(cfg.get("compress_rate_csa") or rates[CSA])
    rates[HCA] = int(cfg.get("compress_rate_hca") or rates[HCA])
    layer_types = cfg.get("layer_types")
    if layer_types is None and cfg.get("compress_ratios") is not None:
        layer_types = [_RATIO_TYPES[int(r)] for r in cfg["compress_ratios"]]
    if layer_types is None:
        layer_types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    mlp_types = cfg.get("mlp_layer_types")
    if mlp_types is None:
        hashed = int(cfg.get("num_hash_layers", 3))
        mlp_types = ["hash_moe"] * min(n, hashed) + ["moe"] * max(0, n - hashed)
    head_dim = int(cfg.get("head_dim", 512))
    partial = cfg.get("partial_rotary_factor")
    if partial is None:
        partial = cfg["qk_rope_head_dim"] / head_dim if cfg.get("qk_rope_head_dim") else 64 / 512
    rope = cfg.get("rope_parameters") or {}
    if isinstance(rope.get("compress"), dict):
        compress = dict(rope["compress"])
        main_theta = float(rope.get("main", {}).get("rope_theta", cfg.get("rope_theta", 10000.0)))
    else:
        flat = {**(cfg.get("rope_scaling") or {}), **rope}
        compress = {k: v for k, v in flat.items() if k not in ("main", "compress")}
        compress["rope_theta"] = float(cfg.get("compress_rope_theta", 160000.0))
        compress["rope_type"] = compress.get("rope_type", compress.get("type", "default"))
        if compress["rope_type"] == "yarn":
            compress.setdefault("attention_factor", 1.0)
        main_theta = float(cfg.get("rope_theta", 10000.0))
    scoring = cfg.get("scoring_func", "sqrtsoftplus")
    if scoring != "sqrtsoftplus":
        raise ValueError(f"deepseek_v4 router scoring {scoring!r} is not supported (only sqrtsoftplus)")
    if int(cfg.get("num_key_value_heads", 1)) != 1:
        raise ValueError("deepseek_v4 attention is shared-KV MQA: num_key_value_heads must be 1")
    return V4Plan(
        vocab_size=int(cfg["vocab_size"]), hidden=int(cfg["hidden_size"]),
        num_heads=int(cfg.get("num_attention_heads", 64)), head_dim=head_dim, rope_dim=int(head_dim * partial),
        q_lora_rank=int(cfg.get("q_lora_rank", 1024)), o_groups=int(cfg.get("o_groups", 8)),
        o_lora_rank=int(cfg.get("o_lora_rank", 1024)), eps=float(cfg.get("rms_norm_eps", 1e-6)),
        window=int(cfg.get("sliding_window", 128)), hc_mult=int(cfg.get("hc_mult", 4)),
        hc_iters=int(cfg.get("hc_sinkhorn_iters", 20)), hc_eps=float(cfg.get("hc_eps", 1e-6)),
        layer_types=list(layer_types[:n]), mlp_types=list(mlp_types[:n]), rates=rates,
        index_heads=int(cfg.get("index_n_heads", 64)), index_dim=int(cfg.get("index_head_dim", 128)),
        index_topk=int(cfg.get("index_topk", 512)), num_experts=int(cfg.get("n_routed_experts", 256)),
        top_k=int(cfg.get("num_experts_per_tok", 6)), moe_intermediate=int(cfg.get("moe_intermediate_size", 2048)),
        routed_scaling=float(cfg.get("routed_scaling_factor", 1.5)), swiglu_limit=float(cfg.get("swiglu_limit", 10.0)),
        main_theta=main_theta, compress_rope=compress,
        max_positions=int(cfg.get("max_position_embeddings") or 4096),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )  # fmt: skip


def architecture_of(plan: V4Plan) -> Architecture:
    """The manifest Architecture; num_kv_heads/head_dim are the pool geometry (plan.cache_dims)."""
    kv_heads, head_dim = plan.cache_dims()
    return Architecture(
        family="deepseek_v4", num_layers=len(plan.layer_types), hidden_size=plan.hidden,
        intermediate_size=plan.moe_intermediate, num_heads=plan.num_heads, num_kv_heads=kv_heads,
        head_dim=head_dim, vocab_size=plan.vocab_size, rope_theta=plan.main_theta, rms_norm_eps=plan.eps,
        max_position_embeddings=plan.max_positions, tie_word_embeddings=plan.tie_word_embeddings,
        attention_bias=False,
    )  # fmt: skip


# -- rotary ---------------------------------------------------------------------------------------


def inv_freq_of(plan: V4Plan, kind: str) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rope_dim/2], cos/sin scale) of the "main" (sliding layers) or
    "compress" (CSA/HCA layers, their compressors and indexer) rotary, as transformers computes them."""
    dim = plan.rope_dim
    if kind == "main":
        theta, params = plan.main_theta, {"rope_type": "default"}
    else:
        params = plan.compress_rope
        theta = float(params["rope_theta"])
    if params.get("rope_type", "default") == "default":
        return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    if params["rope_type"] != "yarn":
        raise ValueError(f"deepseek_v4 rope type {params['rope_type']!r} is not supported (default or yarn)")
    factor = float(params["factor"])
    inv = yarn_inv_freq(dim, theta, factor, float(params.get("beta_fast") or 32), float(params.get("beta_slow") or 1),
                        int(params["original_max_position_embeddings"]), True)  # fmt: skip
    attention = params.get("attention_factor")
    if attention is None:  # transformers' get_mscale
        scale = lambda m: 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0  # noqa: E731
        mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = scale(mscale) / scale(mscale_all) if mscale and mscale_all else scale(1)
    return inv, float(attention)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """V4's interleaved rotary on the trailing 2*cos.shape[-1] dims of x (pairs stay interleaved).
    cos/sin broadcast against x[..., :half]."""
    rot = 2 * cos.shape[-1]
    nope, rope = x[..., : x.shape[-1] - rot], x[..., x.shape[-1] - rot :]
    pairs = rope.reshape(*rope.shape[:-1], rot // 2, 2)
    x1, x2 = pairs[..., 0], pairs[..., 1]
    out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).reshape(rope.shape)
    return torch.cat([nope, out], dim=-1)


# -- per-step state -------------------------------------------------------------------------------


class V4Step:
    """Per-step tensors shared by every layer: the merged history + new sequence layout, masks,
    and rotary tables (built once per step)."""

    def __init__(self, model: "DeepseekV4LM", positions: torch.Tensor, history_lens: torch.Tensor, hist: int) -> None:
        self.model = model
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
        self.sliding = (slot.unsqueeze(0) <= q) & (q - slot.unsqueeze(0) < model.plan.window)  # [B, L, T]
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
            self._rope[kind] = self.model.cos_sin(kind, self.positions.unsqueeze(-1))
        return self._rope[kind]

    def windows(self, rate: int) -> tuple[int, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """(n_w * rate: the merged length padded to whole windows, entry visibility [B, L, n_w]:
        window w complete at the query, and cos/sin [1, n_w, rope/2] of the entries' positions w * rate)."""
        if rate not in self._windows:
            count = (self.total + rate - 1) // rate
            entry = torch.arange(count)
            visible = entry.view(1, 1, -1) < torch.div(self.positions + 1, rate, rounding_mode="floor").unsqueeze(-1)
            cos_sin = self.model.cos_sin("compress", (entry * rate).view(1, -1))  # [1, n_w, rope/2]
            self._windows[rate] = (count * rate, visible, cos_sin)
        return self._windows[rate]


# -- modules --------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, weighted: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if weighted else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return out if self.weight is None else out * self.weight


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
        return rotate(pooled, cos, sin)


class Indexer(nn.Module):
    """CSA lightning indexer: score(query, entry) = sum_h w_h(x) * relu(q_h . k) / sqrt(Di); each
    query keeps its top `index_topk` visible entries (all of them while fewer are visible)."""

    def __init__(self, plan: V4Plan) -> None:
        super().__init__()
        self.plan = plan
        self.compressor = Compressor(plan.hidden, plan.index_dim, plan.rates[CSA], True, plan.eps)
        self.q_b_proj = nn.Linear(plan.q_lora_rank, plan.index_heads * plan.index_dim, bias=False)
        self.weights_proj = nn.Linear(plan.hidden, plan.index_heads, bias=False)

    def select(self, x, q_resid, merged, step, visible):  # noqa: ANN001, ANN201
        p = self.plan
        batch, length, _ = x.shape
        keys = self.compressor.entries(merged, step)  # [B, n_w, Di]
        cos, sin = step.rope("compress")
        q = rotate(self.q_b_proj(q_resid).reshape(batch, length, p.index_heads, p.index_dim), cos, sin)
        scores = torch.relu(torch.einsum("blhd,bwd->blhw", q, keys)) * p.index_dim**-0.5
        weights = self.weights_proj(x) * p.index_heads**-0.5
        index = torch.einsum("blh,blhw->blw", weights, scores).masked_fill(~visible, float("-inf"))
        pad = torch.full((batch, length, p.index_topk), float("-inf"))
        kth = torch.cat([index, pad], dim=-1).topk(p.index_topk, dim=-1)[0][..., -1:]
        return visible & (index >= kth)


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
        q = rotate(self.q_b_norm(self.q_b_proj(q_resid).reshape(batch, length, p.num_heads, p.head_dim)), cos, sin)
        kv = rotate(self.kv_norm(self.kv_proj(x)).unsqueeze(2), cos, sin).squeeze(2)  # [B, L, D]
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
        out = rotate(out, cos, -sin)  # K=V carried rotary into the values: undo it at the query
        groups = out.reshape(batch, length, p.o_groups, -1)
        weight = self.o_a_weight.view(p.o_groups, p.o_lora_rank, -1)
        out = self.o_b_proj(torch.einsum("blgi,gri->blgr", groups, weight).reshape(batch, length, -1))
        return out, new


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

    def forward(self, streams: torch.Tensor):  # noqa: ANN201
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


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class MoE(nn.Module):
    """sqrt(softplus) router: hash-routed (tid2eid[token]) or top-k over scores + correction bias;
    weights renormalised and scaled; dense expert compute (as configured.MoE) plus a shared expert."""

    def __init__(self, plan: V4Plan, hashed: bool) -> None:
        super().__init__()
        self.plan, self.hashed = plan, hashed
        e, i, h = plan.num_experts, plan.moe_intermediate, plan.hidden
        self.gate_weight = nn.Parameter(torch.zeros(e, h))
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(plan.vocab_size, plan.top_k, dtype=torch.int64))
        else:
            self.correction_bias = nn.Parameter(torch.zeros(e))
        self.experts_gate = nn.Parameter(torch.zeros(e, i, h))
        self.experts_up = nn.Parameter(torch.zeros(e, i, h))
        self.experts_down = nn.Parameter(torch.zeros(e, h, i))
        self.shared_gate = nn.Linear(h, i, bias=False)
        self.shared_up = nn.Linear(h, i, bias=False)
        self.shared_down = nn.Linear(i, h, bias=False)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        p = self.plan
        flat = x.reshape(-1, x.shape[-1])
        scores = torch.sqrt(F.softplus(flat @ self.gate_weight.t()))
        if self.hashed:
            idx = self.tid2eid[input_ids.reshape(-1)]
        else:
            idx = (scores + self.correction_bias).topk(p.top_k, dim=-1)[1]
        weights = scores.gather(1, idx)
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20) * p.routed_scaling
        # scatter_add: a hash table row may name one expert twice (transformers then adds it twice)
        dense = torch.zeros(flat.shape[0], p.num_experts).scatter_add(1, idx, weights)  # [N, E]
        gate = torch.einsum("nh,eih->eni", flat, self.experts_gate)
        up = torch.einsum("nh,eih->eni", flat, self.experts_up)
        down = torch.einsum("eni,ehi->enh", clamped_swiglu(gate, up, p.swiglu_limit), self.experts_down)
        routed = (down * dense.t().unsqueeze(-1)).sum(0)
        shared = self.shared_down(clamped_swiglu(self.shared_gate(flat), self.shared_up(flat), p.swiglu_limit))
        return (routed + shared).reshape(x.shape)


class Layer(nn.Module):
    def __init__(self, plan: V4Plan, index: int) -> None:
        super().__init__()
        self.attn_hc = HyperConnection(plan)
        self.ffn_hc = HyperConnection(plan)
        self.input_layernorm = RMSNorm(plan.hidden, plan.eps)
        self.post_attention_layernorm = RMSNorm(plan.hidden, plan.eps)
        self.self_attn = Attention(plan, plan.layer_types[index])
        self.mlp = MoE(plan, plan.mlp_types[index] == "hash_moe")

    def forward(self, streams, input_ids, step, past):  # noqa: ANN001, ANN201
        # comb mixes the input streams transposed: out_k = sum_j comb[j, k] * in_j
        post, comb, collapsed = self.attn_hc(streams)
        attn, new = self.self_attn(self.input_layernorm(collapsed), step, past)
        streams = post.unsqueeze(-1) * attn.unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), streams)
        post, comb, collapsed = self.ffn_hc(streams)
        mlp = self.mlp(self.post_attention_layernorm(collapsed), input_ids)
        return post.unsqueeze(-1) * mlp.unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), streams), new


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


class DeepseekV4LM(nn.Module):
    """The step graph of docs/architecture.md for DeepSeek-V4 (same I/O as ConfiguredLM)."""

    def __init__(self, plan: V4Plan) -> None:
        super().__init__()
        self.plan = plan
        self.arch = architecture_of(plan)
        self.embed_tokens = nn.Embedding(plan.vocab_size, plan.hidden)
        self.layers = nn.ModuleList(Layer(plan, i) for i in range(len(plan.layer_types)))
        self.hc_head = HyperHead(plan)
        self.norm = RMSNorm(plan.hidden, plan.eps)
        self.lm_head = nn.Linear(plan.hidden, plan.vocab_size, bias=False)
        self.mtp_tensors: dict[str, np.ndarray] = {}
        self.reset_rotary()

    def reset_rotary(self) -> None:
        """Rotary frequencies (computed, never loaded; also after building on the meta device)."""
        for kind in ("main", "compress"):
            inv, scale = inv_freq_of(self.plan, kind)
            self.register_buffer(f"{kind}_inv_freq", inv, persistent=False)
            setattr(self, f"{kind}_rope_scale", scale)

    def cos_sin(self, kind: str, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(torch.float32).unsqueeze(-1) * getattr(self, f"{kind}_inv_freq")
        scale = getattr(self, f"{kind}_rope_scale")
        cos, sin = freqs.cos(), freqs.sin()
        return (cos * scale, sin * scale) if scale != 1.0 else (cos, sin)

    def _history(self, kv_pool: torch.Tensor, block_tables: torch.Tensor, layer: int) -> torch.Tensor:
        """Layer's pool slots of each row's pages as per-token channels [B, M*page_tokens, 2*kvh*D]."""
        batch, pages = block_tables.shape
        num_pages = kv_pool.shape[0] // (2 * len(self.layers))
        _, tokens, heads, dim = kv_pool.shape
        parts = []
        for kind in (0, 1):
            rows = (2 * layer + kind) * num_pages + block_tables.reshape(-1)
            parts.append(torch.index_select(kv_pool, 0, rows).reshape(batch, pages * tokens, heads * dim))
        return torch.cat(parts, dim=-1)

    def hidden_states(self, input_ids, positions, history_lens, block_tables, kv_pool):  # noqa: ANN001, ANN201
        """Final-normed hidden states [B, L, H] and new_kv [layers, 2, B, L, kvh, D]."""
        batch, length = input_ids.shape
        kv_heads, head_dim = self.arch.num_kv_heads, self.arch.head_dim
        step = V4Step(self, positions, history_lens, block_tables.shape[1] * kv_pool.shape[1])
        x = self.embed_tokens(input_ids)
        streams = x.unsqueeze(2).expand(-1, -1, self.plan.hc_mult, -1)
        new_kv = []
        for i, layer in enumerate(self.layers):
            streams, new = layer(streams, input_ids, step, self._history(kv_pool, block_tables, i))
            new = F.pad(new, (0, 2 * kv_heads * head_dim - new.shape[-1]))
            new_kv.append(new.reshape(batch, length, 2, kv_heads, head_dim).permute(2, 0, 1, 3, 4))
        return self.norm(self.hc_head(streams)), torch.stack(new_kv, dim=0)

    def forward(self, input_ids, positions, history_lens, query_lens, block_tables, kv_pool, logprob_token_ids):  # noqa: ANN001, ANN201
        normed, new_kv = self.hidden_states(input_ids, positions, history_lens, block_tables, kv_pool)
        hidden = normed.shape[-1]
        last = (query_lens - 1).view(-1, 1, 1).expand(-1, 1, hidden)
        logits = self.lm_head(torch.gather(normed, 1, last).squeeze(1))
        logprobs, lse, top_logprobs, top_ids = logprob_stats(logits)
        token_logprobs = torch.gather(logprobs, 1, logprob_token_ids)
        return logits, lse, top_logprobs, top_ids, token_logprobs, new_kv, normed

    @torch.no_grad()
    def reference(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits [T, V] of one whole sequence as a single prefill over an empty pool."""
        length = ids.shape[0]
        pool = torch.zeros(2 * self.arch.num_layers, 1, self.arch.num_kv_heads, self.arch.head_dim)
        normed, _ = self.hidden_states(
            ids.unsqueeze(0), torch.arange(length).unsqueeze(0), torch.zeros(1, dtype=torch.int64),
            torch.zeros(1, 1, dtype=torch.int64), pool,
        )  # fmt: skip
        return self.lm_head(normed[0])


# -- loading --------------------------------------------------------------------------------------

# transformers' deepseek_v4 conversion renames (conversion_mapping.py), applied in order to names
# without the "model." prefix: the original checkpoint layout (which save_pretrained writes back)
# -> transformers module names. Names already in transformers form pass through unchanged.
_RENAMES = [(re.compile(a), b) for a, b in (
    (r"\.attn\.", ".self_attn."), (r"\.ffn\.", ".mlp."), (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"^embed\.weight", "embed_tokens.weight"), (r"^head\.weight", "lm_head.weight"),
    (r"^hc_head_fn", "hc_head.hc_fn"), (r"^hc_head_base", "hc_head.hc_base"), (r"^hc_head_scale", "hc_head.hc_scale"),
    (r"\.attn_norm\.", ".input_layernorm."), (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_attn_fn", ".attn_hc.fn"), (r"\.hc_attn_base", ".attn_hc.base"), (r"\.hc_attn_scale", ".attn_hc.scale"),
    (r"\.hc_ffn_fn", ".ffn_hc.fn"), (r"\.hc_ffn_base", ".ffn_hc.base"), (r"\.hc_ffn_scale", ".ffn_hc.scale"),
    (r"\.attn_sink", ".sinks"), (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."), (r"\.norm\.", ".kv_norm."), (r"\.ape", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."), (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."), (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."), (r"\.wo_a\.", ".o_a_proj."), (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."), (r"\.gate\.bias", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."), (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
)]  # fmt: skip


def hf_name(name: str) -> str:
    """A checkpoint tensor name as transformers' module name, without the "model." prefix."""
    name = name.removeprefix("model.")
    for pattern, target in _RENAMES:
        name = pattern.sub(target, name)
    return name


def load_deepseek_v4(model: DeepseekV4LM, tensors: dict[str, np.ndarray]) -> None:
    """Set every parameter from the checkpoint's tensors (original DeepSeek names as
    save_pretrained writes them, or transformers' module names); MTP tensors (`mtp.*`, or layers
    past the decoder's) go to model.mtp_tensors; every other tensor must be used."""
    n = len(model.layers)
    names: dict[str, str] = {}
    for original in tensors:
        mtp = re.match(r"^(model\.)?(mtp\.|layers\.(\d+)\.)", original)
        if mtp and (mtp.group(2) == "mtp." or int(mtp.group(3)) >= n):
            model.mtp_tensors[original] = np.asarray(tensors[original])
        else:
            names[hf_name(original)] = original
    used = set(model.mtp_tensors)

    def take(name: str) -> torch.Tensor:
        if name not in names:
            raise KeyError(f"checkpoint has no tensor for {name!r}")
        used.add(names[name])
        return torch.from_numpy(np.array(tensors[names[name]], dtype=np.float32, order="C"))

    def put(module: nn.Module, attr: str, value: torch.Tensor) -> None:
        current = getattr(module, attr)
        if tuple(current.shape) != tuple(value.shape):
            raise ValueError(f"{attr} of {type(module).__name__}: checkpoint shape {tuple(value.shape)} != {tuple(current.shape)}")
        if isinstance(current, nn.Parameter):
            setattr(module, attr, nn.Parameter(value, requires_grad=False))
        else:
            setattr(module, attr, value)

    def compressor(module: Compressor, prefix: str) -> None:
        put(module.kv_proj, "weight", take(prefix + "kv_proj.weight"))
        put(module.gate_proj, "weight", take(prefix + "gate_proj.weight"))
        put(module, "position_bias", take(prefix + "position_bias"))
        put(module.kv_norm, "weight", take(prefix + "kv_norm.weight"))

    inter = model.plan.moe_intermediate
    put(model.embed_tokens, "weight", take("embed_tokens.weight"))
    for i, layer in enumerate(model.layers):
        p = f"layers.{i}."
        for hc in ("attn_hc", "ffn_hc"):
            for attr in ("fn", "base", "scale"):
                put(getattr(layer, hc), attr, take(f"{p}{hc}.{attr}"))
        put(layer.input_layernorm, "weight", take(p + "input_layernorm.weight"))
        put(layer.post_attention_layernorm, "weight", take(p + "post_attention_layernorm.weight"))
        attn, a = layer.self_attn, p + "self_attn."
        for proj in ("q_a_proj", "q_b_proj", "kv_proj", "o_b_proj"):
            put(getattr(attn, proj), "weight", take(a + proj + ".weight"))
        put(attn.q_a_norm, "weight", take(a + "q_a_norm.weight"))
        put(attn.kv_norm, "weight", take(a + "kv_norm.weight"))
        put(attn, "o_a_weight", take(a + "o_a_proj.weight"))
        put(attn, "sinks", take(a + "sinks"))
        if attn.layer_type != SLIDING:
            compressor(attn.compressor, a + "compressor.")
        if attn.layer_type == CSA:
            ix = a + "compressor.indexer."
            compressor(attn.indexer.compressor, ix)
            put(attn.indexer.q_b_proj, "weight", take(ix + "q_b_proj.weight"))
            put(attn.indexer.weights_proj, "weight", take(ix + "scorer.weights_proj.weight"))
        mlp, m = layer.mlp, p + "mlp."
        put(mlp, "gate_weight", take(m + "gate.weight"))
        if mlp.hashed:
            put(mlp, "tid2eid", take(m + "gate.tid2eid").round().to(torch.int64))
        else:
            put(mlp, "correction_bias", take(m + "gate.e_score_correction_bias"))
        if m + "experts.gate_up_proj" in names:  # transformers' fused layout [E, 2I, H]
            gate_up = take(m + "experts.gate_up_proj")
            gate, up, down = gate_up[:, :inter], gate_up[:, inter:], take(m + "experts.down_proj")
        else:  # per-expert w1 (gate), w3 (up), w2 (down)
            stack = lambda w: torch.stack([take(f"{m}experts.{e}.{w}.weight") for e in range(model.plan.num_experts)])  # noqa: E731
            gate, up, down = stack("w1"), stack("w3"), stack("w2")
        put(mlp, "experts_gate", gate.contiguous())
        put(mlp, "experts_up", up.contiguous())
        put(mlp, "experts_down", down.contiguous())
        for ours, theirs in (("shared_gate", "gate_proj"), ("shared_up", "up_proj"), ("shared_down", "down_proj")):
            put(getattr(mlp, ours), "weight", take(f"{m}shared_experts.{theirs}.weight"))
    put(model.hc_head, "fn", take("hc_head.hc_fn"))
    put(model.hc_head, "base", take("hc_head.hc_base"))
    put(model.hc_head, "scale", take("hc_head.hc_scale"))
    put(model.norm, "weight", take("norm.weight"))
    load_lm_head(model, names, take, put)
    check_fully_loaded(model, tensors, used)


def build_deepseek_v4(config: dict[str, Any], tensors: dict[str, np.ndarray]) -> DeepseekV4LM:
    """A float32 eval-mode DeepseekV4LM from a config.json dict and the checkpoint's tensors
    (built on the meta device, then every parameter swapped for its checkpoint tensor)."""
    with torch.device("meta"):
        model = DeepseekV4LM(plan_of(config))
    model.reset_rotary()
    load_deepseek_v4(model, tensors)
    return model.eval().requires_grad_(False)

"""Attention over the paged pool: the per-step state every layer shares, causal attention over
history ++ new tokens, grouped-query attention (GQA) and absorbed multi-head latent attention
(MLA). Families subclass GQAttention / MLAttention for what only they need (their hooks:
`queries`, `keys_values`, `select`, `gate_output`).

A GQA layer that needs none of the plain path's extras (windows, sinks, KV sharing, a family's
own hooks) runs as one ops.pool_attention call instead (flare's PagedAttention kernel in the
exported graph: the pages are read in place, ~80 fewer nodes a layer than gathering them and
attending in plain ops). That kernel rotates every head dimension rotate-half style, so such a
layer stores its q/k head dimensions permuted (`pool_kernel_order`): the rotary pairs of the
checkpoint's layout (partial, interleaved or not) land on the kernel's (i, i + D/2) pairs and the
non-rotating dimensions on pairs that turn by zero. Dot products of q and k are unchanged; the
keys in the pool are in that order, which only this core's graph ever reads."""

from __future__ import annotations

import math
import re

import torch
from torch import nn

from ignition.models import ops
from ignition.models.blocks.loading import TensorLoader
from ignition.models.blocks.norms import RMSNorm
from ignition.models.blocks.rotary import inv_freq, rotate, rotate_leading
from ignition.models.plans import LayerPlan


def frequency_args(plan: LayerPlan) -> tuple:
    """A layer's rotary frequencies as rotary.inv_freq's arguments."""
    return (
        plan.rope_kind,
        plan.rotary_dim,
        plan.rope_theta,
        plan.rope_partial,
        plan.rope_yarn,
        plan.rope_factor,
        plan.rope_freq_factors,
    )


def layer_inv_freq(plan: LayerPlan) -> torch.Tensor:
    """Rotary frequencies of a layer (computed, never loaded)."""
    return inv_freq(*frequency_args(plan))


def rotary_key(plan: LayerPlan) -> tuple:
    """What a layer's cos/sin tables depend on: layers that agree share one table per step."""
    return (*frequency_args(plan), plan.rope_attention)


class PagedPool:
    """The step's paged KV pool as the pool kernel reads it: [kv_layers * 2 * P, page_tokens,
    kv_heads, head_dim], each row's page table and valid new tokens."""

    def __init__(
        self, kv_pool: torch.Tensor, block_tables: torch.Tensor, query_lens: torch.Tensor, kv_layers: int
    ) -> None:
        self.kv_pool = kv_pool
        self.block_tables = block_tables
        self.query_lens = query_lens
        self.kv_layers = kv_layers


class StepState:
    """Per-step inputs every layer shares, with the rotary tables and visibility masks built once
    per step (per rotary kind / window), not once per layer: fewer graph nodes, faster export.
    `selection` carries a sparse-attention key selection from the layer that computed it to the
    later layers that reuse it."""

    def __init__(
        self,
        positions: torch.Tensor,
        history_lens: torch.Tensor,
        mrope: tuple[torch.Tensor, list[int]] | None = None,
        pool: PagedPool | None = None,
    ) -> None:
        """mrope: (rotary positions [3, B, L] per (t, h, w) axis, the axes' frequency counts) of a
        multimodal step graph; the rotary then follows them instead of `positions`. pool: what
        the layers on the pool kernel read (the others get their history gathered)."""
        self.positions = positions
        self.history_lens = history_lens
        self.mrope = mrope
        self.pool = pool
        self.selection: torch.Tensor | None = None
        self._cos_sin: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._visible: dict[int | None, torch.Tensor] = {}
        self._window_columns: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._kernel_rotary: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def frequencies(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """Rotary angles [B, L, rot/2]. Multimodal rotary gives frequency i the position of axis
        h when i % 3 == 1 (i < 3 * h_count), of axis w when i % 3 == 2 (i < 3 * w_count), else
        of axis t: transformers' interleaved mrope. Text tokens have equal axes: plain rotary."""
        if self.mrope is None:
            return self.positions.to(torch.float32).unsqueeze(-1) * inv_freq
        positions, (_, h_count, w_count) = self.mrope
        axis = torch.zeros(inv_freq.shape[0], dtype=torch.int64)
        axis[1 : 3 * h_count : 3] = 1
        axis[2 : 3 * w_count : 3] = 2
        per_axis = positions.to(torch.float32).unsqueeze(-1) * inv_freq  # [3, B, L, rot/2]
        return torch.where(axis == 1, per_axis[1], torch.where(axis == 2, per_axis[2], per_axis[0]))

    def cos_sin(self, plan: LayerPlan, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        key = rotary_key(plan)
        if key not in self._cos_sin:
            freqs = self.frequencies(inv_freq)  # [B, L, rot/2]
            cos, sin = freqs.cos().unsqueeze(2), freqs.sin().unsqueeze(2)
            if plan.rope_attention != 1.0:  # YaRN's attention factor scales cos and sin
                cos, sin = cos * plan.rope_attention, sin * plan.rope_attention
            self._cos_sin[key] = cos, sin
        return self._cos_sin[key]

    def kernel_rotary(self, plan: LayerPlan, inv_freq: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The pool kernel's rotary inputs for this step: (positions [B, L] = each token's row of
        the tables, cos, sin [B * L, head_dim / 2]). The kernel looks cos/sin up by position; a
        per-step table indexed by token carries any rotary (multimodal, YaRN-scaled, partial)
        without a max-positions table in the core. Pairs past the rotary dims turn by zero."""
        key = (*rotary_key(plan), plan.head_dim)
        if key not in self._kernel_rotary:
            batch, length = self.positions.shape
            half = plan.head_dim // 2
            if plan.rotary_dim:
                cos, sin = (t.reshape(batch * length, -1) for t in self.cos_sin(plan, inv_freq))
            else:
                cos = sin = torch.zeros(batch * length, 0)
            pad = half - cos.shape[1]
            if pad:
                cos = torch.cat([cos, torch.ones(batch * length, pad)], dim=1)
                sin = torch.cat([sin, torch.zeros(batch * length, pad)], dim=1)
            rows = torch.arange(batch * length).reshape(batch, length)
            self._kernel_rotary[key] = rows, cos, sin
        return self._kernel_rotary[key]

    def window_columns(self, window: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The block-table columns a layer with this window reads [B, W] and the position of each
        row's first gathered slot [B]. A row's earliest new token (at history_lens) sees keys from
        history_lens - window + 1 on, so pages wholly before that are never gathered: W is the
        most pages window - 1 consecutive slots can touch, at most the table's width (columns past
        a row's table are clamped to its last and masked as beyond its history)."""
        if window not in self._window_columns:
            assert self.pool is not None, "a windowed layer reads its history from the pool"
            pages = self.pool.block_tables.shape[1]
            page_tokens = self.pool.kv_pool.shape[1]
            width = torch.sym_min(pages, (page_tokens + window - 3) // page_tokens + 1)
            first = torch.clamp(self.history_lens - (window - 1), min=0) // page_tokens  # [B]
            columns = torch.clamp(first.unsqueeze(1) + torch.arange(width).unsqueeze(0), max=pages - 1)
            self._window_columns[window] = columns, first * page_tokens
        return self._window_columns[window]

    def visible(self, hist: int, window: int | None) -> torch.Tensor:
        """[B, L, S+L] bool: history slot j is visible to new token i iff its position is below
        history_lens[b]; new key i' iff i' <= i; and, with a window, q - k < window. Slot j holds
        position j, or start[b] + j for a windowed layer's history (window_columns)."""
        if window not in self._visible:
            batch, length = self.positions.shape
            key_pos = torch.arange(hist).unsqueeze(0).expand(batch, hist)
            if window is not None:
                key_pos = key_pos + self.window_columns(window)[1].unsqueeze(1)
            hist_ok = key_pos < self.history_lens.unsqueeze(1)  # [B, S]
            idx = torch.arange(length)
            causal = (idx.unsqueeze(0) <= idx.unsqueeze(1)).unsqueeze(0).expand(batch, length, length)
            visible = torch.cat([hist_ok.unsqueeze(1).expand(batch, length, hist), causal], dim=-1)
            if window is not None:
                all_pos = torch.cat([key_pos, self.positions], dim=1)
                visible = visible & ((self.positions.unsqueeze(2) - all_pos.unsqueeze(1)) < window)
            self._visible[window] = visible
        return self._visible[window]


def attend(
    q: torch.Tensor,  # [B, L, H, Dk]
    k: torch.Tensor,  # [B, L, G, Dk] new keys
    v: torch.Tensor,  # [B, L, G, Dv]
    past_k: torch.Tensor,  # [B, G, S, Dk] history (pool pages, in order)
    past_v: torch.Tensor,  # [B, G, S, Dv]
    visible: torch.Tensor,  # [B, L, S+L] bool (StepState.visible) or [B, G, rep, L, S+L]
    scale: float,
    sinks: torch.Tensor | None = None,  # [H]
    softcap: float = 0.0,
) -> torch.Tensor:
    """Causal attention of each row's new tokens over its history and themselves -> [B, L, H, Dv].

    Query head h uses KV head h // (H/G) (HF order). Padded query rows see at least new key 0
    (themselves or earlier), so no row is all-masked. A soft-cap bounds the scaled scores to
    (-softcap, softcap) before masking."""
    batch, length, heads, dim = q.shape
    groups = k.shape[2]
    rep = heads // groups
    keys = torch.cat([past_k, k.transpose(1, 2)], dim=2)  # [B, G, S+L, Dk]
    values = torch.cat([past_v, v.transpose(1, 2)], dim=2)
    qg = q.reshape(batch, length, groups, rep, dim).permute(0, 2, 3, 1, 4)  # [B, G, rep, L, Dk]
    scores = torch.matmul(qg, keys.unsqueeze(2).transpose(-1, -2)) * scale  # [B, G, rep, L, S+L]
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    mask = visible[:, None, None] if visible.dim() == 3 else visible
    scores = scores.masked_fill(~mask, torch.finfo(torch.float32).min)
    if sinks is not None:
        sink = sinks.reshape(1, groups, rep, 1, 1).expand(batch, groups, rep, length, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, values.unsqueeze(2))  # [B, G, rep, L, Dv]
    return out.permute(0, 3, 1, 2, 4).reshape(batch, length, heads, values.shape[-1])


def pool_kernel_order(head_dim: int, rotary_dim: int, interleave: bool) -> torch.Tensor:
    """The head-dimension permutation of a layer on the pool kernel: new dim i holds the
    checkpoint's dim order[i]. The checkpoint's rotary pairs (x1[j], x2[j]) (rotate-half over the
    leading rotary_dim dims, or interleaved (2j, 2j + 1)) go to (j, j + D/2); the non-rotating
    dims fill the rest of both halves."""
    dims = torch.arange(head_dim)
    rotated, rest = dims[:rotary_dim], dims[rotary_dim:]
    x1, x2 = (rotated[0::2], rotated[1::2]) if interleave else rotated.chunk(2) if rotary_dim else (rotated, rotated)
    p1, p2 = rest.chunk(2) if len(rest) else (rest, rest)
    return torch.cat([x1, p1, x2, p2])


class GQAttention(nn.Module):
    """Grouped-query attention: optional per-head QK norms, partial rotary on the leading dims,
    sliding window, sinks, a sigmoid output gate ("full": gate_proj per element, "head": g_proj
    per head, "query": q_proj yields [query, gate] per head), and KV sharing (the layer reuses
    `shared` = another layer's new keys and values, so it has no k/v projections)."""

    def __init__(self, plan: LayerPlan, hidden: int, eps: float) -> None:
        super().__init__()
        self.plan = plan
        h, g = plan.num_heads, plan.num_kv_heads
        shared = plan.kv_source is not None
        width = 2 if plan.out_gate == "query" else 1
        self.q_proj = nn.Linear(hidden, h * plan.head_dim * width, bias=plan.attention_bias)
        if not shared:
            self.k_proj = nn.Linear(hidden, g * plan.head_dim, bias=plan.attention_bias)
            # None in a family whose values are its keys (no value projection of their own).
            self.v_proj: nn.Linear | None = nn.Linear(hidden, g * plan.v_head_dim, bias=plan.attention_bias)
        self.o_proj = nn.Linear(h * plan.v_head_dim, hidden, bias=plan.attention_bias and plan.o_bias)
        if plan.qk_norm:
            self.q_norm = RMSNorm(plan.head_dim, eps, offset=plan.norm_offset, fusable=True)
            if not shared:
                self.k_norm = RMSNorm(plan.head_dim, eps, offset=plan.norm_offset, fusable=True)
        if plan.out_gate == "full":
            self.gate_proj = nn.Linear(hidden, h * plan.v_head_dim, bias=False)
        elif plan.out_gate == "head":
            self.g_proj = nn.Linear(hidden, h, bias=False)
        if plan.sinks:
            self.sinks = nn.Parameter(torch.zeros(h))
        self.register_buffer("inv_freq", layer_inv_freq(plan), persistent=False)
        self.pool_layer: int | None = None  # set by use_pool_kernel: the layer's index in the pool

    def fits_pool_kernel(self, kv_heads: int, head_dim: int) -> bool:
        """Whether this layer can run as one pool-kernel call on a pool of that geometry: plain
        GQA (no window, soft-cap, sinks or KV sharing, the class's own hooks unchanged, so no
        family step is skipped), K and V of the pool's width, a head width the kernel takes."""
        p = self.plan
        own_hooks = any(
            getattr(type(self), n) is not getattr(GQAttention, n)
            for n in ("forward", "queries", "keys_values", "select", "rotate")
        )
        return (
            not own_hooks
            and p.kind == "gqa"
            and p.window is None
            and not p.attn_softcap
            and not p.sinks
            and p.kv_source is None
            and p.head_dim == p.v_head_dim == head_dim
            and p.num_kv_heads == kv_heads
            and head_dim % 16 == 0
            and head_dim <= 256
            and p.num_heads % p.num_kv_heads == 0
        )

    @torch.no_grad()
    def use_pool_kernel(self, pool_layer: int) -> None:
        """Run on the pool kernel from now on, as layer `pool_layer` of the pool: permute the q/k
        head dimensions of the loaded weights (pool_kernel_order) and fuse q/k/v into one
        projection (one matmul node instead of three)."""
        p = self.plan
        order = pool_kernel_order(p.head_dim, p.rotary_dim, p.rope_interleave)
        width = 2 if p.out_gate == "query" else 1  # per head: head_dim query dims (then the gate's)
        q_rows = torch.arange(p.num_heads * width * p.head_dim).reshape(p.num_heads, width, p.head_dim)
        q_rows[:, 0] = q_rows[:, 0, order]
        k_rows = torch.arange(p.num_kv_heads * p.head_dim).reshape(p.num_kv_heads, p.head_dim)[:, order]
        parts = [
            (self.q_proj, q_rows.reshape(-1)),
            (self.k_proj, k_rows.reshape(-1)),
            (self.v_proj, torch.arange(self.v_proj.out_features)),
        ]
        self.qkv_proj = nn.Linear(
            self.q_proj.in_features,
            sum(len(rows) for _, rows in parts),
            bias=self.q_proj.bias is not None,
            device="cpu",
        )
        self.qkv_proj.weight = nn.Parameter(torch.cat([m.weight[rows] for m, rows in parts]), requires_grad=False)
        if self.q_proj.bias is not None:
            self.qkv_proj.bias = nn.Parameter(torch.cat([m.bias[rows] for m, rows in parts]), requires_grad=False)
        self.qkv_widths = [len(rows) for _, rows in parts]
        del self.q_proj, self.k_proj, self.v_proj
        if p.qk_norm:
            for norm in (self.q_norm, self.k_norm):
                norm.weight = nn.Parameter(norm.weight[order].clone(), requires_grad=False)
        self.pool_layer = pool_layer

    def pool_forward(self, x: torch.Tensor, step: StepState):
        """The layer as one pool-kernel call: the fused projection and QK norms, then rotary and
        attention over the pages in place -> (output [B, L, hidden], new k, v [B, L, G, D])."""
        p, pool = self.plan, step.pool
        batch, length, _ = x.shape
        qkv, gate = self.qkv_proj(x), None
        if p.qk_norm or p.out_gate == "query":  # else the projection is the kernel's input as it is
            q, k, v = qkv.split(self.qkv_widths, dim=-1)
            if p.out_gate == "query":
                q, gate = q.reshape(batch, length, p.num_heads, 2 * p.head_dim).chunk(2, dim=-1)
                gate = gate.reshape(batch, length, -1)
            else:
                q = q.reshape(batch, length, p.num_heads, p.head_dim)
            k = k.reshape(batch, length, p.num_kv_heads, p.head_dim)
            if p.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            qkv = torch.cat([q.reshape(batch, length, -1), k.reshape(batch, length, -1), v], dim=-1)
        rows, cos, sin = step.kernel_rotary(p, self.inv_freq)
        out, k, v = ops.pool_attention(
            qkv,
            rows,
            cos,
            sin,
            pool.kv_pool,
            pool.block_tables,
            step.history_lens,
            pool.query_lens,
            self.pool_layer,
            pool.kv_layers,
            p.num_heads,
            p.num_kv_heads,
            p.scale or None,
        )
        out = out.reshape(batch, length, p.num_heads, p.head_dim)
        k, v = (t.reshape(batch, length, p.num_kv_heads, p.head_dim) for t in (k, v))
        return self.o_proj(self.gate_output(out, x, gate)), k, v

    def rotate(self, t: torch.Tensor, step: StepState) -> torch.Tensor:
        if not self.plan.rotary_dim:
            return t
        return rotate_leading(t, step.cos_sin(self.plan, self.inv_freq), self.plan.rope_interleave)

    def queries(self, x: torch.Tensor, step: StepState) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(normed, rotated queries [B, L, H, D], the "query" output gate [B, L, H*D] or None)."""
        p = self.plan
        batch, length, _ = x.shape
        gate = None
        if p.out_gate == "query":  # per head: head_dim query dims, then head_dim gate dims
            q, gate = self.q_proj(x).reshape(batch, length, p.num_heads, 2 * p.head_dim).chunk(2, dim=-1)
            gate = gate.reshape(batch, length, -1)
        else:
            q = self.q_proj(x).reshape(batch, length, p.num_heads, p.head_dim)
        if p.qk_norm:
            q = self.q_norm(q)
        return self.rotate(q, step), gate

    def keys_values(self, x: torch.Tensor, step: StepState) -> tuple[torch.Tensor, torch.Tensor]:
        """The new tokens' keys (normed, rotated) and values [B, L, G, D]."""
        p = self.plan
        batch, length, _ = x.shape
        k = self.k_proj(x).reshape(batch, length, p.num_kv_heads, p.head_dim)
        v = self.v_proj(x).reshape(batch, length, p.num_kv_heads, p.v_head_dim)
        if p.qk_norm:
            k = self.k_norm(k)
        return self.rotate(k, step), v

    def select(self, x, step, past_k, k, visible):
        """Sparse-attention hook: (the keys each query sees, the K rows to cache); all of them here."""
        return visible, k

    def gate_output(self, out: torch.Tensor, x: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """Attention output [B, L, H, Dv] -> gated [B, L, H*Dv]."""
        if self.plan.out_gate == "head":
            out = out * torch.sigmoid(self.g_proj(x)).unsqueeze(-1)
        out = out.reshape(*x.shape[:2], -1)
        if self.plan.out_gate == "full":
            return out * torch.sigmoid(self.gate_proj(x))
        return out if gate is None else out * torch.sigmoid(gate)

    def forward(self, x, step, past_k, past_v, shared=None):
        if self.pool_layer is not None:
            return self.pool_forward(x, step)
        p = self.plan
        q, gate = self.queries(x, step)
        k, v = shared if shared is not None else self.keys_values(x, step)
        visible, cached_k = self.select(x, step, past_k, k, step.visible(past_k.shape[2], p.window))
        past_k = past_k[:, : p.num_kv_heads, :, : p.head_dim]
        past_v = past_v[:, : p.num_kv_heads, :, : p.v_head_dim]
        scale = p.scale or 1.0 / math.sqrt(p.head_dim)
        out = attend(q, k, v, past_k, past_v, visible, scale, self.sinks if p.sinks else None, p.attn_softcap)
        return self.o_proj(self.gate_output(out, x, gate)), cached_k, v

    def load(self, loader: TensorLoader, prefix: str) -> None:
        """`{prefix}{q,k,v,o}_proj`, `{q,k}_norm`, the output gate's projection and `sinks`. A
        KV-shared layer has no k/v: checkpoints may still carry them, unused."""
        plan = self.plan
        loader.linear(self.q_proj, prefix + "q_proj")
        if plan.qk_norm:
            loader.norm(self.q_norm, prefix + "q_norm")
        if plan.kv_source is None:
            loader.linear(self.k_proj, prefix + "k_proj")
            if self.v_proj is not None:
                loader.linear(self.v_proj, prefix + "v_proj")
            if plan.qk_norm:
                loader.norm(self.k_norm, prefix + "k_norm")
        else:
            unused = re.compile(re.escape(prefix) + r"(k_proj|v_proj|k_norm|v_norm)\.")
            loader.used.update(n for n in loader.tensors if unused.match(n))
        if plan.out_gate == "full":
            loader.linear(self.gate_proj, prefix + "gate_proj")
        elif plan.out_gate == "head":
            loader.linear(self.g_proj, prefix + "g_proj")
        if plan.sinks:
            loader.put(self, "sinks", loader.take(prefix + "sinks"))
        loader.linear(self.o_proj, prefix + "o_proj")


class MLAttention(nn.Module):
    """Multi-head latent attention, absorbed: scores and values in the latent space.

    q_nope . k_nope = q_nope . (W_UK c) = (W_UK^T q_nope) . c, and o = W_UV (sum p c), so the
    pool stores only c = kv_a_layernorm(latent) and the shared rotary key (as K = [c, k_pe],
    V = [c]); the result equals the expanded form up to float rounding."""

    def __init__(self, plan: LayerPlan, hidden: int, eps: float) -> None:
        super().__init__()
        self.plan = plan
        h, rope, nope, rank = plan.num_heads, plan.rotary_dim, plan.qk_nope_head_dim, plan.kv_lora_rank
        if plan.q_lora_rank:
            self.q_a_proj = nn.Linear(hidden, plan.q_lora_rank, bias=plan.attention_bias)
            self.q_a_layernorm = RMSNorm(plan.q_lora_rank, eps)
            self.q_b_proj = nn.Linear(plan.q_lora_rank, h * (nope + rope), bias=False)
        else:
            self.q_proj = nn.Linear(hidden, h * (nope + rope), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, rank + rope, bias=plan.attention_bias)
        self.kv_a_layernorm = RMSNorm(rank, eps)
        self.kv_b_proj = nn.Linear(rank, h * (nope + plan.v_head_dim), bias=False)
        self.o_proj = nn.Linear(h * plan.v_head_dim, hidden, bias=plan.attention_bias)
        self.register_buffer("inv_freq", layer_inv_freq(plan), persistent=False)

    def select(self, x, q_resid, cos_sin, past_v, visible, step, c):
        """Sparse-attention hook: (the keys each query sees, the V rows to cache); all of them and
        the latent here."""
        return visible, c

    def forward(self, x, step, past_k, past_v, shared=None):
        p = self.plan
        batch, length, _ = x.shape
        h, rope, nope, rank = p.num_heads, p.rotary_dim, p.qk_nope_head_dim, p.kv_lora_rank
        q_resid = self.q_a_layernorm(self.q_a_proj(x)) if p.q_lora_rank else None
        q = self.q_b_proj(q_resid) if p.q_lora_rank else self.q_proj(x)
        q = q.reshape(batch, length, h, nope + rope)
        q_nope, q_pe = q.split([nope, rope], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([rank, rope], dim=-1)
        c = self.kv_a_layernorm(latent).unsqueeze(2)  # [B, L, 1, rank]
        cos_sin = step.cos_sin(p, self.inv_freq)
        q_pe = rotate(q_pe, cos_sin, p.rope_interleave)
        k_pe = rotate(k_pe.unsqueeze(2), cos_sin, p.rope_interleave)
        w = self.kv_b_proj.weight.reshape(h, nope + p.v_head_dim, rank)
        w_uk, w_uv = w[:, :nope], w[:, nope:]  # [h, nope, rank], [h, v, rank]
        q_lat = torch.einsum("blhn,hnr->blhr", q_nope, w_uk)
        query = torch.cat([q_lat, q_pe], dim=-1)
        key = torch.cat([c, k_pe], dim=-1)  # [B, L, 1, rank+rope]
        scale = p.scale or 1.0 / math.sqrt(nope + rope)
        visible, value = self.select(x, q_resid, cos_sin, past_v, step.visible(past_k.shape[2], None), step, c)
        past_k, past_v = past_k[:, :1, :, : rank + rope], past_v[:, :1, :, :rank]
        out = attend(query, key, c, past_k, past_v, visible, scale)  # [B, L, h, rank]
        out = torch.einsum("blhr,hvr->blhv", out, w_uv)
        return self.o_proj(out.reshape(batch, length, -1)), key, value

    def load(self, loader: TensorLoader, prefix: str) -> None:
        if self.plan.q_lora_rank:
            loader.linear(self.q_a_proj, prefix + "q_a_proj")
            loader.norm(self.q_a_layernorm, prefix + "q_a_layernorm")
            loader.linear(self.q_b_proj, prefix + "q_b_proj")
        else:
            loader.linear(self.q_proj, prefix + "q_proj")
        loader.linear(self.kv_a_proj_with_mqa, prefix + "kv_a_proj_with_mqa")
        loader.norm(self.kv_a_layernorm, prefix + "kv_a_layernorm")
        loader.linear(self.kv_b_proj, prefix + "kv_b_proj")
        loader.linear(self.o_proj, prefix + "o_proj")

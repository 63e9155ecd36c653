"""flare's torch operators: the schemas of the hot ops a step program calls, and their plain-torch
meaning (the reference every kernel is held to).

    add_rms_norm(x, residual, weight, eps)   -> (rms_norm(x + residual) * weight, x + residual)
    pool_attention(qkv, positions, cos, sin, kv_pool, block_tables, history_lens, query_lens,
                   layer, num_layers, num_heads, kv_heads, scale)
                                              -> one layer's whole attention: rotate-half rotary
                                                 of q and k, causal GQA over the row's pool pages
                                                 plus its new tokens; (out, rotated k, v)
    experts(h, idx, weights, up, down, gate, kind, unit, limit, alpha)
                                              -> [N, W]: sum_j weights[n, j] * down_e(glu(h_n)),
                                                 e = idx[n, j] (routed experts)

ignition traces its models through these ops (ignition.models.ops.fused_export) and lowers them
to ONNX nodes for the CPU engine; a torch step program (`ignition export --target cuda`) keeps
them opaque, so helios must register them (import this module) before `torch.export.load`. The
references are the ops' default implementation on every device; helios.kernels.triton_attention
registers a CUDA kernel for pool_attention over it.

Every reference is device-aware (no tensor is created off the inputs' device) and dtype-aware
(attention scores and softmax run in fp32 whatever the pool's dtype, the result in the input's).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# The ops' meaning in plain torch  -------------------------------------------------------------------------


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    total = x + residual
    wide = total.float()  # the norm in fp32 (a no-op for fp32 inputs), as transformers computes it
    return (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight, total


def rotary_ref(x: torch.Tensor, positions: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor):
    """x [B, L, heads*D], positions [B, L], caches [max_pos, D/2] -> rotated x (HF rotate-half)."""
    batch, length, width = x.shape
    half = cos_cache.shape[1]
    x = x.reshape(batch, length, width // (2 * half), 2 * half)
    cos = cos_cache[positions].unsqueeze(2)  # [B, L, 1, D/2]
    sin = sin_cache[positions].unsqueeze(2)
    x1, x2 = x[..., :half], x[..., half:]
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.reshape(batch, length, width)


def paged_attention_ref(
    q: torch.Tensor,  # [B, L, nh*D], rotated
    k: torch.Tensor,  # [B, L, kvh*D], rotated
    v: torch.Tensor,  # [B, L, kvh*D]
    past_k: torch.Tensor,  # [B, kvh, S, D]: history gathered from the pool (BNSH)
    past_v: torch.Tensor,
    seqlens_k: torch.Tensor,  # [B] int32: history + valid new tokens - 1 (GQA's convention)
    query_lens: torch.Tensor,  # [B] int32: valid new tokens
    total_len: torch.Tensor,  # int32 scalar: S + L, an upper bound of seqlens_k + 1
    num_heads: int,
    kv_heads: int,
    scale: float | None = None,  # softmax scale; None: 1/sqrt(D)
) -> torch.Tensor:
    """[B, L, nh*D]. Row b's history is past[b, :, :h] with h = seqlens_k + 1 - query_lens; new
    token i sees that history and new tokens 0..i. Rows past query_lens are padding (any value)."""
    batch, length, _ = q.shape
    hist, dim = past_k.shape[2], past_k.shape[3]
    group = num_heads // kv_heads
    history_lens = (seqlens_k + 1 - query_lens).to(torch.int64)
    k = k.reshape(batch, length, kv_heads, dim).transpose(1, 2)
    v = v.reshape(batch, length, kv_heads, dim).transpose(1, 2)
    keys = torch.cat([past_k, k], dim=2)  # [B, kvh, S+L, D]
    values = torch.cat([past_v, v], dim=2)
    # Query head h = kv * group + g uses kv head h // group (HF order): regroup Q to
    # [B, kvh, group*L, D] so one matmul per KV head serves its whole group (no repeat).
    q = q.reshape(batch, length, kv_heads, group, dim).permute(0, 2, 3, 1, 4)
    q = q.reshape(batch, kv_heads, group * length, dim) * (scale or 1.0 / math.sqrt(dim))
    # Visibility of key s for query i of row b: history s < history_lens[b], then new keys
    # causally. Padded query rows still see new key 0, so no row is all-masked (no NaN).
    hist_ok = torch.arange(hist, device=q.device).unsqueeze(0) < history_lens.unsqueeze(1)  # [B, S]
    idx = torch.arange(length, device=q.device)
    causal = idx.unsqueeze(0) <= idx.unsqueeze(1)  # [L query, L key]
    visible = torch.cat(
        [hist_ok.unsqueeze(1).expand(batch, length, hist), causal.unsqueeze(0).expand(batch, length, length)], dim=-1
    )
    visible = visible.unsqueeze(1).expand(batch, group, length, hist + length)
    visible = visible.reshape(batch, 1, group * length, hist + length)
    # Scores and softmax in fp32 (a no-op for fp32 inputs), the result in the inputs' dtype.
    scores = torch.matmul(q.float(), keys.float().transpose(-1, -2))
    scores = scores.masked_fill(~visible, torch.finfo(torch.float32).min)
    out = torch.matmul(torch.softmax(scores, dim=-1), values.float()).to(values.dtype)  # [B, kvh, group*L, D]
    out = out.reshape(batch, kv_heads, group, length, dim).permute(0, 3, 1, 2, 4)
    return out.reshape(batch, length, num_heads * dim)


def pool_attention_ref(
    qkv: torch.Tensor,  # [B, L, (nh + 2 kvh) * D]: the fused projection, before rotary
    positions: torch.Tensor,  # [B, L]
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    kv_pool: torch.Tensor,  # [layers * 2 * P, page_tokens, kvh, D]
    block_tables: torch.Tensor,  # [B, M]
    history_lens: torch.Tensor,  # [B]
    query_lens: torch.Tensor,  # [B]
    layer: int,
    num_layers: int,
    num_heads: int,
    kv_heads: int,
    scale: float | None = None,  # softmax scale; None: 1/sqrt(D)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer's attention over its pool pages: (out [B, L, nh*D], rotated k, v [B, L, kvh*D]).
    Pool row (2 * layer + kind) * P + page holds a page of K (kind 0) or V (kind 1)."""
    batch, length, _ = qkv.shape
    _, tokens, _, dim = kv_pool.shape
    q_width, kv_width = num_heads * dim, kv_heads * dim
    qk, v = qkv.split([q_width + kv_width, kv_width], dim=-1)
    q, k = rotary_ref(qk, positions, cos_cache, sin_cache).split([q_width, kv_width], dim=-1)
    pages = kv_pool.shape[0] // (2 * num_layers)

    def history(kind: int) -> torch.Tensor:
        rows = block_tables + (2 * layer + kind) * pages
        gathered = torch.index_select(kv_pool, 0, rows.reshape(-1))
        return gathered.reshape(batch, -1, kv_heads, dim).transpose(1, 2)

    seqlens_k = (history_lens + query_lens - 1).to(torch.int32)
    total_len = torch.ones((), dtype=torch.int32, device=qkv.device) * (block_tables.shape[1] * tokens + length)
    out = paged_attention_ref(
        q, k, v, history(0), history(1), seqlens_k, query_lens.to(torch.int32), total_len, num_heads, kv_heads, scale
    )
    # Padded query rows: zeros, as the fused kernel writes them.
    valid = torch.arange(length, device=qkv.device).unsqueeze(0) < query_lens.unsqueeze(1)
    return out * valid.unsqueeze(-1).to(out.dtype), k, v


ACTIVATIONS = ("silu", "gelu_tanh", "relu2")
# Gated units (act(gate) * up and the families' clamped variants), with a limit L and Minimax's alpha.
UNITS = ("glu", "clamp_after", "clamp_before", "alpha")


def activation(name: str, x: torch.Tensor) -> torch.Tensor:
    """The activations experts and MLPs use (ACTIVATIONS, which flare's MoE kernel also has)."""
    if name == "silu":
        return F.silu(x)
    if name == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if name == "relu2":  # squared ReLU
        return torch.square(F.relu(x))
    raise ValueError(f"unknown activation {name!r}")


def gated(kind: str, unit: str, limit: float, alpha: float, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The gated units (UNITS) that flare's MoE kernels compute too:
    glu: act(g) * u; clamp_after: min(act(g), L) * clamp(u, -L, L) (Step);
    clamp_before: act(min(g, L)) * clamp(u, -L, L) (DeepSeek V4);
    alpha: (clamp(u, -L, L) + 1) * g' * sigmoid(alpha g'), g' = min(g, L) (MiniMax M3)."""
    if unit == "glu":
        return activation(kind, gate) * up
    up = up.clamp(min=-limit, max=limit)
    if unit == "clamp_after":
        return activation(kind, gate).clamp(max=limit) * up
    if unit == "clamp_before":
        return activation(kind, gate.clamp(max=limit)) * up
    if unit == "alpha":
        gate = gate.clamp(max=limit)
        return (up + 1.0) * (gate * torch.sigmoid(gate * alpha))
    raise ValueError(f"unknown gated unit {unit!r}")


def experts_ref(
    h: torch.Tensor,
    idx: torch.Tensor,
    weights: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    gate: torch.Tensor | None,
    kind: str,
    unit: str = "glu",
    limit: float = 0.0,
    alpha: float = 0.0,
) -> torch.Tensor:
    """h [N, W], idx/weights [N, k], up/gate [E, I, W], down [E, W, I] -> [N, W], every expert
    computed; `kind` one of ACTIVATIONS, (unit, limit, alpha) the gated unit (`gated`)."""
    upped = torch.einsum("nh,eih->eni", h, up)
    if gate is None:
        glu = activation(kind, upped)
    else:
        glu = gated(kind, unit, limit, alpha, torch.einsum("nh,eih->eni", h, gate), upped)
    outputs = torch.einsum("eni,ehi->enh", glu, down)
    dense = torch.zeros(h.shape[0], up.shape[0], dtype=weights.dtype, device=h.device).scatter_add(
        1, idx, weights
    )  # [N, E]
    return (outputs * dense.t().unsqueeze(-1)).sum(0)


# -- the operators --------------------------------------------------------------------------------


@torch.library.custom_op("flare::add_rms_norm", mutates_args=())
def add_rms_norm_op(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    out, total = add_rms_norm_ref(x, residual, weight, eps)
    return out, total


@add_rms_norm_op.register_fake
def _(x, residual, weight, eps):
    return torch.empty_like(x), torch.empty_like(x)


@torch.library.custom_op("flare::pool_attention", mutates_args=())
def pool_attention_op(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    kv_pool: torch.Tensor,
    block_tables: torch.Tensor,
    history_lens: torch.Tensor,
    query_lens: torch.Tensor,
    layer: int,
    num_layers: int,
    num_heads: int,
    kv_heads: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    out, k, v = pool_attention_ref(
        qkv,
        positions,
        cos_cache,
        sin_cache,
        kv_pool,
        block_tables,
        history_lens,
        query_lens,
        layer,
        num_layers,
        num_heads,
        kv_heads,
        scale,
    )
    # v is a slice of qkv: a custom op's output may not alias its input, so copy it.
    return out, k.contiguous(), v.clone(memory_format=torch.contiguous_format)


@pool_attention_op.register_fake
def _(
    qkv,
    positions,
    cos_cache,
    sin_cache,
    kv_pool,
    block_tables,
    history_lens,
    query_lens,
    layer,
    num_layers,
    num_heads,
    kv_heads,
    scale,
):
    batch, length, _ = qkv.shape
    dim = kv_pool.shape[-1]
    return (
        qkv.new_empty(batch, length, num_heads * dim),
        qkv.new_empty(batch, length, kv_heads * dim),
        qkv.new_empty(batch, length, kv_heads * dim),
    )


@torch.library.custom_op("flare::experts", mutates_args=())
def experts_op(
    h: torch.Tensor,
    idx: torch.Tensor,
    weights: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    gate: torch.Tensor | None,
    kind: str,
    unit: str,
    limit: float,
    alpha: float,
) -> torch.Tensor:
    return experts_ref(h, idx, weights, up, down, gate, kind, unit, limit, alpha).contiguous()


@experts_op.register_fake
def _(h, idx, weights, up, down, gate, kind, unit, limit, alpha):
    return h.new_empty(h.shape)

"""Triton kernels for `flare::pool_attention` on CUDA (helios.kernels.torch_ops holds the op's
meaning): a rotary prologue, a unified paged-attention kernel for prefill chunks and decode, and a
split-K variant plus reduce for long histories at small batch.

Layout (torch_ops.pool_attention_ref): pool [layers * 2 * P, T, KVH, D], row (2 layer + kind) P +
page; key j of row b lies at page block_tables[b, j // T], slot j % T; a token's KV heads side by
side. One layer's K half, pool[2 layer P : (2 layer + 1) P], is vLLM's cache layout
[blocks, block_size, kv_heads, head_size], so the kernels take the K and V halves as two views.

Numerics (why a row's bits never depend on its batch): a row's history keys fall into fixed
segments of `segment_keys` keys by key index (a constant, never derived from the batch); each
segment is an online softmax over TILE-key tiles from a fresh state, the step's new keys
continue the last segment (causal mask), and the segments are folded left to right by `_merge`.
The fused path folds the segments in one program; the split path gives each segment its own
program, stores the segment's fp32 (acc, max, sum) and folds them in the reduce kernel with the
same `_merge` from the same starting state. Both paths therefore give the same bits (tested under
the interpreter; on the GPU both compile the same code at the same tile shapes), so the choice of
path (`_use_split`) may depend on the batch. All lengths are read on the device: the host never
syncs, so the launches are CUDA-graph capturable.

Operands: bf16/fp16 go into tl.dot as loaded, accumulation and softmax are fp32. `UPCAST` casts
operands to fp32 first (with IEEE dots, no TF32): always for fp32 data, and for every dtype under
TRITON_INTERPRET=1, whose tl.dot mishandles bf16. Only Triton 3.6 features are used (the H200
runs triton 3.6.0).
"""

from __future__ import annotations

import os
import threading

import torch
import triton
import triton.language as tl

import helios.kernels.torch_ops  # noqa: F401  (defines flare::pool_attention)

LOG2E = 1.4426950408889634
SEGMENT_KEYS = 256  # history keys per split-K segment (the CPU kernel's chunk size too)
SPLIT_MAX_PROGRAMS = 128  # split a decode only while the fused grid underfills the GPU (132 SMs)


@triton.jit
def _rotary_kernel(
    qkv,
    positions,
    cos,
    sin,
    q_out,
    k_out,
    v_out,
    H: tl.constexpr,
    KVH: tl.constexpr,
    D: tl.constexpr,
    HALF: tl.constexpr,
    HEADS_PAD: tl.constexpr,
):
    """One token per program: rotate-half rotary of its q and k heads, v copied, in one pass."""
    tok = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, HEADS_PAD)
    cols = tl.arange(0, HALF)
    live = (heads < H + 2 * KVH)[:, None]
    src = qkv + tok * ((H + 2 * KVH) * D) + heads[:, None] * D + cols[None, :]
    x1 = tl.load(src, mask=live, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=live, other=0.0).to(tl.float32)
    pos = tl.load(positions + tok)
    c = tl.load(cos + pos * HALF + cols).to(tl.float32)[None, :]
    s = tl.load(sin + pos * HALF + cols).to(tl.float32)[None, :]
    rotate = (heads < H + KVH)[:, None]
    y1 = tl.where(rotate, x1 * c - x2 * s, x1)
    y2 = tl.where(rotate, x2 * c + x1 * s, x2)
    # Each head goes to its own output; masked lanes compute (but never touch) foreign offsets.
    q_dst = q_out + tok * (H * D) + heads[:, None] * D + cols[None, :]
    is_q = (heads < H)[:, None]
    tl.store(q_dst, y1.to(q_out.dtype.element_ty), mask=is_q)
    tl.store(q_dst + HALF, y2.to(q_out.dtype.element_ty), mask=is_q)
    k_dst = k_out + tok * (KVH * D) + (heads[:, None] - H) * D + cols[None, :]
    is_k = rotate & ~is_q
    tl.store(k_dst, y1.to(k_out.dtype.element_ty), mask=is_k)
    tl.store(k_dst + HALF, y2.to(k_out.dtype.element_ty), mask=is_k)
    v_dst = v_out + tok * (KVH * D) + (heads[:, None] - H - KVH) * D + cols[None, :]
    is_v = live & ~rotate
    tl.store(v_dst, y1.to(v_out.dtype.element_ty), mask=is_v)
    tl.store(v_dst + HALF, y2.to(v_out.dtype.element_ty), mask=is_v)


@triton.jit
def _fold_tile(q, kt, vt, visible, acc, m_i, l_i, qk_scale, UPCAST: tl.constexpr):
    """One online-softmax step over a key tile (kt [D, TILE], vt [TILE, D]); scores in log2 units."""
    if UPCAST:
        s = tl.dot(q, kt.to(tl.float32), input_precision="ieee")
    else:
        s = tl.dot(q, kt)
    s = tl.where(visible, s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key seen yet: keep exp2 finite
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if UPCAST:
        pv = tl.dot(p, vt.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(vt.dtype), vt)
    return acc * alpha[:, None] + pv, m_new, l_i


@triton.jit
def _merge(acc, m_i, l_i, acc_s, m_s, l_s):
    """Fold a segment's state into the running one (the same bits in the fused and split paths)."""
    m_new = tl.maximum(m_i, m_s)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    a = tl.exp2(m_i - m_safe)
    c = tl.exp2(m_s - m_safe)
    return acc * a[:, None] + acc_s * c[:, None], m_new, l_i * a + l_s * c


@triton.jit
def _segment(
    q,
    k_pool,
    v_pool,
    k_new,
    v_new,
    table_row,
    new_row,
    seg,
    nseg,
    hist,
    q_end,
    qi,
    qk_scale,
    KVH: tl.constexpr,
    D: tl.constexpr,
    T: tl.constexpr,
    TILE: tl.constexpr,
    SEG: tl.constexpr,
    BLOCK_M: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Segment `seg` of a row from a fresh state: its history keys from the pool pages, then, for
    the last segment, the step's new keys (k_new/v_new, causal). Returns (acc, max, sum)."""
    kvh = tl.program_id(1)
    d = tl.arange(0, D)
    cols = tl.arange(0, TILE)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    lo = seg * SEG
    hi = tl.minimum(hist, lo + SEG)
    for j0 in range(lo, hi, TILE):
        j = j0 + cols
        live = j < hi
        page = tl.load(table_row + j // T, mask=live, other=0)  # int64: pool offsets exceed 2^31
        slot = (page * T + j % T) * (KVH * D) + kvh * D
        kt = tl.load(k_pool + slot[None, :] + d[:, None], mask=live[None, :], other=0.0)
        vt = tl.load(v_pool + slot[:, None] + d[None, :], mask=live[:, None], other=0.0)
        acc, m_i, l_i = _fold_tile(q, kt, vt, live[None, :], acc, m_i, l_i, qk_scale, UPCAST)
    new_hi = tl.where(seg == nseg - 1, q_end, 0)
    for n0 in range(0, new_hi, TILE):
        n = n0 + cols
        live = n < new_hi
        slot = new_row + n.to(tl.int64) * (KVH * D) + kvh * D
        kt = tl.load(k_new + slot[None, :] + d[:, None], mask=live[None, :], other=0.0)
        vt = tl.load(v_new + slot[:, None] + d[None, :], mask=live[:, None], other=0.0)
        visible = live[None, :] & (n[None, :] <= qi[:, None])
        acc, m_i, l_i = _fold_tile(q, kt, vt, visible, acc, m_i, l_i, qk_scale, UPCAST)
    return acc, m_i, l_i


@triton.jit
def _store_out(out, acc, l_i, tok, head, qi, g, qlen, L, G: tl.constexpr, H: tl.constexpr, D: tl.constexpr):
    d = tl.arange(0, D)
    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o = tl.where(((qi < qlen) & (g < G))[:, None], o, 0.0)  # padded queries: zeros
    dst = out + ((tok * H + head) * D)[:, None] + d[None, :]
    tl.store(dst, o.to(out.dtype.element_ty), mask=((qi < L) & (g < G))[:, None])


@triton.jit
def _attention_kernel(
    q,
    k_new,
    v_new,
    k_pool,
    v_pool,
    block_tables,
    history_lens,
    query_lens,
    out,
    part_acc,
    part_max,
    part_sum,
    L,
    M,
    num_segments,
    qk_scale,
    H: tl.constexpr,
    KVH: tl.constexpr,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    D: tl.constexpr,
    T: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE: tl.constexpr,
    SEG: tl.constexpr,
    SPLIT: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """grid (B * cdiv(L, BLOCK_Q), KVH[, segments]). A program owns BLOCK_Q query positions x the G
    query heads of one KV head, packed as BLOCK_M = BLOCK_Q * G_PAD rows (row r: query r // G_PAD,
    head r % G_PAD), so each K/V tile is loaded once for the whole group (vLLM's trick)."""
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    q_blocks = tl.cdiv(L, BLOCK_Q)
    b = pid // q_blocks
    qb = pid % q_blocks
    rows = tl.arange(0, BLOCK_M)
    qi = qb * BLOCK_Q + rows // G_PAD
    g = rows % G_PAD
    head = kvh * G + g
    d = tl.arange(0, D)
    qlen = tl.load(query_lens + b).to(tl.int32)
    hist = tl.minimum(tl.load(history_lens + b).to(tl.int32), M * T)  # never read past the table
    nseg = tl.maximum(tl.cdiv(hist, SEG), 1)
    nseg = tl.where(qb * BLOCK_Q < qlen, nseg, 0)  # a q-block of padding only writes zeros
    q_end = tl.minimum(qb * BLOCK_Q + BLOCK_Q, qlen)
    tok = b.to(tl.int64) * L + qi
    table_row = block_tables + b.to(tl.int64) * M
    new_row = b.to(tl.int64) * L * (KVH * D)
    q_ok = (qi < qlen) & (g < G)
    qt = tl.load(q + ((tok * H + head) * D)[:, None] + d[None, :], mask=q_ok[:, None], other=0.0)
    if UPCAST:
        qt = qt.to(tl.float32)
    if SPLIT:
        seg = tl.program_id(2)
        if seg < nseg:  # segments past the row's own count (and padding blocks) do nothing
            acc, m_i, l_i = _segment(
                qt,
                k_pool,
                v_pool,
                k_new,
                v_new,
                table_row,
                new_row,
                seg,
                nseg,
                hist,
                q_end,
                qi,
                qk_scale,
                KVH,
                D,
                T,
                TILE,
                SEG,
                BLOCK_M,
                UPCAST,
            )
            at = ((pid * KVH + kvh).to(tl.int64) * num_segments + seg) * BLOCK_M + rows
            tl.store(part_max + at, m_i)
            tl.store(part_sum + at, l_i)
            tl.store(part_acc + at[:, None] * D + d[None, :], acc)
    else:
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        for seg in range(0, nseg):
            acc_s, m_s, l_s = _segment(
                qt,
                k_pool,
                v_pool,
                k_new,
                v_new,
                table_row,
                new_row,
                seg,
                nseg,
                hist,
                q_end,
                qi,
                qk_scale,
                KVH,
                D,
                T,
                TILE,
                SEG,
                BLOCK_M,
                UPCAST,
            )
            acc, m_i, l_i = _merge(acc, m_i, l_i, acc_s, m_s, l_s)
        _store_out(out, acc, l_i, tok, head, qi, g, qlen, L, G, H, D)


@triton.jit
def _reduce_kernel(
    part_acc,
    part_max,
    part_sum,
    history_lens,
    query_lens,
    out,
    L,
    M,
    num_segments,
    H: tl.constexpr,
    KVH: tl.constexpr,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    D: tl.constexpr,
    T: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    SEG: tl.constexpr,
):
    """grid (B * cdiv(L, BLOCK_Q), KVH): fold the row's own segments in order, then normalize."""
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    q_blocks = tl.cdiv(L, BLOCK_Q)
    b = pid // q_blocks
    qb = pid % q_blocks
    rows = tl.arange(0, BLOCK_M)
    qi = qb * BLOCK_Q + rows // G_PAD
    g = rows % G_PAD
    d = tl.arange(0, D)
    qlen = tl.load(query_lens + b).to(tl.int32)
    hist = tl.minimum(tl.load(history_lens + b).to(tl.int32), M * T)
    nseg = tl.maximum(tl.cdiv(hist, SEG), 1)
    nseg = tl.where(qb * BLOCK_Q < qlen, nseg, 0)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    base = (pid * KVH + kvh).to(tl.int64) * num_segments
    for seg in range(0, nseg):
        at = (base + seg) * BLOCK_M + rows
        acc_s = tl.load(part_acc + at[:, None] * D + d[None, :])
        acc, m_i, l_i = _merge(acc, m_i, l_i, acc_s, tl.load(part_max + at), tl.load(part_sum + at))
    _store_out(out, acc, l_i, b.to(tl.int64) * L + qi, kvh * G + g, qi, g, qlen, L, G, H, D)


def _config(length: int, group_pad: int, dim: int, segment_keys: int) -> tuple[int, int, int]:
    """(BLOCK_Q, TILE, num_warps), from the call's shape only (never from lengths on the device).
    Decode (L == 1): BLOCK_Q = 16 // G_PAD, so BLOCK_M reaches tl.dot's minimum of 16 rows (G = 7:
    2 query slots, one used); TILE 64 keys (4 pages); num_warps 4 for D <= 64, 8 for D = 128.
    Prefill: BLOCK_M = 128 rows (BLOCK_Q 16 at G_PAD 8) x TILE 64 for D <= 64, 64 rows (BLOCK_Q 8)
    x TILE 32 for D = 128, 8 warps, capped near L. sm_90 builds of these (triton 3.6 and 3.8, compiled
    without a GPU) fit bf16/fp16 in 255 registers without spilling; 4 warps spilled at prefill
    BLOCK_M 128/D 64 and decode D 128. fp32 (a parity mode) spills. TILE shrinks only for tests' tiny
    segments (segments are whole tiles)."""
    if length == 1:
        block_q, tile, warps = max(1, 16 // group_pad), 64, 4 if dim <= 64 else 8
    else:
        rows, tile, warps = (128, 64, 8) if dim <= 64 else (64, 32, 8)
        block_q = max(1, 16 // group_pad, min(rows // group_pad, triton.next_power_of_2(length)))
    return block_q, min(tile, segment_keys), warps


def _use_split(batch: int, length: int, kv_heads: int, capacity: int, segment_keys: int) -> bool:
    """Split-K for decode steps whose fused grid leaves most SMs idle and whose block table can hold
    more than one segment. `capacity` = M * T (the table's width, a shape: reading the actual
    longest history would sync the host). Either path gives the same bits (module docstring)."""
    return length == 1 and capacity > segment_keys and batch * kv_heads < SPLIT_MAX_PROGRAMS


def pool_attention_triton(
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
    *,
    segment_keys: int = SEGMENT_KEYS,  # tests shrink it to get many segments cheaply
    split: bool | None = None,  # None: `_use_split`; tests force either path
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """flare::pool_attention with the op's signature: (out [B, L, H*D], rotated k, v [B, L, KVH*D])."""
    batch, length, width = qkv.shape
    pool_rows, tokens, pool_heads, dim = kv_pool.shape
    if pool_heads != kv_heads or num_heads % kv_heads or width != (num_heads + 2 * kv_heads) * dim:
        raise ValueError(f"qkv {tuple(qkv.shape)}, pool {tuple(kv_pool.shape)}: not {num_heads}/{kv_heads} heads")
    if dim < 16 or dim & (dim - 1) or pool_rows % (2 * num_layers):
        raise ValueError(f"head dim {dim} must be a power of two >= 16; pool rows {pool_rows} / {num_layers} layers")
    if segment_keys not in (16, 32) and (segment_keys <= 0 or segment_keys % 64):
        raise ValueError(f"segment_keys {segment_keys} must be 16, 32 or a multiple of 64 (whole tiles)")
    if not kv_pool.is_contiguous():
        raise ValueError("kv_pool must be contiguous")  # never copy the pool
    dev, dtype = qkv.device, qkv.dtype
    q = torch.empty(batch, length, num_heads, dim, device=dev, dtype=dtype)
    k = torch.empty(batch, length, kv_heads * dim, device=dev, dtype=dtype)
    v = torch.empty_like(k)
    out = torch.empty(batch, length, num_heads * dim, device=dev, dtype=dtype)
    if batch * length == 0:
        return out, k, v
    _rotary_kernel[(batch * length,)](
        qkv.contiguous(),
        positions.contiguous(),
        cos_cache.contiguous(),
        sin_cache.contiguous(),
        q,
        k,
        v,
        H=num_heads,
        KVH=kv_heads,
        D=dim,
        HALF=dim // 2,
        HEADS_PAD=triton.next_power_of_2(num_heads + 2 * kv_heads),
    )
    pages = pool_rows // (2 * num_layers)
    k_pool = kv_pool[2 * layer * pages : (2 * layer + 1) * pages]  # views: no copy, offset in the pointer
    v_pool = kv_pool[(2 * layer + 1) * pages : (2 * layer + 2) * pages]
    tables = block_tables.to(torch.int64).contiguous()
    max_pages = tables.shape[1]
    group = num_heads // kv_heads
    group_pad = triton.next_power_of_2(group)
    block_q, tile, warps = _config(length, group_pad, dim, segment_keys)
    block_m = block_q * group_pad
    q_blocks = triton.cdiv(length, block_q)
    if split is None:
        split = _use_split(batch, length, kv_heads, max_pages * tokens, segment_keys)
    segments = max(1, triton.cdiv(max_pages * tokens, segment_keys)) if split else 1
    upcast = os.environ.get("TRITON_INTERPRET") == "1" or dtype == torch.float32
    hist = history_lens.to(torch.int64).contiguous()
    qlens = query_lens.to(torch.int64).contiguous()
    rows = batch * q_blocks * kv_heads * segments * block_m
    part_acc = torch.empty(rows * dim if split else 1, device=dev, dtype=torch.float32)
    part_max = torch.empty(rows if split else 1, device=dev, dtype=torch.float32)
    part_sum = torch.empty_like(part_max)
    shape = dict(
        H=num_heads,
        KVH=kv_heads,
        G=group,
        G_PAD=group_pad,
        D=dim,
        T=tokens,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        SEG=segment_keys,
    )
    grid = (batch * q_blocks, kv_heads, segments) if split else (batch * q_blocks, kv_heads)
    _attention_kernel[grid](
        q,
        k,
        v,
        k_pool,
        v_pool,
        tables,
        hist,
        qlens,
        out,
        part_acc,
        part_max,
        part_sum,
        length,
        max_pages,
        segments,
        scale * LOG2E,
        TILE=tile,
        SPLIT=split,
        UPCAST=upcast,
        num_warps=warps,
        **shape,
    )
    if split:
        _reduce_kernel[(batch * q_blocks, kv_heads)](
            part_acc, part_max, part_sum, hist, qlens, out, length, max_pages, segments, num_warps=4, **shape
        )
    return out, k, v


_registered = False
_lock = threading.Lock()


def register_cuda_kernel() -> None:
    """Make pool_attention_triton flare::pool_attention's CUDA kernel (once; later calls do nothing)."""
    global _registered
    with _lock:
        if not _registered:
            torch.library.register_kernel("flare::pool_attention", "cuda", pool_attention_triton)
            _registered = True

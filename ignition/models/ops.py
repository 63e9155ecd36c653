"""The hot-path ops of a decoder layer, each with a plain-torch meaning and a fused ONNX form.

    add_rms_norm(x, residual, weight)   -> (rms_norm(x + residual) * weight, x + residual)
    pool_attention(qkv, positions, cos, sin, kv_pool, block_tables, history_lens, query_lens)
                                        -> one layer's whole attention: rotate-half rotary of q
                                           and k, causal GQA over the row's pool pages plus its
                                           new tokens; (out, rotated k, v)

built from the plain pieces rotary_ref (rotary of every head of [B, L, heads*D]) and
paged_attention_ref (causal GQA over history ++ new tokens per row).

Eager torch (and a plain export) runs the functions below as written. Inside `fused_export()`
the model calls them as torch custom ops instead, and `TRANSLATIONS` lowers those to one node
each: onnxruntime's SkipSimplifiedLayerNormalization, and flare's ai.flare.PagedAttention
(helios/kernels), which shares each KV head across its query group in-kernel and reads the
pages where they lie instead of a Gather + Transpose + RotaryEmbedding + GroupQueryAttention
chain per layer (helios rewrites it back into that chain where flare's kernels cannot run). The
plain functions define what the fused kernels must compute; export validation checks the two
agree.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator

import torch

_FUSED = False


@contextlib.contextmanager
def fused_export() -> Iterator[None]:
    """Route the model through the custom ops (for torch.onnx.export with TRANSLATIONS)."""
    global _FUSED
    previous, _FUSED = _FUSED, True
    try:
        yield
    finally:
        _FUSED = previous


# -- plain torch semantics -------------------------------------------------------------------------


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    total = x + residual
    return total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + eps) * weight, total


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
    hist_ok = torch.arange(hist).unsqueeze(0) < history_lens.unsqueeze(1)  # [B, S]
    idx = torch.arange(length)
    causal = idx.unsqueeze(0) <= idx.unsqueeze(1)  # [L query, L key]
    visible = torch.cat(
        [hist_ok.unsqueeze(1).expand(batch, length, hist), causal.unsqueeze(0).expand(batch, length, length)], dim=-1
    )
    visible = visible.unsqueeze(1).expand(batch, group, length, hist + length)
    visible = visible.reshape(batch, 1, group * length, hist + length)
    scores = torch.matmul(q, keys.transpose(-1, -2))
    scores = scores.masked_fill(~visible, torch.finfo(torch.float32).min)
    out = torch.matmul(torch.softmax(scores, dim=-1), values)  # [B, kvh, group*L, D]
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
    total_len = torch.ones((), dtype=torch.int32) * (block_tables.shape[1] * tokens + length)
    out = paged_attention_ref(
        q, k, v, history(0), history(1), seqlens_k, query_lens.to(torch.int32), total_len, num_heads, kv_heads, scale
    )
    # Padded query rows: zeros, as the fused kernel writes them.
    valid = torch.arange(length).unsqueeze(0) < query_lens.unsqueeze(1)
    return out * valid.unsqueeze(-1).to(out.dtype), k, v


# -- custom ops (export only) ---------------------------------------------------------------------


@torch.library.custom_op("flare::add_rms_norm", mutates_args=())
def _add_rms_norm_op(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    out, total = add_rms_norm_ref(x, residual, weight, eps)
    return out, total


@_add_rms_norm_op.register_fake
def _(x, residual, weight, eps):
    return torch.empty_like(x), torch.empty_like(x)


@torch.library.custom_op("flare::pool_attention", mutates_args=())
def _pool_attention_op(
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
    out, k, v = pool_attention_ref(qkv, positions, cos_cache, sin_cache, kv_pool, block_tables, history_lens,
                                   query_lens, layer, num_layers, num_heads, kv_heads, scale)  # fmt: skip
    return out, k.contiguous(), v.contiguous()


@_pool_attention_op.register_fake
def _(qkv, positions, cos_cache, sin_cache, kv_pool, block_tables, history_lens, query_lens, layer, num_layers,
      num_heads, kv_heads, scale):  # fmt: skip
    batch, length, _ = qkv.shape
    dim = kv_pool.shape[-1]
    return (qkv.new_empty(batch, length, num_heads * dim), qkv.new_empty(batch, length, kv_heads * dim),
            qkv.new_empty(batch, length, kv_heads * dim))  # fmt: skip


# -- what the model calls ---------------------------------------------------------------------------


def add_rms_norm(x, residual, weight, eps: float):
    return (_add_rms_norm_op if _FUSED else add_rms_norm_ref)(x, residual, weight, eps)


def pool_attention(qkv, positions, cos_cache, sin_cache, kv_pool, block_tables, history_lens, query_lens,
                   layer: int, num_layers: int, num_heads: int, kv_heads: int, scale: float | None = None):  # fmt: skip
    """scale: the softmax scale (None: 1/sqrt(head_dim))."""
    scale = scale or 1.0 / math.sqrt(2 * cos_cache.shape[1])
    fn = _pool_attention_op if _FUSED else pool_attention_ref
    return fn(qkv, positions, cos_cache, sin_cache, kv_pool, block_tables, history_lens, query_lens, layer,
              num_layers, num_heads, kv_heads, scale)  # fmt: skip


# -- ONNX translations (onnxruntime contrib ops) ---------------------------------------------------


@functools.cache
def _contrib():
    """The com.microsoft opset for onnxscript. onnx itself has no schemas for onnxruntime's
    contrib ops, so register the few we emit, copied from onnxruntime's own registry."""
    import onnx
    import onnxscript
    from onnxruntime.capi import onnxruntime_pybind11_state as ort_c

    wanted = {"SkipSimplifiedLayerNormalization"}
    param = onnx.defs.OpSchema.FormalParameter
    option = onnx.defs.OpSchema.FormalParameterOption
    for s in ort_c.get_all_operator_schema():
        if s.domain != "com.microsoft" or s.name not in wanted:
            continue
        wanted.discard(s.name)
        if onnx.defs.has(s.name, s.domain):
            continue

        def params(items):
            return [param(p.name, p.typeStr, param_option=getattr(option, p.option.name)) for p in items]

        onnx.defs.register_schema(
            onnx.defs.OpSchema(
                s.name,
                s.domain,
                s.since_version,
                inputs=params(s.inputs),
                outputs=params(s.outputs),
                type_constraints=[(c.type_param_str, list(c.allowed_type_strs), "") for c in s.type_constraints],
                attributes=[
                    onnx.defs.OpSchema.Attribute(a.name, onnx.defs.OpSchema.AttrType(int(a.type)), "", required=a.required)
                    for a in s.attributes.values()
                ],
            )
        )
    if wanted:
        raise RuntimeError(f"this onnxruntime lacks contrib ops {sorted(wanted)}")
    return onnxscript.values.Opset("com.microsoft", 1)


def _add_rms_norm_onnx(x, residual, weight, eps: float):
    # The exporter gives a call every output its schema lists; unused ones are trimmed later
    # (graph.py) so onnxruntime skips computing them.
    out, _mean, _inv_std, total = _contrib().SkipSimplifiedLayerNormalization(x, residual, weight, epsilon=eps)
    return out, total


@functools.cache
def _flare():
    """The ai.flare opset for onnxscript, with the schema of flare's PagedAttention
    (helios/kernels/cpu_kernels.cc documents it)."""
    import onnx
    import onnxscript

    if not onnx.defs.has("PagedAttention", "ai.flare"):
        param = onnx.defs.OpSchema.FormalParameter
        attr = onnx.defs.OpSchema.Attribute
        kind = onnx.defs.OpSchema.AttrType
        onnx.defs.register_schema(
            onnx.defs.OpSchema(
                "PagedAttention", "ai.flare", 1,
                inputs=[param("qkv", "T"), param("positions", "I"), param("cos_cache", "T"), param("sin_cache", "T"),
                        param("kv_pool", "T"), param("block_tables", "I"), param("history_lens", "I"),
                        param("query_lens", "I")],
                outputs=[param("out", "T"), param("k", "T"), param("v", "T")],
                type_constraints=[("T", ["tensor(float)"], ""), ("I", ["tensor(int64)"], "")],
                attributes=[attr("num_heads", kind.INT, "", required=True), attr("kv_heads", kind.INT, "", required=True),
                            attr("layer", kind.INT, "", required=True), attr("num_layers", kind.INT, "", required=True),
                            attr("scale", kind.FLOAT, "", required=True)],
            )
        )  # fmt: skip
    return onnxscript.values.Opset("ai.flare", 1)


def _pool_attention_onnx(qkv, positions, cos_cache, sin_cache, kv_pool, block_tables, history_lens, query_lens,
                         layer: int, num_layers: int, num_heads: int, kv_heads: int, scale: float):  # fmt: skip
    return _flare().PagedAttention(
        qkv, positions, cos_cache, sin_cache, kv_pool, block_tables, history_lens, query_lens,
        num_heads=num_heads, kv_heads=kv_heads, layer=layer, num_layers=num_layers, scale=scale,
    )  # fmt: skip


TRANSLATIONS = {
    torch.ops.flare.pool_attention.default: _pool_attention_onnx,
    torch.ops.flare.add_rms_norm.default: _add_rms_norm_onnx,
}

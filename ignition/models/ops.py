"""The hot-path ops of a decoder layer as the models call them, and their fused ONNX forms.

    add_rms_norm(x, residual, weight)   -> (rms_norm(x + residual) * weight, x + residual)
    pool_attention(qkv, positions, cos, sin, kv_pool, block_tables, history_lens, query_lens)
                                        -> one layer's whole attention: rotate-half rotary of q
                                           and k, causal GQA over the row's pool pages plus its
                                           new tokens; (out, rotated k, v)

built from the plain pieces rotary_ref (rotary of every head of [B, L, heads*D]) and
paged_attention_ref (causal GQA over history ++ new tokens per row).

The ops' schemas and plain-torch meaning (the *_ref functions) live in helios.kernels.torch_ops,
since a torch step program (`--target cuda`) keeps them opaque and helios registers them before
loading it. Eager torch (and a plain ONNX export) runs the references as written. Inside `fused_export()`
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

# The ops' schemas and plain-torch meaning live in helios (a torch step program needs them at load).
from helios.kernels.torch_ops import (
    add_rms_norm_op,
    add_rms_norm_ref,
    pool_attention_op,
    pool_attention_ref,
)

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


def fused() -> bool:
    """Whether the model runs inside `fused_export()` (the custom ops) rather than the plain math."""
    return _FUSED


# -- what the model calls ---------------------------------------------------------------------------


def add_rms_norm(x, residual, weight, eps: float):
    return (add_rms_norm_op if _FUSED else add_rms_norm_ref)(x, residual, weight, eps)


def pool_attention(
    qkv,
    positions,
    cos_cache,
    sin_cache,
    kv_pool,
    block_tables,
    history_lens,
    query_lens,
    layer: int,
    num_layers: int,
    num_heads: int,
    kv_heads: int,
    scale: float | None = None,
):
    """scale: the softmax scale (None: 1/sqrt(head_dim))."""
    scale = scale or 1.0 / math.sqrt(2 * cos_cache.shape[1])
    fn = pool_attention_op if _FUSED else pool_attention_ref
    return fn(
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
                    onnx.defs.OpSchema.Attribute(
                        a.name, onnx.defs.OpSchema.AttrType(int(a.type)), "", required=a.required
                    )
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
                "PagedAttention",
                "ai.flare",
                1,
                inputs=[
                    param("qkv", "T"),
                    param("positions", "I"),
                    param("cos_cache", "T"),
                    param("sin_cache", "T"),
                    param("kv_pool", "T"),
                    param("block_tables", "I"),
                    param("history_lens", "I"),
                    param("query_lens", "I"),
                ],
                outputs=[param("out", "T"), param("k", "T"), param("v", "T")],
                type_constraints=[("T", ["tensor(float)"], ""), ("I", ["tensor(int64)"], "")],
                attributes=[
                    attr("num_heads", kind.INT, "", required=True),
                    attr("kv_heads", kind.INT, "", required=True),
                    attr("layer", kind.INT, "", required=True),
                    attr("num_layers", kind.INT, "", required=True),
                    attr("scale", kind.FLOAT, "", required=True),
                ],
            )
        )
    return onnxscript.values.Opset("ai.flare", 1)


def _pool_attention_onnx(
    qkv,
    positions,
    cos_cache,
    sin_cache,
    kv_pool,
    block_tables,
    history_lens,
    query_lens,
    layer: int,
    num_layers: int,
    num_heads: int,
    kv_heads: int,
    scale: float,
):
    return _flare().PagedAttention(
        qkv,
        positions,
        cos_cache,
        sin_cache,
        kv_pool,
        block_tables,
        history_lens,
        query_lens,
        num_heads=num_heads,
        kv_heads=kv_heads,
        layer=layer,
        num_layers=num_layers,
        scale=scale,
    )


TRANSLATIONS = {
    torch.ops.flare.pool_attention.default: _pool_attention_onnx,
    torch.ops.flare.add_rms_norm.default: _add_rms_norm_onnx,
}

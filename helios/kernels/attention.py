"""ai.flare.PagedAttention rewritten into onnxruntime's own kernels, for where flare's kernel
library cannot run: Split, RotaryEmbedding, a Gather of the layer's pages with a Transpose to
BNSH, and GroupQueryAttention -- the chain ignition emitted per layer before the fused op, with
the same semantics (ignition.models.ops.pool_attention_ref)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from helios.kernels import DOMAIN

OP = "PagedAttention"


PRECISIONS = ("float32", "bfloat16")


def set_precision(model: onnx.ModelProto, precision: str) -> int:
    """Give every PagedAttention node of `model` the `precision` attribute ("float32" is the
    kernel's default and adds none); return how many. The GroupQueryAttention rewrite below runs
    fp32 whatever it says."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown attention precision {precision!r} (choose {', '.join(PRECISIONS)})")
    nodes = [n for n in model.graph.node if n.op_type == OP and n.domain == DOMAIN]
    for node in nodes:
        kept = [a for a in node.attribute if a.name != "precision"]
        del node.attribute[:]
        node.attribute.extend(kept)
        if precision != "float32":
            node.attribute.append(helper.make_attribute("precision", precision))
    return len(nodes)


def to_group_query_attention(model: onnx.ModelProto) -> int:
    """Rewrite every PagedAttention node of `model`; return how many."""
    nodes: list[onnx.NodeProto] = []
    inits: list[onnx.TensorProto] = []
    converted = 0
    for node in model.graph.node:
        if node.op_type != OP or node.domain != DOMAIN:
            nodes.append(node)
            continue
        a = {x.name: helper.get_attribute_value(x) for x in node.attribute}  # precision: fp32 here
        new_nodes, new_inits = _expand(node, a["num_heads"], a["kv_heads"], a["layer"], a["num_layers"], a["scale"])
        nodes += new_nodes
        inits += new_inits
        converted += 1
    if converted:
        del model.graph.node[:]
        model.graph.node.extend(nodes)
        model.graph.initializer.extend(inits)
        if not any(o.domain == "com.microsoft" for o in model.opset_import):
            model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return converted


def _expand(node: onnx.NodeProto, heads: int, kv_heads: int, layer: int, num_layers: int, scale: float):
    qkv, positions, cos, sin, pool, tables, history_lens, query_lens = node.input
    out, k, v = node.output
    p = node.name or out

    def name(x: str) -> str:
        return f"{p}.{x}"

    def const(x: str, value) -> str:
        inits.append(numpy_helper.from_array(np.asarray(value, dtype=np.int64), name(x)))
        return name(x)

    inits: list[onnx.TensorProto] = []
    n: list[onnx.NodeProto] = []
    make = helper.make_node
    # The head width comes from the pool ([rows, tokens, kv_heads, D]) at run time; the split
    # sizes need it as data: qk = (heads + kv_heads) * D, v = kv_heads * D.
    n += [
        make("Shape", [pool], [name("pool_shape")]),
        make("Gather", [name("pool_shape"), const("i3", [3])], [name("dim")], axis=0),
        make("Mul", [name("dim"), const("qk_heads", [heads + kv_heads])], [name("qk_width")]),
        make("Mul", [name("dim"), const("kv_heads", [kv_heads])], [name("kv_width")]),
        make("Mul", [name("dim"), const("q_heads", [heads])], [name("q_width")]),
        make("Concat", [name("qk_width"), name("kv_width")], [name("split_qkv")], axis=0),
        make("Concat", [name("q_width"), name("kv_width")], [name("split_qk")], axis=0),
        make("Split", [qkv, name("split_qkv")], [name("qk"), v], axis=-1),
        make(
            "RotaryEmbedding",
            [name("qk"), positions, cos, sin],
            [name("qk_rot")],
            domain="com.microsoft",
            interleaved=0,
        ),
        make("Split", [name("qk_rot"), name("split_qk")], [name("q"), k], axis=-1),
        # Pool rows of this layer's K and V pages: (2 * layer + kind) * pages + page.
        make("Gather", [name("pool_shape"), const("i0", 0)], [name("rows")], axis=0),
        make("Div", [name("rows"), const("kinds", 2 * num_layers)], [name("pages")]),
        make("Mul", [name("pages"), const("k_kind", 2 * layer)], [name("k_base")]),
        make("Add", [name("k_base"), name("pages")], [name("v_base")]),
        make("Shape", [tables], [name("table_shape")]),
        make("Gather", [name("table_shape"), const("i0b", [0])], [name("batch")], axis=0),
        make(
            "Concat",
            [name("batch"), const("bsnd", [-1]), const("kvh", [kv_heads]), name("dim")],
            [name("bsnd_shape")],
            axis=0,
        ),
    ]
    for kind, base in (("k", "k_base"), ("v", "v_base")):
        n += [
            make("Add", [tables, name(base)], [name(f"{kind}_rows")]),
            make("Gather", [pool, name(f"{kind}_rows")], [name(f"{kind}_pages")], axis=0),
            make("Reshape", [name(f"{kind}_pages"), name("bsnd_shape")], [name(f"{kind}_bsnd")]),
            make("Transpose", [name(f"{kind}_bsnd")], [name(f"past_{kind}")], perm=[0, 2, 1, 3]),
        ]
    # GroupQueryAttention's conventions: total tokens - 1 and valid new tokens as int32, and a
    # total length bounding the present buffer: history slots (M * page_tokens) + the chunk (L).
    n += [
        make("Add", [history_lens, query_lens], [name("total_tokens")]),
        make("Sub", [name("total_tokens"), const("one", 1)], [name("seqlens64")]),
        make("Cast", [name("seqlens64")], [name("seqlens_k")], to=TensorProto.INT32),
        make("Cast", [query_lens], [name("query_lens32")], to=TensorProto.INT32),
        make("Gather", [name("table_shape"), const("i1", 1)], [name("table_pages")], axis=0),
        make("Gather", [name("pool_shape"), const("i1b", 1)], [name("page_tokens")], axis=0),
        make("Shape", [qkv], [name("qkv_shape")]),
        make("Gather", [name("qkv_shape"), const("i1c", 1)], [name("length")], axis=0),
        make("Mul", [name("table_pages"), name("page_tokens")], [name("history_slots")]),
        make("Add", [name("history_slots"), name("length")], [name("total64")]),
        make("Cast", [name("total64")], [name("total_len")], to=TensorProto.INT32),
        make(
            "GroupQueryAttention",
            [
                name("q"),
                k,
                v,
                name("past_k"),
                name("past_v"),
                name("seqlens_k"),
                name("total_len"),
                "",
                "",
                "",
                "",
                "",
                "",
                "",
                "",
                "",
                name("query_lens32"),
            ],
            [name("attention"), name("present_k"), name("present_v")],
            domain="com.microsoft",
            num_heads=heads,
            kv_num_heads=kv_heads,
            scale=scale,
        ),
        # Padded query rows: zeros, as the fused kernel writes them.
        make("Shape", [name("attention")], [name("attention_shape")]),
        make("Gather", [name("attention_shape"), const("i1d", 1)], [name("length_b")], axis=0),
        make("Range", [const("zero", 0), name("length_b"), const("step", 1)], [name("steps")]),
        make("Unsqueeze", [query_lens, const("axis1", [1])], [name("query_lens_col")]),
        make("Less", [name("steps"), name("query_lens_col")], [name("valid")]),
        make("Unsqueeze", [name("valid"), const("axis2", [2])], [name("valid3")]),
        make("Cast", [name("valid3")], [name("valid_f")], to=TensorProto.FLOAT),
        make("Mul", [name("attention"), name("valid_f")], [out]),
    ]
    return n, inits

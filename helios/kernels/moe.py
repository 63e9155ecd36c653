"""ai.flare.MoE rewritten into onnxruntime's own kernels, for where flare's kernel library cannot
run: every expert computed with Einsums and weighed by a scatter-add of the routing weights --
the chain ignition emitted before the routed op, with the same semantics
(ignition.models.moe_ops.experts_ref)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from helios.kernels import DOMAIN

OP = "MoE"
GELU_TANH_C = 0.7978845608028654  # sqrt(2 / pi)


def to_dense_experts(model: onnx.ModelProto) -> int:
    """Rewrite every MoE node of `model`; return how many."""
    nodes: list[onnx.NodeProto] = []
    inits: list[onnx.TensorProto] = []
    converted = 0
    for node in model.graph.node:
        if node.op_type != OP or node.domain != DOMAIN:
            nodes.append(node)
            continue
        kind = next(helper.get_attribute_value(a) for a in node.attribute if a.name == "activation")
        new_nodes, new_inits = _expand(node, kind.decode() if isinstance(kind, bytes) else kind)
        nodes += new_nodes
        inits += new_inits
        converted += 1
    if converted:
        del model.graph.node[:]
        model.graph.node.extend(nodes)
        model.graph.initializer.extend(inits)
    return converted


def _expand(node: onnx.NodeProto, kind: str) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    h, idx, weights, up, down, *rest = node.input
    gate = rest[0] if rest and rest[0] else None
    (out,) = node.output
    p = node.name or out
    inits: list[onnx.TensorProto] = []
    nodes: list[onnx.NodeProto] = []
    make = helper.make_node

    def name(x: str) -> str:
        return f"{p}.{x}"

    def const(x: str, value, dtype=np.int64) -> str:  # noqa: ANN001
        inits.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name(x)))
        return name(x)

    def act(x: str, tag: str) -> str:
        """activation(kind, x) as plain ops."""
        if kind == "silu":
            nodes.extend([make("Sigmoid", [x], [name(tag + ".sig")]), make("Mul", [x, name(tag + ".sig")], [name(tag)])])
        elif kind == "relu2":
            nodes.extend([make("Relu", [x], [name(tag + ".relu")]),
                          make("Mul", [name(tag + ".relu"), name(tag + ".relu")], [name(tag)])])
        elif kind == "gelu_tanh":  # 0.5 x (1 + tanh(c (x + 0.044715 x^3)))
            f32 = np.float32
            nodes.extend([
                make("Mul", [x, x], [name(tag + ".x2")]),
                make("Mul", [name(tag + ".x2"), x], [name(tag + ".x3")]),
                make("Mul", [name(tag + ".x3"), const(tag + ".a", 0.044715, f32)], [name(tag + ".ax3")]),
                make("Add", [x, name(tag + ".ax3")], [name(tag + ".inner")]),
                make("Mul", [name(tag + ".inner"), const(tag + ".c", GELU_TANH_C, f32)], [name(tag + ".scaled")]),
                make("Tanh", [name(tag + ".scaled")], [name(tag + ".tanh")]),
                make("Add", [name(tag + ".tanh"), const(tag + ".one", 1.0, f32)], [name(tag + ".onep")]),
                make("Mul", [x, name(tag + ".onep")], [name(tag + ".xp")]),
                make("Mul", [name(tag + ".xp"), const(tag + ".half", 0.5, f32)], [name(tag)]),
            ])  # fmt: skip
        else:
            raise ValueError(f"MoE node {p}: unknown activation {kind!r}")
        return name(tag)

    # [N, E] routing weights: zeros scattered with each row's chosen experts' weights (added, so
    # an expert named twice counts twice).
    nodes += [
        make("Shape", [h], [name("h_shape")], start=0, end=1),
        make("Shape", [up], [name("e_shape")], start=0, end=1),
        make("Concat", [name("h_shape"), name("e_shape")], [name("ne")], axis=0),
        make("ConstantOfShape", [name("ne")], [name("zeros")],
             value=numpy_helper.from_array(np.zeros(1, np.float32))),
        make("ScatterElements", [name("zeros"), idx, weights], [name("dense")], axis=1, reduction="add"),
        make("Einsum", [h, up], [name("upped")], equation="nh,eih->eni"),
    ]
    if gate is None:
        glu = act(name("upped"), "act")
    else:
        nodes.append(make("Einsum", [h, gate], [name("gated")], equation="nh,eih->eni"))
        nodes.append(make("Mul", [act(name("gated"), "act"), name("upped")], [name("glu")]))
        glu = name("glu")
    nodes += [
        make("Einsum", [glu, down], [name("outputs")], equation="eni,ehi->enh"),
        make("Transpose", [name("dense")], [name("dense_t")], perm=[1, 0]),
        make("Unsqueeze", [name("dense_t"), const("axis2", [2])], [name("dense_e")]),
        make("Mul", [name("outputs"), name("dense_e")], [name("weighted")]),
        make("ReduceSum", [name("weighted"), const("axis0", [0])], [out], keepdims=0),
    ]
    return nodes, inits

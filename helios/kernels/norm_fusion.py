"""Each SkipSimplifiedLayerNormalization whose normed output only feeds an ai.flare.MatMulInt4
folded into that matmul when a graph is opened with flare's kernels: the matmul takes the norm's
skip and gamma (attribute epsilon) and writes the norm's residual sum as its second output.

Why: a decode step of the default core runs 48 such norms on one 896-float row each; as nodes
they cost onnxruntime's dispatch and a pass over cold activations, while the matmul quantizes
the same row anyway. The kernel computes the norm in onnxruntime's own float operations and
order (cpu_kernels.cc: SkipRmsNorm), so the graph's outputs keep their bits. Cores keep the
standard node (what onnxruntime and every other runtime run); the rewrite is a load-time
choice, like the logprob head's (helios.kernels.head)."""

from __future__ import annotations

import onnx
from onnx import helper

from helios.kernels import DOMAIN

NORM_OP = "SkipSimplifiedLayerNormalization"
MICROSOFT_DOMAIN = "com.microsoft"


def fuse_norms(model: onnx.ModelProto) -> int:
    """Rewrite `model` in place; returns the norms folded. A norm qualifies when it has exactly
    (input, skip, gamma), writes neither mean nor inverse deviation, and its normed output is no
    graph output and is read once, as input 0 of a MatMulInt4 without a norm of its own whose
    other inputs are initializers (so the fused node can take the norm's place in the order)."""
    graph = model.graph
    # A subgraph (If, Loop) may read a tensor without naming it as an input: leave such graphs.
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for n in graph.node for a in n.attribute):
        return 0
    initializers = {t.name for t in graph.initializer}
    graph_outputs = {o.name for o in graph.output}
    readers: dict[str, list[int]] = {}
    for at, node in enumerate(graph.node):
        for name in node.input:
            if name:
                readers.setdefault(name, []).append(at)
    fused: dict[int, onnx.NodeProto] = {}  # norm position -> the fused matmul
    dropped: set[int] = set()  # positions of the matmuls folded into them
    for at, norm in enumerate(graph.node):
        if norm.op_type != NORM_OP or norm.domain != MICROSOFT_DOMAIN or len(norm.input) != 3:
            continue
        if any(norm.output[1:3]) or norm.output[0] in graph_outputs:
            continue
        reading = readers.get(norm.output[0], [])
        if len(reading) != 1:
            continue
        matmul = graph.node[reading[0]]
        if not _takes_a_norm(matmul, norm.output[0], initializers):
            continue
        inputs = [norm.input[0], *matmul.input[1:3], matmul.input[3] if len(matmul.input) > 3 else ""]
        outputs = [matmul.output[0]] + ([norm.output[3]] if len(norm.output) > 3 and norm.output[3] else [])
        node = helper.make_node(
            "MatMulInt4",
            [*inputs, norm.input[1], norm.input[2]],
            outputs,
            name=matmul.name,
            domain=DOMAIN,
            epsilon=_epsilon(norm),
        )
        node.attribute.extend(matmul.attribute)
        fused[at] = node
        dropped.add(reading[0])
    if not fused:
        return 0
    nodes = [fused.get(at, node) for at, node in enumerate(graph.node) if at not in dropped]
    del graph.node[:]
    graph.node.extend(nodes)
    return len(fused)


def _takes_a_norm(matmul: onnx.NodeProto, normed: str, initializers: set[str]) -> bool:
    return (
        matmul.op_type == "MatMulInt4"
        and matmul.domain == DOMAIN
        and len(matmul.input) <= 4
        and list(matmul.input).count(normed) == 1
        and matmul.input[0] == normed
        and all(name in initializers for name in matmul.input[1:] if name)
        and all(a.name != "epsilon" for a in matmul.attribute)
    )


def _epsilon(norm: onnx.NodeProto) -> float:
    # onnxruntime's SkipLayerNorm requires the attribute; a graph without it would not load.
    return next((float(helper.get_attribute_value(a)) for a in norm.attribute if a.name == "epsilon"), 1e-12)

"""The logprob head's LogSoftmax -> TopK pair fused into ai.flare.LogSoftmaxTopK
(head_kernels.cc) when a graph is opened with flare's kernels: the same outputs, both threads
over the vocabulary instead of one each. Cores keep the standard pair (what every runtime and
the onnxruntime fallback run); the rewrite is a load-time choice, like the KV pool's type."""

from __future__ import annotations

import onnx
from onnx import helper, numpy_helper

from helios.kernels import DOMAIN

OP = "LogSoftmaxTopK"


def _attribute(node: onnx.NodeProto, name: str, default: int) -> int:
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)


def _constant_k(model: onnx.ModelProto, name: str) -> int | None:
    """The TopK's k when it is a one-element initializer or Constant of the graph, else None."""
    tensor = next((t for t in model.graph.initializer if t.name == name), None)
    if tensor is None:
        producer = next((n for n in model.graph.node if n.op_type == "Constant" and name in n.output), None)
        value = producer and next((a for a in producer.attribute if a.name == "value"), None)
        tensor = value.t if value is not None else None
    if tensor is None or tensor.data_location == onnx.TensorProto.EXTERNAL:
        return None
    array = numpy_helper.to_array(tensor).reshape(-1)
    return int(array[0]) if array.size == 1 else None


def fuse_logprob_head(model: onnx.ModelProto) -> int:
    """Replace each LogSoftmax over the last axis of a 2-D tensor the graph declares (an input,
    output or value_info) whose output feeds a TopK (last axis, largest, sorted, constant k) by
    one LogSoftmaxTopK, placed where the LogSoftmax was, writing the LogSoftmax's output and the
    TopK's two; other readers of the log-softmax keep reading it. Returns the pairs fused."""
    graph = model.graph
    ranks = {v.name: len(v.type.tensor_type.shape.dim) for v in (*graph.input, *graph.output, *graph.value_info)}
    # By position: names may be empty or repeated.
    replaced: dict[int, onnx.NodeProto] = {}  # LogSoftmax position -> the fused node
    dropped: set[int] = set()  # positions of the TopKs it replaces
    for at, soft in enumerate(graph.node):
        if soft.op_type != "LogSoftmax" or soft.domain not in ("", "ai.onnx") or ranks.get(soft.input[0]) != 2:
            continue
        if _attribute(soft, "axis", -1) not in (-1, 1):
            continue
        for top_at, top in enumerate(graph.node):
            if top.op_type != "TopK" or top.input[0] != soft.output[0] or len(top.output) != 2:
                continue
            last_axis = _attribute(top, "axis", -1) in (-1, 1)
            if not (last_axis and _attribute(top, "largest", 1) and _attribute(top, "sorted", 1)):
                continue
            k = _constant_k(model, top.input[1])
            if k is None or k < 1:
                continue
            replaced[at] = helper.make_node(
                OP, [soft.input[0]], [soft.output[0], *top.output], name=f"{soft.name}.topk", domain=DOMAIN, k=k
            )
            dropped.add(top_at)
            break
    if not replaced:
        return 0
    ks = {graph.node[i].input[1] for i in dropped}
    nodes = [replaced.get(i, node) for i, node in enumerate(graph.node) if i not in dropped]
    del graph.node[:]
    graph.node.extend(nodes)
    read = {name for node in graph.node for name in node.input}
    kept = [t for t in graph.initializer if t.name not in ks or t.name in read]  # onnxruntime warns of unread ones
    del graph.initializer[:]
    graph.initializer.extend(kept)
    if not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return len(replaced)

"""The logprob head's LogSoftmax -> TopK pair fused into ai.flare.LogSoftmaxTopK
(head_kernels.cc) when a graph is opened with flare's kernels: the same outputs, both threads
over the vocabulary instead of one each. Cores keep the standard pair (what every runtime and
the onnxruntime fallback run); the rewrite is a load-time choice, like the KV pool's type."""

from __future__ import annotations

import onnx
from onnx import helper, numpy_helper

from helios.kernels import DOMAIN

OP = "LogSoftmaxTopK"
# Sampling candidates a fused head reports per row: top_k up to this many samples without a
# vocabulary pass, and a repetition penalty must push this many tokens under the k-th before
# one is needed (onnxruntime-genai and llama.cpp default to top_k 40-50).
CANDIDATES = 64


def candidate_ids_name(top_ids: str) -> str:
    """The graph output a fused head adds, when asked for candidates, beside a TopK indices output
    that is a graph output: int64 [N, CANDIDATES], each row's largest logits' ids, best first
    (the operator's fourth)."""
    return f"{top_ids}_candidates"


def outside_logit_name(top_ids: str) -> str:
    """The fifth: float [N], each row's largest logit outside its candidates."""
    return f"{top_ids}_outside_logit"


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


def fuse_logprob_head(model: onnx.ModelProto, candidates: bool = False) -> int:
    """Replace each LogSoftmax over the last axis of a 2-D tensor the graph declares (an input,
    output or value_info) whose output feeds a TopK (last axis, largest, sorted, constant k) by
    one LogSoftmaxTopK writing the TopK's two outputs, and the log-softmax itself only where
    something else reads it. A GatherElements along its last axis (int64 ids not computed from
    the head itself) that is the only other reader is folded in: the operator gathers, and the
    [N, V] log-softmax is never written. With `candidates` (a step graph, whose sampler reads
    them), where the TopK's indices are a graph output and the vocabulary holds CANDIDATES, the
    fused node's candidate outputs become graph outputs too (`candidate_ids_name`,
    `outside_logit_name`). Returns the pairs fused."""
    graph = model.graph
    declared_values = (*graph.input, *graph.output, *graph.value_info)
    dims = {v.name: v.type.tensor_type.shape.dim for v in declared_values}
    types = {v.name: v.type.tensor_type.elem_type for v in declared_values}
    declared = {o.name: o for o in graph.output}
    # A subgraph (If, Loop) may read a tensor without naming it as an input: keep every output then.
    nested = any(
        a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for n in graph.node for a in n.attribute
    )
    # By position: names may be empty or repeated.
    replaced: dict[int, onnx.NodeProto] = {}  # LogSoftmax position -> the fused node
    dropped: set[int] = set()  # positions of the TopKs (and gathers) it replaces
    for at, soft in enumerate(graph.node):
        if soft.op_type != "LogSoftmax" or soft.domain not in ("", "ai.onnx"):
            continue
        logit_dims = dims.get(soft.input[0], [])
        if len(logit_dims) != 2:
            continue
        if _attribute(soft, "axis", -1) not in (-1, 1):
            continue
        readers = [(i, n) for i, n in enumerate(graph.node) if soft.output[0] in n.input]
        for top_at, top in readers:
            if top.op_type != "TopK" or top.input[0] != soft.output[0] or len(top.output) != 2:
                continue
            last_axis = _attribute(top, "axis", -1) in (-1, 1)
            if not (last_axis and _attribute(top, "largest", 1) and _attribute(top, "sorted", 1)):
                continue
            k = _constant_k(model, top.input[1])
            if k is None or k < 1:
                continue
            inputs, outputs, extra = [soft.input[0]], [soft.output[0], *top.output, "", ""], {}
            ids = declared.get(top.output[1])
            # The vocabulary, where the graph states it (dim_value 0 where it does not).
            if candidates and ids is not None and CANDIDATES >= k and logit_dims[1].dim_value >= CANDIDATES:
                rows = [d.dim_param or d.dim_value or None for d in ids.type.tensor_type.shape.dim[:1]] or [None]
                outputs[3:5] = [candidate_ids_name(ids.name), outside_logit_name(ids.name)]
                graph.output.extend(
                    [
                        helper.make_tensor_value_info(outputs[3], onnx.TensorProto.INT64, [*rows, CANDIDATES]),
                        helper.make_tensor_value_info(outputs[4], onnx.TensorProto.FLOAT, rows),
                    ]
                )
                extra["candidates"] = CANDIDATES
            others = [(i, n) for i, n in readers if i != top_at]
            private = not nested and soft.output[0] not in declared
            if private and len(others) == 1 and _foldable_gather(graph, others[0][1], soft, types):
                gather_at, gather = others[0]
                inputs.append(gather.input[1])
                outputs.append(gather.output[0])
                dropped.add(gather_at)
                others = []
            if private and not others:
                outputs[0] = ""  # nothing reads the log-softmax: never written
            while outputs[-1] == "":
                outputs.pop()
            replaced[at] = helper.make_node(OP, inputs, outputs, name=f"{soft.name}.topk", domain=DOMAIN, k=k, **extra)
            dropped.add(top_at)
            break
    if not replaced:
        return 0
    ks = {graph.node[i].input[1] for i in dropped if graph.node[i].op_type == "TopK"}
    nodes = _topologically_sorted([replaced.get(i, node) for i, node in enumerate(graph.node) if i not in dropped])
    del graph.node[:]
    graph.node.extend(nodes)
    read = {name for node in graph.node for name in node.input}
    kept = [t for t in graph.initializer if t.name not in ks or t.name in read]  # onnxruntime warns of unread ones
    del graph.initializer[:]
    graph.initializer.extend(kept)
    if not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return len(replaced)


def _foldable_gather(graph: onnx.GraphProto, node: onnx.NodeProto, soft: onnx.NodeProto, types: dict[str, int]) -> bool:
    """Whether `node` is a GatherElements of the log-softmax along its last axis whose ids are
    int64 (the operator's input type) and not computed from the log-softmax (the fused node
    would read its own output)."""
    return (
        _gathers_last_axis(node, soft.output[0])
        and types.get(node.input[1]) == onnx.TensorProto.INT64
        and not _computed_from(graph, node.input[1], soft.output[0])
    )


def _computed_from(graph: onnx.GraphProto, name: str, source: str) -> bool:
    """Whether tensor `name` depends on tensor `source` through the graph's nodes."""
    producers = {out: n for n in graph.node for out in n.output if out}
    seen, pending = set(), [name]
    while pending:
        current = pending.pop()
        if current == source:
            return True
        if current in seen or current not in producers:
            continue
        seen.add(current)
        pending.extend(x for x in producers[current].input if x)
    return False


def _gathers_last_axis(node: onnx.NodeProto, data: str) -> bool:
    """Whether `node` is a GatherElements of the 2-D `data` along its last axis (and reads it
    only as its data)."""
    return (
        node.op_type == "GatherElements"
        and node.domain in ("", "ai.onnx")
        and node.input[0] == data
        and node.input[1] != data
        and _attribute(node, "axis", 0) in (-1, 1)
    )


def _topologically_sorted(nodes: list[onnx.NodeProto]) -> list[onnx.NodeProto]:
    """`nodes` with each after the producers of its inputs, otherwise in their order (a fused
    node placed where the LogSoftmax was may read an input produced after it)."""
    produced = {name for node in nodes for name in node.output if name}
    written: set[str] = set()
    pending, ordered = list(nodes), []
    while pending:
        at = next(
            (i for i, n in enumerate(pending) if all(x in written or x not in produced for x in n.input if x)), None
        )
        if at is None:
            raise ValueError("the graph has a cycle")
        node = pending.pop(at)
        ordered.append(node)
        written.update(node.output)
    return ordered

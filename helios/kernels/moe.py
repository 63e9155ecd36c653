"""Routed experts' graph rewrites: ai.flare.MoE's fp32 expert tables packed into ai.flare.MoEInt4
(int4, MatMulInt4's tiled layout per expert; `quantize_experts`, at export), and both rewritten
into onnxruntime's own kernels where flare's kernel library cannot run (`to_dense_experts`):
every expert computed with Einsums and weighed by a scatter-add of the routing weights -- the
chain ignition emitted before the routed op, with the same semantics
(ignition.models.moe_ops.experts_ref); int4 tables are dequantized exactly for it."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from helios.kernels import DOMAIN
from helios.kernels.int4_layout import TILE, nbits_to_q, pack, pack8, swiglu_order, unpack, unpack8

OP = "MoE"
INT4_OP = "MoEInt4"
GELU_TANH_C = 0.7978845608028654  # sqrt(2 / pi)
BLOCKS = (64, 32, 16)  # weights per int4 scale along K: the largest that divides K
BLOCKS8 = (128, 64, 32, 16)  # per int8 scale: int8 cores' dense layers use 128


def _attrs(node: onnx.NodeProto) -> dict:
    values = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    return {k: v.decode() if isinstance(v, bytes) else v for k, v in values.items()}


def quantize_int4(rows: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """rows float32 [N, K] -> (q uint8 [N, K] values 0..15, scales [N, K // block]): symmetric
    4-bit blocks along K, computed by onnxruntime's own MatMulNBits quantizer."""
    from onnxruntime.capi._pybind_state import quantize_matmul_4bits

    n, k = rows.shape
    blocks = k // block
    packed = np.zeros((n, blocks, block // 2), np.uint8)
    scales = np.zeros(n * blocks, np.float32)
    zero_points = np.zeros(n * ((blocks + 1) // 2), np.uint8)
    quantize_matmul_4bits(
        packed, np.ascontiguousarray(rows.T, dtype=np.float32), scales, zero_points, block, n, k, True
    )
    return nbits_to_q(packed, n, k, block), scales.reshape(n, blocks)


def quantize_int8(rows: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """rows float32 [N, K] -> (q uint8 [N, K] = round(x / scale) + 128, scales [N, K // block]):
    symmetric per block, scale = max |x| / 127 (as MatMulNBits' 8-bit symmetric quantization)."""
    n, k = rows.shape
    x = rows.reshape(n, k // block, block).astype(np.float32)
    scales = np.abs(x).max(axis=2) / 127.0
    safe = np.where(scales == 0, 1.0, scales)
    q = np.clip(np.rint(x / safe[:, :, None]), -127, 127).astype(np.int16) + 128
    return q.reshape(n, k).astype(np.uint8), scales.astype(np.float32)


def quantize_experts(model: onnx.ModelProto, bits: int = 4) -> int:
    """Pack every MoE node's fp32 expert tables into MoEInt4 (experts back to back) at `bits` (4:
    int4 cores; 8: int8 cores, attribute bits = 8); return how many. A layer whose widths no block
    divides (or, with a gate, whose intermediate width is not a multiple of 16) stays fp32."""
    blocks, quantized, packer = (BLOCKS8, quantize_int8, pack8) if bits == 8 else (BLOCKS, quantize_int4, pack)
    inits = {init.name: init for init in model.graph.initializer}
    used = [name for node in model.graph.node for name in node.input]
    converted = 0
    for node in model.graph.node:
        if node.op_type != OP or node.domain != DOMAIN or not all(n in inits for n in node.input[3:] if n):
            continue
        gate_name = node.input[5] if len(node.input) > 5 and node.input[5] else None
        up, down = (numpy_helper.to_array(inits[n]).astype(np.float32) for n in node.input[3:5])
        gate = numpy_helper.to_array(inits[gate_name]).astype(np.float32) if gate_name else None
        experts, inter, width = up.shape
        block_up = next((b for b in blocks if width % b == 0), None)
        block_down = next((b for b in blocks if inter % b == 0), None)
        if block_up is None or block_down is None or (gate is not None and inter % TILE):
            continue
        order = swiglu_order(2 * inter) if gate is not None else None
        parts: dict[str, list[np.ndarray]] = {"gu": [], "gus": [], "dn": [], "dns": []}
        for e in range(experts):
            first = up[e] if gate is None else np.concatenate([gate[e], up[e]])[order]
            for key, rows, block in (("gu", first, block_up), ("dn", down[e], block_down)):
                data, scales = packer(*quantized(rows, block), block)
                parts[key].append(data)
                parts[key + "s"].append(scales)
        base = node.name or node.output[0]
        names = [f"{base}.{key}" for key in ("gate_up", "gate_up_scales", "down", "down_scales")]
        for name, key in zip(names, ("gu", "gus", "dn", "dns")):
            model.graph.initializer.append(numpy_helper.from_array(np.concatenate(parts[key]), name))
        attrs = _attrs(node)
        extra = {key: attrs[key] for key in ("top_k", "unit", "limit", "alpha") if key in attrs}
        if bits == 8:
            extra["bits"] = 8
        new = helper.make_node(
            INT4_OP,
            [*node.input[:3], *names],
            list(node.output),
            name=node.name,
            domain=DOMAIN,
            activation=attrs["activation"],
            glu=int(gate is not None),
            inter=inter,
            block_up=block_up,
            block_down=block_down,
            experts=experts,
            **extra,
        )
        node.CopyFrom(new)
        converted += 1
    if converted:
        still = {name for node in model.graph.node for name in node.input}
        keep = [init for init in model.graph.initializer if init.name in still or init.name not in used]
        del model.graph.initializer[:]
        model.graph.initializer.extend(keep)
    return converted


def to_dense_experts(model: onnx.ModelProto) -> int:
    """Rewrite every MoE and MoEInt4 node of `model`; return how many."""
    nodes: list[onnx.NodeProto] = []
    inits: list[onnx.TensorProto] = []
    tables = {init.name: init for init in model.graph.initializer}
    packed: set[str] = set()
    converted = 0
    for node in model.graph.node:
        if node.op_type not in (OP, INT4_OP) or node.domain != DOMAIN:
            nodes.append(node)
            continue
        attrs = _attrs(node)
        if node.op_type == INT4_OP:
            packed.update(node.input[3:7])  # replaced by their dequantized copies
            node, dequantized = _dequantized(node, attrs, tables)
            inits += dequantized
        new_nodes, new_inits = _expand(node, attrs)
        nodes += new_nodes
        inits += new_inits
        converted += 1
    if converted:
        del model.graph.node[:]
        model.graph.node.extend(nodes)
        model.graph.initializer.extend(inits)
        used = {name for node in model.graph.node for name in node.input}
        kept = [init for init in model.graph.initializer if init.name in used or init.name not in packed]
        del model.graph.initializer[:]
        model.graph.initializer.extend(kept)
    return converted


def _dequantized(node: onnx.NodeProto, attrs: dict, tables: dict) -> tuple[onnx.NodeProto, list[onnx.TensorProto]]:
    """A MoEInt4 node as the fp32 MoE node of the same numbers, with its dequantized tables."""
    gu, gus, dn, dns = (numpy_helper.to_array(tables[n]) for n in node.input[3:7])
    experts, inter, glu = attrs["experts"], attrs["inter"], bool(attrs["glu"])
    n1 = 2 * inter if glu else inter
    eight = attrs.get("bits", 4) == 8
    unpacker, zero = (unpack8, 128) if eight else (unpack, 8)
    # gate_up is [E x tiles(n1) x W x 8 (16 at 8 bits)] bytes: W follows from its size.
    width = gu.size // experts // (-(-n1 // TILE) * (16 if eight else 8))
    ups, downs, gates = [], [], []
    gu, gus = gu.reshape(experts, -1), gus.reshape(experts, -1)
    dn, dns = dn.reshape(experts, -1), dns.reshape(experts, -1)
    for e in range(experts):
        q, s = unpacker(gu[e], gus[e], n1, width, attrs["block_up"])
        first = (q.astype(np.float32) - zero) * np.repeat(s, attrs["block_up"], axis=1)
        if glu:
            first = first[np.argsort(swiglu_order(n1))]  # back to [gate rows, up rows]
            gates.append(first[:inter])
            ups.append(first[inter:])
        else:
            ups.append(first)
        q, s = unpacker(dn[e], dns[e], width, inter, attrs["block_down"])
        downs.append((q.astype(np.float32) - zero) * np.repeat(s, attrs["block_down"], axis=1))
    base = node.name or node.output[0]
    arrays = {f"{base}.dense_up": np.stack(ups), f"{base}.dense_down": np.stack(downs)}
    if glu:
        arrays[f"{base}.dense_gate"] = np.stack(gates)
    dense = helper.make_node(
        OP, [*node.input[:3], *arrays], list(node.output), name=node.name, domain=DOMAIN, activation=attrs["activation"]
    )  # the caller expands it with `attrs`
    return dense, [numpy_helper.from_array(a.astype(np.float32), name) for name, a in arrays.items()]


def _expand(node: onnx.NodeProto, attrs: dict) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    kind, unit = attrs["activation"], attrs.get("unit", "glu")
    limit, alpha = float(attrs.get("limit", 0.0)), float(attrs.get("alpha", 0.0))
    h, idx, weights, up, down, *rest = node.input
    gate = rest[0] if rest and rest[0] else None
    (out,) = node.output
    p = node.name or out
    inits: list[onnx.TensorProto] = []
    nodes: list[onnx.NodeProto] = []
    make = helper.make_node

    def name(x: str) -> str:
        return f"{p}.{x}"

    def const(x: str, value, dtype=np.int64) -> str:
        inits.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name(x)))
        return name(x)

    def act(x: str, tag: str) -> str:
        """activation(kind, x) as plain ops."""
        if kind == "silu":
            nodes.extend(
                [make("Sigmoid", [x], [name(tag + ".sig")]), make("Mul", [x, name(tag + ".sig")], [name(tag)])]
            )
        elif kind == "relu2":
            nodes.extend(
                [
                    make("Relu", [x], [name(tag + ".relu")]),
                    make("Mul", [name(tag + ".relu"), name(tag + ".relu")], [name(tag)]),
                ]
            )
        elif kind == "gelu_tanh":  # 0.5 x (1 + tanh(c (x + 0.044715 x^3)))
            f32 = np.float32
            nodes.extend(
                [
                    make("Mul", [x, x], [name(tag + ".x2")]),
                    make("Mul", [name(tag + ".x2"), x], [name(tag + ".x3")]),
                    make("Mul", [name(tag + ".x3"), const(tag + ".a", 0.044715, f32)], [name(tag + ".ax3")]),
                    make("Add", [x, name(tag + ".ax3")], [name(tag + ".inner")]),
                    make("Mul", [name(tag + ".inner"), const(tag + ".c", GELU_TANH_C, f32)], [name(tag + ".scaled")]),
                    make("Tanh", [name(tag + ".scaled")], [name(tag + ".tanh")]),
                    make("Add", [name(tag + ".tanh"), const(tag + ".one", 1.0, f32)], [name(tag + ".onep")]),
                    make("Mul", [x, name(tag + ".onep")], [name(tag + ".xp")]),
                    make("Mul", [name(tag + ".xp"), const(tag + ".half", 0.5, f32)], [name(tag)]),
                ]
            )
        else:
            raise ValueError(f"MoE node {p}: unknown activation {kind!r}")
        return name(tag)

    # [N, E] routing weights: zeros scattered with each row's chosen experts' weights (added, so
    # an expert named twice counts twice).
    nodes += [
        make("Shape", [h], [name("h_shape")], start=0, end=1),
        make("Shape", [up], [name("e_shape")], start=0, end=1),
        make("Concat", [name("h_shape"), name("e_shape")], [name("ne")], axis=0),
        make("ConstantOfShape", [name("ne")], [name("zeros")], value=numpy_helper.from_array(np.zeros(1, np.float32))),
        make("ScatterElements", [name("zeros"), idx, weights], [name("dense")], axis=1, reduction="add"),
        make("Einsum", [h, up], [name("upped")], equation="nh,eih->eni"),
    ]
    if gate is None:
        glu = act(name("upped"), "act")
    else:
        nodes.append(make("Einsum", [h, gate], [name("gated")], equation="nh,eih->eni"))
        glu = _unit(unit, limit, alpha, name("gated"), name("upped"), act, nodes, name, const, make)
    nodes += [
        make("Einsum", [glu, down], [name("outputs")], equation="eni,ehi->enh"),
        make("Transpose", [name("dense")], [name("dense_t")], perm=[1, 0]),
        make("Unsqueeze", [name("dense_t"), const("axis2", [2])], [name("dense_e")]),
        make("Mul", [name("outputs"), name("dense_e")], [name("weighted")]),
        make("ReduceSum", [name("weighted"), const("axis0", [0])], [out], keepdims=0),
    ]
    return nodes, inits


def _unit(unit: str, limit: float, alpha: float, g: str, u: str, act, nodes: list, name, const, make) -> str:
    """The gated unit (ignition.models.moe_ops.gated) of tensors g and u as plain ops."""
    f32 = np.float32
    if unit == "glu":
        nodes.append(make("Mul", [act(g, "act"), u], [name("glu")]))
        return name("glu")
    lim, neg = const("limit", limit, f32), const("neg_limit", -limit, f32)
    nodes.append(make("Clip", [u, neg, lim], [name("u_clip")]))
    if unit == "clamp_after":
        nodes.append(make("Min", [act(g, "act"), lim], [name("g_unit")]))
    elif unit == "clamp_before":
        nodes.append(make("Min", [g, lim], [name("g_min")]))
        nodes.append(make("Identity", [act(name("g_min"), "act")], [name("g_unit")]))
    elif unit == "alpha":  # (u + 1) * g' * sigmoid(alpha g')
        nodes += [
            make("Min", [g, lim], [name("g_min")]),
            make("Mul", [name("g_min"), const("alpha", alpha, f32)], [name("g_alpha")]),
            make("Sigmoid", [name("g_alpha")], [name("g_sig")]),
            make("Mul", [name("g_min"), name("g_sig")], [name("g_unit")]),
            make("Add", [name("u_clip"), const("one_u", 1.0, f32)], [name("u_plus")]),
        ]
        nodes.append(make("Mul", [name("g_unit"), name("u_plus")], [name("glu")]))
        return name("glu")
    else:
        raise ValueError(f"unknown gated unit {unit!r}")
    nodes.append(make("Mul", [name("g_unit"), name("u_clip")], [name("glu")]))
    return name("glu")

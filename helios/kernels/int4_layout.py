"""Flare's tiled int4 weight layout (`ai.flare.MatMulInt4`) and the graph rewrites between it
and onnxruntime's `com.microsoft.MatMulNBits`.

MatMulNBits stores each output column's K weights contiguously ([N, blocks, block/2] bytes, two
consecutive k per byte). MatMulInt4 stores 16 columns side by side so that one 64-byte vector holds
[16 columns x 4 k] in its low nibbles and the next 4 k in its high nibbles: the kernel
(cpu_kernels.cc) unpacks each vector once and multiplies it with every activation row of a
pass. Both encode the same numbers (symmetric 4-bit, value = (q - 8) * scale), so converting
either way is exact; ignition writes MatMulInt4, and helios turns it back into MatMulNBits
where the kernel library cannot run (no AVX512-VNNI, no compiler, a GPU provider).

MatMulInt4 keeps a matrix's scales as float16 where every one of them is a half float exactly
(ignition rounds them so at quantization: `round_scales_to_half`), which halves the bytes they
take (4.25 bits a weight at block 64 instead of 4.5); the conversions stay exact either way.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from helios.kernels import DOMAIN

OP = "MatMulInt4"
TILE = 16  # output columns per tile


def _padded(q: np.ndarray, scales: np.ndarray, block: int, zero: int) -> tuple[np.ndarray, np.ndarray, int, int]:
    """q and scales padded to whole tiles (missing columns: q = zero, scale 0), tiles, blocks."""
    n, k = q.shape
    tiles = -(-n // TILE)
    qp = np.full((tiles * TILE, k), zero, np.uint8)
    qp[:n] = q
    sp = np.zeros((tiles * TILE, k // block), np.float32)
    sp[:n] = scales
    return qp, sp, tiles, k // block


def pack(q: np.ndarray, scales: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """q: uint8 [N, K] values 0..15, scales: float32 [N, K // block] -> (packed uint8
    [tiles * K * 8], scales float32 [tiles, blocks, 16]); missing columns of the last tile
    hold q = 8 with scale 0."""
    qp, sp, tiles, blocks = _padded(q, scales, block, zero=8)
    # k = b * block + 8 p + 4 h + j  ->  [tile, b, p, h, column, j]
    x = qp.reshape(tiles, TILE, blocks, block // 8, 2, 4).transpose(0, 2, 3, 4, 1, 5)
    packed = x[:, :, :, 0] | (x[:, :, :, 1] << 4)
    return np.ascontiguousarray(packed).reshape(-1), np.ascontiguousarray(
        sp.reshape(tiles, TILE, blocks).transpose(0, 2, 1)
    )


def unpack(packed: np.ndarray, scales: np.ndarray, n: int, k: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """The inverse of pack: (q uint8 [N, K], scales float32 [N, blocks])."""
    blocks = k // block
    tiles = -(-n // TILE)
    x = packed.reshape(tiles, blocks, block // 8, TILE, 4)
    both = np.stack([x & 15, x >> 4], axis=3)  # [tile, b, p, h, column, j]
    q = both.transpose(0, 4, 1, 2, 3, 5).reshape(tiles * TILE, k)[:n]
    s = scales.reshape(tiles, blocks, TILE).transpose(0, 2, 1).reshape(tiles * TILE, blocks)[:n]
    return np.ascontiguousarray(q), np.ascontiguousarray(s, dtype=np.float32)


def as_half_if_exact(scales: np.ndarray) -> np.ndarray:
    """`scales` as float16 when each value is one exactly, else as they are (float32)."""
    half = scales.astype(np.float16)
    return half if np.array_equal(half.astype(np.float32), scales) else scales


def round_scales_to_half(scales: np.ndarray) -> np.ndarray:
    """float32 scales rounded to the nearest half float (a relative change of at most 2^-11, against
    a 4-bit step of the scale itself), except those outside half's normal range, kept as they
    are: a matrix holding one of those keeps float32 scales (as_half_if_exact)."""
    half = scales.astype(np.float16).astype(np.float32)
    normal = (np.abs(scales) >= np.finfo(np.float16).tiny) & (np.abs(scales) <= np.finfo(np.float16).max)
    return np.where(normal, half, scales).astype(np.float32)


def pack8(q: np.ndarray, scales: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """The 8-bit tiles of MoEInt4 (bits = 8): q uint8 [N, K] values 0..255 (q + 128), scales
    [N, K // block] -> (packed uint8 [tiles * K * 16]: per tile and block, vectors of [16 columns
    x 4 k], scales float32 [tiles, blocks, 16]); missing columns hold q = 128, scale 0."""
    qp, sp, tiles, blocks = _padded(q, scales, block, zero=128)
    # k = b * block + 4 p + j  ->  [tile, b, p, column, j]
    x = qp.reshape(tiles, TILE, blocks, block // 4, 4).transpose(0, 2, 3, 1, 4)
    return np.ascontiguousarray(x).reshape(-1), np.ascontiguousarray(sp.reshape(tiles, TILE, blocks).transpose(0, 2, 1))


def unpack8(packed: np.ndarray, scales: np.ndarray, n: int, k: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """The inverse of pack8: (q uint8 [N, K], scales float32 [N, blocks])."""
    blocks = k // block
    tiles = -(-n // TILE)
    q = packed.reshape(tiles, blocks, block // 4, TILE, 4).transpose(0, 3, 1, 2, 4).reshape(tiles * TILE, k)[:n]
    s = scales.reshape(tiles, blocks, TILE).transpose(0, 2, 1).reshape(tiles * TILE, blocks)[:n]
    return np.ascontiguousarray(q), np.ascontiguousarray(s)


def nbits_to_q(b: np.ndarray, n: int, k: int, block: int) -> np.ndarray:
    """MatMulNBits' B [N, blocks, block/2] (element 2i in the low nibble of byte i) -> q [N, K]."""
    b = b.reshape(n, k // block, block // 2)
    q = np.empty((n, k // block, block), np.uint8)
    q[:, :, 0::2] = b & 15
    q[:, :, 1::2] = b >> 4
    return q.reshape(n, k)


def q_to_nbits(q: np.ndarray, block: int) -> np.ndarray:
    n, k = q.shape
    q = q.reshape(n, k // block, block)
    return np.ascontiguousarray(q[:, :, 0::2] | (q[:, :, 1::2] << 4))


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _convertible(node: onnx.NodeProto) -> bool:
    if node.op_type != "MatMulNBits" or node.domain != "com.microsoft":
        return False
    a = _attrs(node)
    extra = list(node.input[3:])
    zero_points_or_gidx = any(extra[:2])  # inputs 3, 4: zero_points, g_idx
    return (
        a.get("bits") == 4
        and a["block_size"] % 16 == 0
        and a["K"] % a["block_size"] == 0
        and not zero_points_or_gidx
        and len(node.input) <= 6
    )


def to_int4_tiles(model: onnx.ModelProto) -> int:
    """Rewrite every symmetric 4-bit MatMulNBits of `model` (weights loaded) as MatMulInt4, with
    a SwiGLU MLP's Split/Sigmoid/Mul/Mul folded into its gate_up matmul; return how many."""
    inits = {t.name: t for t in model.graph.initializer}
    swiglu = _swiglu_patterns(model)
    removed: set[int] = set()
    converted = 0
    for node in model.graph.node:
        if not _convertible(node) or node.input[1] not in inits or node.input[2] not in inits:
            continue
        a = _attrs(node)
        n, k, block = a["N"], a["K"], a["block_size"]
        q = nbits_to_q(numpy_helper.to_array(inits[node.input[1]]), n, k, block)
        scales = numpy_helper.to_array(inits[node.input[2]]).reshape(n, k // block)
        bias = node.input[5] if len(node.input) > 5 else ""
        outputs, extra = list(node.output), {}
        fused = swiglu.get(node.output[0]) if not bias and n % (2 * TILE) == 0 else None
        if fused is not None:
            order = swiglu_order(n)
            q, scales = q[order], scales[order]
            outputs, extra = [fused[1]], {"activation": "swiglu"}
            removed.update(id(x) for x in fused[0])
        packed, tiled = pack(q, scales, block)
        inits[node.input[1]].CopyFrom(numpy_helper.from_array(packed, node.input[1]))
        inits[node.input[2]].CopyFrom(numpy_helper.from_array(as_half_if_exact(tiled), node.input[2]))
        inputs = [node.input[0], node.input[1], node.input[2]] + ([bias] if bias else [])
        node.CopyFrom(
            helper.make_node(OP, inputs, outputs, name=node.name, domain=DOMAIN, K=k, N=n, block_size=block, **extra)
        )
        converted += 1
    if removed:
        kept = [node for node in model.graph.node if id(node) not in removed]
        del model.graph.node[:]
        model.graph.node.extend(kept)
    if converted and not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return converted


def swiglu_order(n: int) -> np.ndarray:
    """Column order of a fused gate_up weight: 16 gate columns, the same 16 up columns, ..."""
    half = n // 2
    tiles = np.arange(half).reshape(-1, TILE)
    return np.stack([tiles, tiles + half], axis=1).reshape(-1)


def _swiglu_patterns(model: onnx.ModelProto) -> dict[str, tuple[list[onnx.NodeProto], str]]:
    """matmul output -> (its Split, Sigmoid, Mul, Mul nodes, the SwiGLU output) for every
    `Split(x) -> (g, u); y = g * Sigmoid(g) * u` over x's last axis whose pieces have no other
    consumer. x's rank comes from the graph's shape information; without it, 3 ([B, L, N]: what
    ignition's layers feed their matmuls; the experts' shared MLP sees flat rows, [N, K])."""
    ranks = {
        v.name: len(v.type.tensor_type.shape.dim)
        for v in [*model.graph.value_info, *model.graph.input, *model.graph.output]
        if v.type.tensor_type.HasField("shape")
    }
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    graph_outputs = {o.name for o in model.graph.output}

    def only(name: str, op: str) -> onnx.NodeProto | None:
        users = consumers.get(name, [])
        return users[0] if len(users) == 1 and users[0].op_type == op and name not in graph_outputs else None

    found = {}
    for split in model.graph.node:
        attrs = _attrs(split)
        if (
            split.op_type != "Split"
            or len(split.output) != 2
            or attrs.get("axis") not in (-1, ranks.get(split.input[0], 3) - 1)
            or (len(split.input) > 1 and split.input[1])  # explicit sizes: not the even halves
            or attrs.get("num_outputs", 2) != 2
            or len(consumers.get(split.input[0], [])) != 1
        ):
            continue
        gate, up = split.output
        gate_users = consumers.get(gate, [])
        sigmoid = next((x for x in gate_users if x.op_type == "Sigmoid"), None)
        silu = (
            next(
                (x for x in gate_users if x.op_type == "Mul" and sorted(x.input) == sorted([gate, sigmoid.output[0]])),
                None,
            )
            if sigmoid
            else None
        )
        if sigmoid is None or silu is None or len(gate_users) != 2 or only(sigmoid.output[0], "Mul") is not silu:
            continue
        product = only(silu.output[0], "Mul")
        if product is None or only(up, "Mul") is not product or sorted(product.input) != sorted([silu.output[0], up]):
            continue
        found[split.input[0]] = ([split, sigmoid, silu, product], product.output[0])
    return found


def to_matmul_nbits(model: onnx.ModelProto, accuracy_level: int = 4) -> int:
    """The inverse rewrite: every MatMulInt4 of `model` (weights loaded) back to MatMulNBits, a
    fused SwiGLU back to Split/Sigmoid/Mul/Mul."""
    inits = {t.name: t for t in model.graph.initializer}
    converted = 0
    nodes: list[onnx.NodeProto] = []
    for node in model.graph.node:
        if node.op_type != OP or node.domain != DOMAIN:
            nodes.append(node)
            continue
        a = _attrs(node)
        n, k, block = a["N"], a["K"], a["block_size"]
        q, scales = unpack(
            numpy_helper.to_array(inits[node.input[1]]), numpy_helper.to_array(inits[node.input[2]]), n, k, block
        )
        swiglu = a.get("activation", b"") in (b"swiglu", "swiglu")
        if swiglu:
            inverse = np.argsort(swiglu_order(n))
            q, scales = q[inverse], scales[inverse]
        inits[node.input[1]].CopyFrom(numpy_helper.from_array(q_to_nbits(q, block), node.input[1]))
        inits[node.input[2]].CopyFrom(numpy_helper.from_array(scales.reshape(-1), node.input[2]))
        bias = node.input[3] if len(node.input) > 3 else ""
        inputs = [node.input[0], node.input[1], node.input[2]] + (["", "", bias] if bias else [])
        out = node.output[0] + ".gate_up" if swiglu else node.output[0]
        nodes.append(
            helper.make_node(
                "MatMulNBits",
                inputs,
                [out],
                name=node.name,
                domain="com.microsoft",
                K=k,
                N=n,
                bits=4,
                block_size=block,
                accuracy_level=accuracy_level,
            )
        )
        if swiglu:
            gate, up, sig, silu, halves = (f"{node.output[0]}.{x}" for x in ("gate", "up", "sigmoid", "silu", "halves"))
            model.graph.initializer.append(numpy_helper.from_array(np.array([n // 2, n // 2], np.int64), halves))
            nodes += [
                helper.make_node("Split", [out, halves], [gate, up], name=f"{node.name}.split", axis=-1),
                helper.make_node("Sigmoid", [gate], [sig], name=f"{node.name}.sigmoid"),
                helper.make_node("Mul", [gate, sig], [silu], name=f"{node.name}.silu"),
                helper.make_node("Mul", [silu, up], [node.output[0]], name=f"{node.name}.swiglu"),
            ]
        converted += 1
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    if converted:
        kept = [o for o in model.opset_import if o.domain != DOMAIN]
        del model.opset_import[:]
        model.opset_import.extend(kept)
        if not any(o.domain == "com.microsoft" for o in kept):
            model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return converted

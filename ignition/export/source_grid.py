"""A pre-quantized checkpoint's int4 weights kept exactly (issue 40, item 4).

ignition reads a GPTQ/AWQ folder by unpacking each linear to the weights its integers and scales
stand for (ignition/checkpoints/prequantized.py); the int4 export then quantizes those floats
again. Where a block of the core's int4 layout (symmetric, `block` weights along K, one scale)
holds weights that lie on one symmetric 4-bit grid, scale * c with integer c in [-8, 7] (a
symmetric GPTQ group of 64 or 128 without act-order, or any other block that happens to be
one), onnxruntime's quantizer may still pick another scale (absmax / -8 only reproduces the
grid when the block's largest weight is the negative extreme), so every weight would be rounded a
second time. `snap_to_source_grid` rewrites those blocks with the grid's own scale and codes,
which dequantize to the source weights bit for bit; every other block keeps the quantizer's
numbers. Asymmetric groups (AWQ, GPTQ with zero points other than 8) are never one symmetric
grid and stay requantized.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

CODES = range(8, 0, -1)  # the grid's largest |code| in a block: absmax / k is the candidate scale


def matmul_weights(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """The constant [K, N] weights of the graph's MatMul nodes, by initializer name (before the
    quantizer replaces them)."""
    inits = {t.name: t for t in model.graph.initializer}
    names = {node.input[1] for node in model.graph.node if node.op_type == "MatMul" and node.input[1] in inits}
    return {name: numpy_helper.to_array(inits[name]) for name in sorted(names)}


def grid_blocks(weight: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For a [K, N] weight: (exact [N, K/block] bool, scales [N, K/block] float32, codes
    [N, K/block, block] in -8..7) of the blocks along K that lie on one symmetric 4-bit grid."""
    rows = np.ascontiguousarray(weight.T, dtype=np.float32).reshape(weight.shape[1], -1, block)
    absmax = np.abs(rows).max(axis=-1)
    exact = np.zeros(absmax.shape, dtype=bool)
    scales = np.zeros(absmax.shape, dtype=np.float32)
    codes = np.zeros(rows.shape, dtype=np.int8)
    for k in CODES:
        scale = (absmax.astype(np.float64) / k).astype(np.float32)
        with np.errstate(divide="ignore", invalid="ignore"):
            c = np.rint(rows / scale[..., None])
        fits = (scale > 0) & np.all((c >= -8) & (c <= 7), axis=-1)
        fits &= np.all(np.where(fits[..., None], c, 0).astype(np.float32) * scale[..., None] == rows, axis=-1)
        new = fits & ~exact
        scales[new] = scale[new]
        codes[new] = c[new].astype(np.int8)
        exact |= new
    return exact, scales, codes


def snap_to_source_grid(model: onnx.ModelProto, originals: dict[str, np.ndarray], block: int) -> int:
    """Rewrite the symmetric 4-bit MatMulNBits blocks whose source weights lie on one grid with
    that grid's scale and codes. Returns how many blocks were rewritten."""
    inits = {t.name: t for t in model.graph.initializer}
    snapped = 0
    for node in model.graph.node:
        if node.op_type != "MatMulNBits" or len(node.input) < 3:
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        source = node.input[1].removesuffix("_Q4")
        weight = originals.get(source)
        if (
            attrs.get("bits") != 4
            or attrs.get("block_size") != block
            or weight is None
            or weight.shape[0] % block
            or (len(node.input) > 3 and node.input[3])  # zero points: not the symmetric layout
        ):
            continue
        exact, scales, codes = grid_blocks(weight, block)
        if not exact.any():
            continue
        packed_init, scales_init = inits[node.input[1]], inits[node.input[2]]
        packed = numpy_helper.to_array(packed_init).copy()  # [N, K/block, block/2]
        old_scales = numpy_helper.to_array(scales_init)
        new_scales = old_scales.reshape(exact.shape).copy()
        q = (codes + 8).astype(np.uint8)
        nibbles = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
        packed[exact] = nibbles[exact]
        new_scales[exact] = scales[exact].astype(new_scales.dtype)
        packed_init.CopyFrom(numpy_helper.from_array(packed, packed_init.name))
        scales_init.CopyFrom(numpy_helper.from_array(new_scales.reshape(old_scales.shape), scales_init.name))
        snapped += int(exact.sum())
    return snapped

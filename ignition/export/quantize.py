"""Weight-only quantization of an exported step graph (onnxruntime MatMulNBits).

Activations and the KV pool stay fp32; constant matmul weights (and, for int4, the token-embedding
table) become block-quantized, symmetric (no zero points). An int4 core's attention (flare's
PagedAttention) also runs in bfloat16 on AMX tiles where the CPU has them (fp32 accumulation).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper
from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

from helios.kernels import DOMAIN
from helios.kernels.attention import set_precision
from helios.kernels.int4_layout import OP, round_scales_to_half, to_int4_tiles
from helios.kernels.moe import quantize_experts
from helios.manifest import Quantization
from ignition.export.graph import save_with_external_data
from ignition.export.source_grid import matmul_weights, snap_to_source_grid

PRECISIONS = ("int4", "int8", "fp32")


@dataclass(frozen=True)
class QuantSettings:
    bits: int  # transformer-block matmuls: 4 or 8
    block_size: int  # weights per scale, along K
    accuracy_level: int  # MatMulNBits compute type: 4 = int8 activations (VNNI); 1 = fp32
    lm_head_bits: int | None  # None keeps the lm_head fp32
    embedding_bits: int | None  # 4: GatherBlockQuantized token table (onnxruntime: 4 bits only)
    lm_head_block_size: int = 128  # 8-bit block 32 is a slow MLAS path (see below)
    # Store the 4-bit matmuls in flare's tiled layout (ai.flare.MatMulInt4, helios/kernels):
    # the same numbers as MatMulNBits, read by a kernel that batches rows (see below).
    int4_tiles: bool = False
    # PagedAttention's arithmetic: "bfloat16" rounds Q, K, P and V to bf16 on AMX tiles (fp32
    # accumulation and softmax), ~3x the fp32 kernel on long prompts (docs/performance.md).
    attention: str = "float32"


# Measured on the real Qwen2.5-Coder-0.5B, 2 threads, this AVX512-VNNI machine. Speed: median
# process CPU-ms per decoded token (other tenants disturb it far less than wall time) and
# isolated-MatMulNBits microbenchmarks; quality: mean KL(reference || engine) and top-1 agreement
# over 227 positions of 3 prompts (reference = fp32 torch on the dequantized GGUF).
#
#   layers        lm_head     b=1 cpu-ms  b=8 cpu-ms/tok  prefill cpu-ms/tok  mean KL  top-1
#   int4 b32 a4   int8 b32    30-44       13.2-13.7       6.5                 0.040    0.925
#   int4 b32 a4   int4 b32    38          13.2            6.5                 0.054    0.947
#   int4 b32 a4   fp32        67          15.8            6.5                 0.040    0.925
#   int4 b64 a4   int8 b64    28-39       12.6-12.8       6.2                 0.045    0.916
#   int4 b128 a4  int8 b128   24-32       10.4-11.1       5.0                 0.061    0.912
#   int8 b32 a4   int8 b32    36-50       13.0-13.8       6.3                 0.0004   0.996
#   int8 b128 a4  int8 b128   28-42       11.2-11.9       4.9                 0.0011   1.000
#   accuracy_level 1 (fp32 compute): int4 ~0.5 s/token, int8 ~1.5 s/token (no fast MLAS path
#   here), so level 4 (int8 activations, VNNI) it is.
#   8-bit block 32 is a slow MLAS path: the lm_head alone takes ~7x longer at M=1 than with
#   block 64/128 (isolated: 21 ms vs 3.1-3.6 ms), so the 8-bit lm_head always uses block 128.
#
# int4 layers: block 64. Re-measured with every other process on the host
#   paused (median ms per step graph call, the real 0.5B, int4 block-128 lm_head, 64-token
#   history; KL and top-1 over the validation sequence, reference = fp32 graph of the GGUF):
#
#     layers   b=1 ms      b=8 ms      mean KL  max KL  top-1   core data MB
#     b32      15.6-15.8   42.9-43.8   0.0014   0.0040  1.0     390
#     b64      13.4-14.4   40.5-42.1   0.0029   0.0107  1.0     359
#     b128     11.9-12.7   34.3-36.0   0.0118   0.0552  1.0     -
#
#   Isolated MatMulNBits (M=1, 24 cache-cold copies of the 0.5B's gate_up 896x9728): block 32
#   247 us (22 GB/s), block 64 175 us (28 GB/s): at M=1 the block-32 kernel is bound by its
#   per-block work, not by memory, on this CPU. Block 64 buys ~14% at b=1 for a KL that stays
#   ~170x inside the int4 tolerance; block 128 would buy another ~12% for 4x the KL (its worst
#   position, 0.055, is where top-1 starts to be at risk), so 64 it is. The 4-bit embedding
#   table (same block) halves the core for +6% KL and no speed cost (it is gathered, not
#   multiplied).
# int4 lm_head: the lm_head is the largest matmul (151936 x 896); at 8 bits it
#   is ~140 of the ~365 MB a decode step reads. Re-measured on the validation sequence (64-token
#   prompt + 8 decode steps, 10 positions; reference = cached fp32 torch logits), lm_head variants
#   over the same int4 b32 layers, interleaved runs, process CPU-ms per b=1 step on a loaded host:
#
#     lm_head     data MB  b=1 cpu-ms (median/min)  mean KL   max KL   top-1
#     int8 b128   458      59-68 / 49-60            0.00167   0.0130   1.0
#     int4 b32    402      59-61 / 55-56            0.00251   0.0163   1.0
#     int4 b64    394      54 / 48                  0.00311   0.0149   1.0
#     int4 b128   390      51-53 / 45-50            0.00303   0.0191   1.0
#
#   int4 block 128 is the fastest (fewest scales to read) at a KL still ~7x below honest int4
#   layers' worst case and >100x inside the int4 tolerance, so the lm_head is 4-bit block 128.
# int8: block 128, ~15% faster than 32 at negligible KL either way. It decodes about as fast as
#   int4 on 2 cores (unpacking nibbles costs what the halved bandwidth saves) at ~40x lower KL.
#   8-bit Gather is unsupported, so its embedding stays fp32 (core ~1.06 GB).
# int4 tiles (ai.flare.MatMulInt4): the same block-64 int4 weights and int8
#   activation blocks, run by flare's MatMulInt4 (helios/kernels/cpu_kernels.cc) instead of
#   MatMulNBits. Isolated, 12-24 cache-cold copies, interleaved: M=1 0.9-1.8x MatMulNBits' speed
#   (parity on the largest shapes, ahead on small ones), M=8 1.8-4.8x, M=64 1.9-3.0x; step graph
#   b=1 14.0-14.9 -> 11.8-12.3 ms, b=8 41.9-43.1 -> 22.8-23.3 ms (with SwiGLU folded in), KL
#   0.0029 -> 0.0026.
SETTINGS = {
    "int4": QuantSettings(
        bits=4, block_size=64, accuracy_level=4, lm_head_bits=4, embedding_bits=4, int4_tiles=True, attention="bfloat16"
    ),
    "int8": QuantSettings(bits=8, block_size=128, accuracy_level=4, lm_head_bits=8, embedding_bits=None),
}


def manifest_quantization(precision: str) -> Quantization | None:
    """What the manifest records about a precision's weight storage (None for fp32)."""
    s = SETTINGS.get(precision)
    if s is None:
        return None
    return Quantization(
        layers_bits=s.bits,
        layers_block=s.block_size,
        accuracy_level=s.accuracy_level,
        lm_head_bits=s.lm_head_bits,
        lm_head_block=s.lm_head_block_size if s.lm_head_bits is not None else None,
        embedding_bits=s.embedding_bits,
        matmul_op=f"{DOMAIN}.{OP}" if s.int4_tiles else "com.microsoft.MatMulNBits",
        embedding_block=s.block_size if s.embedding_bits is not None else None,
        attention=s.attention,
        scales="float16" if s.int4_tiles else "float32",
    )


LM_HEAD_OUTPUT = "logits"  # the contract's output: the lm_head matmul is the node producing it


def quantize(
    onnx_in: Path,
    onnx_out: Path,
    precision: str,
    settings: QuantSettings | None = None,
    source_grid: bool = False,
) -> None:
    """Write onnx_out (+ onnx_out.data) from the fp32 step graph onnx_in at `precision`.
    source_grid: the weights came from a pre-quantized checkpoint, so int4 blocks that lie on
    one symmetric grid keep it exactly (ignition.export.source_grid)."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r} (choose {', '.join(PRECISIONS)})")
    model = onnx.load(str(onnx_in))  # with its external data
    if precision != "fp32":
        gemm_to_matmul(model)
        quantize_weights(model, settings or SETTINGS[precision], source_grid)
    out = Path(onnx_out)
    save_with_external_data(model, out, out.name + ".data")


def quantize_weights(model: onnx.ModelProto, s: QuantSettings, source_grid: bool = False) -> None:
    _name_nodes(model)
    lm_head = [n.name for n in model.graph.node if LM_HEAD_OUTPUT in n.output and n.op_type == "MatMul"]
    originals = matmul_weights(model) if source_grid and s.bits == 4 else {}
    _matmul_nbits(model, s, s.bits, None, lm_head, ("MatMul",), s.block_size)
    if s.lm_head_bits is not None and lm_head:
        _matmul_nbits(model, s, s.lm_head_bits, lm_head, [], ("MatMul",), s.lm_head_block_size)
    if s.int4_tiles:
        round_int4_scales(model)
    if originals:  # after the rounding: a source grid's own scales stay exact
        snap_to_source_grid(model, originals, s.block_size)
    if s.embedding_bits is not None:
        if s.embedding_bits != 4:
            raise ValueError("onnxruntime quantizes Gather to 4 bits only")
        embeds = [n.name for n in model.graph.node if n.op_type == "Gather" and n.input[1] == "input_ids"]
        _matmul_nbits(model, s, s.embedding_bits, embeds, [], ("Gather",), s.block_size)
    fold_bias_adds(model)
    if s.int4_tiles:
        to_int4_tiles(model)
    # Routed experts (ai.flare.MoE): each expert's tables in the dense layers' scheme, run by
    # MoEInt4: 4-bit blocks of 64 (or 32/16 where the width needs them), 8-bit blocks of 128.
    quantize_experts(model, bits=s.bits)
    set_precision(model, s.attention)


def quantize_score(onnx_in: Path, onnx_out: Path, precision: str) -> None:
    """The prompt-scoring head (ignition.export.score) at `precision`: its only matmul is the
    lm_head, quantized exactly as quantize_weights quantizes the step graph's, so both graphs
    compute the same logits."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r} (choose {', '.join(PRECISIONS)})")
    model = onnx.load(str(onnx_in))
    s = SETTINGS.get(precision)
    if s is not None and s.lm_head_bits is not None:
        gemm_to_matmul(model)
        _name_nodes(model)
        _matmul_nbits(model, s, s.lm_head_bits, None, [], ("MatMul",), s.lm_head_block_size)
        if s.int4_tiles:
            round_int4_scales(model)  # as the step graph's lm_head: the same logits
            to_int4_tiles(model)
    out = Path(onnx_out)
    save_with_external_data(model, out, out.name + ".data")


def _matmul_nbits(
    model: onnx.ModelProto,
    s: QuantSettings,
    bits: int,
    include: list[str] | None,
    exclude: list[str],
    op_types: tuple[str, ...],
    block: int,
) -> None:
    # The quantizer logs one line per node at INFO, and warns that a 4-bit Gather lifts the
    # opset to 21 (onnxruntime runs the result; validation checks it).
    logging.getLogger("onnxruntime.quantization").setLevel(logging.ERROR)
    quantizer = MatMulNBitsQuantizer(
        model,
        bits=bits,
        block_size=block,
        is_symmetric=True,  # no zero points: less to read, and MLAS's fastest int4 path
        accuracy_level=s.accuracy_level,
        nodes_to_include=include,
        nodes_to_exclude=exclude,
        op_types_to_quantize=op_types,
        quant_axes=(("MatMul", 0), ("Gather", 1)),
    )
    quantizer.process()
    model.CopyFrom(quantizer.model.model)


def round_int4_scales(model: onnx.ModelProto) -> None:
    """Round every 4-bit MatMulNBits' scales to half floats, which MatMulInt4 then stores as
    float16: a decode step reads ~5% fewer bytes (4.25 bits a weight at block 64 instead of 4.5;
    the default core 282 -> 269 MB). Each scale moves by at most 2^-11 of itself, so a weight by
    at most 1/128 of what its 4-bit rounding already moves it; the codes stay as the quantizer
    chose them. On the real 0.5B (200 teacher-forced decode positions) the rounded core differs
    from the float32-scale one by mean KL 0.0025, as much as scales moved by only 1e-6 do (0.0023):
    either change re-draws which way the int8 activations round, and validation's KL against the
    reference stays where it was (0.0023 -> 0.0025)."""
    inits = {t.name: t for t in model.graph.initializer}
    for node in model.graph.node:
        bits = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "bits"), None)
        if node.op_type == "MatMulNBits" and bits == 4 and node.input[2] in inits:
            scales = inits[node.input[2]]
            rounded = round_scales_to_half(numpy_helper.to_array(scales))
            scales.CopyFrom(numpy_helper.from_array(rounded, scales.name))


def fold_bias_adds(model: onnx.ModelProto) -> None:
    """MatMulNBits(x) + constant bias -> MatMulNBits(x, bias=...): one node less per biased
    projection (qwen2's q/k/v), the add done inside the matmul's output loop."""
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    consumers: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            consumers[name] = consumers.get(name, 0) + 1
    producers = {out: node for node in graph.node for out in node.output}
    graph_outputs = {o.name for o in graph.output}
    kept = []
    for node in graph.node:
        matmul = producers.get(node.input[0]) if node.op_type == "Add" and len(node.input) == 2 else None
        bias = inits.get(node.input[1]) if matmul is not None else None
        if (
            matmul is None
            or matmul.op_type != "MatMulNBits"
            or len(matmul.input) > 3  # has zero points / g_idx / bias already
            or consumers[node.input[0]] != 1
            or node.input[0] in graph_outputs
            or bias is None
            or list(bias.dims) != [next(a.i for a in matmul.attribute if a.name == "N")]
        ):
            kept.append(node)
            continue
        matmul.input.extend(["", "", node.input[1]])  # zero_points, g_idx: absent
        matmul.output[0] = node.output[0]
    del graph.node[:]
    graph.node.extend(kept)


def gemm_to_matmul(model: onnx.ModelProto) -> None:
    """Rewrite Gemm(A, B^T) with a constant B as MatMul(A, B') (+ Add for a bias): the quantizer
    only handles MatMul, and the exporter emits the lm_head as a Gemm."""
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    uses: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            uses[name] = uses.get(name, 0) + 1
    nodes = []
    for node in graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if (
            node.op_type != "Gemm"
            or node.input[1] not in inits
            or attrs.get("transA", 0)
            or attrs.get("alpha", 1.0) != 1.0
            or attrs.get("beta", 1.0) != 1.0
        ):
            nodes.append(node)
            continue
        weight = numpy_helper.to_array(inits[node.input[1]])
        if attrs.get("transB", 0):
            weight = np.ascontiguousarray(weight.T)
        # A weight shared with another node (a tied embedding's Gather) gets its own copy.
        name = node.input[1] if uses[node.input[1]] == 1 else node.input[1] + ".matmul"
        if name in inits:
            inits[name].CopyFrom(numpy_helper.from_array(weight, name))
        else:
            graph.initializer.append(numpy_helper.from_array(weight, name))
        has_bias = len(node.input) > 2 and node.input[2]
        out = node.output[0] + ".nobias" if has_bias else node.output[0]
        nodes.append(helper.make_node("MatMul", [node.input[0], name], [out], name=node.name or out))
        if has_bias:
            nodes.append(helper.make_node("Add", [out, node.input[2]], [node.output[0]], name=out + ".bias"))
    del graph.node[:]
    graph.node.extend(nodes)


def _name_nodes(model: onnx.ModelProto) -> None:
    """The quantizer selects nodes by name; give unnamed ones a stable name."""
    for i, node in enumerate(model.graph.node):
        if not node.name:
            node.name = f"{node.op_type}_{i}"

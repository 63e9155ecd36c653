"""The KV pool's element type: float32, or a 16-bit pool (bfloat16, float16) that halves the memory
every token costs and the bytes a decode step reads.

A core's step graph declares `kv_pool` as float32 (the contract ignition traces); a 16-bit pool is
chosen at serve time: `retype_pool` rewrites the graph's input type when the session opens (no
re-export). ai.flare.PagedAttention reads any of the three types and rounds the step's new K/V to
the pool's type before it attends (helios/kernels/attention_kernels.cc); any other reader of the
pool (a Gather of pages in families without the fused kernel, or onnxruntime's rewrite where the
kernel library cannot run) gets a Cast to float32 after its gather, so only the pages it reads are
widened.

"auto" picks bfloat16 where the CPU has a bf16 dot product (AVX512-BF16 or AMX), else float16
where it converts halves in hardware (F16C), else float32; and float32 for a graph whose pool is
read by anything but the fused kernel, or where the kernel library cannot run: only the fused
kernel rounds a step's own keys before attending, which keeps a query's result independent of how
its prompt was chunked (an explicit 16-bit choice still serves those graphs, within rounding).
"""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from helios.kernels import available, cpu_flags

KV_DTYPES = ("float32", "bfloat16", "float16")
CHOICES = ("auto", "bf16", "fp16", "fp32")  # what `helios serve --kv-dtype` takes
_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", **{name: name for name in KV_DTYPES}}
_NUMPY = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype(np.float16)}
_ONNX = {"float32": TensorProto.FLOAT, "bfloat16": TensorProto.BFLOAT16, "float16": TensorProto.FLOAT16}
# Readers of the pool that need no Cast: flare's fused attention reads every type, Shape none.
_TYPE_AGNOSTIC = {("ai.flare", "PagedAttention"), ("", "Shape")}


def canonical(name: str) -> str:
    """ "auto" or one of KV_DTYPES, from a CLI or manifest spelling (bf16, bfloat16, ...)."""
    if name == "auto":
        return name
    if name not in _ALIASES:
        raise ValueError(f"unknown KV pool dtype {name!r} (choose auto, bf16, fp16 or fp32)")
    return _ALIASES[name]


def resolve(name: str, flags: set[str] | None = None, fused: bool = True) -> str:
    """The pool dtype `name` means on this CPU (`flags`: /proc/cpuinfo's, by default) for a graph
    whose pool only the fused kernel reads (`fused`)."""
    name = canonical(name)
    if name != "auto":
        return name
    if not fused:
        return "float32"
    flags = (cpu_flags() or set()) if flags is None else flags
    if "avx512_bf16" in flags or "amx_bf16" in flags:
        return "bfloat16"
    if "f16c" in flags:
        return "float16"
    return "float32"


def fused_reads_only(graph_path: Path) -> bool:
    """Whether only flare's fused attention reads the graph's pool, and flare's kernels run here."""
    header = onnx.load(str(graph_path), load_external_data=False)
    readers = [n for n in header.graph.node if "kv_pool" in n.input]
    return available()[0] is not None and all((n.domain, n.op_type) in _TYPE_AGNOSTIC for n in readers)


def numpy_dtype(name: str) -> np.dtype:
    return _NUMPY[canonical(name)]


def itemsize(name: str) -> int:
    """Bytes of one element of a pool of `name` (a KV dtype, or any numpy dtype a test pool holds)."""
    return numpy_dtype(name).itemsize if name in _ALIASES else np.dtype(name).itemsize


def name_of(dtype: np.dtype) -> str:
    """The KV_DTYPES name of a numpy dtype (ValueError for any other)."""
    for name, known in _NUMPY.items():
        if np.dtype(dtype) == known:
            return name
    raise ValueError(f"{dtype} is not a KV pool dtype")


def to_bfloat16(values: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 rounded to nearest even, as ml_dtypes' cast rounds (NaN stays NaN),
    in a few whole-array integer operations: ml_dtypes casts element by element, ~5x slower on
    the K/V a step scatters into a bf16 pool."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = ((bits + (np.uint32(0x7FFF) + ((bits >> 16) & 1))) >> 16).astype(np.uint16)
    nan = np.isnan(values)
    if nan.any():  # a low-payload NaN would round into infinity
        rounded[nan] = (bits[nan] >> 16).astype(np.uint16) | 0x0040
    return rounded.view(_NUMPY["bfloat16"])


def ort_value(pool: np.ndarray) -> ort.OrtValue:
    """An OrtValue over `pool`'s memory (never a copy): what the next run reads is what the pool holds."""
    if pool.dtype == _NUMPY["bfloat16"]:  # numpy has no bf16: onnxruntime sees the bits
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(pool.view(np.uint16), TensorProto.BFLOAT16)
    return ort.OrtValue.ortvalue_from_numpy(pool)


def retype_pool(model: onnx.ModelProto, name: str) -> int:
    """Declare `model`'s kv_pool input as `name`; a Gather (or a windowed layer's GatherND) of pool
    rows gets a Cast of its output to float32. Returns the number of Casts added; any other
    reader is refused (ValueError)."""
    name = canonical(name)
    pool = next((i for i in model.graph.input if i.name == "kv_pool"), None)
    if pool is None:
        raise ValueError("the graph has no kv_pool input")
    pool.type.tensor_type.elem_type = _ONNX[name]
    if name == "float32":
        return 0
    nodes: list[onnx.NodeProto] = []
    casts = 0
    for node in model.graph.node:
        nodes.append(node)
        if "kv_pool" not in node.input or (node.domain, node.op_type) in _TYPE_AGNOSTIC:
            continue
        if node.op_type not in ("Gather", "GatherND") or list(node.input).index("kv_pool") != 0:
            raise ValueError(f"{node.op_type} node {node.name!r} reads kv_pool: only gathers of its rows can widen it")
        wide = node.output[0]
        node.output[0] = f"{wide}.{name}"
        nodes.append(helper.make_node("Cast", [node.output[0]], [wide], name=f"{wide}.widen", to=TensorProto.FLOAT))
        casts += 1
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return casts

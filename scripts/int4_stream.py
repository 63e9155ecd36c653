"""How fast ai.flare.MatMulInt4 streams a decode step's weights, against the bandwidth probe.

python scripts/int4_stream.py [--rows 1 8] [--layers 24] [--repeats 20] [--threads 2] [--library A.so B.so]
                              [--scales float16 float32]

One ONNX graph holds the default core's int4 matmuls for a whole decode step (per layer: qkv
896x1152, o 896x896, gate_up 896x9728 with swiglu, down 4864x896, all block 64; then lm_head
896x151936 at block 128), each its own random weights, so every run streams ~280 MB cache-cold,
as a step does. Reported per row count: ms per step of matmuls alone, the GB/s that is, and its
ratio to scripts/bandwidth.py's probe read in the same minutes. The A/B tool for the kernel's
streaming (prefetch, blocking, work split): it times the kernel without the rest of the graph.
`--library` times several builds of the kernel library (default: helios.kernels' own), and
`--scales` the weight scales' types (ignition writes float16), in turns, in the same run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parent))

import kernel_ab
from bandwidth import read_bandwidth

from helios import kernels

TILE = 16
# (name, K, N, block, activation) of one layer, then the lm_head.
LAYER = (
    ("qkv", 896, 1152, 64, ""),
    ("o", 896, 896, 64, ""),
    ("gate_up", 896, 9728, 64, "swiglu"),
    ("down", 4864, 896, 64, ""),
)
LM_HEAD = ("lm_head", 896, 151936, 128, "")


def _matmul(name: str, k: int, n: int, block: int, activation: str, rng: np.random.Generator, scale_dtype: str):
    tiles = (n + TILE - 1) // TILE
    w = rng.integers(0, 256, tiles * k * 8, dtype=np.uint8)
    scales = (rng.random((tiles, k // block, TILE), dtype=np.float32) * 0.01).astype(scale_dtype)
    attrs = {"K": k, "N": n, "block_size": block}
    if activation:
        attrs["activation"] = activation
    node = helper.make_node(
        "MatMulInt4", [f"a{k}", f"{name}.w", f"{name}.s"], [f"{name}.y"], name=name, domain=kernels.DOMAIN, **attrs
    )
    out_n = n // 2 if activation == "swiglu" else n
    inits = [numpy_helper.from_array(w, f"{name}.w"), numpy_helper.from_array(scales, f"{name}.s")]
    return node, inits, helper.make_tensor_value_info(f"{name}.y", TensorProto.FLOAT, ["M", out_n])


def step_model(layers: int, scale_dtype: str = "float32", seed: int = 0) -> tuple[onnx.ModelProto, int]:
    """(model, weight bytes it reads per run), its scales stored as `scale_dtype`."""
    rng = np.random.default_rng(seed)
    nodes, inits, outputs = [], [], []
    shapes = [(f"l{i}.{name}", *rest) for i in range(layers) for name, *rest in LAYER] + [LM_HEAD]
    for name, k, n, block, activation in shapes:
        node, weights, output = _matmul(name, k, n, block, activation, rng, scale_dtype)
        nodes.append(node)
        inits += weights
        outputs.append(output)
    weight_bytes = sum(len(t.raw_data) for t in inits)
    inputs = [
        helper.make_tensor_value_info(f"a{k}", TensorProto.FLOAT, ["M", k]) for k in sorted({s[1] for s in shapes})
    ]
    graph = helper.make_graph(nodes, "int4_step", inputs, outputs, inits)
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(kernels.DOMAIN, 1)]
    )
    return model, weight_bytes


def row_feeds(sess: ort.InferenceSession, rows: int) -> dict:
    rng = np.random.default_rng(rows)
    return {i.name: rng.standard_normal((rows, int(i.name[1:])), dtype=np.float32) for i in sess.get_inputs()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument(
        "--scales", nargs="+", default=["float16"], choices=["float16", "float32"], help="the weight scales' types"
    )
    kernel_ab.add_options(parser, repeats=20)
    args = parser.parse_args()
    sessions, weight_mb = {}, {}
    for scale_dtype in args.scales:
        model, weight_bytes = step_model(args.layers, scale_dtype)
        weight_mb[scale_dtype] = weight_bytes / 1e6
        for lib in kernel_ab.libraries(args):
            key = f"{Path(lib).name} {scale_dtype} scales"
            sessions[key] = (kernel_ab.session(model.SerializeToString(), args.threads, lib), weight_bytes)
    probe = read_bandwidth(args.threads)["gbs"]
    result = {"weight_mb": {k: round(v, 1) for k, v in weight_mb.items()}, "probe_gbs": probe, "libraries": {}}
    for _turn in range(args.turns):
        for key, (sess, weight_bytes) in sessions.items():
            for rows in args.rows:
                ms = kernel_ab.median_ms(sess, row_feeds(sess, rows), args.repeats, warmups=2)
                best = result["libraries"].setdefault(key, {}).get(rows)
                if best is None or ms < best["ms"]:
                    gbs = weight_bytes / ms / 1e6
                    best = {"ms": round(ms, 3), "gbs": round(gbs, 2), "vs_probe": round(gbs / probe, 3)}
                result["libraries"][key][rows] = best
    result["probe_after_gbs"] = read_bandwidth(args.threads)["gbs"]
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

"""How fast ai.flare.PagedAttention attends over a long history, against the bandwidth probe.

python scripts/attention_speed.py [--history 16384] [--queries 1 512] [--rows 1] [--kv-dtype bf16]
                                  [--layers 24] [--repeats 10] [--threads 2] [--library A.so B.so]

One ONNX graph holds `--layers` PagedAttention nodes with the default core's geometry (14 query
heads, 2 KV heads, head dim 64, 16-token pages), each reading its own layer of one pool whose
pages are shuffled, as served rows' are: one run is the attention of one step of `--rows` rows,
each `--queries` new tokens over `--history` pool tokens. Reported per query count: ms per
layer, and for decode (one query) the K/V GB/s that is and its ratio to scripts/bandwidth.py's
probe read in the same minutes. The A/B tool for the attention chunks (`--library`: several
kernel builds in turns).
"""

from __future__ import annotations

import argparse
import json
import math
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
from helios.kernels import kv_dtype as kv_types

HEADS, KV_HEADS, DIM, PAGE = 14, 2, 64, 16
INPUTS = ["qkv", "positions", "cos_cache", "sin_cache", "kv_pool", "block_tables", "history_lens", "query_lens"]


def attention_model(layers: int, positions: int, kv_dtype: str) -> onnx.ModelProto:
    """The attention graph with its pool declared `kv_dtype`, as the runner declares a step graph's."""
    angles = np.arange(positions)[:, None] * (1.0 / 1e6 ** (np.arange(0, DIM, 2) / DIM))[None]
    inits = [
        numpy_helper.from_array(np.cos(angles).astype(np.float32), "cos_cache"),
        numpy_helper.from_array(np.sin(angles).astype(np.float32), "sin_cache"),
    ]
    nodes = [
        helper.make_node(
            "PagedAttention",
            INPUTS,
            [f"out{layer}", f"k{layer}", f"v{layer}"],
            domain=kernels.DOMAIN,
            name=f"attn{layer}",
            num_heads=HEADS,
            kv_heads=KV_HEADS,
            layer=layer,
            num_layers=layers,
            scale=1.0 / math.sqrt(DIM),
        )
        for layer in range(layers)
    ]
    f, i = TensorProto.FLOAT, TensorProto.INT64
    inputs = [
        helper.make_tensor_value_info("qkv", f, ["B", "L", (HEADS + 2 * KV_HEADS) * DIM]),
        helper.make_tensor_value_info("positions", i, ["B", "L"]),
        helper.make_tensor_value_info("kv_pool", f, ["R", PAGE, KV_HEADS, DIM]),
        helper.make_tensor_value_info("block_tables", i, ["B", "M"]),
        helper.make_tensor_value_info("history_lens", i, ["B"]),
        helper.make_tensor_value_info("query_lens", i, ["B"]),
    ]
    outputs = [helper.make_tensor_value_info(f"out{layer}", f, None) for layer in range(layers)]
    graph = helper.make_graph(nodes, "attention_step", inputs, outputs, inits)
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(kernels.DOMAIN, 1)]
    )
    kv_types.retype_pool(model, kv_dtype)
    return model


def pool_value(tokens: int, layers: int, dtype: np.dtype) -> ort.OrtValue:
    """A pool of random K/V with the pages `tokens` need in every layer."""
    pages = -(-tokens // PAGE)
    rng = np.random.default_rng(0)
    return kv_types.ort_value(
        rng.standard_normal((layers * 2 * pages, PAGE, KV_HEADS, DIM), dtype=np.float32).astype(dtype)
    )


def feeds_for(history: int, queries: int, rows: int, pool: ort.OrtValue) -> dict:
    rng = np.random.default_rng(queries)
    pages = -(-(history + queries) // PAGE)
    return {
        "qkv": rng.standard_normal((rows, queries, (HEADS + 2 * KV_HEADS) * DIM), dtype=np.float32),
        "positions": np.tile(np.arange(history, history + queries, dtype=np.int64), (rows, 1)),
        "kv_pool": pool,
        # Every row's pages, shuffled over the pool as served rows' are.
        "block_tables": rng.permutation(rows * pages).astype(np.int64).reshape(rows, pages),
        "history_lens": np.full(rows, history, np.int64),
        "query_lens": np.full(rows, queries, np.int64),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--history", type=int, default=16384)
    parser.add_argument("--queries", type=int, nargs="+", default=[1, 512])
    parser.add_argument("--rows", type=int, default=1, help="batch rows, each over its own history")
    parser.add_argument("--kv-dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--layers", type=int, default=24)
    kernel_ab.add_options(parser, repeats=10)
    args = parser.parse_args()
    dtype = kv_types.numpy_dtype(args.kv_dtype)
    model = attention_model(args.layers, args.history + max(args.queries) + 1, args.kv_dtype).SerializeToString()
    sessions = {lib: kernel_ab.session(model, args.threads, lib) for lib in kernel_ab.libraries(args)}
    pages = -(-(args.history + max(args.queries)) // PAGE)
    pool = pool_value(args.rows * pages * PAGE, args.layers, dtype)
    feeds = {q: feeds_for(args.history, q, args.rows, pool) for q in args.queries}
    kv_bytes = args.rows * args.history * KV_HEADS * DIM * 2 * dtype.itemsize  # one layer's K and V
    probe = read_bandwidth(args.threads)["gbs"]
    result = {"history": args.history, "rows": args.rows, "kv_dtype": args.kv_dtype, "probe_gbs": probe}
    result["libraries"] = {}
    for _turn in range(args.turns):
        for lib, sess in sessions.items():
            for queries in args.queries:
                ms = kernel_ab.median_ms(sess, feeds[queries], args.repeats) / args.layers
                best = result["libraries"].setdefault(Path(lib).name, {}).get(queries)
                if best is None or ms < best["ms_per_layer"]:
                    best = {"ms_per_layer": round(ms, 4)}
                    if queries == 1:
                        gbs = kv_bytes / ms / 1e6
                        best |= {"gbs": round(gbs, 2), "vs_probe": round(gbs / probe, 3)}
                result["libraries"][Path(lib).name][queries] = best
    result["probe_after_gbs"] = read_bandwidth(args.threads)["gbs"]
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

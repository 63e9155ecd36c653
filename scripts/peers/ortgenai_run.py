"""onnxruntime-genai speed on a built genai model; run with the ortgenai peer venv's python.

    python ortgenai_run.py MODEL_DIR --decode 64 --prefill 512 --repeats 2
    python ortgenai_run.py MODEL_DIR --long 16384 --decode 64 [--chunk 512]
    python ortgenai_run.py MODEL_DIR --serve

--serve (scripts/paired_speed.py): loads and warms the model, prints "ready", then answers each
stdin line "BATCH STEPS" with one JSON line {"tps": ...} (the decode below) until stdin closes.

Prints one JSON line: decode_b1_tps, decode_b8_tps (8 equal-length prompts in one generator:
aggregate tokens/s after the first token), prefill_tps (a fresh prompt of --prefill ids).
Greedy, EOS held off with min_length so every row decodes the same number of tokens.
Threads come from the model's genai_config.json (scripts/peers/envs.py sets them).

--long N (the long-context mode; only these figures): one generator with max_length N + --decode
+ 1; a fresh prompt of N token ids is appended in --chunk-token pieces (long_prefill_tps: N / the
time of those appends; the CPU GroupQueryAttention materializes a [heads, chunk, history] score
buffer, which for one 16k-token append would be ~15 GB), then --decode greedy tokens after the
first (long_decode_tps). The model's `context_length` (genai_config.json) must hold N + --decode
+ 1; the runner exits with an error naming it otherwise.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime_genai as og


def long_context(a: argparse.Namespace) -> dict:
    total = a.long + a.decode + 1
    config = json.loads((Path(a.model) / "genai_config.json").read_text())
    context = config["model"].get("context_length", 0)
    if context < total:
        sys.exit(
            f"{a.model}: genai_config.json context_length {context} < {total} tokens needed "
            f"(rebuild the model with a longer context)"
        )
    model = og.Model(a.model)

    def generator(length: int):
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=length, min_length=length, do_sample=False, batch_size=1)
        return og.Generator(model, params)

    warm = generator(a.chunk + 4)  # warm up the prefill and decode paths
    warm.append_tokens(np.array([[(1000 + 7 * i + 13 * 9999) % 30000 + 100 for i in range(a.chunk)]], dtype=np.int32))
    warm.generate_next_token()
    warm.generate_next_token()
    del warm
    ids = [(1000 + 7 * i) % 30000 + 100 for i in range(a.long)]
    gen = generator(total)
    start = time.perf_counter()
    for i in range(0, a.long, a.chunk):
        gen.append_tokens(np.array([ids[i : i + a.chunk]], dtype=np.int32))
    prefill_s = time.perf_counter() - start
    gen.generate_next_token()  # the first output token
    start = time.perf_counter()
    for _ in range(a.decode):
        gen.generate_next_token()
    decode_s = time.perf_counter() - start
    return {
        "long_tokens": a.long,
        "long_prefill_tps": round(a.long / prefill_s, 1),
        "long_prefill_ms": round(prefill_s * 1000, 1),
        "long_decode_tps": round(a.decode / decode_s, 2),
        "long_decode_tokens": a.decode,
        "chunk": a.chunk,
        "context_length": context,
    }


PROMPT = [(1000 + 7 * i) % 30000 + 100 for i in range(12)]


def decode_tps(model: og.Model, batch: int, steps: int) -> float:
    """Aggregate tokens/s of `batch` equal rows over `steps` greedy tokens after the first."""
    params = og.GeneratorParams(model)
    total = len(PROMPT) + steps + 1
    params.set_search_options(max_length=total, min_length=total, do_sample=False, batch_size=batch)
    gen = og.Generator(model, params)
    gen.append_tokens(np.array([PROMPT] * batch, dtype=np.int32))  # prompt + first token
    gen.generate_next_token()
    start = time.perf_counter()
    for _ in range(steps):
        gen.generate_next_token()
    return batch * steps / (time.perf_counter() - start)


def serve(model: og.Model) -> None:
    """The --serve loop: one decode per stdin line "BATCH STEPS"."""
    decode_tps(model, 1, 4)
    decode_tps(model, 8, 4)
    print("ready", flush=True)
    for line in sys.stdin:
        batch, steps = (int(x) for x in line.split())
        print(json.dumps({"tps": round(decode_tps(model, batch, steps), 2)}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--long", type=int, default=0, help="long-context mode: prompt tokens (e.g. 16384)")
    ap.add_argument("--chunk", type=int, default=512, help="long mode: prompt tokens per append_tokens")
    ap.add_argument("--serve", action="store_true", help="decode on request from stdin (see above)")
    a = ap.parse_args()
    if a.long:
        print(json.dumps(long_context(a)))
        return
    model = og.Model(a.model)
    if a.serve:
        serve(model)
        return

    def prefill(rep: int) -> float:
        ids = [(1000 + 7 * i + 13 * rep) % 30000 + 100 for i in range(a.prefill)]
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=a.prefill + 1, do_sample=False, batch_size=1)
        gen = og.Generator(model, params)
        start = time.perf_counter()
        gen.append_tokens(np.array([ids], dtype=np.int32))
        return a.prefill / (time.perf_counter() - start)

    decode_tps(model, 1, 4)
    b1 = max(decode_tps(model, 1, a.decode) for _ in range(a.repeats))
    decode_tps(model, 8, 4)
    b8 = max(decode_tps(model, 8, a.decode) for _ in range(a.repeats))
    pre = max(prefill(r) for r in range(a.repeats + 1))
    print(json.dumps({"decode_b1_tps": round(b1, 2), "decode_b8_tps": round(b8, 2), "prefill_tps": round(pre, 1)}))


if __name__ == "__main__":
    main()

"""onnxruntime-genai speed on a built genai model; run with the ortgenai peer venv's python.

    python ortgenai_run.py MODEL_DIR --decode 64 --prefill 512 --repeats 2

Prints one JSON line: decode_b1_tps, decode_b8_tps (8 equal-length prompts in one generator:
aggregate tokens/s after the first token), prefill_tps (a fresh prompt of --prefill ids).
Greedy, EOS held off with min_length so every row decodes the same number of tokens.
Threads come from the model's genai_config.json (scripts/peers/envs.py sets them).
"""

import argparse
import json
import time

import numpy as np
import onnxruntime_genai as og


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    model = og.Model(a.model)
    prompt = [(1000 + 7 * i) % 30000 + 100 for i in range(12)]

    def decode(batch: int, steps: int) -> float:
        params = og.GeneratorParams(model)
        total = len(prompt) + steps + 1
        params.set_search_options(max_length=total, min_length=total, do_sample=False, batch_size=batch)
        gen = og.Generator(model, params)
        gen.append_tokens(np.array([prompt] * batch, dtype=np.int32))  # prompt + first token
        gen.generate_next_token()
        start = time.perf_counter()
        for _ in range(steps):
            gen.generate_next_token()
        elapsed = time.perf_counter() - start
        return batch * steps / elapsed

    def prefill(rep: int) -> float:
        ids = [(1000 + 7 * i + 13 * rep) % 30000 + 100 for i in range(a.prefill)]
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=a.prefill + 1, do_sample=False, batch_size=1)
        gen = og.Generator(model, params)
        start = time.perf_counter()
        gen.append_tokens(np.array([ids], dtype=np.int32))
        return a.prefill / (time.perf_counter() - start)

    decode(1, 4)
    b1 = max(decode(1, a.decode) for _ in range(a.repeats))
    decode(8, 4)
    b8 = max(decode(8, a.decode) for _ in range(a.repeats))
    pre = max(prefill(r) for r in range(a.repeats + 1))
    print(json.dumps({"decode_b1_tps": round(b1, 2), "decode_b8_tps": round(b8, 2), "prefill_tps": round(pre, 1)}))


if __name__ == "__main__":
    main()

"""llama.cpp (llama-cpp-python) speed on a GGUF; run with the llamacpp peer venv's python.

    python llamacpp_run.py MODEL.gguf --threads 2 --decode 64 --prefill 512 --repeats 2

Prints one JSON line: decode_b1_tps (greedy single-stream decode after a short prompt, tokens
after the first), prefill_tps (a fresh prompt of --prefill token ids, best of --repeats).
llama-cpp-python has no multi-sequence batch API, so no decode_b8_tps.
"""

import argparse
import json
import time

import numpy as np
from llama_cpp import Llama


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    llm = Llama(a.model, n_ctx=2048, n_threads=a.threads, n_threads_batch=a.threads, n_batch=512,
                n_ubatch=512, verbose=False, logits_all=False)
    vocab = llm.n_vocab()

    def decode(steps: int) -> float:
        llm.reset()
        llm.eval(llm.tokenize(b"Write a long story about a lighthouse keeper.", add_bos=False))
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        start = time.perf_counter()
        for _ in range(steps):
            llm.eval([token])
            token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        return steps / (time.perf_counter() - start)

    def prefill(rep: int) -> float:
        ids = [(1000 + 7 * i + 13 * rep) % 30000 + 100 for i in range(a.prefill)]
        llm.reset()
        start = time.perf_counter()
        llm.eval(ids)
        return a.prefill / (time.perf_counter() - start)

    decode(4)  # warm up
    b1 = max(decode(a.decode) for _ in range(a.repeats))
    pre = max(prefill(r) for r in range(a.repeats + 1))  # the first also warms the batch path
    assert vocab > 0
    print(json.dumps({"decode_b1_tps": round(b1, 2), "prefill_tps": round(pre, 1)}))


if __name__ == "__main__":
    main()

"""llama.cpp (llama-cpp-python) speed on a GGUF; run with the llamacpp peer venv's python.

    python llamacpp_run.py MODEL.gguf --threads 2 --decode 64 --prefill 512 --repeats 2
    python llamacpp_run.py MODEL.gguf --threads 2 --long 16384 --decode 64
    python llamacpp_run.py MODEL.gguf --threads 2 --edit PROMPT.txt --decode 1200
    python llamacpp_run.py MODEL.gguf --threads 2 --serve

Prints one JSON line: decode_b1_tps (greedy single-stream decode after a short prompt, tokens
after the first), prefill_tps (a fresh prompt of --prefill token ids, best of --repeats).
llama-cpp-python has no multi-sequence batch API, so no decode_b8_tps.

--long N (the long-context mode; only these figures): one fresh prompt of N token ids
(long_prefill_tps: N / its eval time, 512-token batches), then --decode greedy single-stream
tokens with that prompt as history (long_decode_tps). The context holds N + --decode tokens;
the KV cache keeps llama.cpp's default type (f16; no type_k/type_v). Flash attention is on,
which is what llama.cpp's own default ("auto") resolves to on a CPU; llama-cpp-python's wrapper
defaults it off, --no-flash-attn measures that configuration.

--serve (scripts/paired_speed.py): loads and warms the model, prints "ready", then answers each
stdin line "1 STEPS" with one JSON line {"tps": ...} (the decode above) until stdin closes.

--edit FILE (the speculative-decoding peer; only these figures): greedy completion of the file's
text up to --decode tokens (stopping at a closing ```), once plainly (edit_plain_tps) and once
with llama-cpp-python's prompt-lookup drafts (LlamaPromptLookupDecoding, its speculative mode
for a single model; edit_lookup_tps), and with --draft SMALL.gguf also with greedy drafts from
that smaller model through the binding's draft-model hook (LlamaDraftModel; edit_draft_tps);
tokens after the first over the time after the first.
"""

import argparse
import json
import sys
import time

import numpy as np
from llama_cpp import Llama
from llama_cpp.llama_speculative import LlamaDraftModel, LlamaPromptLookupDecoding

BATCH = 512


def prompt_ids(tokens: int, rep: int) -> list[int]:
    """Fresh token ids (the same formula as scripts/bench.py): prompts of different reps differ
    from their first token."""
    return [(1000 + 7 * i + 13 * rep) % 30000 + 100 for i in range(tokens)]


def next_token(llm: Llama, vocab: int) -> int:
    """Greedy token from the last evaluated position's logits (with logits_all=False the wrapper
    keeps no scores of its own: read the context's last output row)."""
    logits = np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(vocab,))
    return int(np.argmax(logits))


def long_context(a: argparse.Namespace) -> dict:
    llm = Llama(
        a.model,
        n_ctx=a.long + a.decode + 16,
        n_threads=a.threads,
        n_threads_batch=a.threads,
        n_batch=BATCH,
        n_ubatch=BATCH,
        flash_attn=not a.no_flash_attn,
        verbose=False,
        logits_all=False,
    )
    vocab = llm.n_vocab()
    llm.eval(prompt_ids(min(BATCH, a.long), 9999))  # warm up the batch path and the decode path
    llm.eval([next_token(llm, vocab)])
    llm.reset()
    ids = prompt_ids(a.long, 0)
    start = time.perf_counter()
    llm.eval(ids)
    prefill_s = time.perf_counter() - start
    token = next_token(llm, vocab)  # the first output token
    start = time.perf_counter()
    for _ in range(a.decode):
        llm.eval([token])
        token = next_token(llm, vocab)
    decode_s = time.perf_counter() - start
    return {
        "long_tokens": a.long,
        "long_prefill_tps": round(a.long / prefill_s, 1),
        "long_prefill_ms": round(prefill_s * 1000, 1),
        "long_decode_tps": round(a.decode / decode_s, 2),
        "long_decode_tokens": a.decode,
        "flash_attn": not a.no_flash_attn,
        "n_ctx": llm.n_ctx(),
    }


class ModelDraft(LlamaDraftModel):
    """Greedy drafts from a second, smaller model with the same tokenizer: llama-cpp-python's
    draft-model hook with a Llama of its own (its KV cache keeps the common prefix between calls)."""

    def __init__(self, path: str, threads: int, width: int):
        self.llm = Llama(
            path,
            n_ctx=3072,
            n_threads=threads,
            n_threads_batch=threads,
            n_batch=BATCH,
            n_ubatch=BATCH,
            verbose=False,
            logits_all=False,
        )
        self.width = width

    def __call__(self, input_ids, /, **kwargs):
        drafts = []
        for token in self.llm.generate(input_ids.tolist(), top_k=1, temp=0.0):
            drafts.append(token)
            if len(drafts) >= self.width:
                break
        return np.array(drafts, dtype=np.intc)


def edit(a: argparse.Namespace) -> dict:
    prompt = open(a.edit, encoding="utf-8").read()
    result = {}
    modes = [("plain", None), ("lookup", LlamaPromptLookupDecoding(num_pred_tokens=10))]
    if a.draft:
        modes.append(("draft", ModelDraft(a.draft, a.threads, a.draft_width)))
    for label, draft in modes:
        # The wrapper verifies drafts against every position's logits: it needs logits_all.
        llm = Llama(
            a.model,
            n_ctx=3072,
            n_threads=a.threads,
            n_threads_batch=a.threads,
            n_batch=BATCH,
            n_ubatch=BATCH,
            verbose=False,
            draft_model=draft,
            logits_all=draft is not None,
        )
        first, tokens = None, 0
        for _chunk in llm.create_completion(
            prompt, max_tokens=a.decode, temperature=0.0, top_k=1, stop=["```"], stream=True
        ):
            tokens += 1
            if first is None:
                first = time.perf_counter()
        result[f"edit_{label}_tps"] = round((tokens - 1) / (time.perf_counter() - first), 2)
        result[f"edit_{label}_tokens"] = tokens
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--long", type=int, default=0, help="long-context mode: prompt tokens (e.g. 16384)")
    ap.add_argument("--no-flash-attn", action="store_true", help="long mode: flash attention off")
    ap.add_argument("--serve", action="store_true", help='decode on request: stdin lines "1 STEPS"')
    ap.add_argument("--edit", help="edit mode: a prompt file (plain and prompt-lookup decode)")
    ap.add_argument("--draft", help="edit mode: a smaller GGUF with the same tokenizer, as a draft model")
    ap.add_argument("--draft-width", type=int, default=4, help="draft-model tokens per round")
    a = ap.parse_args()
    if a.edit:
        print(json.dumps(edit(a)))
        return
    if a.long:
        print(json.dumps(long_context(a)))
        return
    llm = Llama(
        a.model,
        n_ctx=2048,
        n_threads=a.threads,
        n_threads_batch=a.threads,
        n_batch=BATCH,
        n_ubatch=BATCH,
        verbose=False,
        logits_all=False,
    )
    vocab = llm.n_vocab()

    def decode(steps: int) -> float:
        llm.reset()
        llm.eval(llm.tokenize(b"Write a long story about a lighthouse keeper.", add_bos=False))
        token = next_token(llm, vocab)
        start = time.perf_counter()
        for _ in range(steps):
            llm.eval([token])
            token = next_token(llm, vocab)
        return steps / (time.perf_counter() - start)

    if a.serve:  # one stream only: this runner has no batched decode
        decode(4)
        print("ready", flush=True)
        for line in sys.stdin:
            batch, steps = (int(x) for x in line.split())
            reply = {"tps": round(decode(steps), 2)} if batch == 1 else {"error": "llama.cpp runs one stream here"}
            print(json.dumps(reply), flush=True)
        return

    def prefill(rep: int) -> float:
        ids = prompt_ids(a.prefill, rep)
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

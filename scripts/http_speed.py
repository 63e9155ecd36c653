"""Speed through an OpenAI-compatible HTTP server (streamed /v1/completions with `ignore_eos`,
token-id prompts): what scripts/bench.py measures helios and the vLLM peer with, the same calls
for both."""

from __future__ import annotations

import itertools
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

STORY = "Write a long story about a lighthouse keeper."


def stream_completion(client: httpx.Client, prompt, max_tokens: int, model: str | None = None) -> dict:
    """One streamed completion; returns TTFT, decode time and token counts from usage. `model`:
    the name a server that checks it (a peer) serves under."""
    body = {
        **({"model": model} if model else {}),
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 1,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return stream_sse(client, "/v1/completions", body)


def stream_sse(client: httpx.Client, path: str, body: dict) -> dict:
    """One streamed request to `path`: its text, TTFT, time after the first token, and usage."""
    start = time.perf_counter()
    first = None
    usage = None
    text = []
    with client.stream("POST", path, json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and first is None:
                first = time.perf_counter()
            for choice in chunk.get("choices") or ():
                text.append(choice.get("text") or "")  # /v1/completions deltas
            if chunk.get("usage"):
                usage = chunk["usage"]
    end = time.perf_counter()
    return {
        "text": "".join(text),
        "ttft": (first or end) - start,
        "decode_seconds": end - (first or end),
        "completion_tokens": usage["completion_tokens"],
        "prompt_tokens": usage["prompt_tokens"],
        "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
    }


def decode_tps(client: httpx.Client, streams: int, max_tokens: int, model: str | None = None) -> float:
    """Aggregate decode tokens/s of `streams` concurrent streams, after the last first token."""
    with ThreadPoolExecutor(max_workers=streams) as pool:
        start = time.perf_counter()
        results = list(pool.map(lambda _: stream_completion(client, STORY, max_tokens, model), range(streams)))
        wall = time.perf_counter() - start
    # Tokens after each stream's first, over the time after the last stream's first token.
    generated = sum(r["completion_tokens"] - 1 for r in results)
    ttft = max(r["ttft"] for r in results)
    return generated / max(wall - ttft, 1e-9)


_FRESH = itertools.count()


def fresh_prompt(tokens: int) -> list[int]:
    """`tokens` token ids no earlier prompt of this run shares a first token with (so no prefix
    checkpoint applies); the peers' runners use the same formula."""
    r = next(_FRESH)
    return [(1000 + 7 * i + 13 * r) % 30000 + 100 for i in range(tokens)]


def prefill(client: httpx.Client, tokens: int, repeats: int, model: str | None = None) -> tuple[float, float]:
    """Prefill tokens/s and median TTFT for a fresh (uncached) prompt of `tokens` token ids:
    every prompt of the run differs from its first token, so no prefix checkpoint applies."""
    ttfts = []
    for _ in range(repeats):
        ttfts.append(stream_completion(client, fresh_prompt(tokens), 1, model)["ttft"])
    median = statistics.median(ttfts)
    return tokens / median, median * 1000


def server_speed(client: httpx.Client, quick: bool, model: str | None = None) -> dict:
    """Decode at 1 and 8 streams and a fresh 512-token prefill, best of the repeats."""
    decode_tokens = 64 if quick else 128
    repeats = 2 if quick else 3
    prefill_tps, ttft_ms = prefill(client, 512, repeats, model)
    return {
        "decode_b1_tps": round(max(decode_tps(client, 1, decode_tokens, model) for _ in range(repeats)), 2),
        "decode_b8_tps": round(max(decode_tps(client, 8, decode_tokens, model) for _ in range(repeats)), 2),
        "prefill_tps": round(prefill_tps, 1),
        "ttft_ms": round(ttft_ms, 1),
    }


def long_context(client: httpx.Client, tokens: int, decode: int, model: str | None = None) -> dict:
    """A fresh `tokens`-token prompt (prefill tokens/s = tokens / TTFT of a max_tokens=1 request),
    then the same prompt with `decode` tokens (decode tokens/s after the first token; a server with
    prefix caching restores the prompt)."""
    prompt = fresh_prompt(tokens)
    first = stream_completion(client, prompt, 1, model)
    turn = stream_completion(client, prompt, decode, model)
    return {
        "prefill_16k_tps": round(tokens / first["ttft"], 1),
        "prefill_16k_ms": round(first["ttft"] * 1000, 1),
        "decode_16k_tps": round((turn["completion_tokens"] - 1) / max(turn["decode_seconds"], 1e-9), 2),
    }

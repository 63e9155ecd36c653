"""Prefix-reuse TTFT through the real HTTP API (prints numbers, asserts nothing).

    python scripts/prefix_ttft.py --url http://127.0.0.1:PORT [--repeats 3] [--json OUT]
    python scripts/prefix_ttft.py --core cores/default        # starts its own `helios serve`

A conversation's earlier turns (~2,000 tokens, ending at a message boundary) are sent once as
their own request, which checkpoints them; the TTFT of the next turn (earlier turns + an
assistant reply + a new question) is compared with the TTFT of the same shape whose history no
request has seen. Each history is unique, so only the intended checkpoint can be reused.
`prefix_hit_ttft_ratio` is median(cached) / median(uncached); `measure(client)` is importable
(scripts/bench.py can call it with its own client).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import httpx
from served import run_against

LINE = "Step {i}: the agent opened file src/module_{i}.py, read its functions, and noted the results.\n"


def history(tag: str, lines: int) -> str:
    return f"Session {tag} {time.time_ns()}.\n" + "".join(LINE.format(i=i) for i in range(lines))


def conversation(text: str) -> list[dict]:
    return [
        {"role": "user", "content": text},
        {"role": "assistant", "content": "Noted."},
        {"role": "user", "content": "Which file came last? Answer briefly."},
    ]


def first_token(client: httpx.Client, messages: list[dict]) -> tuple[float, dict]:
    """Seconds to the first streamed choice chunk, and the final usage."""
    body = {
        "messages": messages,
        "max_tokens": 1,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first, usage = None, {}
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk.get("choices"):
                first = time.perf_counter() - start
            usage = chunk.get("usage") or usage
    return (first if first is not None else time.perf_counter() - start), usage


def measure(client: httpx.Client, repeats: int = 3, lines: int = 85, log=print) -> dict:
    first_token(client, [{"role": "user", "content": "warm up"}])
    cold, hot, cached = [], [], []
    for rep in range(repeats):
        seconds, usage = first_token(client, conversation(history(f"cold{rep}", lines)))
        cold.append(seconds)
        log(
            f"uncached  ttft {seconds * 1000:8.0f} ms  prompt {usage.get('prompt_tokens')}  "
            f"cached {usage.get('prompt_tokens_details', {}).get('cached_tokens')}"
        )
        text = history(f"hot{rep}", lines)
        first_token(client, [{"role": "user", "content": text}])  # the earlier turn: checkpointed
        seconds, usage = first_token(client, conversation(text))
        hot.append(seconds)
        cached.append(usage.get("prompt_tokens_details", {}).get("cached_tokens", 0))
        log(f"cached    ttft {seconds * 1000:8.0f} ms  prompt {usage.get('prompt_tokens')}  cached {cached[-1]}")
    uncached_ms, cached_ms = statistics.median(cold) * 1000, statistics.median(hot) * 1000
    return {
        "uncached_ttft_ms": round(uncached_ms, 1),
        "cached_ttft_ms": round(cached_ms, 1),
        "cached_tokens": min(cached),
        "prefix_hit_ttft_ratio": round(cached_ms / uncached_ms, 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running helios server")
    parser.add_argument("--core", type=Path, help="start `helios serve CORE` instead")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    def run(url: str, _pid: int | None) -> dict:
        with httpx.Client(base_url=url, timeout=900) as client:
            return measure(client, args.repeats)

    run_against(args.url, args.core, run, args.json)


if __name__ == "__main__":
    main()

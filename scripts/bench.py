"""Benchmark helios through its real HTTP API (not a test: it prints numbers, it asserts nothing).

    python scripts/bench.py [--core cores/default] [--quick] [--json OUT]

Measures on one core, in one run: decode tokens/s at 1 and 8 concurrent streams, prefill
tokens/s for a 512-token prompt, time to first token, and the server's RSS. Peers (llama.cpp,
onnxruntime-genai) are measured by the engine-speed work, in the same run, on the same model.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.conftest import Server  # noqa: E402  (the same launcher the tests use)


def stream_completion(client: httpx.Client, prompt, max_tokens: int) -> dict:
    """One streamed completion; returns TTFT, decode time and token counts from usage."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 1,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first = None
    usage = None
    with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and first is None:
                first = time.perf_counter()
            if chunk.get("usage"):
                usage = chunk["usage"]
    end = time.perf_counter()
    return {
        "ttft": (first or end) - start,
        "decode_seconds": end - (first or end),
        "completion_tokens": usage["completion_tokens"],
        "prompt_tokens": usage["prompt_tokens"],
    }


def decode_tps(client: httpx.Client, streams: int, max_tokens: int) -> float:
    prompt = "Write a long story about a lighthouse keeper."
    with ThreadPoolExecutor(max_workers=streams) as pool:
        start = time.perf_counter()
        results = list(pool.map(lambda _: stream_completion(client, prompt, max_tokens), range(streams)))
        wall = time.perf_counter() - start
    generated = sum(r["completion_tokens"] for r in results)
    ttft = max(r["ttft"] for r in results)
    return generated / max(wall - ttft, 1e-9)


def prefill(client: httpx.Client, tokens: int, repeats: int) -> tuple[float, float]:
    """Prefill tokens/s and median TTFT for a fresh (uncached) prompt of `tokens` token ids."""
    ttfts = []
    for r in range(repeats):
        prompt = [(1000 + 7 * i + 13 * r) % 30000 + 100 for i in range(tokens)]
        ttfts.append(stream_completion(client, prompt, 1)["ttft"])
    median = statistics.median(ttfts)
    return tokens / median, median * 1000


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--core", type=Path, default=REPO / "cores" / "default")
    parser.add_argument("--quick", action="store_true", help="fewer tokens and repeats")
    parser.add_argument("--json", type=Path, help="write results here")
    args = parser.parse_args()
    if not (args.core / "core.json").is_file():
        sys.exit(f"{args.core} is not a core; run: ignition export --recipe qwen25_coder --out {args.core}")

    decode_tokens = 32 if args.quick else 128
    repeats = 2 if args.quick else 3
    server = Server(args.core)
    try:
        with httpx.Client(base_url=server.url, timeout=600) as client:
            stream_completion(client, "warm up", 4)
            b1 = decode_tps(client, 1, decode_tokens)
            b8 = decode_tps(client, 8, decode_tokens)
            prefill_tps, ttft_ms = prefill(client, 512, repeats)
            rss = rss_mb(server.process.pid)
    finally:
        server.stop()

    results = {
        "helios": {
            "decode_b1_tps": round(b1, 2),
            "decode_b8_tps": round(b8, 2),
            "prefill_tps": round(prefill_tps, 1),
            "ttft_ms": round(ttft_ms, 1),
            "rss_mb": round(rss, 1),
        },
        "peers": {},
        "machine": {"cpu": platform.processor() or platform.machine(), "python": platform.python_version()},
        "core": str(args.core),
    }
    print(f"{'metric':<16}{'helios':>12}")
    for key, value in results["helios"].items():
        print(f"{key:<16}{value:>12}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()

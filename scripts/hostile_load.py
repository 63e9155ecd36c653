"""A normal chat's latency while worst-case compressed bodies are in flight, and the server's
memory while it parses bodies (prints numbers, asserts nothing; targets in docs/performance.md).

    python scripts/hostile_load.py --core cores/default [--json OUT]   # starts its own server
    python scripts/hostile_load.py --url http://127.0.0.1:PORT --pid PID

Four client threads send worst-case bodies back to back, each under 64 KiB on the wire: gzip of
many empty members, a gzip bomb inflating to the body limit of `[]` elements, and a gzip bomb
inflating to a body-limit prompt string. Meanwhile a normal short chat is timed; the ratio to its
idle median is `loaded_chat_ratio` (target <= 2). `parse_rss_ratio` is the peak RSS increase over
idle while those bodies (and the largest element count the parser accepts) are parsed, over the
body limit (target < 4; needs permission to reset the server's peak RSS).
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import threading
import time
from pathlib import Path

import httpx
from served import run_against

CHAT = {"messages": [{"role": "user", "content": "Reply with exactly OK."}], "max_tokens": 4, "ignore_eos": True}


def worst_bodies(limit: int) -> list[bytes]:
    members = gzip.compress(b"") * 150_000  # 3 MB of empty members
    empties = gzip.compress(b"[" + b"[]," * ((limit - 2) // 3 - 1) + b"[]]", 9)
    text = gzip.compress(b'{"prompt": "' + b"a" * (limit - 64) + b'", "max_tokens": 1}', 9)
    return [members, empties, text, empties]


def chat_ms(client: httpx.Client) -> float:
    start = time.perf_counter()
    client.post("/v1/chat/completions", json=CHAT).raise_for_status()
    return (time.perf_counter() - start) * 1000


def rss_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def measure(url: str, pid: int | None, limit: int, repeats: int = 15) -> dict:
    with httpx.Client(base_url=url, timeout=600) as client:
        for _ in range(3):
            chat_ms(client)
        idle = [chat_ms(client) for _ in range(repeats)]
        peak_reset = False
        if pid is not None:
            try:
                Path(f"/proc/{pid}/clear_refs").write_text("5")
                peak_reset = True
            except OSError:
                pass
        idle_rss = rss_kib(pid, "VmRSS") if pid else 0
        stop = threading.Event()
        statuses: list[int] = []

        def attacker(body: bytes) -> None:
            with httpx.Client(base_url=url, timeout=600) as hostile:
                while not stop.is_set():
                    try:
                        response = hostile.post(
                            "/v1/completions",
                            content=body,
                            headers={"Content-Encoding": "gzip", "Content-Type": "application/json"},
                        )
                        statuses.append(response.status_code)
                    except httpx.TransportError as exc:  # the server may cut a hostile connection
                        statuses.append(type(exc).__name__)

        threads = [threading.Thread(target=attacker, args=(body,), daemon=True) for body in worst_bodies(limit)]
        for thread in threads:
            thread.start()
        time.sleep(1.0)
        loaded = [chat_ms(client) for _ in range(repeats)]
        stop.set()
        for thread in threads:
            thread.join(600)
        most = json.dumps({"prompt": list(range(200, 200 + 262_000)), "max_tokens": 1}).encode()
        client.post("/v1/completions", content=gzip.compress(most), headers={"Content-Encoding": "gzip"})
        peak = rss_kib(pid, "VmHWM") if pid and peak_reset else None
    result = {
        "idle_chat_ms": round(statistics.median(idle), 1),
        "loaded_chat_ms": round(statistics.median(loaded), 1),
        "loaded_chat_ratio": round(statistics.median(loaded) / statistics.median(idle), 3),
        "hostile_requests": len(statuses),
        "hostile_statuses": sorted({str(s) for s in statuses}),
        "body_limit_bytes": limit,
    }
    if peak is not None:
        result["parse_rss_increase_mb"] = round((peak - idle_rss) / 1024, 1)
        result["parse_rss_ratio"] = round((peak - idle_rss) * 1024 / limit, 3)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running helios server")
    parser.add_argument("--pid", type=int, help="its process id (for memory)")
    parser.add_argument("--core", type=Path, help="start `helios serve CORE` instead")
    parser.add_argument("--body-limit", type=int, default=32 << 20, help="the server's max_body_bytes")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    run_against(args.url, args.core, lambda url, pid: measure(url, pid, args.body_limit), args.json, args.pid)


if __name__ == "__main__":
    main()

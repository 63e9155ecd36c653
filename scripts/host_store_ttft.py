"""Host prefix store TTFT through the real HTTP API (prints numbers, asserts nothing).

    python scripts/host_store_ttft.py [--core cores/default] [--tokens 16000] [--json OUT]

One long agent prompt (a system prompt with a tool list, then a question) is answered:
1. cold, on a fresh `helios serve CORE --host-store DIR`;
2. after that server is stopped and a new one started on the same DIR (the disk tier);
3. after eight other long prompts have pushed its checkpoint out of the pool (the DRAM tier);
each as the time to the first streamed token, with the reused tokens from usage. The pool is
sized (`--kv-pages`) so that the eight others evict it. Restore throughput is the reused tokens
over the restart TTFT, against the disk's sequential read speed measured on the record itself.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from prefix_ttft import first_token  # noqa: E402 (a sibling script)
from tests.conftest import Server  # noqa: E402

TOOL = {"type": "function", "function": {
    "name": "tool_{i}", "description": "Reads, edits or runs part {i} of the repository: {what}",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "pattern": {"type": "string"},
                                                     "limit": {"type": "integer"}}, "required": ["path"]}}}
WHAT = "the source files, their tests, the build scripts and the logs they write, one step at a time."


def agent_prompt(tag: str, tokens: int) -> list[dict]:
    """A system prompt of about `tokens` tokens (rules plus a tool list) and a question."""
    tools = json.dumps([json.loads(json.dumps(TOOL).replace("{i}", str(i)).replace("{what}", WHAT))
                        for i in range(tokens // 150)], indent=1)  # ~150 tokens a tool
    system = f"Session {tag} {time.time_ns()}. You are a coding agent. Use the tools below.\n{tools}"
    return [{"role": "system", "content": system}, {"role": "user", "content": "Which tool reads part 3?"}]


def metric(url: str, name: str) -> float:
    data = httpx.get(url + "/metrics", params={"format": "json"}, timeout=30).json()
    return float(data.get(name, 0))


def disk_read_gbps(folder: Path) -> float:
    record = max(folder.rglob("*.rec"), key=lambda p: p.stat().st_size)
    start = time.perf_counter()
    with open(record, "rb") as source:
        while source.read(64 << 20):
            pass
    return record.stat().st_size / (time.perf_counter() - start) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--core", type=Path, default=Path("cores/default"))
    parser.add_argument("--tokens", type=int, default=16000)
    parser.add_argument("--others", type=int, default=8)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="flare-host-store-"))
    # Checkpoints may own half the pool: room for the long prompt's and about four others'.
    pages = str(2 * (args.tokens // 16) * 3)
    serve = ("--host-store", str(folder), "--kv-pages", pages)
    prompt = agent_prompt("main", args.tokens)
    others = [agent_prompt(f"other{i}", args.tokens // 2) for i in range(args.others)]
    result: dict = {}

    server = Server(args.core, *serve)
    try:
        with httpx.Client(base_url=server.url, timeout=1800) as client:
            first_token(client, [{"role": "user", "content": "warm up"}])
            seconds, usage = first_token(client, prompt)
            result["cold_ttft_ms"] = round(seconds * 1000, 1)
            result["prompt_tokens"] = usage.get("prompt_tokens")
            print(f"cold      {seconds * 1000:9.0f} ms  prompt {usage.get('prompt_tokens')}", flush=True)
    finally:
        server.stop()
    server = Server(args.core, *serve)
    try:
        with httpx.Client(base_url=server.url, timeout=1800) as client:
            bytes_before = metric(server.url, "host_bytes_in")
            seconds, usage = first_token(client, prompt)
            restored = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
            moved = metric(server.url, "host_bytes_in") - bytes_before
            result.update(restart_ttft_ms=round(seconds * 1000, 1), restart_cached_tokens=restored,
                          restore_tokens_per_s=round(restored / seconds), restore_gbps=round(moved / seconds / 1e9, 3))
            print(f"restart   {seconds * 1000:9.0f} ms  cached {restored}", flush=True)
            for other in others:
                first_token(client, other)
            seconds, usage = first_token(client, prompt)
            result.update(evicted_ttft_ms=round(seconds * 1000, 1),
                          evicted_cached_tokens=usage.get("prompt_tokens_details", {}).get("cached_tokens", 0),
                          host_hits=metric(server.url, "host_hits"))
            print(f"evicted   {seconds * 1000:9.0f} ms  cached {result['evicted_cached_tokens']}", flush=True)
    finally:
        server.stop()
    result["disk_read_gbps"] = round(disk_read_gbps(folder), 3)
    result["restart_ratio"] = round(result["restart_ttft_ms"] / result["cold_ttft_ms"], 4)
    result["evicted_ratio"] = round(result["evicted_ttft_ms"] / result["cold_ttft_ms"], 4)
    print(json.dumps({"host_store": result}))
    if args.json:
        args.json.write_text(json.dumps({"host_store": result}, indent=2) + "\n")


if __name__ == "__main__":
    main()

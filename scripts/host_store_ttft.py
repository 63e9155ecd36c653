"""Host prefix store TTFT through the real HTTP API (prints numbers, asserts nothing).

    python scripts/host_store_ttft.py [--core cores/default] [--tokens 16000] [--json OUT]
    python scripts/bench.py --host-store ...      # the same section inside bench.py's JSON

One long agent prompt (a system prompt with a tool list, then a question) is answered:
1. cold, on a fresh `helios serve CORE --host-store DIR`;
2. after that server is stopped, the record files are dropped from the OS page cache
   (posix_fadvise DONTNEED, so the restore reads the disk, not memory) and a new server is
   started on the same DIR (the disk tier);
3. after eight other prompts have pushed its checkpoints out of the pool (the DRAM tier);
each as the time to the first streamed token, with the reused tokens from usage. The pool is
sized (`--kv-pages`) so that checkpoints may own about 1.5x the long prompt, and the others
(a quarter of its length each) evict it. Restore throughput is the restart's restored tokens and
host bytes over its TTFT, against the disk's sequential read speed measured on the largest
record with the page cache dropped. Targets: restart and evicted TTFT <= 0.05x cold.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from prefix_ttft import first_token

from helios.launcher import HeliosProcess

TOOL = {
    "type": "function",
    "function": {
        "name": "tool_{i}",
        "description": "Reads, edits or runs part {i} of the repository: {what}",
        "parameters": {
            "type": "object",
            "properties": {"path": {"type": "string"}, "pattern": {"type": "string"}, "limit": {"type": "integer"}},
            "required": ["path"],
        },
    },
}
WHAT = "the source files, their tests, the build scripts and the logs they write, one step at a time."
TARGETS = {"restart_ratio": 0.05, "evicted_ratio": 0.05}


def agent_prompt(tag: str, tokens: int) -> list[dict]:
    """A system prompt of about `tokens` tokens (rules plus a tool list) and a question."""
    tools = json.dumps(
        [json.loads(json.dumps(TOOL).replace("{i}", str(i)).replace("{what}", WHAT)) for i in range(tokens // 140)],
        indent=1,
    )  # ~140 tokens a tool
    system = f"Session {tag} {time.time_ns()}. You are a coding agent. Use the tools below.\n{tools}"
    return [{"role": "system", "content": system}, {"role": "user", "content": "Which tool reads part 3?"}]


def metric(url: str, name: str) -> float:
    data = httpx.get(url + "/metrics", params={"format": "json"}, timeout=30).json()
    return float(data.get(name, 0))


def drop_page_cache(folder: Path) -> None:
    """Ask the OS to forget the record files' cached pages (they are clean: written and closed)."""
    for path in folder.rglob("*.rec"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def disk_read_gbps(folder: Path) -> float:
    record = max(folder.rglob("*.rec"), key=lambda p: p.stat().st_size)
    drop_page_cache(folder)
    start = time.perf_counter()
    with open(record, "rb") as source:
        while source.read(64 << 20):
            pass
    return record.stat().st_size / (time.perf_counter() - start) / 1e9


def measure(core: Path, tokens: int = 16000, others: int = 8, log: Callable[[str], None] = print) -> dict:
    """The bench.py `host_store` section (cold, restart and evicted TTFT, restore rates)."""
    folder = Path(tempfile.mkdtemp(prefix="flare-host-store-"))
    page_tokens = json.loads((core / "core.json").read_text())["kv"]["page_tokens"]
    # Checkpoints may own half the pool: about 1.5x the long prompt.
    serve = ("--host-store", str(folder), "--kv-pages", str(3 * tokens // page_tokens))
    prompt = agent_prompt("main", tokens)
    result: dict = {"prompt_tokens": 0}

    server = HeliosProcess(core, *serve)
    try:
        with httpx.Client(base_url=server.url, timeout=3600) as client:
            first_token(client, [{"role": "user", "content": "warm up"}])
            seconds, usage = first_token(client, prompt)
            result.update(cold_ttft_ms=round(seconds * 1000, 1), prompt_tokens=usage.get("prompt_tokens"))
            log(f"cold      {seconds * 1000:9.0f} ms  prompt {usage.get('prompt_tokens')}")
    finally:
        server.stop()
    drop_page_cache(folder)
    server = HeliosProcess(core, *serve)
    try:
        with httpx.Client(base_url=server.url, timeout=3600) as client:
            seconds, usage = first_token(client, prompt)
            restored = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
            moved = metric(server.url, "host_bytes_in")
            result.update(
                restart_ttft_ms=round(seconds * 1000, 1),
                restart_cached_tokens=restored,
                restore_tokens_per_s=round(restored / seconds),
                restore_gbps=round(moved / seconds / 1e9, 3),
            )
            log(f"restart   {seconds * 1000:9.0f} ms  cached {restored}")
            for index in range(others):
                first_token(client, agent_prompt(f"other{index}", tokens // 4))
            seconds, usage = first_token(client, prompt)
            result.update(
                evicted_ttft_ms=round(seconds * 1000, 1),
                evicted_cached_tokens=usage.get("prompt_tokens_details", {}).get("cached_tokens", 0),
                host_hits=metric(server.url, "host_hits"),
                host_memory_records=metric(server.url, "host_memory_records"),
            )
            log(f"evicted   {seconds * 1000:9.0f} ms  cached {result['evicted_cached_tokens']}")
    finally:
        server.stop()
    result["disk_read_gbps"] = round(disk_read_gbps(folder), 3)
    result["restart_ratio"] = round(result["restart_ttft_ms"] / result["cold_ttft_ms"], 4)
    result["evicted_ratio"] = round(result["evicted_ttft_ms"] / result["cold_ttft_ms"], 4)
    result["targets"] = {
        name: {"target": f"<= {bound}", "met": result[name] <= bound} for name, bound in TARGETS.items()
    }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--core", type=Path, default=Path("cores/default"))
    parser.add_argument("--tokens", type=int, default=16000)
    parser.add_argument("--others", type=int, default=8)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    result = measure(args.core, args.tokens, args.others, log=lambda line: print(line, flush=True))
    print(json.dumps({"host_store": result}))
    if args.json:
        args.json.write_text(json.dumps({"host_store": result}, indent=2) + "\n")


if __name__ == "__main__":
    main()

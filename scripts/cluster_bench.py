"""Scale-out routing on Ray Serve: prefix affinity against Ray Serve's power of two choices, in
one run (prints numbers, asserts nothing; the targets live in docs/performance.md).

    python scripts/cluster_bench.py [--core DIR] [--sessions 8] [--turns 5] [--json OUT]

Each policy gets a fresh `helios cluster serve CORE --replicas 2 --threads 1` with default
settings. Eight simulated agent sessions run at once; each has its own long system prompt
(~1,600 tokens: tool rules and a project digest, the way Claude Code's prompt carries the
environment), then short turns (the previous reply plus a new ~40-token question, after a second
of "tool time"). Reported per policy: `reuse_ratio` = cached_tokens / prompt_tokens over the
follow-up turns, follow-up TTFT (median, mean, p90) and first-turn TTFT; plus `ttft_ratio` =
affinity / power-of-two median follow-up TTFT and `ttft_mean_ratio`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from prefix_ttft import first_token

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from helios.cache_dir import cache_root
from helios.launcher import ClusterProcess

THINK_S = 1.0  # between turns: the agent runs its tools
RULE = "Rule {n}: when the user asks about module {s}_{n}, read it first, then answer in one short line.\n"


def system_prompt(session: int, rules: int = 60) -> str:
    head = f"You are a coding agent working in project alpha-{session} (session {session}, {time.time_ns()}).\n"
    return head + "".join(RULE.format(n=n, s=session) for n in range(rules))


def run_session(url: str, session: int, turns: int) -> list[dict]:
    messages = [
        {"role": "system", "content": system_prompt(session)},
        {"role": "user", "content": f"Which module should I read first in project alpha-{session}?"},
    ]
    out = []
    with httpx.Client(base_url=url, timeout=600) as client:
        for turn in range(turns):
            seconds, usage = first_token(client, messages)
            details = usage.get("prompt_tokens_details") or {}
            out.append(
                {
                    "turn": turn,
                    "ttft_s": seconds,
                    "prompt_tokens": usage.get("prompt_tokens", 0),
                    "cached_tokens": details.get("cached_tokens", 0),
                }
            )
            time.sleep(THINK_S)
            messages += [
                {"role": "assistant", "content": f"Read module {session}_{turn} first."},
                {
                    "role": "user",
                    "content": f"Done reading module {session}_{turn}: it defines two helpers "
                    f"and one class. What should I check in it next, briefly?",
                },
            ]
    return out


def measure(core: Path, policy: str, sessions: int, turns: int) -> dict:
    cluster = ClusterProcess(core, "--threads", "1", "--router", policy)
    try:
        first_token(httpx.Client(base_url=cluster.url, timeout=600), [{"role": "user", "content": "warm up"}])
        with ThreadPoolExecutor(sessions) as pool:
            results = [
                r for rows in pool.map(lambda s: run_session(cluster.url, s, turns), range(sessions)) for r in rows
            ]
        routing = cluster.metrics().get("routing", {})
    finally:
        cluster.stop()
    follow = [r for r in results if r["turn"] > 0]
    first = [r for r in results if r["turn"] == 0]
    prompt = sum(r["prompt_tokens"] for r in follow)
    return {
        "reuse_ratio": round(sum(r["cached_tokens"] for r in follow) / max(1, prompt), 4),
        "followup_ttft_ms": round(statistics.median(r["ttft_s"] for r in follow) * 1000, 1),
        "followup_ttft_mean_ms": round(statistics.mean(r["ttft_s"] for r in follow) * 1000, 1),
        "followup_ttft_p90_ms": round(sorted(r["ttft_s"] for r in follow)[int(0.9 * (len(follow) - 1))] * 1000, 1),
        "first_turn_ttft_ms": round(statistics.median(r["ttft_s"] for r in first) * 1000, 1),
        "followup_prompt_tokens_mean": round(prompt / max(1, len(follow))),
        "routing": routing,
    }


def default_core() -> Path:
    cores = sorted((cache_root() / "cores").glob("qwen25_coder-int4-*"))
    if not cores:
        raise SystemExit("no default core cached: run the tests once, or pass --core")
    return cores[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--core", type=Path)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    core = args.core or default_core()
    result = {}
    for policy in ("affinity", "power-of-two"):
        result[policy] = measure(core, policy, args.sessions, args.turns)
        print(policy, json.dumps(result[policy]), flush=True)
    for name, field in (("ttft_ratio", "followup_ttft_ms"), ("ttft_mean_ratio", "followup_ttft_mean_ms")):
        result[name] = round(result["affinity"][field] / result["power-of-two"][field], 4)
    out = {"cluster": result}
    print(json.dumps(out))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()

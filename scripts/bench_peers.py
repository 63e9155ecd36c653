"""The peer runtimes of scripts/bench.py (its docstring says how each is set up and measured):
llama.cpp and onnxruntime-genai through their runner processes, vLLM through its HTTP server."""

from __future__ import annotations

from pathlib import Path

import httpx
from http_speed import long_context, server_speed
from paired_speed import Measure, PeerLoop, http_measure, paired_decode
from peers import envs as setup
from peers.vllm_server import SERVED_NAME, VllmServer

from helios.manifest import Manifest
from ignition.checkpoints.packaged import PACKAGED_MODELS, resolve_packaged


def long_result(raw: dict) -> dict:
    """A runner's long-context JSON under the bench's names (and the raw line, for the record)."""
    return {
        "prefill_16k_tps": raw["long_prefill_tps"],
        "decode_16k_tps": raw["long_decode_tps"],
        "prefill_16k_ms": raw["long_prefill_ms"],
        "long_run": raw,
    }


def bench_peers(
    core: Path,
    quick: bool,
    threads: int,
    only: list[str] | None,
    long_tokens: int | None = None,
    long_decode: int = 64,
    vllm: dict | None = None,
) -> dict:
    """One round of each peer; with `long_tokens`, also each peer's long-context run (a separate
    runner process: prefill_16k_tps, decode_16k_tps, prefill_16k_ms; `long_error` if it failed).
    `vllm`: the vLLM server started for the run ({"url"}, or {"error"}), measured over HTTP."""
    manifest = Manifest.load(core, verify_files=False)
    name = manifest.identity.checkpoint_id
    if name not in PACKAGED_MODELS:
        return {"peers": {"error": f"peers need a packaged checkpoint; this core came from {name!r}"}}
    gguf_path = resolve_packaged(PACKAGED_MODELS[name], report=setup.log)
    decode = "64" if quick else "128"
    repeats = "2" if quick else "3"
    peers: dict[str, dict] = {}
    wanted = only or PEERS
    long_args = ["--long", str(long_tokens), "--decode", str(long_decode)] if long_tokens else []
    # The genai model's context_length must hold the long prompt (ensure_genai_model rebuilds a
    # model built with less).
    min_context = (long_tokens + long_decode + 1) if long_tokens else 0
    if "llama.cpp" in wanted:
        try:
            python = setup.ensure_llamacpp()
            label = f"llama.cpp ({setup.gguf_quantization(gguf_path)})"
            result = setup.run_peer(
                python,
                "llamacpp_run.py",
                [str(gguf_path), "--threads", str(threads), "--decode", decode, "--repeats", repeats],
                timeout=1800,
            )
            if long_args:
                try:
                    result.update(
                        long_result(
                            setup.run_peer(
                                python,
                                "llamacpp_run.py",
                                [str(gguf_path), "--threads", str(threads), *long_args],
                                timeout=1800,
                            )
                        )
                    )
                except Exception as exc:
                    result["long_error"] = str(exc)[-500:]
            peers[label] = result
        except Exception as exc:  # a peer failing must not lose helios's numbers
            peers["llama.cpp"] = {"error": str(exc)[-500:]}
    if "onnxruntime-genai" in wanted:
        try:
            python = setup.ensure_ortgenai()
            model = setup.ensure_genai_model(python, gguf_path, name, threads, min_context=min_context)
            result = setup.run_peer(
                python, "ortgenai_run.py", [str(model), "--decode", decode, "--repeats", repeats], timeout=1800
            )
            if long_args:
                try:
                    result.update(
                        long_result(setup.run_peer(python, "ortgenai_run.py", [str(model), *long_args], timeout=1800))
                    )
                except Exception as exc:
                    result["long_error"] = str(exc)[-500:]
            peers["onnxruntime-genai (int4)"] = result
        except Exception as exc:
            peers["onnxruntime-genai"] = {"error": str(exc)[-500:]}
    if "vllm" in wanted and vllm is not None:
        peers[VLLM_LABEL] = measure_vllm(vllm, quick, long_tokens, long_decode)
    return peers


PEERS = ["llama.cpp", "onnxruntime-genai", "vllm"]
PAIRED_TOKENS = 64  # decode tokens after the first in each paired turn
VLLM_LABEL = "vLLM (bf16 safetensors)"  # its CPU build serves bf16, dequantized from the same GGUF


def start_vllm(core: Path, threads: int) -> tuple[object | None, dict]:
    """vLLM's server for the whole run (its start-up compiles for minutes): (server, {"url"}), or
    (None, {"error"}) when it cannot be installed or started."""
    manifest = Manifest.load(core, verify_files=False)
    name = manifest.identity.checkpoint_id
    if name not in PACKAGED_MODELS:
        return None, {"error": f"peers need a packaged checkpoint; this core came from {name!r}"}
    try:
        python = setup.ensure_vllm()
        context = manifest.limits.context_length
        model = setup.ensure_vllm_model(resolve_packaged(PACKAGED_MODELS[name], report=setup.log), name, context)
        # KV cache sized like helios' default pool in bf16 (vLLM's CPU KV type), whole GiB.
        kv = manifest.kv
        pool_bytes = manifest.limits.kv_pages * kv.page_tokens * kv.num_layers * 2 * kv.kv_heads * kv.head_dim * 2
        server = VllmServer(python, model, threads, kv_gib=max(1, -(-pool_bytes // 2**30)), max_model_len=context)
    except Exception as exc:  # a peer failing must not lose helios's numbers
        return None, {"error": str(exc)[-800:]}
    return server, {"url": server.url}


def measure_vllm(vllm: dict, quick: bool, long_tokens: int | None, long_decode: int) -> dict:
    """One round of the vLLM server through the same HTTP calls as helios."""
    if "error" in vllm:
        return {"error": vllm["error"]}
    try:
        with httpx.Client(base_url=vllm["url"], timeout=1800) as client:
            result = server_speed(client, quick, SERVED_NAME)
            if long_tokens:
                try:
                    result.update(long_context(client, long_tokens, long_decode, SERVED_NAME))
                except Exception as exc:
                    result["long_error"] = str(exc)[-500:]
            return result
    except Exception as exc:
        return {"error": str(exc)[-500:]}


def peer_measures(
    core: Path, threads: int, only: list[str] | None, vllm: dict | None
) -> tuple[dict[str, Measure], list]:
    """Each peer's decode for scripts/paired_speed.py, under the rounds' labels: ({label:
    measure}, what to close afterwards: runner loops and vLLM's HTTP client). A peer that cannot
    start is left out (the rounds report why)."""
    manifest = Manifest.load(core, verify_files=False)
    name = manifest.identity.checkpoint_id
    if name not in PACKAGED_MODELS:
        return {}, []
    gguf_path = resolve_packaged(PACKAGED_MODELS[name], report=setup.log)
    wanted = only or PEERS
    measures: dict[str, Measure] = {}
    opened: list = []
    if "llama.cpp" in wanted:
        try:
            loop = PeerLoop(
                setup.ensure_llamacpp(), setup.HERE / "llamacpp_run.py", [str(gguf_path), "--threads", str(threads)]
            )
            opened.append(loop)
            measures[f"llama.cpp ({setup.gguf_quantization(gguf_path)})"] = loop.decode
        except Exception as exc:
            setup.log(f"paired: llama.cpp left out: {exc}")
    if "onnxruntime-genai" in wanted:
        try:
            python = setup.ensure_ortgenai()
            model = setup.ensure_genai_model(python, gguf_path, name, threads)
            loop = PeerLoop(python, setup.HERE / "ortgenai_run.py", [str(model)])
            opened.append(loop)
            measures["onnxruntime-genai (int4)"] = loop.decode
        except Exception as exc:
            setup.log(f"paired: onnxruntime-genai left out: {exc}")
    if "vllm" in wanted and vllm is not None and "url" in vllm:
        client = httpx.Client(base_url=vllm["url"], timeout=1800)
        opened.append(client)
        measures[VLLM_LABEL] = http_measure(client, SERVED_NAME)
    return measures, opened


def measure_paired(
    client: httpx.Client, core: Path, threads: int, only: list[str] | None, vllm: dict | None, turns: int
) -> dict:
    """scripts/paired_speed.py against every peer that starts: decode at 1 and 8 streams."""
    measures, opened = peer_measures(core, threads, only, vllm)
    try:
        paired = paired_decode(http_measure(client), measures, turns, PAIRED_TOKENS)
    finally:
        for thing in opened:
            thing.close()
    return {"turns": turns, "tokens": PAIRED_TOKENS, **paired}

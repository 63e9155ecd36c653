"""scripts/gpu_check.py's phases 1-3: env (versions, GPU, copy bandwidth, matmul rate), kernels
(pool_attention_triton vs its reference) and compat (a CPU-written torch program loaded and run by
the device's torch, graph replay vs eager)."""

from __future__ import annotations

import math
import platform
import subprocess
import sys
import time
import types
import warnings
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gpu_check_common import Run, error_record, make_runner, write_fixture

# -- phase 1: environment ------------------------------------------------------------------------


def phase_env(run: Run, rec: dict) -> None:
    device, plan = run.device, run.plan
    rec.update(
        python=platform.python_version(),
        torch=torch.__version__,
        cuda=torch.version.cuda,
        device=device,
        tf32_matmul=torch.backends.cuda.matmul.allow_tf32,
        numpy=np.__version__,
    )
    for package in ("triton", "transformers", "onnxruntime"):
        try:
            rec[package] = __import__(package).__version__
        except Exception as exc:
            rec[package] = f"missing: {type(exc).__name__}: {exc}"
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        rec.update(
            gpu=props.name,
            capability=list(torch.cuda.get_device_capability(0)),
            sms=props.multi_processor_count,
            memory_gib=round(props.total_memory / 2**30, 1),
        )
    try:
        rec["nvidia_smi"] = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=15
        ).stdout.strip()
    except Exception as exc:
        rec["nvidia_smi"] = f"unavailable: {type(exc).__name__}: {exc}"
    src = torch.empty(plan.copy_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(run.device_seconds(partial(dst.copy_, src), 1) for _ in range(5))
    # A copy reads and writes every byte: HBM traffic is twice its size (what a decode step's
    # weight reads are held against).
    rec.update(copy_bytes=plan.copy_bytes, copy_seconds=best, bandwidth_GBps=round(2 * plan.copy_bytes / best / 1e9, 1))
    del src, dst
    n = plan.matmul  # prefill is compute-bound: held against what a plain bf16 matmul reaches here
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    a @ a
    rec["matmul_bf16_tflops"] = round(2 * n**3 * 5 / run.device_seconds(lambda: a @ a, 5) / 1e12, 1)


# -- phase 2: kernel parity ---------------------------------------------------------------------------

KERNEL_BUDGET_S = 45  # the two real head shapes first; the cross shapes only while this lasts


def attention_case(
    run: Run, heads: int, kvh: int, dim: int, hists: list[int], length: int, dtype: torch.dtype, seed: int
) -> dict:
    """pool_attention_triton vs pool_attention_ref (fp32, of the same rounded values) on one case."""
    from helios.kernels.torch_ops import pool_attention_ref
    from helios.kernels.triton_attention import pool_attention_triton
    from ignition.models.blocks.rotary import Rotary

    device = run.device
    gen = torch.Generator(device=device).manual_seed(seed)
    tokens, layers, layer, batch = 16, 2, 1, len(hists)
    cols = max(1, -(-max(hists) // tokens))
    pages = batch * cols + 1
    tables = torch.randperm(pages, generator=gen, device=device)[: batch * cols].reshape(batch, cols)
    # std 0.5: bf16's half-ulp stays below the tolerance for every value drawn
    pool = (torch.randn(layers * 2 * pages, tokens, kvh, dim, generator=gen, device=device) * 0.5).to(dtype)
    qkv = (torch.randn(batch, length, (heads + 2 * kvh) * dim, generator=gen, device=device) * 0.5).to(dtype)
    hist = torch.tensor(hists, device=device)
    qlens = torch.full((batch,), length, device=device)
    positions = hist[:, None] + torch.arange(length, device=device)
    rotary = Rotary(dim, 1e6, max(hists) + length + 1)
    cos, sin = rotary.cos_cache.to(device, dtype), rotary.sin_cache.to(device, dtype)
    args = (positions, cos, sin, pool, tables, hist, qlens, layer, layers, heads, kvh, 1 / math.sqrt(dim))
    started = time.perf_counter()
    got = pool_attention_triton(qkv, *args)
    run.sync()
    seconds = time.perf_counter() - started
    ref = pool_attention_ref(qkv.float(), positions, cos.float(), sin.float(), pool.float(), *args[4:])
    errors = {name: (a.float() - b).abs().max().item() for name, a, b in zip(("out", "k", "v"), got, ref)}
    res = {"max_abs_error": errors, "first_call_s": round(seconds, 3)}
    # The kernel promises the same bits from its split-K and fused paths (batch invariance); the
    # interpreter is slow, so the smoke checks it once.
    if length == 1 and (device == "cuda" or hists == [max(run.plan.decode_hists)]):
        paths = [pool_attention_triton(qkv, *args, split=split)[0] for split in (True, False)]
        res["split_equals_fused"] = torch.equal(*paths)
    return res


def phase_kernels(run: Run, rec: dict) -> None:
    device, plan = run.device, run.plan
    if device == "cpu":
        rec["note"] = "cpu-smoke: Triton interpreter (TRITON_INTERPRET=1), tiny shapes"
    cases = []
    for heads, kvh, dim in plan.heads:
        for batch in (1, 8 if device == "cuda" else 3):
            cases += [(f"decode B={batch} hist={h}", heads, kvh, dim, [h] * batch, 1) for h in plan.decode_hists]
        cases.append((f"decode mixed hist={list(plan.mixed_hists)}", heads, kvh, dim, list(plan.mixed_hists), 1))
        cases += [(f"prefill L={chunk} hist={h}", heads, kvh, dim, [h], chunk) for chunk, h in plan.prefill]
    rec["cases"], started = [], time.monotonic()
    for i, (name, heads, kvh, dim, hists, length) in enumerate(cases):
        for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
            if time.monotonic() - started > KERNEL_BUDGET_S or run.left() < 240:  # the models need the time more
                rec["skipped_cases"] = rec.get("skipped_cases", 0) + 1
                continue
            case = {"case": name, "heads": [heads, kvh, dim], "dtype": str(dtype).removeprefix("torch."), "tol": tol}
            rec["cases"].append(case)
            with run.attempt(rec, f"{name} {case['heads']} {case['dtype']}"):
                case.update(attention_case(run, heads, kvh, dim, hists, length, dtype, seed=i))
                case["pass"] = max(case["max_abs_error"].values()) <= tol and case.get("split_equals_fused", True)
    done = [c for c in rec["cases"] if "pass" in c]
    rec["passed"] = sum(c["pass"] for c in done)
    rec["failed"] = [f"{c['case']} {c['heads']} {c['dtype']}: {c['max_abs_error']}" for c in done if not c["pass"]]
    run.log(f"  kernels: {rec['passed']}/{len(rec['cases'])} pass, {len(rec.get('errors', []))} errors")


def reference_attention_if_no_kernel(run: Run) -> str | None:
    """If no Triton kernel ran in phase kernels, flare::pool_attention keeps its reference on CUDA
    (load_step_program registers the kernel; this makes that a no-op), so the later phases still
    check loading, graphs and parity, and measure everything but attention. Returns why, if so."""
    kernels = run.results.data["phases"].get("kernels", {})
    if run.device != "cuda" or any("pass" in c for c in kernels.get("cases", [])) or kernels.get("status") == "skipped":
        return None
    stub = types.ModuleType("helios.kernels.triton_attention")
    stub.register_cuda_kernel = lambda: None  # type: ignore[attr-defined]
    try:
        import helios.kernels.triton_attention as module

        module.register_cuda_kernel = stub.register_cuda_kernel
    except Exception:  # triton itself is missing or broken
        sys.modules[stub.__name__] = stub
    return "no Triton kernel ran in phase kernels: pool_attention runs its torch reference on CUDA"


# -- phase 3: compatibility of a CPU-written program ------------------------------------------------------


def phase_compat(run: Run, rec: dict) -> None:
    from helios.engine.step_io import StepRow
    from helios.manifest import Manifest

    device = run.device
    rec["tf32"] = "off (torch.backends.cuda.matmul.allow_tf32 = False for the whole run)"
    fixture = Path(run.args.fixture)
    if (fixture / "core.json").is_file():
        core, manifest = fixture, Manifest.load(fixture, verify_files=False)  # the ONNX files may stay behind
        rec["fixture"] = str(fixture)
    else:  # still check CPU vs GPU and graphs, on a program written here; the 2.13 -> device check is then missing
        core = run.tmp / "fixture"
        manifest = write_fixture(core)
        rec["fixture"] = f"MISSING {fixture}: used a tiny float32 program exported by this torch instead"
    engine = manifest.engine("step", "cuda")
    rec.update(
        written_by_torch=engine.torch_version,
        program_dtype=engine.dtype,
        loading_torch=torch.__version__,
        program_bytes=(core / engine.file).stat().st_size,
    )
    from helios.engine.torch_runner import load_step_program

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:  # the question of this phase: does a program written by the CPU torch load in this one
            load_step_program(core / engine.file, torch.device(device))
        except Exception as exc:
            rec["load_error"] = error_record(exc)
            raise
    rec.update(loaded=True, load_warnings=sorted({str(w.message)[:500] for w in caught}))
    dev = make_runner(core, manifest, 64, device, graphs=True, max_batch=4)
    cpu = make_runner(core, manifest, 64, "cpu", graphs=False, max_batch=4)
    rng = np.random.default_rng(0)
    vocab = manifest.architecture.vocab_size
    tables = {s: list(range(4 * s, 4 * s + 4)) for s in range(3)}  # three sequences of <= 64 tokens
    hist = {0: 0, 1: 0, 2: 0}

    def rows_for(seqs: list[int], lengths: list[int]) -> list:
        return [StepRow(rng.integers(0, vocab, n).tolist(), hist[s], tables[s]) for s, n in zip(seqs, lengths)]

    script = [([0], [20]), ([1, 2], [7, 33])] + [([0], [1])] * 5 + [([0, 1, 2], [1, 1, 1])] * 4
    rec["steps"] = []
    for seqs, lengths in script:
        rows = rows_for(seqs, lengths)
        a, b = dev.step(rows), cpu.step(rows)
        rec["steps"].append(
            {
                "rows": len(rows),
                "tokens": lengths,
                "max_abs_logit_diff": float(np.abs(a.logits - b.logits).max()),
                "top1_equal": bool((a.top_ids[:, 0] == b.top_ids[:, 0]).all()),
            }
        )
        for s, n in zip(seqs, lengths):
            hist[s] += n
    worst = max(s["max_abs_logit_diff"] for s in rec["steps"])
    rec.update(max_abs_logit_diff=worst, cpu_vs_device_pass=worst <= 1e-4)
    if dev.graphs is not None:
        for seqs in ([0], [0, 1, 2]):
            rec[f"graph_vs_eager_b{len(seqs)}"] = graph_vs_eager(dev, rows_for(seqs, [1] * len(seqs)))
            for s in seqs:
                hist[s] += 1
    run.log(
        f"  compat: max |dlogit| {worst:.2e}, graph==eager "
        f"{[rec.get(k, {}).get('same_bucket_bitwise') for k in ('graph_vs_eager_b1', 'graph_vs_eager_b3')]}"
    )


def graph_vs_eager(runner: Any, rows: list) -> dict:
    """One decode step replayed from its graph vs the same step eager, on identical pool contents:
    (a) eager over the same static buffers (same shapes: the bit-for-bit target), (b) the runner's
    eager path over the rows themselves (other shapes: informative)."""
    g = runner.graphs
    bucket = g.bucket(len(rows))
    with torch.inference_mode():
        snapshot = runner.pool.clone()
        graphed = runner.step(rows)
        raw_graph = [o.clone() for o in g.outputs[bucket]]
        pool_graph = runner.pool.clone()
        runner.pool.copy_(snapshot)
        raw_eager = g.forward(bucket)
        same = all(torch.equal(a, b) for a, b in zip(raw_graph, raw_eager)) and torch.equal(pool_graph, runner.pool)
        diffs = [(a.float() - b.float()).abs().max().item() for a, b in zip(raw_graph, raw_eager)]
        runner.pool.copy_(snapshot)
        eager = runner.run_eager(rows)
        live = slice(0, runner.num_pages)  # the spare page also holds the graph's padding rows
        pool_same = torch.equal(pool_graph.view(runner.pages.shape)[:, :, live], runner.pages[:, :, live])
        runner.pool.copy_(pool_graph)
    return {
        "bucket": bucket,
        "same_bucket_bitwise": same,
        "same_bucket_max_abs_diff": max(diffs),
        "rows_eager_logits_bitwise": bool(np.array_equal(graphed.logits, eager.logits)),
        "rows_eager_max_abs_logit_diff": float(np.abs(graphed.logits - eager.logits).max()),
        "rows_eager_pool_bitwise": pool_same,
    }

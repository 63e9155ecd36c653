"""One-shot check of the GPU engine on a CUDA machine (/work/shared/gpu-notes.md, sections 1, 5, 6).

    python scripts/gpu_check.py --out $OUT/gpu_check.json [--deadline 420] [--fixture tests/data/gpu_fixture]
    python scripts/gpu_check.py --cpu-smoke --out /tmp/gpu_smoke.json   # the plumbing, tiny shapes, on a CPU
    python scripts/gpu_check.py --write-fixture tests/data/gpu_fixture   # a ~1 MB fp32 core for phase compat

Phases (each one's results are written to --out as soon as it ends, so a killed run still reports):
  env      versions, GPU, `nvidia-smi -L`, device-to-device copy bandwidth (the bounds' bandwidth)
  kernels  pool_attention_triton vs pool_attention_ref on the device, fp32 and bf16 pools
  compat   the fixture core's torch program (written by CPU torch here) loaded by the device's torch:
           TorchRunner on cuda (graphs) vs on cpu, same rows; graph replay vs eager, bit for bit
  model:*  Qwen2.5-Coder 0.5B / 1.5B shapes, random weights: bf16 export on the machine, parity vs an
           fp32 reference, decode b1/b8 (graph replay alone and through TorchRunner.step), prefill
  peer     transformers Qwen2 + StaticCache + torch.compile(reduce-overhead) decode (gpt-fast's method)
  targets  the issue's targets, met / not met, with the numbers
Every exception is recorded verbatim and the run goes on; past --deadline the remaining phases are
skipped (and say so). No network and no weights are needed: every model is random.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import gc
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a plain script from a copy of the tree

ARGS = argparse.Namespace()
T0 = time.monotonic()


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    hidden: int
    inter: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    max_positions: int = 32768
    theta: float = 1e6


MODELS = [Shape("0.5b", 24, 896, 4864, 14, 2, 64, 151936), Shape("1.5b", 28, 1536, 8960, 12, 2, 128, 151936)]
TINY = Shape("tiny", 2, 64, 128, 4, 2, 16, 1000, max_positions=4096)


@dataclasses.dataclass(frozen=True)
class Plan:
    """Sizes of one run: the device's, or --cpu-smoke's tiny ones."""
    copy_bytes: int = 4 << 30
    matmul: int = 8192
    heads: tuple = ((14, 2, 64), (12, 2, 128), (14, 2, 128), (12, 2, 64))  # the two models first
    decode_hists: tuple = (0, 15, 16, 17, 2000)
    mixed_hists: tuple = (0, 15, 16, 17, 100, 513, 1000, 2000)
    prefill: tuple = ((512, 0), (512, 1000))  # (chunk, history)
    history: int = 512  # decode speed is measured at this history
    steps: int = 256
    prompt: int = 32  # parity: prompt tokens, then `parity_steps` decode steps compared
    parity_steps: int = 256
    chunks: tuple = (512, 2048)
    compile_peer: bool = True
    floor_tokens: int = 32


SMOKE = Plan(copy_bytes=64 << 20, matmul=256, heads=((4, 2, 16),), decode_hists=(0, 16, 17, 40), mixed_hists=(0, 17, 40),
             prefill=((20, 0), (20, 17)), history=40, steps=6, prompt=8, parity_steps=12, chunks=(32, 64),
             compile_peer=False, floor_tokens=4)  # fmt: skip


# -- bookkeeping ------------------------------------------------------------------------------------


def log(msg: str) -> None:
    print(f"[gpu_check {time.monotonic() - T0:6.1f}s] {msg}", flush=True)


def left() -> float:
    return ARGS.deadline - (time.monotonic() - T0)


def error_record(exc: BaseException) -> dict:
    return {"type": type(exc).__name__, "message": str(exc)[:8000],
            "traceback": traceback.format_exc().rstrip().splitlines()[-25:]}  # fmt: skip


class Results:
    """The results file: rewritten whole (atomically) after every phase and sub-step."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict[str, Any] = {"args": vars(ARGS), "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                     "deadline_s": ARGS.deadline, "finished": False, "phases": {}}  # fmt: skip

    def write(self) -> None:
        self.data["elapsed_s"] = round(time.monotonic() - T0, 2)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        temp = self.path.with_name(self.path.name + ".tmp")
        temp.write_text(json.dumps(self.data, indent=1, default=_plain) + "\n")
        os.replace(temp, self.path)

    def phase(self, name: str, fn: Callable[[dict], None], needs_s: float = 0.0) -> None:
        rec: dict[str, Any] = {"status": "running", "started_s": round(time.monotonic() - T0, 2)}
        self.data["phases"][name] = rec
        if needs_s and left() < needs_s:
            rec.update(status="skipped", reason=f"deadline: {left():.0f}s left, the phase needs ~{needs_s:.0f}s")
            log(f"{name}: skipped ({rec['reason']})")
            self.write()
            return
        log(f"{name}: start")
        self.write()
        try:
            fn(rec)
            rec["status"] = "ok" if not rec.get("errors") else "partial"
        except Exception as exc:  # recorded verbatim; the next phase still runs
            rec.update(status="error", error=error_record(exc))
            log(f"{name}: {type(exc).__name__}: {str(exc)[:300]}")
        rec["seconds"] = round(time.monotonic() - T0 - rec["started_s"], 2)
        log(f"{name}: {rec['status']} in {rec['seconds']}s")
        free_memory()
        self.write()


def _plain(o: Any) -> Any:
    return o.tolist() if hasattr(o, "tolist") else str(o)  # numpy / torch values; paths


@contextlib.contextmanager
def attempt(rec: dict, what: str) -> Iterator[None]:
    """A sub-step whose failure is recorded in rec["errors"] without ending the phase."""
    try:
        yield
    except Exception as exc:
        rec.setdefault("errors", []).append({"what": what, **error_record(exc)})
        log(f"  {what}: {type(exc).__name__}: {str(exc)[:300]}")


def free_memory() -> None:
    gc.collect()
    if "torch" in sys.modules and DEVICE == "cuda":
        torch.cuda.empty_cache()


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def device_seconds(fn: Callable[[], Any], reps: int) -> float:
    """Seconds for `reps` calls of fn, measured on the device (CUDA events) after a sync."""
    if DEVICE != "cuda":
        return timed_host(fn, reps)
    sync()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


# -- phase 1: environment ------------------------------------------------------------------------


def phase_env(rec: dict) -> None:
    rec.update(python=platform.python_version(), torch=torch.__version__, cuda=torch.version.cuda, device=DEVICE,
               tf32_matmul=torch.backends.cuda.matmul.allow_tf32, numpy=np.__version__)  # fmt: skip
    for package in ("triton", "transformers", "onnxruntime"):
        try:
            rec[package] = __import__(package).__version__
        except Exception as exc:
            rec[package] = f"missing: {type(exc).__name__}: {exc}"
    if DEVICE == "cuda":
        props = torch.cuda.get_device_properties(0)
        rec.update(gpu=props.name, capability=list(torch.cuda.get_device_capability(0)), sms=props.multi_processor_count,
                   memory_gib=round(props.total_memory / 2**30, 1))  # fmt: skip
    try:
        rec["nvidia_smi"] = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=15).stdout.strip()
    except Exception as exc:
        rec["nvidia_smi"] = f"unavailable: {type(exc).__name__}: {exc}"
    src = torch.empty(PLAN.copy_bytes, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(device_seconds(lambda: dst.copy_(src), 1) for _ in range(5))
    # A copy reads and writes every byte: HBM traffic is twice its size (what a decode step's
    # weight reads are held against).
    rec.update(copy_bytes=PLAN.copy_bytes, copy_seconds=best, bandwidth_GBps=round(2 * PLAN.copy_bytes / best / 1e9, 1))
    del src, dst
    n = PLAN.matmul  # prefill is compute-bound: held against what a plain bf16 matmul reaches here
    a = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16)
    a @ a
    rec["matmul_bf16_tflops"] = round(2 * n**3 * 5 / device_seconds(lambda: a @ a, 5) / 1e12, 1)


# -- phase 2: kernel parity ---------------------------------------------------------------------------

KERNEL_BUDGET_S = 45  # the two real head shapes first; the cross shapes only while this lasts


def attention_case(heads: int, kvh: int, dim: int, hists: list[int], length: int, dtype: torch.dtype, seed: int) -> dict:
    """pool_attention_triton vs pool_attention_ref (fp32, of the same rounded values) on one case."""
    from helios.kernels.torch_ops import pool_attention_ref
    from helios.kernels.triton_attention import pool_attention_triton
    from ignition.models.blocks.rotary import Rotary

    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    tokens, layers, layer, batch = 16, 2, 1, len(hists)
    cols = max(1, -(-max(hists) // tokens))
    pages = batch * cols + 1
    tables = torch.randperm(pages, generator=gen, device=DEVICE)[: batch * cols].reshape(batch, cols)
    # std 0.5: bf16's half-ulp stays below the tolerance for every value drawn
    pool = (torch.randn(layers * 2 * pages, tokens, kvh, dim, generator=gen, device=DEVICE) * 0.5).to(dtype)
    qkv = (torch.randn(batch, length, (heads + 2 * kvh) * dim, generator=gen, device=DEVICE) * 0.5).to(dtype)
    hist = torch.tensor(hists, device=DEVICE)
    qlens = torch.full((batch,), length, device=DEVICE)
    positions = hist[:, None] + torch.arange(length, device=DEVICE)
    rotary = Rotary(dim, 1e6, max(hists) + length + 1)
    cos, sin = rotary.cos_cache.to(DEVICE, dtype), rotary.sin_cache.to(DEVICE, dtype)
    args = (positions, cos, sin, pool, tables, hist, qlens, layer, layers, heads, kvh, 1 / math.sqrt(dim))
    started = time.perf_counter()
    got = pool_attention_triton(qkv, *args)
    sync()
    seconds = time.perf_counter() - started
    ref = pool_attention_ref(qkv.float(), positions, cos.float(), sin.float(), pool.float(), *args[4:])
    errors = {name: (a.float() - b).abs().max().item() for name, a, b in zip(("out", "k", "v"), got, ref)}
    res = {"max_abs_error": errors, "first_call_s": round(seconds, 3)}
    # The kernel promises the same bits from its split-K and fused paths (batch invariance); the
    # interpreter is slow, so the smoke checks it once.
    if length == 1 and (DEVICE == "cuda" or hists == [max(PLAN.decode_hists)]):
        paths = [pool_attention_triton(qkv, *args, split=split)[0] for split in (True, False)]
        res["split_equals_fused"] = torch.equal(*paths)
    return res


def phase_kernels(rec: dict) -> None:
    if DEVICE == "cpu":
        rec["note"] = "cpu-smoke: Triton interpreter (TRITON_INTERPRET=1), tiny shapes"
    cases = []
    for heads, kvh, dim in PLAN.heads:
        for batch in (1, 8 if DEVICE == "cuda" else 3):
            cases += [(f"decode B={batch} hist={h}", heads, kvh, dim, [h] * batch, 1) for h in PLAN.decode_hists]
        cases.append((f"decode mixed hist={list(PLAN.mixed_hists)}", heads, kvh, dim, list(PLAN.mixed_hists), 1))
        cases += [(f"prefill L={chunk} hist={h}", heads, kvh, dim, [h], chunk) for chunk, h in PLAN.prefill]
    rec["cases"], started = [], time.monotonic()
    for i, (name, heads, kvh, dim, hists, length) in enumerate(cases):
        for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
            if time.monotonic() - started > KERNEL_BUDGET_S or left() < 240:  # the models need the time more
                rec["skipped_cases"] = rec.get("skipped_cases", 0) + 1
                continue
            case = {"case": name, "heads": [heads, kvh, dim], "dtype": str(dtype).removeprefix("torch."), "tol": tol}
            rec["cases"].append(case)
            with attempt(rec, f"{name} {case['heads']} {case['dtype']}"):
                case.update(attention_case(heads, kvh, dim, hists, length, dtype, seed=i))
                case["pass"] = max(case["max_abs_error"].values()) <= tol and case.get("split_equals_fused", True)
    done = [c for c in rec["cases"] if "pass" in c]
    rec["passed"] = sum(c["pass"] for c in done)
    rec["failed"] = [f"{c['case']} {c['heads']} {c['dtype']}: {c['max_abs_error']}" for c in done if not c["pass"]]
    log(f"  kernels: {rec['passed']}/{len(rec['cases'])} pass, {len(rec.get('errors', []))} errors")


# -- model helpers ----------------------------------------------------------------------------------------


def random_model(shape: Shape, device: str, seed: int = 0) -> Any:
    """The flare qwen2 step module with random fp32 weights on `device`: N(0, 0.02) like HF's init,
    norms at 1, embeddings tied as in both real checkpoints. Built on meta, filled on the device."""
    from helios.manifest import Architecture
    from ignition.models.qwen2 import Qwen2ForCausalLM

    arch = Architecture(family="qwen2", num_layers=shape.layers, hidden_size=shape.hidden, intermediate_size=shape.inter,
                        num_heads=shape.heads, num_kv_heads=shape.kv_heads, head_dim=shape.head_dim,
                        vocab_size=shape.vocab, rope_theta=shape.theta, rms_norm_eps=1e-6,
                        max_position_embeddings=shape.max_positions, tie_word_embeddings=True, attention_bias=True)  # fmt: skip
    with torch.device("meta"):
        model = Qwen2ForCausalLM(arch)
    model = model.to_empty(device=device)
    model.lm_head.weight = model.embed_tokens.weight
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=gen)
    model.rotary.reset_parameters()  # computed tables (meta -> empty left them unset)
    return model.to(device).eval().requires_grad_(False)


def export_core(model: Any, shape: Shape, folder: Path, dtype: str, max_batch: int) -> tuple[Any, float]:
    """Export the model's torch program (dtype) into `folder` with a minimal core.json; returns
    (manifest, export seconds). The program is traced on the CPU, as ignition does."""
    from helios.manifest import (Identity, KVLayout, Limits, Logprobs, Manifest, Parsers, Sampling, SamplingDefaults,
                                 TemplateSpec, TokenizerSpec)  # fmt: skip
    from ignition.export.torch_program import TORCH_DTYPES, export_torch_program

    arch = model.arch
    kv = KVLayout(page_tokens=16, num_layers=shape.layers, kv_heads=shape.kv_heads, head_dim=shape.head_dim)
    started = time.perf_counter()
    cpu_model = copy.deepcopy(model).to("cpu", TORCH_DTYPES[dtype])
    engine = export_torch_program(cpu_model, arch, kv, folder, dtype=dtype)
    seconds = time.perf_counter() - started
    del cpu_model
    weight_bytes = sum(p.numel() for p in model.parameters()) * (2 if dtype == "bfloat16" else 4)
    manifest = Manifest(
        identity=Identity(recipe="gpu-check", checkpoint_id=f"random-qwen2-{shape.name}", checkpoint_sha256=""),
        architecture=arch, precision=dtype, kv=dataclasses.replace(kv, dtype=dtype), engines=[engine],
        limits=Limits(context_length=shape.max_positions, max_concurrency=max_batch, prefill_chunk_size=2048,
                      max_batch_tokens=8192, default_max_tokens=256, kv_pages=1024),
        tokenizer=TokenizerSpec(file="tokenizer.json", bos_token_id=None, eos_token_ids=[], pad_token_id=None,
                                add_bos=False),
        template=TemplateSpec(file=None), sampling=Sampling(defaults=SamplingDefaults()), parsers=Parsers(),
        logprobs=Logprobs(max_top_logprobs=20, explicit_token_ids=True, prompt_logprobs=False),
        decode_weight_bytes=weight_bytes,
    )  # fmt: skip
    manifest.save(folder)
    return manifest, seconds


def make_runner(core: Path, manifest: Any, num_pages: int, device: str, graphs: bool, max_batch: int) -> Any:
    from helios.engine.torch_runner import TorchRunner

    return TorchRunner(core, manifest, num_pages, device=device, graphs=graphs, max_batch=max_batch)


def reference_attention_if_no_kernel() -> str | None:
    """If no Triton kernel ran in phase kernels, flare::pool_attention keeps its reference on CUDA
    (load_step_program registers the kernel; this makes that a no-op), so the later phases still
    check loading, graphs and parity, and measure everything but attention. Returns why, if so."""
    kernels = RESULTS.data["phases"].get("kernels", {})
    if DEVICE != "cuda" or any("pass" in c for c in kernels.get("cases", [])) or kernels.get("status") == "skipped":
        return None
    import types

    stub = types.ModuleType("helios.kernels.triton_attention")
    stub.register_cuda_kernel = lambda: None  # type: ignore[attr-defined]
    try:
        import helios.kernels.triton_attention as module

        module.register_cuda_kernel = stub.register_cuda_kernel
    except Exception:  # triton itself is missing or broken
        sys.modules[stub.__name__] = stub
    return "no Triton kernel ran in phase kernels: pool_attention runs its torch reference on CUDA"


# -- phase 3: compatibility of a CPU-written program ------------------------------------------------------


def phase_compat(rec: dict) -> None:
    from helios.engine.step_io import StepRow
    from helios.manifest import Manifest

    rec["tf32"] = "off (torch.backends.cuda.matmul.allow_tf32 = False for the whole run)"
    fixture = Path(ARGS.fixture)
    if (fixture / "core.json").is_file():
        core, manifest = fixture, Manifest.load(fixture, verify_files=False)  # the ONNX files may stay behind
        rec["fixture"] = str(fixture)
    else:  # still check CPU vs GPU and graphs, on a program written here; the 2.13 -> device check is then missing
        core = Path(TMP) / "fixture"
        manifest = write_fixture(core)
        rec["fixture"] = f"MISSING {fixture}: used a tiny float32 program exported by this torch instead"
    engine = manifest.engine("step", "cuda")
    rec.update(written_by_torch=engine.torch_version, program_dtype=engine.dtype, loading_torch=torch.__version__,
               program_bytes=(core / engine.file).stat().st_size)  # fmt: skip
    from helios.engine.torch_runner import load_step_program

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:  # the question of this phase: does a program written by the CPU torch load in this one
            load_step_program(core / engine.file, torch.device(DEVICE))
        except Exception as exc:
            rec["load_error"] = error_record(exc)
            raise
    rec.update(loaded=True, load_warnings=sorted({str(w.message)[:500] for w in caught}))
    dev = make_runner(core, manifest, 64, DEVICE, graphs=True, max_batch=4)
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
        rec["steps"].append({"rows": len(rows), "tokens": lengths, "max_abs_logit_diff": float(np.abs(a.logits - b.logits).max()),
                             "top1_equal": bool((a.top_ids[:, 0] == b.top_ids[:, 0]).all())})  # fmt: skip
        for s, n in zip(seqs, lengths):
            hist[s] += n
    worst = max(s["max_abs_logit_diff"] for s in rec["steps"])
    rec.update(max_abs_logit_diff=worst, cpu_vs_device_pass=worst <= 1e-4)
    if dev.graphs is not None:
        for seqs in ([0], [0, 1, 2]):
            rec[f"graph_vs_eager_b{len(seqs)}"] = graph_vs_eager(dev, rows_for(seqs, [1] * len(seqs)))
            for s in seqs:
                hist[s] += 1
    log(f"  compat: max |dlogit| {worst:.2e}, graph==eager "
        f"{[rec.get(k, {}).get('same_bucket_bitwise') for k in ('graph_vs_eager_b1', 'graph_vs_eager_b3')]}")


def write_fixture(folder: Path) -> Any:
    """The tiny random qwen2 (vocab 1000: a ~1 MB program) as a float32 core folder: core.json +
    step.cuda.pt2, written by this torch (`--write-fixture`: what phase compat loads on the device)."""
    return export_core(random_model(TINY, "cpu"), TINY, folder, "float32", max_batch=4)[0]


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
        eager = runner._run_eager(rows)
        live = slice(0, runner.num_pages)  # the spare page also holds the graph's padding rows
        pool_same = torch.equal(pool_graph.view(runner.pages.shape)[:, :, live], runner.pages[:, :, live])
        runner.pool.copy_(pool_graph)
    return {"bucket": bucket, "same_bucket_bitwise": same, "same_bucket_max_abs_diff": max(diffs),
            "rows_eager_logits_bitwise": bool(np.array_equal(graphed.logits, eager.logits)),
            "rows_eager_max_abs_logit_diff": float(np.abs(graphed.logits - eager.logits).max()),
            "rows_eager_pool_bitwise": pool_same}  # fmt: skip


# -- phase 4: the real shapes -----------------------------------------------------------------------------

PEAK_BF16_TFLOPS = 790.0  # an 8k bf16 matmul on this H200 (KINDS.md), if phase env did not measure it


def phase_model(shape: Shape, rec: dict) -> None:
    from helios.engine.step_io import StepRow

    folder = Path(TMP) / f"core-{shape.name}"
    model = random_model(shape, DEVICE)
    params = sum(p.numel() for p in model.parameters())
    manifest, rec["export_s"] = export_core(model, shape, folder, "bfloat16", max_batch=8)
    rec.update(params=params, program_bytes=(folder / manifest.engines[0].file).stat().st_size,
               program_dtype=manifest.engines[0].dtype)  # fmt: skip
    log(f"  {shape.name}: exported in {rec['export_s']:.1f}s")
    seqs = 10  # 0-7: b8, 8: b1, 9: parity; then the prefill scratch pages
    per_seq = -(-(max(PLAN.history + 2 * PLAN.steps + 64, PLAN.prompt + PLAN.parity_steps + 1)) // 16)
    num_pages = seqs * per_seq + -(-max(PLAN.chunks) // 16)
    started = time.perf_counter()
    runner = make_runner(folder, manifest, num_pages, DEVICE, graphs=True, max_batch=8)
    rec.update(runner_init_s=round(time.perf_counter() - started, 2), num_pages=num_pages,
               buckets=runner.graphs.buckets, cuda_graphs=DEVICE == "cuda")  # fmt: skip
    log(f"  {shape.name}: runner (load + capture) in {rec['runner_init_s']}s")
    tables = [list(range(s * per_seq, (s + 1) * per_seq)) for s in range(seqs)]
    scratch = list(range(seqs * per_seq, num_pages))
    rng = np.random.default_rng(1)
    with attempt(rec, "parity"):
        rec["parity"] = parity(model, runner, tables[9], rng, shape.vocab)
        log(f"  {shape.name}: parity {rec['parity']}")
    del model
    free_memory()
    RESULTS.write()
    bw = RESULTS.data["phases"].get("env", {}).get("bandwidth_GBps")
    weight_bytes, kv_token = manifest.decode_weight_bytes, 2 * shape.layers * shape.kv_heads * shape.head_dim * 2
    rec.update(decode_weight_bytes=weight_bytes, kv_bytes_per_token=kv_token, bandwidth_GBps=bw)
    hist = [0] * seqs
    tokens = [0] * seqs
    with attempt(rec, "prefill"):
        for s in range(9):  # every decode sequence gets its history (the first call also warms up)
            out = runner.step([StepRow(rng.integers(0, shape.vocab, PLAN.history).tolist(), 0, tables[s])])
            hist[s], tokens[s] = PLAN.history, int(out.top_ids[0, 0])
        for chunk in PLAN.chunks:
            row = StepRow(rng.integers(0, shape.vocab, chunk).tolist(), 0, scratch)
            warm = timed_host(lambda: runner.step([row]), 1)  # the prefill kernels of this shape compile
            reps = min(3, affordable(warm, 3, 0.02))
            seconds = timed_host(lambda: runner.step([row]), reps)
            rec[f"prefill_{chunk}_tok_s"] = round(chunk * reps / seconds)
            # lm_head runs on the last token only: a prefill token costs the non-embedding matmuls
            tflops = chunk * reps / seconds * 2 * (params - shape.vocab * shape.hidden) / 1e12
            rec[f"prefill_{chunk}_tflops"] = round(tflops, 1)
            peak = RESULTS.data["phases"].get("env", {}).get("matmul_bf16_tflops") or PEAK_BF16_TFLOPS
            rec[f"prefill_{chunk}_of_matmul_peak"] = round(tflops / peak, 3)
        RESULTS.write()
    for batch, first in ((1, 8), (8, 0)):
        with attempt(rec, f"decode b{batch}"):
            rec[f"decode_b{batch}"] = decode_speed(runner, list(range(first, first + batch)), tables, hist, tokens, bw,
                                                   weight_bytes, kv_token)  # fmt: skip
            log(f"  {shape.name}: decode b{batch} {rec[f'decode_b{batch}']}")
            RESULTS.write()
    with attempt(rec, "eager decode b1"):  # the same steps without graphs: what capture buys
        steps = min(32, PLAN.steps)
        rows = lambda: [StepRow([tokens[8]], hist[8], tables[8])]  # noqa: E731
        seconds = timed_host(lambda: runner._run_eager(rows()), steps)
        rec["eager_b1_tok_s"] = round(steps / seconds, 1)
    if "decode_b1" in rec and "decode_b8" in rec:
        rec["b8_over_b1"] = round(rec["decode_b8"]["runner_tok_s"] / rec["decode_b1"]["runner_tok_s"], 2)
    del runner
    shutil.rmtree(folder, ignore_errors=True)  # a 1.5B program is 3 GB of a 64 GiB disk


def affordable(seconds_per_call: float, wanted: int, share: float = 0.08) -> int:
    """How many of `wanted` calls fit in `share` of the time left (at least 8): a slow path still ends."""
    return max(8, min(wanted, int(share * max(left(), 0.0) / max(seconds_per_call, 1e-6))))


def timed_host(fn: Callable[[], Any], reps: int) -> float:
    """Wall seconds of `reps` calls, host work included (every runner step ends in a D2H copy)."""
    sync()
    started = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return time.perf_counter() - started


def parity(model: Any, runner: Any, table: list[int], rng: Any, vocab: int) -> dict:
    """Our bf16 program's last-position logprobs (a prompt, then decode steps through the runner's
    graphs) vs the fp32 model's at the same positions (one full-sequence forward, plain-torch ops)."""
    from helios.engine.step_io import StepRow

    prompt, steps = PLAN.prompt, PLAN.parity_steps
    ids = rng.integers(0, vocab, prompt + steps).tolist()
    runner.step([StepRow(ids[:prompt], 0, table)])
    ours = []
    for i in range(steps):
        out = runner.step([StepRow([ids[prompt + i]], prompt + i, table)])
        ours.append(out.logits[0] - out.logsumexp[0])
    ours_lp = torch.from_numpy(np.stack(ours)).to(DEVICE)
    arch = model.arch
    n_tok = prompt + steps
    with torch.no_grad():
        inputs = (torch.tensor([ids], device=DEVICE), torch.arange(n_tok, device=DEVICE)[None], torch.zeros(1, dtype=torch.int64, device=DEVICE),
                  torch.tensor([n_tok], device=DEVICE), torch.zeros(1, 1, dtype=torch.int64, device=DEVICE),
                  torch.zeros(arch.num_layers * 2, 16, arch.num_kv_heads, arch.head_dim, device=DEVICE),
                  torch.zeros(1, 1, dtype=torch.int64, device=DEVICE), torch.zeros(steps, dtype=torch.int64, device=DEVICE),
                  torch.arange(prompt, n_tok, device=DEVICE))  # fmt: skip
        ref_lp = torch.log_softmax(model(*inputs)[0].float(), dim=-1)
    top_ref = ref_lp.topk(20, dim=-1)
    ours_at_top = ours_lp.gather(1, top_ref.indices)
    dlp = (ours_at_top - top_ref.values).abs().amax(1)
    agree = ours_lp.argmax(1) == top_ref.indices[:, 0]
    margin = top_ref.values[:, 0] - top_ref.values[:, 1]
    kl = (ref_lp.exp() * (ref_lp - ours_lp)).sum(1)
    decided = margin > 4e-2  # positions whose top-1 is not a near tie at the logprob tolerance
    return {"positions": steps, "top1_agreement": agree.float().mean().item(),
            "top1_agreement_margin_gt_4e-2": agree[decided].float().mean().item() if decided.any() else None,
            "max_abs_dlogprob_top20": dlp.max().item(), "mean_abs_dlogprob_top20": dlp.mean().item(),
            "mean_kl": kl.mean().item(), "median_top1_margin": margin.median().item(),
            "ref_top1_logprob_mean": top_ref.values[:, 0].mean().item()}  # fmt: skip


def decode_speed(runner: Any, seqs: list[int], tables: list, hist: list, tokens: list, bw: float | None,
                 weight_bytes: int, kv_token: int) -> dict:  # fmt: skip
    """Greedy decode of `seqs` through TorchRunner.step (host work included), then the same
    bucket's graph replayed alone in a loop (CUDA events), both against the bandwidth bound."""
    from helios.engine.step_io import StepRow

    def step() -> None:
        out = runner.step([StepRow([tokens[s]], hist[s], tables[s]) for s in seqs])
        for i, s in enumerate(seqs):
            tokens[s], hist[s] = int(out.top_ids[i, 0]), hist[s] + 1

    step()  # the first replay of this bucket
    steps = affordable(timed_host(step, 2) / 2, PLAN.steps)
    batch = len(seqs)
    start_hist = hist[seqs[0]]
    runner_s = timed_host(step, steps)
    replay = runner.graphs.replays[runner.graphs.bucket(batch)]
    replay_s = device_seconds(replay, steps)
    res = {"steps": steps, "history_start": start_hist, "runner_tok_s": round(batch * steps / runner_s, 1),
           "replay_tok_s": round(batch * steps / replay_s, 1),
           "host_us_per_step": round((runner_s - replay_s) / steps * 1e6, 1)}  # fmt: skip
    if bw:
        context = start_hist + steps // 2
        bound = batch * bw * 1e9 / (weight_bytes + batch * context * kv_token)
        res.update(bound_tok_s=round(bound, 1), runner_of_bound=round(res["runner_tok_s"] / bound, 3),
                   replay_of_bound=round(res["replay_tok_s"] / bound, 3))  # fmt: skip
    return res


# -- phase 5: the transformers peer ------------------------------------------------------------------------


def hf_model(shape: Shape) -> Any:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    kw = dict(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.inter,
              num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
              max_position_embeddings=shape.max_positions, tie_word_embeddings=True, rms_norm_eps=1e-6)  # fmt: skip
    try:  # transformers 5 names rope settings rope_parameters, 4.x takes rope_theta
        config = Qwen2Config(**kw, rope_parameters={"rope_type": "default", "rope_theta": shape.theta})
    except TypeError:
        config = Qwen2Config(**kw, rope_theta=shape.theta)
    config._attn_implementation = "sdpa"
    with torch.device(DEVICE):
        model = Qwen2ForCausalLM(config)  # HF's own init (N(0, 0.02)), on the device
    return model.to(DEVICE, torch.bfloat16).eval().requires_grad_(False)


def static_cache(model: Any, batch: int, length: int) -> Any:
    import inspect

    from transformers import StaticCache

    params = inspect.signature(StaticCache.__init__).parameters
    kw: dict[str, Any] = {"config": model.config, "max_cache_len": length}
    kw.update({k: v for k, v in (("max_batch_size", batch), ("device", DEVICE), ("dtype", torch.bfloat16)) if k in params})
    return StaticCache(**kw)


def peer_decode(model: Any, batch: int) -> dict:
    """gpt-fast's loop: eager prefill into a StaticCache, then one-token steps through
    torch.compile(mode="reduce-overhead", fullgraph=True) (CUDA graphs), argmax on the device."""
    steps, history = PLAN.steps, PLAN.history
    cache = static_cache(model, batch, history + steps + 8)
    prompt = torch.randint(0, model.config.vocab_size, (batch, history), device=DEVICE)
    torch._dynamo.reset()
    with torch.no_grad():
        out = model(input_ids=prompt, past_key_values=cache, cache_position=torch.arange(history, device=DEVICE), use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        position = torch.tensor([history], device=DEVICE)

        def one(token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
            logits = model(input_ids=token, past_key_values=cache, cache_position=position, use_cache=True).logits
            return logits[:, -1:].argmax(-1)

        res: dict[str, Any] = {"batch": batch, "history_start": history}
        # cpu-smoke: dynamo's capture only (no Inductor build on 2 cores)
        options = {"mode": "reduce-overhead"} if PLAN.compile_peer else {"backend": "eager"}
        started = time.perf_counter()
        for fullgraph in (True, False):  # a graph break is recorded, then compiled around
            try:
                step = torch.compile(one, fullgraph=fullgraph, dynamic=False, **options)
                for _ in range(3):  # compile, record, replay
                    token = step(token, position).clone()  # clone: the next replay overwrites the output
                    position += 1
                break
            except Exception as exc:
                if not fullgraph:
                    raise
                res["fullgraph_error"] = error_record(exc)
                torch._dynamo.reset()
        sync()
        res.update(compile=f"{options}, fullgraph={fullgraph}", compile_s=round(time.perf_counter() - started, 1))
        with contextlib.suppress(Exception):  # > 0: Inductor ran this step without CUDA graphs (a mutated input, ...)
            from torch._dynamo.utils import counters

            res["cudagraph_skips"] = counters["inductor"]["cudagraph_skips"]

        def decode() -> None:
            nonlocal token
            token = step(token, position).clone()
            position.add_(1)

        steps = affordable(timed_host(decode, 2) / 2, steps)
        seconds = timed_host(decode, steps)
    res.update(steps=steps, tok_s=round(batch * steps / seconds, 1))
    return res


def peer_floor(model: Any) -> dict:
    """HF eager `generate` (dynamic cache, no compile) at b=1: prefill subtracted."""
    n = PLAN.floor_tokens
    prompt = torch.randint(0, model.config.vocab_size, (1, PLAN.history), device=DEVICE)

    def gen(k: int) -> float:
        return timed_host(lambda: model.generate(prompt, max_new_tokens=k, min_new_tokens=k, do_sample=False,
                                                 pad_token_id=0), 1)  # fmt: skip

    gen(2)  # warm-up
    seconds = gen(n) - gen(1)
    return {"tokens": n, "tok_s": round((n - 1) / seconds, 1)}


def phase_peer(rec: dict) -> None:
    warnings.filterwarnings("ignore", message=".*past_key_values.*")  # deprecated in transformers 5.2x, kept for 4.x
    import transformers

    rec["transformers"] = transformers.__version__
    shapes = {s.name: s for s in MODELS} if DEVICE == "cuda" else {"tiny": TINY}
    wanted = ARGS.peer_models.split(",") if DEVICE == "cuda" else ["tiny"]
    for name in wanted:
        shape, res = shapes[name], {}
        rec[name] = res
        if left() < 40:
            res["skipped"] = f"deadline: {left():.0f}s left"
            continue
        with attempt(res, "build"):
            model = hf_model(shape)
            for batch in (1, 8):
                if left() < 35:
                    res[f"b{batch}"] = {"skipped": f"deadline: {left():.0f}s left"}
                    continue
                with attempt(res, f"b{batch}"):
                    res[f"b{batch}"] = peer_decode(model, batch)
                    log(f"  peer {name} b{batch}: {res[f'b{batch}']}")
                RESULTS.write()
            if left() > 20:
                with attempt(res, "eager generate"):
                    res["eager_generate_b1"] = peer_floor(model)
            del model
            torch._dynamo.reset()
            free_memory()
        ours = RESULTS.data["phases"].get(f"model:{name}", {})
        for batch in (1, 8):
            mine, theirs = ours.get(f"decode_b{batch}", {}), res.get(f"b{batch}", {})
            if "runner_tok_s" in mine and "tok_s" in theirs:
                res[f"ours_over_peer_b{batch}"] = round(mine["runner_tok_s"] / theirs["tok_s"], 2)
        RESULTS.write()
    if any(r.get("errors") for r in rec.values() if isinstance(r, dict)):
        rec["errors"] = [e for r in rec.values() if isinstance(r, dict) for e in r.get("errors", [])]


# -- targets -------------------------------------------------------------------------------------------


def phase_targets(rec: dict) -> None:
    phases = RESULTS.data["phases"]
    compat = phases.get("compat", {})
    main = "1.5b" if DEVICE == "cuda" else "tiny"
    model = phases.get(f"model:{main}", {})
    peer = phases.get("peer", {}).get(main, {})

    def target(value: Any, threshold: float, what: str, higher: bool = True) -> dict:
        met = None if value is None else (value >= threshold if higher else value <= threshold)
        return {"met": met, "value": value, "threshold": threshold, "what": what}

    out: dict[str, Any] = {}
    for name in [s.name for s in MODELS] if DEVICE == "cuda" else ["tiny"]:
        p = phases.get(f"model:{name}", {}).get("parity", {})
        out[f"parity_{name}_dlogprob"] = target(p.get("max_abs_dlogprob_top20"), 2e-2, "max |dlogprob| over the fp32 top-20", False)
        out[f"parity_{name}_top1"] = target(p.get("top1_agreement"), 0.99, f"top-1 agreement over {p.get('positions')} positions")
    bitwise = [compat.get(k, {}).get("same_bucket_bitwise") for k in ("graph_vs_eager_b1", "graph_vs_eager_b3")]
    out["graph_equals_eager"] = {"met": None if None in bitwise else all(bitwise), "value": bitwise,
                                 "what": "graph replay == eager step on the same buffers, bit for bit (b1, b3)"}  # fmt: skip
    b1, b8 = model.get("decode_b1", {}), model.get("decode_b8", {})
    out["b1_runner_of_bound"] = target(b1.get("runner_of_bound"), 0.60, f"{main} b1 through TorchRunner.step / bound")
    out["b1_replay_of_bound"] = target(b1.get("replay_of_bound"), 0.75, f"{main} b1 graph replay alone / bound")
    out["b1_over_peer"] = target(peer.get("ours_over_peer_b1"), 1.2, f"{main} b1 ours / compiled transformers")
    out["b8_over_our_b1"] = target(model.get("b8_over_b1"), 4.0, f"{main} b8 / b1, both through the runner")
    out["b8_over_peer"] = target(peer.get("ours_over_peer_b8"), 1.5, f"{main} b8 ours / compiled transformers")
    out["prefill_2048"] = target(model.get(f"prefill_{max(PLAN.chunks)}_tok_s"), 60000, f"{main} prefill tok/s, one chunk")
    rec["targets"] = out
    peer_all = phases.get("peer", {})
    rec["peer_ratios"] = {k: {r: v[r] for r in ("ours_over_peer_b1", "ours_over_peer_b8") if r in v}
                          for k, v in peer_all.items() if isinstance(v, dict)}  # every model the peer reached
    rec["met"] = sorted(k for k, v in out.items() if v["met"] is True)
    rec["not_met"] = sorted(k for k, v in out.items() if v["met"] is False)
    rec["not_measured"] = sorted(k for k, v in out.items() if v["met"] is None)
    if DEVICE == "cpu":
        rec["note"] = "cpu-smoke: tiny shapes on a CPU; the numbers say nothing about the GPU"
    log(f"  targets met {rec['met']}, not met {rec['not_met']}, not measured {rec['not_measured']}")


# -- main ------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    global ARGS, PLAN, TMP, DEVICE, torch, np
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("gpu_check.json"))
    parser.add_argument("--deadline", type=float, default=420.0, help="seconds; later phases are skipped past it")
    parser.add_argument("--fixture", default=str(ROOT / "tests" / "data" / "gpu_fixture"))
    parser.add_argument("--cpu-smoke", action="store_true", help="every phase on the CPU with tiny shapes")
    parser.add_argument("--phases", default="env,kernels,compat,model,peer", help="comma-separated subset")
    parser.add_argument("--peer-models", default="0.5b,1.5b", help="peer models, in order (time allowing)")
    parser.add_argument("--write-fixture", type=Path, help="only write the compat phase's fixture core there")
    ARGS = parser.parse_args(argv)
    TMP = tempfile.mkdtemp(prefix="gpu_check_")
    # Compiled kernels go to a scratch folder: nothing is reused from, or left for, another run.
    os.environ["TRITON_CACHE_DIR"] = os.path.join(TMP, "triton")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(TMP, "inductor")
    if ARGS.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # read when @triton.jit decorates: before helios' kernels import
    import numpy as np
    import torch

    PLAN = SMOKE if ARGS.cpu_smoke else Plan()
    DEVICE = "cpu" if ARGS.cpu_smoke or ARGS.write_fixture else "cuda"
    try:
        return run_phases()
    finally:
        shutil.rmtree(TMP, ignore_errors=True)


def run_phases() -> int:
    global RESULTS
    if ARGS.write_fixture:
        manifest = write_fixture(ARGS.write_fixture)
        log(f"wrote {ARGS.write_fixture} (torch {manifest.engines[0].torch_version})")
        return 0
    RESULTS = Results(ARGS.out)
    if DEVICE == "cpu":
        torch.set_num_threads(1)  # tiny shapes: threads only add spin-waits on a shared 2-core machine
    try:  # fp32 comparisons mean fp32 (the bf16 program is unaffected)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")
    except Exception as exc:
        RESULTS.data["tf32_error"] = error_record(exc)
    if DEVICE == "cuda" and not torch.cuda.is_available():
        RESULTS.data["fatal"] = "torch.cuda.is_available() is False (use --cpu-smoke on a machine without a GPU)"
        RESULTS.write()
        log(RESULTS.data["fatal"])
        return 2
    wanted = set(ARGS.phases.split(","))
    phases: list[tuple[str, Callable[[dict], None], float]] = [
        ("env", phase_env, 0), ("kernels", phase_kernels, 30), ("compat", phase_compat, 20)]
    for shape in MODELS if DEVICE == "cuda" else [TINY]:
        phases.append((f"model:{shape.name}", lambda rec, s=shape: phase_model(s, rec), 45))
    phases.append(("peer", phase_peer, 40))
    for name, fn, needs in phases:
        if name.split(":")[0] in wanted:
            RESULTS.phase(name, fn, needs)
        if name == "kernels" and name in wanted and (why := reference_attention_if_no_kernel()):
            RESULTS.data["attention_fallback"] = why
            log(why)
    RESULTS.phase("targets", phase_targets)
    RESULTS.data["finished"] = True
    RESULTS.write()
    log(f"done: {ARGS.out}")
    return 0


PLAN: Plan
TMP: str
DEVICE = "cpu"
RESULTS: Results
torch: Any = None
np: Any = None

if __name__ == "__main__":
    sys.exit(main())

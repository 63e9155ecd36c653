"""scripts/gpu_check.py's bookkeeping, shared by every phase: the shapes and sizes of a run, the
run's context (`Run`: settings, clock, device, results file), timing helpers and the model helpers
that more than one phase uses.

Project imports (helios, ignition) stay inside the functions that use them, as in every gpu_check
module: a missing or broken dependency then fails its phase, recorded, instead of the whole run.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import gc
import json
import os
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch


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


SMOKE = Plan(
    copy_bytes=64 << 20,
    matmul=256,
    heads=((4, 2, 16),),
    decode_hists=(0, 16, 17, 40),
    mixed_hists=(0, 17, 40),
    prefill=((20, 0), (20, 17)),
    history=40,
    steps=6,
    prompt=8,
    parity_steps=12,
    chunks=(32, 64),
    compile_peer=False,
    floor_tokens=4,
)


# -- bookkeeping ------------------------------------------------------------------------------------

Phase = Callable[["Run", dict], None]  # fills its record (rec) in place


def error_record(exc: BaseException) -> dict:
    return {
        "type": type(exc).__name__,
        "message": str(exc)[:8000],
        "traceback": traceback.format_exc().rstrip().splitlines()[-25:],
    }


@dataclasses.dataclass
class Run:
    """One run's settings and state, handed to every phase (in place of module globals)."""

    args: argparse.Namespace
    plan: Plan
    device: str  # "cuda"; "cpu" under --cpu-smoke and --write-fixture
    tmp: Path  # scratch folder of this run, removed at its end
    t0: float  # time.monotonic() at start: log times, elapsed_s and --deadline count from it
    results: Results = dataclasses.field(init=False, repr=False)  # set once the run writes a results file

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def log(self, msg: str) -> None:
        print(f"[gpu_check {self.elapsed():6.1f}s] {msg}", flush=True)

    def left(self) -> float:
        return self.args.deadline - self.elapsed()

    @contextlib.contextmanager
    def attempt(self, rec: dict, what: str) -> Iterator[None]:
        """A sub-step whose failure is recorded in rec["errors"] without ending the phase."""
        try:
            yield
        except Exception as exc:
            rec.setdefault("errors", []).append({"what": what, **error_record(exc)})
            self.log(f"  {what}: {type(exc).__name__}: {str(exc)[:300]}")

    def free_memory(self) -> None:
        gc.collect()
        if self.device == "cuda":
            torch.cuda.empty_cache()

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def device_seconds(self, fn: Callable[[], Any], reps: int) -> float:
        """Seconds for `reps` calls of fn, measured on the device (CUDA events) after a sync."""
        if self.device != "cuda":
            return self.timed_host(fn, reps)
        self.sync()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def timed_host(self, fn: Callable[[], Any], reps: int) -> float:
        """Wall seconds of `reps` calls, host work included (every runner step ends in a D2H copy)."""
        self.sync()
        started = time.perf_counter()
        for _ in range(reps):
            fn()
        self.sync()
        return time.perf_counter() - started

    def affordable(self, seconds_per_call: float, wanted: int, share: float = 0.08) -> int:
        """How many of `wanted` calls fit in `share` of the time left (at least 8): a slow path still ends."""
        return max(8, min(wanted, int(share * max(self.left(), 0.0) / max(seconds_per_call, 1e-6))))


class Results:
    """The results file (--out): rewritten whole (atomically) after every phase and sub-step."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.path: Path = run.args.out
        self.data: dict[str, Any] = {
            "args": vars(run.args),
            "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "deadline_s": run.args.deadline,
            "finished": False,
            "phases": {},
        }

    def write(self) -> None:
        self.data["elapsed_s"] = round(self.run.elapsed(), 2)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        temp = self.path.with_name(self.path.name + ".tmp")
        temp.write_text(json.dumps(self.data, indent=1, default=_plain) + "\n")
        os.replace(temp, self.path)

    def phase(self, name: str, fn: Phase, needs_s: float = 0.0) -> None:
        run = self.run
        rec: dict[str, Any] = {"status": "running", "started_s": round(run.elapsed(), 2)}
        self.data["phases"][name] = rec
        if needs_s and run.left() < needs_s:
            rec.update(status="skipped", reason=f"deadline: {run.left():.0f}s left, the phase needs ~{needs_s:.0f}s")
            run.log(f"{name}: skipped ({rec['reason']})")
            self.write()
            return
        run.log(f"{name}: start")
        self.write()
        try:
            fn(run, rec)
            rec["status"] = "ok" if not rec.get("errors") else "partial"
        except Exception as exc:  # recorded verbatim; the next phase still runs
            rec.update(status="error", error=error_record(exc))
            run.log(f"{name}: {type(exc).__name__}: {str(exc)[:300]}")
        rec["seconds"] = round(run.elapsed() - rec["started_s"], 2)
        run.log(f"{name}: {rec['status']} in {rec['seconds']}s")
        run.free_memory()
        self.write()


def _plain(o: Any) -> Any:
    return o.tolist() if hasattr(o, "tolist") else str(o)  # numpy / torch values; paths


# -- model helpers (phases compat and model, --write-fixture) -----------------------------------------


def random_model(shape: Shape, device: str, seed: int = 0) -> Any:
    """The flare qwen2 step module with random fp32 weights on `device`: N(0, 0.02) like HF's init,
    norms at 1, embeddings tied as in both real checkpoints. Built on meta, filled on the device."""
    from helios.manifest import Architecture
    from ignition.models.qwen2 import Qwen2ForCausalLM

    arch = Architecture(
        family="qwen2",
        num_layers=shape.layers,
        hidden_size=shape.hidden,
        intermediate_size=shape.inter,
        num_heads=shape.heads,
        num_kv_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        vocab_size=shape.vocab,
        rope_theta=shape.theta,
        rms_norm_eps=1e-6,
        max_position_embeddings=shape.max_positions,
        tie_word_embeddings=True,
        attention_bias=True,
    )
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
    from helios.manifest import (
        Identity,
        KVLayout,
        Limits,
        Logprobs,
        Manifest,
        Parsers,
        Sampling,
        SamplingDefaults,
        TemplateSpec,
        TokenizerSpec,
    )
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
        architecture=arch,
        precision=dtype,
        kv=dataclasses.replace(kv, dtype=dtype),
        engines=[engine],
        limits=Limits(
            context_length=shape.max_positions,
            max_concurrency=max_batch,
            prefill_chunk_size=2048,
            max_batch_tokens=8192,
            default_max_tokens=256,
            kv_pages=1024,
        ),
        tokenizer=TokenizerSpec(
            file="tokenizer.json", bos_token_id=None, eos_token_ids=[], pad_token_id=None, add_bos=False
        ),
        template=TemplateSpec(file=None),
        sampling=Sampling(defaults=SamplingDefaults()),
        parsers=Parsers(),
        logprobs=Logprobs(max_top_logprobs=20, explicit_token_ids=True, prompt_logprobs=False),
        decode_weight_bytes=weight_bytes,
    )
    manifest.save(folder)
    return manifest, seconds


def write_fixture(folder: Path) -> Any:
    """The tiny random qwen2 (vocab 1000: a ~1 MB program) as a float32 core folder: core.json +
    step.cuda.pt2, written by this torch (`--write-fixture`: what phase compat loads on the device)."""
    return export_core(random_model(TINY, "cpu"), TINY, folder, "float32", max_batch=4)[0]


def make_runner(core: Path, manifest: Any, num_pages: int, device: str, graphs: bool, max_batch: int) -> Any:
    from helios.engine.torch_runner import TorchRunner

    return TorchRunner(core, manifest, num_pages, device=device, graphs=graphs, max_batch=max_batch)

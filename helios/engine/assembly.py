"""How the engine's parts are built from a core's manifest and its runner: the prefix cache's
host store and recurrent-state callbacks, the speculator and its learned drafter (helios.engine.engine
wires them)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from helios.engine.drafter import LearnedDrafter
from helios.engine.host_store import HostStore, HostStoreConfig, core_identity
from helios.engine.runner import SPARE_STATE_SLOTS, Runner
from helios.engine.speculation import SpeculationConfig, Speculator
from helios.engine.step_io import StepRunner
from helios.kernels import kv_dtype as kv_types
from helios.manifest import Manifest


def speculator_for(
    core_dir: Path, manifest: Manifest, runner: StepRunner, config: SpeculationConfig | None
) -> Speculator | None:
    """History drafts and the core's learned drafter, where the step graph can verify drafts and
    no recurrent state must roll back; None when neither source is on."""
    config = config or SpeculationConfig()
    if not config.enabled or manifest.state is not None or not runner.can_verify:
        return None
    learned = None
    if config.learned_drafter and manifest.drafter is not None and isinstance(runner, Runner):
        learned = LearnedDrafter.load(core_dir, manifest, runner, config.drafter_catch_up_tokens)
    if learned is None and not config.history_drafts:
        return None
    return Speculator(config, learned)


def page_copier(runner: StepRunner, speculator: Speculator | None) -> Callable[[int, int], None] | None:
    """The prefix cache's page copy: the target's pool, and the learned drafter's beside it."""
    copy = runner.copy_page if runner.copies_pages else None
    learned = speculator.learned if speculator is not None else None
    if copy is None or learned is None:
        return copy

    def both(src: int, dst: int) -> None:
        copy(src, dst)
        learned.copy_page(src, dst)

    return both


def host_store_arguments(manifest: Manifest, runner: StepRunner, config: HostStoreConfig | None) -> dict[str, Any]:
    """PrefixCache arguments for the host prefix store (none without a config or page access)."""
    if config is None or not runner.exports_pages or (config.dram_bytes <= 0 and config.directory is None):
        return {}
    identity = core_identity(manifest, runner.pool_dtype)
    page_bytes = kv_page_bytes(manifest, runner.pool_dtype)
    store = HostStore(identity, config, manifest.kv.page_tokens, page_bytes, runner.pool_dtype)
    return {"host": store, "read_pages": runner.read_pages, "write_pages": runner.write_pages}


def kv_page_bytes(manifest: Manifest, pool_dtype: str) -> int:
    """Bytes of one page (every layer's K and V) in a pool of `pool_dtype`, as copies and the host
    store move it."""
    kv = manifest.kv
    return kv.num_layers * 2 * kv.page_tokens * kv.kv_heads * kv.head_dim * kv_types.itemsize(pool_dtype)


def state_snapshot_arguments(manifest: Manifest, runner: StepRunner) -> dict[str, Any]:
    """PrefixCache arguments for a core with recurrent state: snapshots of the runner's slots."""
    if manifest.state is None:
        return {}
    if runner.num_state_slots == 0:
        return {"recurrent_state": True}  # no slots to snapshot: checkpoints are refused
    return {
        "recurrent_state": True,
        "read_state": runner.read_state,
        "write_state": runner.write_state,
        "state_bytes": manifest.state.width * 4,
    }  # float32 snapshots


DEVICES = ("auto", "cpu", "cuda")
ENGINES = ("auto", "onnx", "torch")


@dataclass(frozen=True)
class RunnerChoice:
    """Which step engine serves the core, where: ("onnx", "cpu"), ("torch", "cpu") or ("torch",
    "cuda"), and the ONNX runner's KV pool type (helios.kernels.kv_dtype; "auto" resolved there)."""

    engine: str = "onnx"
    device: str = "cpu"
    kv_dtype: str = "float32"


def choose_runner(
    manifest: Manifest, device: str = "auto", engine: str = "auto", kv_dtype: str | None = None
) -> RunnerChoice:
    """--device / --engine / --kv-dtype against the core and this machine; ValueError says what is
    missing.

    auto device: CUDA when the core has a torch program (target "cuda") and torch sees a GPU;
    auto engine: the torch program on CUDA, the ONNX graph on a CPU. kv_dtype None: the core's
    default (manifest limits); the torch program's pool has the program's dtype."""
    if device not in DEVICES or engine not in ENGINES:
        raise ValueError(f"--device is one of {', '.join(DEVICES)} and --engine one of {', '.join(ENGINES)}")
    pool = kv_types.canonical(kv_dtype or manifest.limits.kv_dtype)
    has_program = manifest.has_engine("step", "cuda")
    if device == "auto":
        device = "cuda" if engine != "onnx" and has_program and _cuda_available() else "cpu"
    if engine == "auto":
        engine = "torch" if device == "cuda" else "onnx"
    if engine == "onnx" and device == "cuda":
        raise ValueError(
            "the ONNX step graph runs on the CPU only; on CUDA helios runs the core's torch program (--engine torch)"
        )
    if engine == "torch" and not has_program:
        raise ValueError("this core has no torch step program: export it with `ignition export --target cpu,cuda`")
    if device == "cuda" and not _cuda_available():
        raise ValueError("--device cuda, but torch sees no CUDA device (a CUDA build of torch and a GPU are needed)")
    if engine == "torch":
        program = manifest.engine("step", "cuda").dtype or "float32"
        if kv_dtype is not None and pool not in ("auto", program):
            raise ValueError(f"the torch step program's KV pool has its weights' dtype ({program}), not {pool}")
        return RunnerChoice(engine, device, program)
    return RunnerChoice(engine, device, pool)


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def build_runner(
    core_dir: Path, manifest: Manifest, choice: RunnerChoice, num_pages: int, threads: int | None, max_concurrency: int
) -> StepRunner:
    """The chosen runner, its state slots and decode-graph buckets sized for max_concurrency."""
    slots = max_concurrency + SPARE_STATE_SLOTS
    if choice.engine == "onnx":
        return Runner(core_dir, manifest, num_pages, threads, state_slots=slots, kv_dtype=choice.kv_dtype)
    from helios.engine.torch_runner import TorchRunner  # torch only where its engine serves

    return TorchRunner(
        core_dir,
        manifest,
        num_pages,
        device=choice.device,
        threads=threads,
        state_slots=slots,
        max_batch=max_concurrency,
    )


def describe_runner(manifest: Manifest, runner: StepRunner) -> str:
    """The start-up line's engine part: which engine, where, and its decode graphs."""
    if isinstance(runner, Runner):  # checked first: an ONNX core's start-up never imports torch
        kernels = {"flare": ", flare's CPU kernels", "onnxruntime": ", flare ops run as onnxruntime kernels"}
        return f"engine: ONNX step graph on onnxruntime (CPU{kernels.get(runner.kernels, '')})"
    from helios.engine.torch_runner import TorchRunner

    if not isinstance(runner, TorchRunner):
        return f"engine: {type(runner).__name__}"
    engine = manifest.engine("step", "cuda")
    text = f"engine: torch step program ({engine.dtype}, written by torch {engine.torch_version}) on {runner.device}"
    graphs = runner.graphs
    if graphs is not None and graphs.captured:
        text += f", CUDA graphs for decode batches {', '.join(map(str, graphs.buckets))}"
    return text

"""`ignition verify`: re-checks a core as a release artifact.

Every digest is checked again; the export-time parity is re-run against the torch reference
when the checkpoint is available, or an engine smoke test runs when it is not.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from helios.engine.runner import Runner, StepRow
from helios.engine.step_io import StepRunner
from helios.manifest import MANIFEST_NAME, Manifest, ManifestError, Parity
from ignition.checkpoints.base import CheckpointError
from ignition.checkpoints.load import load_checkpoint
from ignition.checkpoints.packaged import PACKAGED_MODELS
from ignition.export.cache import identify
from ignition.export.validate import (
    TORCH_PROGRAM_PRECISION,
    VALIDATION_PROMPT,
    ParityError,
    torch_program_runners,
    validate,
    validation_prompt,
)
from ignition.models import build_model

# verify fails when the parity it measures moved from the export-time value by more than this
# fraction of the precision's tolerance: the engine no longer behaves as it did when released,
# even if still within tolerance (other CPUs move fp32 logits by ~1e-5; tolerance is 1e-3).
PARITY_DRIFT = 0.1
SMOKE_DECODE_STEPS = 4


@dataclass
class Check:
    name: str
    ok: bool | None  # None: skipped / informational
    detail: str


@dataclass
class Verification:
    core: Path
    checks: list[Check] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok is not False for c in self.checks)

    def add(self, name: str, ok: bool | None, detail: str, report: Callable[[Check], None]) -> Check:
        check = Check(name, ok, detail)
        self.checks.append(check)
        report(check)
        return check

    def to_dict(self) -> dict[str, Any]:
        return {"core": str(self.core), "ok": self.ok, "checks": [dataclasses.asdict(c) for c in self.checks]}


def verify_core(
    core: Path,
    checkpoint: str | None = None,
    require_reference: bool = False,
    report: Callable[[Check], None] = lambda check: None,
) -> Verification:
    """Digests, then parity against the reference (checkpoint available) or an engine smoke run."""
    core = Path(core)
    result = Verification(core)
    try:
        manifest = Manifest.load(core, verify_files=False)
    except ManifestError as exc:
        result.add("manifest", False, str(exc), report)
        return result
    result.add("manifest", True, f"{MANIFEST_NAME} format {manifest.format_version}, {manifest.model_id}", report)
    try:
        manifest.verify_files(core)
    except ManifestError as exc:
        result.add("digests", False, str(exc), report)
        return result
    if not manifest.files:
        result.add("digests", False, f"{MANIFEST_NAME} lists no files: nothing to verify", report)
        return result
    result.add("digests", True, f"{len(manifest.files)} files match; digest {manifest.digest or '(none)'}", report)

    spec, why = _checkpoint_spec(manifest, checkpoint)
    if spec is None:
        result.add("reference", False if require_reference else None, why, report)
        if require_reference:
            return result
        _smoke(core, manifest, result, report)
        return result
    _parity(core, manifest, spec, checkpoint is not None, result, report)
    return result


def _checkpoint_spec(manifest: Manifest, explicit: str | None) -> tuple[str | None, str]:
    """The checkpoint to rebuild the reference from, or None and why there is none."""
    ident = manifest.identity
    if explicit is not None:
        return explicit, ""
    candidate = ident.checkpoint_id
    if candidate in PACKAGED_MODELS:
        return candidate, ""
    for path in (Path(candidate), Path(candidate + ".gguf")):
        if path.exists():
            return str(path), ""
    return None, (
        f"checkpoint {ident.checkpoint_id!r} (sha256 {ident.checkpoint_sha256[:12]}…) is not available here "
        "(pass --checkpoint): verifying digests and an engine smoke run only"
    )


def _parity(
    core: Path, manifest: Manifest, spec: str, explicit: bool, result: Verification, report: Callable[[Check], None]
) -> None:
    want = manifest.identity.checkpoint_sha256
    source = identify(spec)
    if source is not None and source.sha256 != want:
        result.add(
            "checkpoint",
            False,
            f"{spec} has sha256 {source.sha256}, but the core was exported from {want}",
            report,
        )
        return
    try:
        checkpoint = load_checkpoint(spec)
    except CheckpointError as exc:
        result.add("checkpoint", False if explicit else None, f"cannot read {spec}: {exc}", report)
        if not explicit:
            _smoke(core, manifest, result, report)
        return
    if checkpoint.sha256 != want:
        result.add(
            "checkpoint", False, f"{spec} has sha256 {checkpoint.sha256}, but the core was exported from {want}", report
        )
        return
    result.add("checkpoint", True, f"{spec} (sha256 {want[:12]}…)", report)

    recorded = manifest.parity
    model = build_model(*checkpoint.model_inputs())
    prompt_ids = validation_prompt(core / manifest.tokenizer.file, checkpoint)
    steps = recorded.decode_steps if recorded else 8
    _judge(
        "parity",
        lambda: validate(
            core, model, manifest.kv, prompt_ids, steps, precision=manifest.precision, state=manifest.state
        ),
        recorded,
        result,
        report,
    )
    for engine in (e for e in manifest.engines if e.target == "cuda"):
        precision = TORCH_PROGRAM_PRECISION.get(str(engine.dtype), str(engine.dtype))  # unknown: validate says so
        _judge(
            f"parity ({engine.target} {engine.dtype})",
            partial(
                validate,
                core,
                model,
                manifest.kv,
                prompt_ids,
                steps,
                precision=precision,
                state=manifest.state,
                make_runner=torch_program_runners(core, manifest),
            ),
            engine.parity,
            result,
            report,
        )


def _judge(
    name: str,
    measure: Callable[[], Parity],
    recorded: Parity | None,
    result: Verification,
    report: Callable[[Check], None],
) -> None:
    """Measure one engine's parity and hold it to the export-time record."""
    try:
        measured = measure()
    except ParityError as exc:
        result.add(name, False, str(exc), report)
        return
    except Exception as exc:
        result.add(name, False, f"the engine failed to run: {type(exc).__name__}: {exc}", report)
        return
    detail = (
        f"max |Δlogit| {measured.max_abs_logit_error:.3g} (tolerance {measured.tolerance:g}), "
        f"top-1 {measured.top1_agreement:.0%} over {measured.prompt_tokens}+{measured.decode_steps} positions"
    )
    if recorded is None:
        result.add(name, True, detail + "; no export-time parity recorded", report)
        return
    detail += f"; at export {recorded.max_abs_logit_error:.3g}, top-1 {recorded.top1_agreement:.0%}"
    drift = abs(measured.max_abs_logit_error - recorded.max_abs_logit_error)
    if measured.prompt_tokens != recorded.prompt_tokens:
        result.add(
            name, False, detail + f"; the validation prompt was {recorded.prompt_tokens} tokens at export", report
        )
    elif drift > PARITY_DRIFT * measured.tolerance:
        result.add(name, False, detail + f"; moved {drift:.3g} since export (> {PARITY_DRIFT:g} x tolerance)", report)
    else:
        result.add(name, True, detail, report)


def _smoke(core: Path, manifest: Manifest, result: Verification, report: Callable[[Check], None]) -> None:
    """Run each step engine on the validation prompt (two prefill chunks, then greedy decode) and
    check that its outputs are finite and consistent with each other."""
    _smoke_one("smoke", lambda pages: Runner(core, manifest, num_pages=pages), core, manifest, result, report)
    for engine in (e for e in manifest.engines if e.target == "cuda"):
        _smoke_one(
            f"smoke ({engine.target} {engine.dtype})",
            torch_program_runners(core, manifest),
            core,
            manifest,
            result,
            report,
        )


def _smoke_one(
    name: str,
    make_runner: Callable[[int], StepRunner],
    core: Path,
    manifest: Manifest,
    result: Verification,
    report: Callable[[Check], None],
) -> None:
    vocab = manifest.architecture.vocab_size
    ids = (
        Tokenizer.from_file(str(core / manifest.tokenizer.file)).encode(VALIDATION_PROMPT, add_special_tokens=False).ids
    )
    ids = [i for i in ids if i < vocab] or [0, 0]
    if len(ids) < 2:
        ids = ids * 2
    total = len(ids) + SMOKE_DECODE_STEPS
    pages = -(-total // manifest.kv.page_tokens)
    try:
        runner = make_runner(pages + 1)
        table = list(range(pages, 0, -1))  # reversed, non-zero pages: the order matters
        sequence, problems = list(ids), []

        def step(start: int, end: int):
            out = runner.step([StepRow(sequence[start:end], start, table, state_slot=0)])
            problems.extend(_output_problems(out, vocab, end - 1))
            return out

        split = len(ids) // 2
        step(0, split)
        out = step(split, len(ids))  # the second chunk attends to the first through the pool
        for _ in range(SMOKE_DECODE_STEPS):
            if problems:
                break
            sequence.append(int(out.logits[0].argmax()))
            out = step(len(sequence) - 1, len(sequence))
    except Exception as exc:
        result.add(name, False, f"the engine failed to run: {type(exc).__name__}: {exc}", report)
        return
    if problems:
        result.add(name, False, "; ".join(problems[:3]), report)
        return
    result.add(
        name,
        True,
        f"{len(ids)}-token prompt in 2 chunks + {len(sequence) - len(ids)} decode steps: logits finite, "
        "logsumexp and top logprobs consistent",
        report,
    )


def _output_problems(out: Any, vocab: int, position: int) -> list[str]:
    problems = []
    logits = np.asarray(out.logits[0], dtype=np.float64)
    where = f"at position {position}"
    if logits.shape != (vocab,):
        return [f"logits {where} have shape {logits.shape}, not ({vocab},)"]
    if not np.isfinite(logits).all():
        return [f"non-finite logits {where}"]
    lse = float(np.log(np.exp(logits - logits.max()).sum()) + logits.max())
    if not math.isclose(float(out.logsumexp[0]), lse, rel_tol=1e-4, abs_tol=1e-3):
        problems.append(f"logsumexp {float(out.logsumexp[0]):.5g} {where}, logits give {lse:.5g}")
    top_ids = np.asarray(out.top_ids[0])
    top = np.asarray(out.top_logprobs[0], dtype=np.float64)
    if top_ids.min() < 0 or top_ids.max() >= vocab:
        problems.append(f"top ids out of range {where}")
    elif not np.allclose(top, logits[top_ids] - lse, atol=1e-3):
        problems.append(f"top logprobs {where} disagree with the logits")
    if (np.diff(top) > 1e-6).any():
        problems.append(f"top logprobs {where} are not decreasing")
    return problems

"""`ignition inspect` and `ignition verify`: a core seen as a release artifact.

inspect reads core.json (and the files' sizes) and shows what a release engineer checks;
`--json` gives the same as one JSON object (core.json's fields plus sizes). verify re-checks
every digest and re-runs the export-time parity against the torch reference when the
checkpoint is available, or runs an engine smoke test when it is not.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.table import Table
from rich.text import Text

from helios.manifest import MANIFEST_NAME, Manifest, ManifestError, listing_digest

# verify fails when the parity it measures moved from the export-time value by more than this
# fraction of the precision's tolerance: the engine no longer behaves as it did when released,
# even if still within tolerance (other CPUs move fp32 logits by ~1e-5; tolerance is 1e-3).
PARITY_DRIFT = 0.1
SMOKE_DECODE_STEPS = 4


# -- inspect -----------------------------------------------------------------------------------


def inspect_data(core: Path) -> dict[str, Any]:
    """core.json's fields, plus: core (the folder), model_id, file_bytes (per listed file),
    total_bytes, listing_ok (the listing matches `digest`), content_ok (core.json matches
    `content_digest`; None before 1.5), files_present, and bytes per engine."""
    core = Path(core)
    manifest = Manifest.load(core, verify_files=False)
    data: dict[str, Any] = {"core": str(core), "model_id": manifest.model_id}
    data |= dataclasses.asdict(manifest)
    sizes = {}
    for rel in sorted(set(manifest.files) | set(manifest.referenced_files())):
        path = core / rel
        sizes[rel] = path.stat().st_size if path.is_file() else None
    data["file_bytes"] = sizes
    data["files_present"] = all(size is not None for size in sizes.values())
    data["total_bytes"] = sum(size or 0 for size in sizes.values())
    data["listing_ok"] = (listing_digest(manifest.files) == manifest.digest) if manifest.digest else None
    data["content_ok"] = manifest.content_matches(core)
    for engine in data["engines"]:
        engine["bytes"] = sum(sizes.get(name) or 0 for name in [engine["file"], *engine["data_files"]])
    return data


def _mb(n: int | None) -> str:
    if n is None:
        return "missing"
    return f"{n / 1e6:.1f} MB" if n >= 100_000 else f"{n / 1e3:.1f} kB"


def _num(value: float) -> str:
    return f"{value:g}"


def _quantization_text(q: dict[str, Any] | None) -> str:
    if not q:
        return ""
    parts = [f"layers int{q['layers_bits']} block {q['layers_block']}"]
    if q.get("lm_head_bits"):
        parts.append(f"lm_head int{q['lm_head_bits']} block {q['lm_head_block']}")
    if q.get("embedding_bits"):
        parts.append(f"embedding int{q['embedding_bits']} block {q['embedding_block']}")
    op = q.get("matmul_op", "com.microsoft.MatMulNBits").rsplit(".", 1)[-1]
    return f" ({', '.join(parts)}, accuracy level {q['accuracy_level']}, {op})"


def render_inspect(data: dict[str, Any]) -> Table:
    table = Table(title=f"core {data['core']}", show_header=False, title_justify="left")
    table.add_column(style="bold", no_wrap=True)
    table.add_column()
    ident, arch = data["identity"], data["architecture"]
    aliases = ", ".join(a for a in ident["aliases"] if a) or "none"
    table.add_row("model", f"{data['model_id']}  (aliases: {aliases})")
    table.add_row("recipe", ident["recipe"])
    table.add_row("checkpoint", f"{ident['checkpoint_id']}  sha256 {ident['checkpoint_sha256']}")
    table.add_row("format", data["format_version"])
    table.add_row("precision", data["precision"] + _quantization_text(data.get("quantization")))
    table.add_row(
        "architecture",
        f"{arch['family']}: {arch['num_layers']} layers, hidden {arch['hidden_size']}, "
        f"{arch['num_heads']} heads / {arch['num_kv_heads']} KV x {arch['head_dim']}, vocab {arch['vocab_size']}, "
        f"rope theta {_num(arch['rope_theta'])}, {'tied' if arch['tie_word_embeddings'] else 'untied'} embeddings",
    )
    for engine in data["engines"]:
        parts = ", ".join(f"{name} {_mb(data['file_bytes'].get(name))}" for name in [engine["file"], *engine["data_files"]])
        table.add_row(f"engine {engine['name']}", f"{_mb(engine['bytes'])}: {parts}")
    table.add_row("decode weights", f"{_mb(data['decode_weight_bytes'])} read per decode token")
    lim, kv = data["limits"], data["kv"]
    table.add_row(
        "limits",
        f"context {lim['context_length']}, concurrency {lim['max_concurrency']}, prefill chunk "
        f"{lim['prefill_chunk_size']}, batch tokens {lim['max_batch_tokens']}, default max tokens "
        f"{lim['default_max_tokens']}",
    )
    table.add_row(
        "kv cache",
        f"{lim['kv_pages']} pages x {kv['page_tokens']} tokens ({kv['dtype']}, {kv['num_layers']} layers x "
        f"{kv['kv_heads']} heads x {kv['head_dim']})",
    )
    state = data.get("state")
    if state:
        kinds = sorted({layer["kind"] for layer in state["layers"]})
        table.add_row(
            "recurrent state",
            f"{state['width']} {state['dtype']} per sequence slot: {len(state['layers'])} layers "
            f"({', '.join(kinds)}: {', '.join(str(layer['layer']) for layer in state['layers'])})",
        )
    table.add_row("sampling", _sampling_table(data["sampling"]))
    parsers = data["parsers"]
    table.add_row("parsers", f"tool {parsers['tool'] or 'none'}, reasoning {parsers['reasoning'] or 'none'}")
    lp = data["logprobs"]
    table.add_row(
        "logprobs",
        f"top {lp['max_top_logprobs']} alternatives, explicit token ids {'yes' if lp['explicit_token_ids'] else 'no'}, "
        f"prompt logprobs {'yes' if lp['prompt_logprobs'] else 'no'}",
    )
    tok, tpl = data["tokenizer"], data["template"]
    table.add_row(
        "tokenizer",
        f"{tok['file']}: bos {tok['bos_token_id']}, eos {tok['eos_token_ids']}, pad {tok['pad_token_id']}, "
        f"add bos {'yes' if tok['add_bos'] else 'no'}",
    )
    table.add_row(
        "template",
        f"{tpl['file']}: system {'yes' if tpl['supports_system'] else 'no'}, tools {'yes' if tpl['supports_tools'] else 'no'}"
        if tpl["file"]
        else "none (no chat)",
    )
    parity = data["parity"]
    if parity:
        table.add_row(
            "parity",
            f"max |Δlogit| {parity['max_abs_logit_error']:.3g} (tolerance {_num(parity['tolerance'])}), top-1 agreement "
            f"{parity['top1_agreement']:.0%}"
            + (f", mean KL {parity['mean_kl']:.2g} nats" if parity.get("mean_kl") is not None else "")
            + f" over {parity['prompt_tokens']} prompt + {parity['decode_steps']} decode positions",
        )
    else:
        table.add_row("parity", Text("not measured", style="yellow"))
    table.add_row("toolchain", ", ".join(f"{k} {v}" for k, v in data["toolchain"].items()) or "not recorded")
    listing = {True: "", False: "  [red](listing does not match: run ignition verify)[/]", None: ""}[data["listing_ok"]]
    if data["content_ok"] is False:
        listing += "  [red](core.json fields do not match content_digest: run ignition verify)[/]"
    missing = [rel for rel, size in data["file_bytes"].items() if size is None]
    present = f"  [red](missing: {', '.join(missing)})[/]" if missing else ""
    table.add_row(
        "digest",
        f"{data['digest'] or 'none (format < 1.1)'}  ({len(data['files'])} files, {_mb(data['total_bytes'])}){listing}{present}",
    )
    return table


def _sampling_table(sampling: dict[str, Any]) -> Table:
    table = Table(show_edge=False, box=None, pad_edge=False)
    table.add_column("parameter")
    table.add_column("default", justify="right")
    table.add_column("range")
    ranges = sampling["ranges"]
    for name, default in sampling["defaults"].items():
        bounds = ranges.get(name)
        shown = "any" if default is None and name == "seed" else str(default)
        if bounds:
            span = f"[{_num(bounds['min'])}, {_num(bounds['max'])}]"
        else:
            span = "per request" if name == "seed" else "fixed"
        table.add_row(name, shown, span)
    return table


# -- verify ------------------------------------------------------------------------------------


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
    from ignition.checkpoints.packaged import PACKAGED_MODELS

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
    from ignition.checkpoints.base import CheckpointError
    from ignition.checkpoints.load import load_checkpoint
    from ignition.export.cache import identify
    from ignition.export.pipeline import validation_prompt
    from ignition.export.validate import ParityError, validate
    from ignition.models import build_model

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
        result.add("checkpoint", False, f"{spec} has sha256 {checkpoint.sha256}, but the core was exported from {want}", report)
        return
    result.add("checkpoint", True, f"{spec} (sha256 {want[:12]}…)", report)

    recorded = manifest.parity
    model = build_model(*checkpoint.model_inputs())
    prompt_ids = validation_prompt(core / manifest.tokenizer.file, checkpoint)
    steps = recorded.decode_steps if recorded else 8
    try:
        measured = validate(core, model, manifest.kv, prompt_ids, steps, precision=manifest.precision, state=manifest.state)
    except ParityError as exc:
        result.add("parity", False, str(exc), report)
        return
    except Exception as exc:  # noqa: BLE001 - an engine that cannot run is the finding
        result.add("parity", False, f"the engine failed to run: {type(exc).__name__}: {exc}", report)
        return
    detail = (
        f"max |Δlogit| {measured.max_abs_logit_error:.3g} (tolerance {measured.tolerance:g}), "
        f"top-1 {measured.top1_agreement:.0%} over {measured.prompt_tokens}+{measured.decode_steps} positions"
    )
    if recorded is None:
        result.add("parity", True, detail + "; no export-time parity recorded", report)
        return
    detail += f"; at export {recorded.max_abs_logit_error:.3g}, top-1 {recorded.top1_agreement:.0%}"
    drift = abs(measured.max_abs_logit_error - recorded.max_abs_logit_error)
    if measured.prompt_tokens != recorded.prompt_tokens:
        result.add("parity", False, detail + f"; the validation prompt was {recorded.prompt_tokens} tokens at export", report)
    elif drift > PARITY_DRIFT * measured.tolerance:
        result.add("parity", False, detail + f"; moved {drift:.3g} since export (> {PARITY_DRIFT:g} x tolerance)", report)
    else:
        result.add("parity", True, detail, report)


def _smoke(core: Path, manifest: Manifest, result: Verification, report: Callable[[Check], None]) -> None:
    """Run the engine on the validation prompt (two prefill chunks, then greedy decode) and
    check that its outputs are finite and consistent with each other."""
    from tokenizers import Tokenizer

    from helios.engine.runner import Runner, StepRow
    from ignition.export.pipeline import VALIDATION_PROMPT

    vocab = manifest.architecture.vocab_size
    ids = Tokenizer.from_file(str(core / manifest.tokenizer.file)).encode(VALIDATION_PROMPT, add_special_tokens=False).ids
    ids = [i for i in ids if i < vocab] or [0, 0]
    if len(ids) < 2:
        ids = ids * 2
    total = len(ids) + SMOKE_DECODE_STEPS
    pages = -(-total // manifest.kv.page_tokens)
    try:
        runner = Runner(core, manifest, num_pages=pages + 1)
        table = list(range(pages, 0, -1))  # reversed, non-zero pages: the order matters
        sequence, problems = list(ids), []

        def step(start: int, end: int):  # noqa: ANN202
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
    except Exception as exc:  # noqa: BLE001 - any engine failure is the finding
        result.add("smoke", False, f"the engine failed to run: {type(exc).__name__}: {exc}", report)
        return
    if problems:
        result.add("smoke", False, "; ".join(problems[:3]), report)
        return
    result.add(
        "smoke",
        True,
        f"{len(ids)}-token prompt in 2 chunks + {len(sequence) - len(ids)} decode steps: logits finite, "
        "logsumexp and top logprobs consistent",
        report,
    )


def _output_problems(out: Any, vocab: int, position: int) -> list[str]:
    import numpy as np

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

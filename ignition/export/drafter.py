"""`ignition export --drafter CHECKPOINT`: a smaller model with the target's tokenizer, compiled
with the same recipe and precision into the same core as its own step engine (`drafter/`).

The drafter is exported as a core of its own first (the same pipeline, cache and parity checks,
in the work folder), then its step graph and weights move under `drafter/` and the target's
manifest names them (helios.manifest.Drafter). helios runs it beside the step graph to propose
the drafts a speculative round verifies (helios/engine/drafter.py).
"""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from helios.manifest import Drafter, Engine, Manifest
from ignition.checkpoints.base import Checkpoint
from ignition.export.options import ExportError, ExportOptions, Progress

DRAFTER_ENGINE = "drafter"
DRAFTER_DIR = "drafter"  # in the core folder
DRAFTER_WORK = "drafter-core"  # in the work folder: the drafter exported as a core of its own


def check_drafter_vocab(drafter: str, ours: dict[str, int], theirs: dict[str, int]) -> None:
    """Refuse a drafter whose vocabulary (token -> id, added tokens included) is not the target's."""
    if ours != theirs:
        raise ExportError(
            f"the drafter {drafter} has another tokenizer than the target "
            f"({len(theirs)} vs {len(ours)} tokens, or other ids): its drafts would be other tokens"
        )


@dataclass(frozen=True)
class CompiledDrafter:
    """The drafter's product: its step engine (files moved under `drafter/` in the core) and the
    manifest of the core it was exported as."""

    spec: str  # --drafter
    engine: Engine
    manifest: Manifest


def add_drafter(
    options: ExportOptions,
    checkpoint: Checkpoint,
    work: Path,
    core: Path,
    progress: Progress,
    export_core: Callable[[ExportOptions, Progress], Manifest],
) -> CompiledDrafter | None:
    """With --drafter: export it (export_core: the pipeline's entry point) and move its step engine
    into the core; the manifest's `drafter` section is `describe_drafter`'s. None without one."""
    spec = options.drafter
    if spec is None:
        return None

    def nested(stage: str, detail: str) -> None:  # the drafter's stages show inside "export"
        progress("export", f"drafter: {stage}: {detail}")

    source = work / DRAFTER_WORK
    drafter_options = dataclasses.replace(
        options, checkpoint=spec, out=source, drafter=None, prompt_logprobs=False, force=False
    )
    try:
        drafter = export_core(drafter_options, nested)
    except ExportError as exc:
        raise ExportError(f"the drafter {spec}: {exc}") from None
    if drafter.state is not None:
        raise ExportError(
            f"the drafter {spec} keeps recurrent state, which cannot roll back rejected "
            "drafts: choose an attention-only drafter"
        )
    ours = Tokenizer.from_str(checkpoint.tokenizer_json).get_vocab(with_added_tokens=True)
    theirs = Tokenizer.from_file(str(source / drafter.tokenizer.file)).get_vocab(with_added_tokens=True)
    check_drafter_vocab(spec, ours, theirs)
    step = drafter.engine("step")
    target = core / DRAFTER_DIR
    target.mkdir()
    for name in (step.file, *step.data_files):
        shutil.move(source / name, target / name)
    shutil.rmtree(source)
    engine = dataclasses.replace(
        step,
        name=DRAFTER_ENGINE,
        file=f"{DRAFTER_DIR}/{step.file}",
        data_files=[f"{DRAFTER_DIR}/{name}" for name in step.data_files],
    )
    return CompiledDrafter(spec, engine, drafter)


def describe_drafter(drafter: CompiledDrafter, manifest: Manifest) -> Drafter:
    """The target manifest's `drafter` section, checked to share the target's pages."""
    own = drafter.manifest
    section = Drafter(
        engine=DRAFTER_ENGINE,
        checkpoint_id=own.identity.checkpoint_id,
        checkpoint_sha256=own.identity.checkpoint_sha256,
        architecture=own.architecture,
        kv=own.kv,
        decode_weight_bytes=own.decode_weight_bytes,
        parity=own.parity,
    )
    try:
        section.check(manifest)
    except ValueError as exc:
        raise ExportError(f"the drafter {drafter.spec} cannot serve this core: {exc}") from None
    return section

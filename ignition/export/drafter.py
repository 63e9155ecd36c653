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

from tokenizers import Tokenizer

from helios.manifest import Drafter, Manifest
from ignition.export.state import ExportError, ExportState

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


def add_drafter(state: ExportState, export_core) -> None:
    """With --drafter: export it (export_core: the pipeline's entry point) and move its step engine
    into the core; the manifest's `drafter` section is set by `describe_drafter`."""
    options = state.options
    if options.drafter is None:
        return
    outer = state.progress

    def progress(stage: str, detail: str) -> None:  # the drafter's stages show inside "export"
        outer("export", f"drafter: {stage}: {detail}")

    nested = dataclasses.replace(
        options,
        checkpoint=options.drafter,
        out=state.work / DRAFTER_WORK,
        drafter=None,
        prompt_logprobs=False,
        force=False,
    )
    try:
        drafter = export_core(nested, progress)
    except ExportError as exc:
        raise ExportError(f"the drafter {options.drafter}: {exc}") from None
    if drafter.state is not None:
        raise ExportError(
            f"the drafter {options.drafter} keeps recurrent state, which cannot roll back rejected "
            "drafts: choose an attention-only drafter"
        )
    source = state.work / DRAFTER_WORK
    assert state.checkpoint is not None
    ours = Tokenizer.from_str(state.checkpoint.tokenizer_json).get_vocab(with_added_tokens=True)
    theirs = Tokenizer.from_file(str(source / drafter.tokenizer.file)).get_vocab(with_added_tokens=True)
    check_drafter_vocab(options.drafter, ours, theirs)
    step = drafter.engine("step")
    target = state.core_dir / DRAFTER_DIR
    target.mkdir()
    for name in (step.file, *step.data_files):
        shutil.move(source / name, target / name)
    state.engines.append(
        dataclasses.replace(
            step,
            name=DRAFTER_ENGINE,
            file=f"{DRAFTER_DIR}/{step.file}",
            data_files=[f"{DRAFTER_DIR}/{name}" for name in step.data_files],
        )
    )
    state.drafter = drafter
    shutil.rmtree(source)


def describe_drafter(state: ExportState, manifest: Manifest) -> None:
    """Name the exported drafter in `manifest`, checking it can share the target's pages."""
    drafter = state.drafter
    if drafter is None:
        return
    manifest.drafter = Drafter(
        engine=DRAFTER_ENGINE,
        checkpoint_id=drafter.identity.checkpoint_id,
        checkpoint_sha256=drafter.identity.checkpoint_sha256,
        architecture=drafter.architecture,
        kv=drafter.kv,
        decode_weight_bytes=drafter.decode_weight_bytes,
        parity=drafter.parity,
    )
    try:
        manifest.drafter.check(manifest)
    except ValueError as exc:
        raise ExportError(f"the drafter {state.options.drafter} cannot serve this core: {exc}") from None

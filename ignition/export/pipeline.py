"""The export pipeline: recipe + checkpoint -> core folder, stage by stage (stages.py).

Release-artifact rules (docs/cores.md):
- Reproducible: the same checkpoint, recipe, flags and toolchain give byte-identical files and
  core.json (no timestamps, no absolute paths, sorted JSON, the exporter's source-location
  metadata stripped from the graph, deterministic names and external-data layout).
- Atomic: the core is assembled in a hidden sibling of --out and renamed into place (output.py).
- Cached: read/convert/trace results are reused from the export cache (cache.py) by content
  hash, unless ExportOptions.cache is False (--no-cache).
"""

from __future__ import annotations

from pathlib import Path

from helios.manifest import Manifest
from ignition.checkpoints.load import peek_config, peek_family, peek_vocab
from ignition.export import stages
from ignition.export.cache import CachedStages
from ignition.export.drafter import add_drafter, check_drafter_vocab, describe_drafter
from ignition.export.manifest import assemble, serving_limits
from ignition.export.output import check_out, work_folder
from ignition.export.quantize import PRECISIONS
from ignition.export.state import ExportError, ExportOptions, ExportState, Progress
from ignition.export.torch_program import TORCH_DTYPES
from ignition.export.validate import ParityError
from ignition.models import PLANNED, logit_postprocessing

# The stages as the CLI shows them (trace and score report as "export").
STAGES = ("read", "convert", "export", "quantize", "validate", "write")


def export_core(options: ExportOptions, progress: Progress = lambda stage, detail: None) -> Manifest:
    """Export options.checkpoint with options.recipe into the core folder options.out."""
    check_request(options)
    with work_folder(Path(options.out)) as work:
        state = ExportState(options, progress, work)
        with CachedStages(state) as cached:
            cached.run(stages.read_checkpoint, stages.convert_model, stages.trace_step_graph)
            # Before quantization and validation: a --context-length past the native context stops here.
            assert state.checkpoint is not None
            state.limits = serving_limits(state.recipe, state.checkpoint, options.context_length)
            stages.quantize_step_graph(state)
            stages.add_score_graph(state)
            stages.add_vision_graph(state)
            stages.add_torch_program(state)
            stages.free_scratch(state)
            add_drafter(state, export_core)
            state.manifest = assemble(state)
            describe_drafter(state, state.manifest)
            try:
                stages.validate_engines(state)
            except ParityError as exc:
                # What the cache keeps is sound (only this precision's engine failed): keep it.
                cached.commit()
                raise ExportError(str(exc)) from None
            cached.commit()
            stages.write_core(state)
            return state.manifest


def check_request(options: ExportOptions) -> None:
    """Refuse, before any work, what the options and the checkpoint's metadata already rule out
    (no tensor is read, nothing is downloaded)."""
    recipe = options.recipe
    if options.precision not in PRECISIONS:
        raise ExportError(f"unknown precision {options.precision!r} (choose {', '.join(PRECISIONS)})")
    if "cuda" in options.targets and options.torch_dtype not in TORCH_DTYPES:
        raise ExportError(f"unknown --torch-dtype {options.torch_dtype!r} (choose {', '.join(TORCH_DTYPES)})")
    if recipe.family in PLANNED:
        raise ExportError(
            f"recipe {recipe.name!r} compiles the {recipe.family!r} family, which cannot be compiled yet: "
            f"missing {PLANNED[recipe.family]} (docs/recipes.md)"
        )
    if not options.checkpoint:
        raise ExportError(f"recipe {recipe.name!r} has no default checkpoint: pass --checkpoint")
    check_out(Path(options.out), options.force)
    if options.drafter is not None and (drafter := peek_family(options.drafter)) != recipe.family:
        raise ExportError(
            f"drafter {options.drafter} is a {drafter!r} model but recipe {recipe.name!r} compiles "
            f"{recipe.family!r}: the drafter is compiled with the target's recipe"
        )
    if options.drafter is not None and isinstance(peek_config(options.checkpoint).get("vision_config"), dict):
        raise ExportError(
            "a learned drafter cannot be compiled beside a vision tower yet: the drafter would see "
            "image placeholders without their features (export the target alone)"
        )
    family = peek_family(options.checkpoint)
    if family != recipe.family:
        raise ExportError(
            f"checkpoint {options.checkpoint} is a {family!r} model but recipe {recipe.name!r} compiles {recipe.family!r}"
        )
    if options.prompt_logprobs and (reason := logit_postprocessing(family, peek_config(options.checkpoint))):
        raise ExportError(
            f"--prompt-logprobs is not supported for this family ({family}): {reason}, "
            "so prompt scores from the bare lm_head would differ from generation logprobs"
        )
    if options.drafter is not None:  # folders: compared here; .gguf and packaged ones once read
        ours, theirs = peek_vocab(options.checkpoint), peek_vocab(options.drafter)
        if ours is not None and theirs is not None:
            check_drafter_vocab(options.drafter, ours, theirs)

"""The export pipeline: recipe + checkpoint -> core folder. export_core runs the stages in this
order, each taking earlier products and returning its own (stages.py unless named):

    check          refuse what the options and the checkpoint's metadata rule out (nothing read)
    read           -> Checkpoint                                        [cached]
    convert        -> TorchModel (on a cache hit: built only if needed)  [cached]
    trace          -> Traced: fp32 step graph, its engine, KV and state layouts  [cached]
    reference      -> validation's reference (recorded on a miss, replayed on a hit)  [cached]
    limits         -> Limits (manifest.py): a --context-length past the native context stops here
    quantize       -> the step Engine, in the core at --precision
    score          -> the score Engine (--prompt-logprobs)
    vision         -> VisionGraph (a checkpoint with a vision tower)
    torch program  -> its .pt2, then its Engine in the core (--target cuda)  [cached per dtype]
    free scratch   the fp32 graph the cache does not keep
    drafter        -> CompiledDrafter (drafter.py, --drafter: this pipeline, nested)
    assemble       -> Manifest (manifest.py; with the drafter's section)
    validate       -> Manifest with parity; past tolerance ParityError fails the export
    commit         the cache entry (also on ParityError: only this precision's engine failed)
    write          seal core.json and rename the core into place

Release-artifact rules (docs/cores.md):
- Reproducible: the same checkpoint, recipe, flags and toolchain give byte-identical files and
  core.json (no timestamps, no absolute paths, sorted JSON, the exporter's source-location
  metadata stripped from the graph, deterministic names and external-data layout).
- Atomic: the core is assembled in a hidden sibling of --out and renamed into place (output.py).
- Cached: the [cached] stages' products are reused from the export cache (cache.py) by content
  hash, unless ExportOptions.cache is False (--no-cache).
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from helios.manifest import Manifest
from ignition.checkpoints.load import peek_config, peek_family, peek_vocab
from ignition.export import display, stages
from ignition.export.cache import CachedStages
from ignition.export.drafter import add_drafter, check_drafter_vocab, describe_drafter
from ignition.export.manifest import assemble, serving_limits
from ignition.export.options import ExportError, ExportOptions, Progress
from ignition.export.output import check_out, work_folder
from ignition.export.quantize import PRECISIONS
from ignition.export.torch_program import TORCH_DTYPES
from ignition.export.validate import ParityError
from ignition.models import PLANNED, logit_postprocessing

# The stages as the CLI shows them (trace, score, vision and the torch program report as "export").
STAGES = display.STAGES


def export_core(options: ExportOptions, progress: Progress = lambda stage, detail: None) -> Manifest:
    """Export options.checkpoint with options.recipe into the core folder options.out."""
    check_request(options)
    recipe, precision, dtype = options.recipe, options.precision, options.torch_dtype
    with work_folder(Path(options.out)) as work, CachedStages(options, progress, work / stages.SCRATCH_DIR) as cache:
        core = work / stages.CORE_DIR
        checkpoint = cache.read(stages.read_checkpoint)
        model = cache.convert(stages.convert_model, checkpoint)
        traced = cache.trace(stages.trace_step_graph, checkpoint, model)
        reference = cache.reference(model)
        # Before quantization and validation: a --context-length past the native context stops here.
        limits = serving_limits(recipe, checkpoint, options.context_length, options.kv_dtype)
        prequantized = (checkpoint.source_quantization or "").startswith(("gptq-int4", "awq-int4"))
        engines = [stages.quantize_step_graph(traced, precision, core, progress, source_grid=prequantized)]
        if options.prompt_logprobs:
            engines.append(stages.add_score_graph(traced, checkpoint, precision, work, core, progress))
        vision = stages.add_vision_graph(traced, checkpoint, limits, core, progress)
        if vision is not None:
            engines.append(vision.engine)
        if "cuda" in options.targets:
            program = cache.torch_program(stages.trace_torch_program, checkpoint, traced, model, dtype)
            engines.append(stages.add_torch_program(program, checkpoint, traced, dtype, core))
        stages.free_scratch(work / stages.SCRATCH_DIR)
        drafter = add_drafter(options, checkpoint, work, core, progress, export_core)
        if drafter is not None:
            engines.append(drafter.engine)
        manifest = assemble(
            options, checkpoint, limits, traced.kv, traced.state, engines, vision.spec if vision else None, core
        )
        if drafter is not None:
            manifest.drafter = describe_drafter(drafter, manifest)
        try:
            manifest = stages.validate_engines(manifest, checkpoint, reference, model, core, progress)
        except ParityError as exc:
            cache.commit(checkpoint, traced)  # only this precision's engine failed: what the cache keeps is sound
            raise ExportError(str(exc)) from None
        cache.commit(checkpoint, traced)
        stages.write_core(manifest, core, Path(options.out), options.force, progress)
        return manifest


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


def export_with_progress(options: ExportOptions, console: Console) -> Manifest:
    """export_core with its stages shown on `console`."""
    with display.StageDisplay(console) as shown:
        return export_core(options, shown.report)

"""The export stages: each a function of what earlier stages produced that returns its own
product; pipeline.export_core composes them in order (its docstring lists them):

    read -> Checkpoint, convert -> TorchModel, trace -> Traced, quantize -> step Engine,
    score -> score Engine, vision -> VisionGraph, torch program -> .pt2 (-> its Engine),
    validate -> Manifest with parity, write -> the published core

The export cache (cache.py) wraps read, convert, trace and the torch program: on a hit it gives
their products without running them. Progress is reported under the CLI's stage names
(pipeline.STAGES): trace, score, vision and the torch program as "export".
"""

from __future__ import annotations

import dataclasses
import shutil
from dataclasses import dataclass
from pathlib import Path

import onnx

from helios.manifest import Engine, KVLayout, Limits, Manifest, Parity, StateLayout, Vision
from ignition.checkpoints.base import Checkpoint
from ignition.checkpoints.load import load_checkpoint
from ignition.export.graph import canonicalize_graph, export_step_graph
from ignition.export.manifest import cache_layouts
from ignition.export.options import ExportError, Progress
from ignition.export.output import publish
from ignition.export.quantize import quantize, quantize_score
from ignition.export.reference import CachedReference, Reference, ReferenceMiss
from ignition.export.score import export_score_graph, lm_head_from_step_graph
from ignition.export.torch_program import TorchExportError, export_torch_program, torch_program_engine
from ignition.export.validate import (
    TORCH_PROGRAM_PRECISION,
    torch_program_runners,
    validate,
    validate_scores,
    validation_prompt,
)
from ignition.export.vision import VISION_GRAPH_FILE, export_vision_graph, vision_engine, vision_spec
from ignition.models import DecoderLM, build_model
from ignition.models.qwen3_5_vision import build_vision_tower
from ignition.recipes import Recipe

# In the work folder (output.work_folder):
SCRATCH_DIR = "fp32"  # the fp32 step graph when the export cache does not keep it
SCORE_SCRATCH_DIR = "score-fp32"  # the fp32 score graph before quantization
CORE_DIR = "core"  # the core being assembled, renamed to --out at the end


class TorchModel:
    """convert's product: the torch model. An export-cache hit converts nothing, so the torch
    program, when it is not cached too, reads and builds the model on first use (once)."""

    def __init__(self, spec: str, progress: Progress, converted: DecoderLM | None = None) -> None:
        self.spec = spec  # the checkpoint it is (or would be) converted from
        self.progress = progress
        self.converted = converted

    def get(self) -> DecoderLM:
        if self.converted is None:
            self.progress("export", "cached trace: reading the checkpoint for the torch program")
            self.converted = build_model(*load_checkpoint(self.spec).model_inputs())
        return self.converted


@dataclass(frozen=True)
class Traced:
    """trace's product: the fp32 step graph (the vision graph and torch programs lie beside it, in
    a cache entry, its staging folder or scratch) and the cache layouts it was traced for."""

    graph: Path
    engine: Engine  # the step engine as the fp32 graph has it
    kv: KVLayout
    state: StateLayout | None

    @property
    def vision(self) -> bool:
        """A multimodal step graph (it takes image features): the torch program takes them too."""
        return any(spec.name == "image_embeds" for spec in self.engine.inputs)


@dataclass(frozen=True)
class VisionGraph:
    """vision's product: the vision graph's engine (its files are in the core) and the manifest's
    image section."""

    engine: Engine
    spec: Vision


def read_checkpoint(spec: str, progress: Progress) -> Checkpoint:
    progress("read", f"reading {spec}")
    return load_checkpoint(spec)


def convert_model(recipe: Recipe, checkpoint: Checkpoint, progress: Progress) -> DecoderLM:
    """The torch model, which is also validation's reference."""
    progress("convert", f"building {recipe.family} model ({checkpoint.architecture.num_layers} layers)")
    return build_model(*checkpoint.model_inputs())


def trace_step_graph(
    recipe: Recipe, checkpoint: Checkpoint, model: DecoderLM, folder: Path, progress: Progress
) -> Traced:
    """The fp32 step graph (and a vision tower's graph beside it, so the cache keeps both) into
    `folder`: a cache staging folder, or scratch."""
    cache_off = folder.name == SCRATCH_DIR
    progress("export", "tracing the step graph to ONNX" + (" (export cache off)" if cache_off else ""))
    kv, state = cache_layouts(recipe, checkpoint)
    engine = export_step_graph(model, checkpoint.architecture, kv, folder, state=state)
    tower = build_vision_tower(checkpoint.model_config, checkpoint.tensors) if model.mrope_section else None
    if tower is not None:
        progress("export", "tracing the vision graph to ONNX")
        export_vision_graph(tower, folder)
    return Traced(folder / engine.file, engine, kv, state)


def quantize_step_graph(
    traced: Traced, precision: str, core: Path, progress: Progress, source_grid: bool = False
) -> Engine:
    """The core's step engine: the fp32 step graph at `precision`, written into the new core folder
    (source_grid: a pre-quantized checkpoint's grid blocks kept exactly, ignition.export.source_grid)."""
    progress("quantize", f"quantizing to {precision}")
    core.mkdir()
    quantize(traced.graph, core / traced.engine.file, precision, source_grid=source_grid)
    canonicalize_graph(core / traced.engine.file)
    data_files = sorted(p.name for p in core.iterdir() if p.name != traced.engine.file)
    return dataclasses.replace(traced.engine, data_files=data_files)


def add_score_graph(
    traced: Traced, checkpoint: Checkpoint, precision: str, work: Path, core: Path, progress: Progress
) -> Engine:
    """--prompt-logprobs' prompt-scoring engine, from the fp32 step graph's lm_head, quantized like it."""
    progress("export", "building the prompt-scoring graph (--prompt-logprobs)")
    try:
        head = lm_head_from_step_graph(traced.graph)
    except ValueError as exc:
        # e.g. Gemma 4 / Muse Spark soft-cap their logits after the lm_head: the score graph
        # would report other numbers than the step graph, so it is refused rather than wrong.
        raise ExportError(f"--prompt-logprobs is not supported for this family yet: {exc}") from None
    fp32_dir = work / SCORE_SCRATCH_DIR
    score = export_score_graph(head, checkpoint.architecture, fp32_dir)
    quantize_score(fp32_dir / score.file, core / score.file, precision)
    canonicalize_graph(core / score.file)
    score.data_files = [score.file + ".data"]
    shutil.rmtree(fp32_dir)
    return score


def add_vision_graph(
    traced: Traced, checkpoint: Checkpoint, limits: Limits, core: Path, progress: Progress
) -> VisionGraph | None:
    """A multimodal core's vision graph (traced beside the fp32 step graph) and its manifest
    section; None without one. The tower stays fp32: it runs once per image, not once per token."""
    source = traced.graph.parent / VISION_GRAPH_FILE
    if not source.is_file():
        return None
    progress("export", "adding the vision graph")
    for name in (VISION_GRAPH_FILE, VISION_GRAPH_FILE + ".data"):
        shutil.copyfile(source.parent / name, core / name)
    engine = vision_engine(onnx.load(str(source), load_external_data=False))
    return VisionGraph(engine, vision_spec(checkpoint, engine, limits.context_length))


def trace_torch_program(
    checkpoint: Checkpoint, traced: Traced, model: TorchModel, dtype: str, path: Path, progress: Progress
) -> Path:
    """--target cuda: the torch step program of the same model with `dtype` weights, written to
    `path` (beside the fp32 graph when the export cache keeps it)."""
    progress("export", f"exporting the {dtype} torch step program (--target cuda)")
    try:
        torch_program_engine(checkpoint.architecture, traced.kv, dtype, traced.state, traced.vision)  # refusals first
        export_torch_program(
            model.get(), checkpoint.architecture, traced.kv, path.parent, dtype, traced.state, file_name=path.name
        )
    except TorchExportError as exc:
        raise ExportError(str(exc)) from None
    return path


def add_torch_program(program: Path, checkpoint: Checkpoint, traced: Traced, dtype: str, core: Path) -> Engine:
    """The torch program's engine, its file copied into the core beside the ONNX graph."""
    try:
        engine = torch_program_engine(checkpoint.architecture, traced.kv, dtype, traced.state, traced.vision)
    except TorchExportError as exc:
        raise ExportError(str(exc)) from None
    shutil.copyfile(program, core / engine.file)
    return engine


def free_scratch(scratch: Path) -> None:
    """Delete the scratch fp32 step graph once quantize, score and the torch program have read it:
    the disk is better spent on validation (a 0.5B model's fp32 graph is ~2 GB)."""
    if scratch.exists():
        shutil.rmtree(scratch)


def validate_engines(
    manifest: Manifest,
    checkpoint: Checkpoint,
    reference: Reference | None,
    model: TorchModel,
    core: Path,
    progress: Progress,
) -> Manifest:
    """The manifest with the engines' parity with the reference recorded; raises ParityError.

    `reference` is None, or replays logits for other tokens (ReferenceMiss), only on an export-
    cache hit: then the step graph is held to a model read from the checkpoint itself."""
    label = "cached torch reference" if isinstance(reference, CachedReference) else "torch reference"
    progress("validate", f"comparing engine logits with the {label}")
    kv, state, precision = manifest.kv, manifest.state, manifest.precision
    step_graph = core / manifest.engines[0].file
    prompt_ids = validation_prompt(core / manifest.tokenizer.file, checkpoint)
    try:
        if reference is None:
            raise ReferenceMiss("the cache entry has no reference logits")
        parity = validate(step_graph, reference, kv, prompt_ids, precision=precision, state=state)
    except ReferenceMiss:
        progress("validate", "cached reference does not apply: reading the checkpoint for the reference")
        fresh = build_model(*load_checkpoint(model.spec).model_inputs())
        parity = validate(step_graph, fresh, kv, prompt_ids, precision=precision, state=state)
    engines = []
    for engine in manifest.engines:
        if engine.target == "cuda":
            progress("validate", f"comparing the torch step program ({engine.dtype}) with the {label}")
            dtype = engine.dtype or "float32"
            engine = dataclasses.replace(
                engine, parity=_validate_torch_program(manifest, reference, model, core, dtype, prompt_ids)
            )
        engines.append(engine)
    if manifest.logprobs.prompt_logprobs:
        progress("validate", "checking prompt scores against the step graph's logprobs")
        validate_scores(step_graph, core / manifest.engine("score").file, kv, prompt_ids, state=state)
    return dataclasses.replace(manifest, engines=engines, parity=parity)


def _validate_torch_program(
    manifest: Manifest,
    reference: Reference | None,
    model: TorchModel,
    core: Path,
    dtype: str,
    prompt_ids: list[int],
) -> Parity:
    """The torch program on CPU torch, through helios' torch runner, against the reference."""
    precision, runner = TORCH_PROGRAM_PRECISION[dtype], torch_program_runners(core, manifest)
    kv, state = manifest.kv, manifest.state
    try:
        if reference is None:
            raise ReferenceMiss("the cache entry has no reference logits")
        return validate(core, reference, kv, prompt_ids, precision=precision, state=state, make_runner=runner)
    except ReferenceMiss:
        return validate(core, model.get(), kv, prompt_ids, precision=precision, state=state, make_runner=runner)


def write_core(manifest: Manifest, core: Path, out: Path, force: bool, progress: Progress) -> None:
    progress("write", f"writing {out}")
    manifest.seal(core)
    manifest.save(core)  # last: until now the folder had no core.json
    publish(core, out, force)

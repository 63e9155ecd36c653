"""The export stages, each a function of the ExportState (state.py) that reads what earlier
stages set and sets its own part; pipeline.py runs them in order:

    read -> convert -> trace -> quantize -> score -> validate -> write

The export cache (cache.py) stands in for read, convert and trace on a hit; between score and
validate the pipeline assembles the manifest (manifest.py). Progress is reported under the
CLI's stage names (pipeline.STAGES): trace and score as "export".
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import onnx

from helios.manifest import Parity
from ignition.checkpoints.load import load_checkpoint
from ignition.export.cache import CachedReference, ReferenceMiss
from ignition.export.graph import canonicalize_graph, export_step_graph
from ignition.export.manifest import cache_layouts
from ignition.export.output import publish
from ignition.export.quantize import quantize, quantize_score
from ignition.export.score import export_score_graph, lm_head_from_step_graph
from ignition.export.state import ExportError, ExportState
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

SCORE_SCRATCH_DIR = "score-fp32"  # in the work folder: the fp32 score graph before quantization


def read_checkpoint(state: ExportState) -> None:
    state.progress("read", f"reading {state.options.checkpoint}")
    state.checkpoint = load_checkpoint(state.options.checkpoint)


def convert_model(state: ExportState) -> None:
    checkpoint = state.checkpoint
    assert checkpoint is not None
    state.progress("convert", f"building {state.recipe.family} model ({checkpoint.architecture.num_layers} layers)")
    state.model = build_model(*checkpoint.model_inputs())
    state.reference = state.model  # validation compares the engine with this very model


def trace_step_graph(state: ExportState) -> None:
    """The fp32 step graph, into state.fp32_dir (a cache staging folder, or scratch)."""
    checkpoint, model = state.checkpoint, state.model
    assert checkpoint is not None and model is not None
    cache_off = state.fp32_dir == state.scratch_dir
    state.progress("export", "tracing the step graph to ONNX" + (" (export cache off)" if cache_off else ""))
    state.kv, state.state_layout = cache_layouts(state.recipe, checkpoint)
    engine = export_step_graph(model, checkpoint.architecture, state.kv, state.fp32_dir, state=state.state_layout)
    state.fp32_engine, state.fp32_graph = engine, state.fp32_dir / engine.file
    tower = build_vision_tower(checkpoint.model_config, checkpoint.tensors) if model.mrope_section else None
    if tower is not None:  # beside the step graph, so the export cache keeps it too
        state.progress("export", "tracing the vision graph to ONNX")
        export_vision_graph(tower, state.fp32_dir)


def add_vision_graph(state: ExportState) -> None:
    """A multimodal core's vision graph (traced beside the fp32 step graph) and its manifest
    section. The tower stays fp32: it runs once per image, not once per token."""
    assert state.fp32_graph is not None and state.checkpoint is not None and state.limits is not None
    source = state.fp32_graph.parent / VISION_GRAPH_FILE
    if not source.is_file():
        return
    state.progress("export", "adding the vision graph")
    for name in (VISION_GRAPH_FILE, VISION_GRAPH_FILE + ".data"):
        shutil.copyfile(source.parent / name, state.core_dir / name)
    engine = vision_engine(onnx.load(str(source), load_external_data=False))
    state.engines.append(engine)
    state.vision = vision_spec(state.checkpoint, engine, state.limits.context_length)


def add_torch_program(state: ExportState) -> None:
    """With --target cuda: the torch step program of the same model, beside the ONNX graph.

    Traced beside the fp32 ONNX graph, so the export cache keeps it with a fresh entry; an entry
    cached without it (an earlier cpu-only export) has the checkpoint read and converted again."""
    if "cuda" not in state.options.targets:
        return
    checkpoint, kv, graph = state.checkpoint, state.kv, state.fp32_graph
    assert checkpoint is not None and kv is not None and graph is not None
    dtype = state.options.torch_dtype
    cached = graph.parent / f"step.cuda.{dtype}.pt2"  # the cache entry's (or staging's, or scratch's)
    if cached.is_file():
        state.progress("export", f"cached {dtype} torch step program")
    else:
        state.progress("export", f"exporting the {dtype} torch step program (--target cuda)")
        cached = state.fp32_dir / cached.name  # staging on a miss: committed with the entry
    try:
        engine = torch_program_engine(checkpoint.architecture, kv, dtype, state.state_layout, _vision(state))
        if not cached.is_file():
            export_torch_program(
                _torch_model(state),
                checkpoint.architecture,
                kv,
                cached.parent,
                dtype,
                state.state_layout,
                file_name=cached.name,
            )
    except TorchExportError as exc:
        raise ExportError(str(exc)) from None
    shutil.copyfile(cached, state.core_dir / engine.file)
    state.engines.append(engine)


def _vision(state: ExportState) -> bool:
    """A multimodal step graph (it takes image features): the program takes them too."""
    assert state.fp32_engine is not None
    return any(spec.name == "image_embeds" for spec in state.fp32_engine.inputs)


def quantize_step_graph(state: ExportState) -> None:
    """The core's step engine: the fp32 step graph at the requested precision."""
    precision, fp32_engine, fp32_graph = state.options.precision, state.fp32_engine, state.fp32_graph
    assert fp32_engine is not None and fp32_graph is not None
    state.progress("quantize", f"quantizing to {precision}")
    core = state.core_dir
    core.mkdir()
    quantize(fp32_graph, core / fp32_engine.file, precision)
    canonicalize_graph(core / fp32_engine.file)
    data_files = sorted(p.name for p in core.iterdir() if p.name != fp32_engine.file)
    state.engines = [dataclasses.replace(fp32_engine, data_files=data_files)]


def add_score_graph(state: ExportState) -> None:
    """With --prompt-logprobs: the prompt-scoring engine, from the fp32 step graph's lm_head,
    quantized like it."""
    if not state.options.prompt_logprobs:
        return
    assert state.fp32_graph is not None and state.checkpoint is not None
    state.progress("export", "building the prompt-scoring graph (--prompt-logprobs)")
    try:
        head = lm_head_from_step_graph(state.fp32_graph)
    except ValueError as exc:
        # e.g. Gemma 4 / Muse Spark soft-cap their logits after the lm_head: the score graph
        # would report other numbers than the step graph, so it is refused rather than wrong.
        raise ExportError(f"--prompt-logprobs is not supported for this family yet: {exc}") from None
    fp32_dir, core = state.work / SCORE_SCRATCH_DIR, state.core_dir
    score = export_score_graph(head, state.checkpoint.architecture, fp32_dir)
    quantize_score(fp32_dir / score.file, core / score.file, state.options.precision)
    canonicalize_graph(core / score.file)
    score.data_files = [score.file + ".data"]
    shutil.rmtree(fp32_dir)
    state.engines.append(score)


def free_scratch(state: ExportState) -> None:
    """Delete the scratch fp32 step graph once quantize and score have read it: the disk is
    better spent on validation (a 0.5B model's fp32 graph is ~2 GB)."""
    if state.scratch_dir.exists():
        shutil.rmtree(state.scratch_dir)


def validate_engines(state: ExportState) -> None:
    """The engines' parity with the reference, recorded in the manifest; raises ParityError."""
    checkpoint, manifest, kv = state.checkpoint, state.manifest, state.kv
    assert checkpoint is not None and manifest is not None and kv is not None
    cached = isinstance(state.reference, CachedReference)
    reference = "cached torch reference" if cached else "torch reference"
    state.progress("validate", f"comparing engine logits with the {reference}")
    core, precision = state.core_dir, state.options.precision
    step_graph = core / state.engines[0].file
    prompt_ids = validation_prompt(core / manifest.tokenizer.file, checkpoint)
    try:
        if state.reference is None:
            raise ReferenceMiss("the cache entry has no reference logits")
        parity = validate(step_graph, state.reference, kv, prompt_ids, precision=precision, state=state.state_layout)
    except ReferenceMiss:
        # Only a cache hit gets here: rebuild the reference from the checkpoint itself.
        state.progress("validate", "cached reference does not apply: reading the checkpoint for the reference")
        model = build_model(*load_checkpoint(state.options.checkpoint).model_inputs())
        parity = validate(step_graph, model, kv, prompt_ids, precision=precision, state=state.state_layout)
    for engine in (e for e in manifest.engines if e.target == "cuda"):
        state.progress("validate", f"comparing the torch step program ({engine.dtype}) with the {reference}")
        engine.parity = _validate_torch_program(state, engine.dtype or "float32", prompt_ids)
    if state.options.prompt_logprobs:
        state.progress("validate", "checking prompt scores against the step graph's logprobs")
        validate_scores(step_graph, core / state.engines[1].file, kv, prompt_ids, state=state.state_layout)
    manifest.parity = parity


def _validate_torch_program(state: ExportState, dtype: str, prompt_ids: list[int]) -> Parity:
    """The torch program on CPU torch, through helios' torch runner, against the reference."""
    manifest, kv = state.manifest, state.kv
    assert manifest is not None and kv is not None
    precision = TORCH_PROGRAM_PRECISION[dtype]
    runner = torch_program_runners(state.core_dir, manifest)

    try:
        if state.reference is None:
            raise ReferenceMiss("the cache entry has no reference logits")
        return validate(
            state.core_dir,
            state.reference,
            kv,
            prompt_ids,
            precision=precision,
            state=state.state_layout,
            make_runner=runner,
        )
    except ReferenceMiss:
        return validate(
            state.core_dir,
            _torch_model(state),
            kv,
            prompt_ids,
            precision=precision,
            state=state.state_layout,
            make_runner=runner,
        )


def _torch_model(state: ExportState) -> DecoderLM:
    """The converted model; on an export-cache hit nothing was converted, so read and build it."""
    if state.model is None:
        state.progress("export", "cached trace: reading the checkpoint for the torch program")
        state.model = build_model(*load_checkpoint(state.options.checkpoint).model_inputs())
    return state.model


def write_core(state: ExportState) -> None:
    manifest, out = state.manifest, Path(state.options.out)
    assert manifest is not None
    state.progress("write", f"writing {out}")
    manifest.seal(state.core_dir)
    manifest.save(state.core_dir)  # last: until now the folder had no core.json
    publish(state.core_dir, out, state.options.force)

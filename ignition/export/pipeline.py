"""The export pipeline: recipe + checkpoint -> core folder, stage by stage.

Stages: read -> convert -> export -> quantize -> validate -> write.

Release-artifact rules (docs/cores.md):
- Reproducible: the same checkpoint, recipe, flags and toolchain give byte-identical files and
  core.json (no timestamps, no absolute paths, sorted JSON, the exporter's source-location
  metadata stripped from the graph, deterministic names and external-data layout).
- Atomic: the core is assembled in a hidden temporary sibling (`.NAME.partial-PID-HOST-*`),
  core.json is written last and the folder is renamed into place, so a failed or interrupted
  export never leaves a folder that looks like a core. Leftovers of dead exports are removed
  by the next export to the same place. An existing --out is replaced only with force, and
  only when it is a core (or empty).
- Cached: read/convert/export results are reused from the export cache (cache.py) by content
  hash, unless ExportOptions.cache is False (--no-cache).
"""

from __future__ import annotations

import copy
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import onnx

from helios.manifest import (
    MANIFEST_NAME,
    Identity,
    KVLayout,
    Limits,
    Logprobs,
    Manifest,
    Parsers,
    Sampling,
    StateLayout,
    TemplateSpec,
    TokenizerSpec,
)
from ignition.checkpoints.base import Checkpoint
from ignition.export import cache as export_cache
from ignition.recipes import Recipe

STAGES = ("read", "convert", "export", "quantize", "validate", "write")
PRECISIONS = ("int4", "int8", "fp32")
VALIDATION_PROMPT = (
    "<|im_start|>user\nWrite a Python function that returns the sum of a list.<|im_end|>\n"
    "<|im_start|>assistant\n"
)
TOP_LOGPROBS = 20
MAX_EXPLICIT_TOKEN_IDS = 128  # api.md: logprob_token_ids takes at most 128 ids
GRAPH_FILE = "step.onnx"
# Graph metadata the exporter adds that is not part of the model: source file paths and line
# numbers (they differ between checkouts and virtual environments of the same code).
STRIPPED_METADATA = ("pkg.torch.onnx.stack_trace",)


class ExportError(RuntimeError):
    pass


@dataclass
class ExportOptions:
    recipe: Recipe
    checkpoint: str  # packaged name, .gguf file or Hugging Face folder
    out: Path
    precision: str = "int4"
    prompt_logprobs: bool = False
    force: bool = False
    cache: bool = True  # reuse/populate the export cache ($FLARE_CACHE/export)
    context_length: int | None = None  # narrows the checkpoint's native context (--context-length)


Progress = Callable[[str, str], None]  # (stage, detail)


def export_core(options: ExportOptions, progress: Progress = lambda stage, detail: None) -> Manifest:
    from ignition.checkpoints.load import load_checkpoint, peek_config, peek_family
    from ignition.export.graph import export_step_graph
    from ignition.export.quantize import manifest_quantization, quantize
    from ignition.export.validate import ParityError, validate_scores
    from ignition.models import logit_postprocessing
    from ignition.models import build_model

    recipe, out = options.recipe, Path(options.out)
    if options.precision not in PRECISIONS:
        raise ExportError(f"unknown precision {options.precision!r} (choose {', '.join(PRECISIONS)})")
    from ignition.models import PLANNED

    if recipe.family in PLANNED:
        raise ExportError(
            f"recipe {recipe.name!r} compiles the {recipe.family!r} family, which cannot be compiled yet: "
            f"missing {PLANNED[recipe.family]} (docs/recipes.md)"
        )
    if not options.checkpoint:
        raise ExportError(f"recipe {recipe.name!r} has no default checkpoint: pass --checkpoint")
    check_out(out, options.force)
    family = peek_family(options.checkpoint)
    if family != recipe.family:
        raise ExportError(
            f"checkpoint {options.checkpoint} is a {family!r} model but recipe {recipe.name!r} compiles {recipe.family!r}"
        )
    if options.prompt_logprobs and (reason := logit_postprocessing(family, peek_config(options.checkpoint))):
        raise ExportError(f"--prompt-logprobs is not supported for this family ({family}): {reason}, "
                          "so prompt scores from the bare lm_head would differ from generation logprobs")

    out.parent.mkdir(parents=True, exist_ok=True)
    remove_dead_partials(out)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-{os.getpid()}-{socket.gethostname()}-", dir=out.parent))
    staging = None
    try:
        cache = export_cache.ExportCache() if options.cache else None
        source = key = entry = None
        seconds: dict[str, float] = {}  # of read/convert/export on a miss, kept in the cache entry
        if cache is not None:
            progress("read", f"looking up {options.checkpoint} in the export cache")
            source = export_cache.identify(options.checkpoint)
            key = export_cache.entry_key(source, recipe.limits.page_tokens, GRAPH_FILE) if source else None
            entry = cache.lookup(key) if key else None
        exported = None
        if entry is not None:
            assert source is not None
            progress("read", f"export cache hit {entry.key[:12]}: converted checkpoint, nothing read")
            checkpoint = entry.checkpoint(source)
            progress(
                "convert",
                f"skipped: cached (read+convert+export took {entry.saved_seconds:.1f}s when it was cached)",
            )
            reference = entry.reference()
            progress("export", f"skipped: cached fp32 step graph {entry.key[:12]}")
            engine, fp32_graph = entry.engine(), entry.graph
            kv, state = _cache_layouts(recipe, checkpoint)
        else:
            started = time.monotonic()
            progress("read", f"reading {options.checkpoint}")
            checkpoint = load_checkpoint(options.checkpoint)
            seconds["read"] = time.monotonic() - started
            if key is not None and source is not None and (source.checkpoint_id, source.sha256) == (
                checkpoint.checkpoint_id,
                checkpoint.sha256,
            ):
                try:
                    staging = cache.stage(key)
                except OSError:  # an unwritable cache only costs the reuse
                    staging = None

            started = time.monotonic()
            progress("convert", f"building {family} model ({checkpoint.architecture.num_layers} layers)")
            model = build_model(*checkpoint.model_inputs())
            seconds["convert"] = time.monotonic() - started

            started = time.monotonic()
            progress("export", "tracing the step graph to ONNX" + ("" if staging else " (export cache off)"))
            fp32_dir = staging.path if staging else work / "fp32"
            kv, state = _cache_layouts(recipe, checkpoint)
            engine = export_step_graph(model, checkpoint.architecture, kv, fp32_dir, file_name=GRAPH_FILE, state=state)
            fp32_graph = fp32_dir / engine.file
            seconds["export"] = time.monotonic() - started
            exported = copy.deepcopy(engine)  # as the fp32 graph has it, for the cache entry
            reference = export_cache.RecordingReference(model) if staging else model

        # Before quantization and validation: a --context-length past the native context stops here.
        limits = _limits(recipe, checkpoint, options.context_length)
        progress("quantize", f"quantizing to {options.precision}")
        engine_dir = work / "core"
        engine_dir.mkdir()
        quantize(fp32_graph, engine_dir / engine.file, options.precision)
        canonicalize_graph(engine_dir / engine.file)
        engine.data_files = sorted(p.name for p in engine_dir.iterdir() if p.name != engine.file)
        engines = [engine]
        if options.prompt_logprobs:
            progress("export", "building the prompt-scoring graph (--prompt-logprobs)")
            engines.append(_score_engine(fp32_graph, checkpoint.architecture, work / "score-fp32", engine_dir, options.precision))
        if staging is None and entry is None:
            shutil.rmtree(work / "fp32")  # free the disk before validation

        tokenizer_spec = _write_tokenizer(checkpoint, recipe, engine_dir)
        template_spec = _write_template(checkpoint, recipe, engine_dir)
        manifest = Manifest(
            identity=Identity(
                recipe=recipe.name,
                checkpoint_id=checkpoint.checkpoint_id,
                checkpoint_sha256=checkpoint.sha256,
                aliases=list(recipe.aliases),
            ),
            architecture=checkpoint.architecture,
            precision=options.precision,
            limits=limits,
            kv=kv,
            engines=engines,
            tokenizer=tokenizer_spec,
            template=template_spec,
            sampling=Sampling(defaults=recipe.sampling_defaults, ranges=dict(recipe.sampling_ranges)),
            parsers=Parsers(tool=recipe.tool_parser, reasoning=recipe.reasoning_parser),
            logprobs=Logprobs(
                max_top_logprobs=TOP_LOGPROBS,
                explicit_token_ids=True,
                prompt_logprobs=options.prompt_logprobs,
                max_explicit_token_ids=MAX_EXPLICIT_TOKEN_IDS,
            ),
            decode_weight_bytes=decode_weight_bytes(engine_dir / engine.file),
            toolchain=export_cache.toolchain(),
            state=state,
            quantization=manifest_quantization(options.precision),
        )

        cached_ref = entry is not None and reference is not None
        progress(
            "validate",
            "comparing engine logits with the "
            + ("cached torch reference" if cached_ref else "torch reference"),
        )
        prompt_ids = validation_prompt(engine_dir / tokenizer_spec.file, checkpoint)
        try:
            try:
                if reference is None:
                    raise export_cache.ReferenceMiss("the cache entry has no reference logits")
                parity = _validate(engine_dir / engine.file, reference, kv, prompt_ids, options.precision, state)
            except export_cache.ReferenceMiss:
                # Only a cache hit gets here: rebuild the reference from the checkpoint itself.
                progress("validate", "cached reference does not apply: reading the checkpoint for the reference")
                model = build_model(*load_checkpoint(options.checkpoint).model_inputs())
                parity = _validate(engine_dir / engine.file, model, kv, prompt_ids, options.precision, state)
            if options.prompt_logprobs:
                progress("validate", "checking prompt scores against the step graph's logprobs")
                validate_scores(engine_dir / engine.file, engine_dir / engines[1].file, kv, prompt_ids, state=state)
        except ParityError as exc:
            _commit(staging, checkpoint, exported, seconds, reference)
            raise ExportError(str(exc)) from None
        _commit(staging, checkpoint, exported, seconds, reference)
        manifest.parity = parity

        progress("write", f"writing {out}")
        manifest.seal(engine_dir)
        manifest.save(engine_dir)  # last: until now the folder had no core.json
        for path in engine_dir.rglob("*"):
            os.chmod(path, 0o755 if path.is_dir() else 0o644)
        os.chmod(engine_dir, 0o755)
        replace_into(engine_dir, out, options.force)
        return manifest
    finally:
        if staging is not None:
            staging.discard()
        shutil.rmtree(work, ignore_errors=True)


def _score_engine(fp32_step: Path, arch, fp32_dir: Path, engine_dir: Path, precision: str):  # noqa: ANN001, ANN202
    """Export the prompt-scoring head from the fp32 step graph's lm_head, quantized like it."""
    from ignition.export.quantize import quantize_score
    from ignition.export.score import export_score_graph, lm_head_from_step_graph

    try:
        head = lm_head_from_step_graph(fp32_step)
    except ValueError as exc:
        # e.g. Gemma 4 / Muse Spark soft-cap their logits after the lm_head: the score graph
        # would report other numbers than the step graph, so it is refused rather than wrong.
        raise ExportError(f"--prompt-logprobs is not supported for this family yet: {exc}") from None
    score = export_score_graph(head, arch, fp32_dir)
    quantize_score(fp32_dir / score.file, engine_dir / score.file, precision)
    canonicalize_graph(engine_dir / score.file)
    score.data_files = [score.file + ".data"]
    shutil.rmtree(fp32_dir)
    return score


def _cache_layouts(recipe: Recipe, checkpoint: Checkpoint) -> tuple[KVLayout, StateLayout | None]:
    """The paged KV pool's geometry and the recurrent state layout (None for attention-only
    families): recurrent layers have no K/V rows (docs/architecture.md)."""
    from ignition.models import cache_layout

    arch = checkpoint.architecture
    kv_layers, state = cache_layout(arch.family, checkpoint.model_config, arch.num_layers)
    kv = KVLayout(page_tokens=recipe.limits.page_tokens, num_layers=kv_layers, kv_heads=arch.num_kv_heads,
                  head_dim=arch.head_dim)  # fmt: skip
    return kv, state


def _validate(graph: Path, reference, kv: KVLayout, prompt_ids: list[int], precision: str, state=None):  # noqa: ANN001, ANN202
    from ignition.export.validate import validate

    return validate(graph, reference, kv, prompt_ids, precision=precision, state=state)


def _commit(staging, checkpoint: Checkpoint, engine, seconds: dict[str, float], reference) -> None:  # noqa: ANN001
    """Put a fresh export's reusable work into the cache (a failure here never fails the export)."""
    if staging is None:
        return
    recorder = reference if isinstance(reference, export_cache.RecordingReference) else None
    try:
        staging.commit(checkpoint, engine, seconds, recorder)
    except OSError:
        staging.discard()


# -- atomic output ----------------------------------------------------------------------------


def check_out(out: Path, force: bool) -> None:
    """Refuse an existing --out without force, and anything but a core or an empty folder with it."""
    if not (out.exists() or out.is_symlink()):
        return
    if not force:
        raise ExportError(f"{out} already exists; pass --force to replace it")
    if not out.is_dir():
        raise ExportError(f"refusing to replace {out}: it is not a folder")
    if not (out / MANIFEST_NAME).is_file() and any(out.iterdir()):
        raise ExportError(f"refusing to replace {out}: it is not a core (no {MANIFEST_NAME}) and not empty")


def replace_into(folder: Path, out: Path, force: bool) -> None:
    """Rename the finished `folder` to `out`; an existing core is moved aside first and deleted
    after, so `out` is at every moment either the old core or the new one."""
    if not (out.exists() or out.is_symlink()):
        os.rename(folder, out)
        return
    check_out(out, force)
    aside = out.parent / f".{out.name}.old-{os.getpid()}-{socket.gethostname()}-{time.monotonic_ns()}"
    os.rename(out, aside)
    try:
        os.rename(folder, out)
    except BaseException:  # noqa: BLE001 - interrupted too: put the old core back
        os.rename(aside, out)
        raise
    shutil.rmtree(aside, ignore_errors=True)


def remove_dead_partials(out: Path) -> None:
    """Remove `.NAME.partial-*` / `.NAME.old-*` siblings left by exports that died on this host."""
    if not out.parent.is_dir():
        return
    for kind in ("partial", "old"):
        prefix = f".{out.name}.{kind}-"
        for path in out.parent.glob(prefix + "*"):
            fields = path.name[len(prefix) :].split("-", 1)
            if not export_cache.owner_alive(fields):
                shutil.rmtree(path, ignore_errors=True)


def canonicalize_graph(path: Path) -> None:
    """Strip metadata that records where the exporter ran, not what it built (see
    STRIPPED_METADATA), rewriting only the graph file: the weights file is untouched."""
    model = onnx.load(str(path), load_external_data=False)
    changed = False

    def strip(props) -> None:  # noqa: ANN001
        nonlocal changed
        keep = [p for p in props if p.key not in STRIPPED_METADATA]
        if len(keep) != len(props):
            kept = [(p.key, p.value) for p in keep]
            del props[:]
            for k, v in kept:
                props.add(key=k, value=v)
            changed = True

    def walk(graph: onnx.GraphProto) -> None:
        strip(graph.metadata_props)
        for value in (*graph.input, *graph.output, *graph.value_info, *graph.initializer):
            strip(value.metadata_props)
        for node in graph.node:
            strip(node.metadata_props)
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    walk(attr.g)
                for sub in attr.graphs:
                    walk(sub)

    strip(model.metadata_props)
    walk(model.graph)
    for function in model.functions:
        strip(function.metadata_props)
        for node in function.node:
            strip(node.metadata_props)
    if changed:
        path.write_bytes(model.SerializeToString())


def serving_context(recipe: Recipe, native: int, requested: int | None) -> int:
    """The core's prompt+output limit: the checkpoint's native context, narrowed by the recipe or
    by --context-length; never wider than what the checkpoint was trained for."""
    if requested is not None and not 0 < requested <= native:
        raise ExportError(f"--context-length {requested} must lie in 1..{native} (the checkpoint's native context)")
    return min(requested or recipe.limits.context_length or native, native)


def _limits(recipe: Recipe, checkpoint: Checkpoint, requested_context: int | None) -> Limits:
    lim = recipe.limits
    context = serving_context(recipe, checkpoint.architecture.max_position_embeddings, requested_context)
    # The default pool holds two full-context sequences (a long agent session and one more).
    full_context_pages = -(-context // lim.page_tokens)
    return Limits(
        context_length=context,
        max_concurrency=lim.max_concurrency,
        prefill_chunk_size=lim.prefill_chunk_size,
        max_batch_tokens=lim.max_batch_tokens,
        default_max_tokens=min(lim.default_max_tokens, context),
        kv_pages=max(lim.kv_pages, 2 * full_context_pages),
    )


def _write_tokenizer(checkpoint: Checkpoint, recipe: Recipe, folder: Path) -> TokenizerSpec:
    from tokenizers import Tokenizer

    (folder / "tokenizer.json").write_text(checkpoint.tokenizer_json)
    tokenizer = Tokenizer.from_str(checkpoint.tokenizer_json)
    eos = list(checkpoint.eos_token_ids)
    for text in recipe.eos_tokens:
        token_id = tokenizer.token_to_id(text)
        if token_id is None:
            raise ExportError(f"recipe {recipe.name} names stop token {text!r}, which the tokenizer lacks")
        if token_id not in eos:
            eos.append(token_id)
    specials = {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    return TokenizerSpec(
        file="tokenizer.json",
        bos_token_id=checkpoint.bos_token_id,
        eos_token_ids=eos,
        pad_token_id=checkpoint.pad_token_id,
        add_bos=checkpoint.add_bos if recipe.add_bos is None else recipe.add_bos,
        special_tokens=dict(sorted(specials.items(), key=lambda kv: kv[1])),
    )


def _write_template(checkpoint: Checkpoint, recipe: Recipe, folder: Path) -> TemplateSpec:
    if recipe.template_source == "checkpoint":
        source = checkpoint.chat_template
        if not source and recipe.template_fallback:  # e.g. tiny test checkpoints (docs/recipes.md)
            source = (recipe.path.parent / recipe.template_fallback).read_text()
    else:
        source = (recipe.path.parent / recipe.template_source).read_text()
    if not source:
        return TemplateSpec(file=None, supports_system=False, supports_tools=False)
    (folder / "chat_template.jinja").write_text(source)
    return TemplateSpec(
        file="chat_template.jinja",
        supports_system=recipe.supports_system,
        supports_tools=recipe.supports_tools,
        numeric_effort=list(numeric) if (numeric := recipe.reasoning and recipe.reasoning.numeric_effort) else None,
    )


def validation_prompt(tokenizer_file: Path, checkpoint: Checkpoint) -> list[int]:
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(tokenizer_file)).encode(VALIDATION_PROMPT, add_special_tokens=False).ids
    vocab = checkpoint.architecture.vocab_size
    return [i for i in ids if i < vocab]


def decode_weight_bytes(onnx_path: Path) -> int:
    """Bytes of weights one decode step reads for one request.

    Every initializer counts in full except embedding tables read by Gather, of which a decode
    step reads one row (for a 4-bit table, GatherBlockQuantized: one row of its data, scales and
    zero points).
    """
    model = onnx.load(str(onnx_path), load_external_data=False)
    gathered = {node.input[0] for node in model.graph.node if node.op_type == "Gather"}
    for node in model.graph.node:
        if node.op_type == "GatherBlockQuantized":  # inputs: data, indices, scales[, zero_points]
            gathered.update(name for i, name in enumerate(node.input) if i != 1 and name)
    total = 0
    for init in model.graph.initializer:
        size = _initializer_bytes(init)
        if init.name in gathered and len(init.dims) == 2:
            size //= max(int(init.dims[0]), 1)
        total += size
    return total


def _initializer_bytes(init: onnx.TensorProto) -> int:
    for entry in init.external_data:
        if entry.key == "length":
            return int(entry.value)
    if init.raw_data:
        return len(init.raw_data)
    count = 1
    for d in init.dims:
        count *= int(d)
    return count * onnx.helper.tensor_dtype_to_np_dtype(init.data_type).itemsize

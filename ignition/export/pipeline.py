"""The export pipeline: recipe + checkpoint -> core folder, stage by stage.

Stages: read -> convert -> export -> quantize -> validate -> write. The core is assembled in a
temporary sibling folder and renamed into place at the end, so a failed or interrupted export
never leaves a folder that looks like a core.
"""

from __future__ import annotations

import importlib.metadata
import shutil
import tempfile
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
    TemplateSpec,
    TokenizerSpec,
    file_sha256,
)
from ignition.checkpoints.base import Checkpoint
from ignition.recipes import Recipe

STAGES = ("read", "convert", "export", "quantize", "validate", "write")
PRECISIONS = ("int4", "int8", "fp32")
VALIDATION_PROMPT = (
    "<|im_start|>user\nWrite a Python function that returns the sum of a list.<|im_end|>\n"
    "<|im_start|>assistant\n"
)
TOP_LOGPROBS = 20


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


Progress = Callable[[str, str], None]  # (stage, detail)


def export_core(options: ExportOptions, progress: Progress = lambda stage, detail: None) -> Manifest:
    from ignition.checkpoints.load import load_checkpoint, peek_family
    from ignition.export.graph import export_step_graph
    from ignition.export.quantize import quantize
    from ignition.export.validate import ParityError, validate
    from ignition.models import build_model

    recipe, out = options.recipe, Path(options.out)
    if options.precision not in PRECISIONS:
        raise ExportError(f"unknown precision {options.precision!r} (choose {', '.join(PRECISIONS)})")
    if options.prompt_logprobs:
        raise ExportError("--prompt-logprobs (scored prefill graphs) is not implemented yet")
    if out.exists() and not options.force:
        raise ExportError(f"{out} already exists; pass --force to replace it")
    family = peek_family(options.checkpoint)
    if family != recipe.family:
        raise ExportError(
            f"checkpoint {options.checkpoint} is a {family!r} model but recipe {recipe.name!r} compiles {recipe.family!r}"
        )

    progress("read", f"reading {options.checkpoint}")
    checkpoint = load_checkpoint(options.checkpoint)

    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        progress("convert", f"building {family} model ({checkpoint.architecture.num_layers} layers)")
        model = build_model(checkpoint)
        kv = KVLayout(
            page_tokens=recipe.limits.page_tokens,
            num_layers=checkpoint.architecture.num_layers,
            kv_heads=checkpoint.architecture.num_kv_heads,
            head_dim=checkpoint.architecture.head_dim,
        )
        progress("export", "tracing the step graph to ONNX")
        fp32_dir = work / "fp32"
        fp32_dir.mkdir()
        engine = export_step_graph(model, checkpoint.architecture, kv, fp32_dir, file_name="step.onnx")

        progress("quantize", f"quantizing to {options.precision}")
        engine_dir = work / "core"
        engine_dir.mkdir()
        quantize(fp32_dir / engine.file, engine_dir / engine.file, options.precision)
        shutil.rmtree(fp32_dir)
        engine.data_files = sorted(p.name for p in engine_dir.iterdir() if p.name != engine.file)

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
            limits=_limits(recipe, checkpoint),
            kv=kv,
            engines=[engine],
            tokenizer=tokenizer_spec,
            template=template_spec,
            sampling=Sampling(defaults=recipe.sampling_defaults, ranges=dict(recipe.sampling_ranges)),
            parsers=Parsers(tool=recipe.tool_parser, reasoning=recipe.reasoning_parser),
            logprobs=Logprobs(max_top_logprobs=TOP_LOGPROBS, explicit_token_ids=False, prompt_logprobs=False),
            decode_weight_bytes=decode_weight_bytes(engine_dir / engine.file),
            toolchain=_toolchain(),
        )
        manifest.save(engine_dir)  # validation loads the core the way helios will

        progress("validate", "comparing engine logits with the torch reference")
        prompt_ids = _validation_prompt(engine_dir / tokenizer_spec.file, checkpoint)
        try:
            manifest.parity = validate(engine_dir, model, kv, prompt_ids, precision=options.precision)
        except ParityError as exc:
            raise ExportError(str(exc)) from None

        progress("write", f"writing {out}")
        manifest.files = {
            p.relative_to(engine_dir).as_posix(): file_sha256(p)
            for p in sorted(engine_dir.rglob("*"))
            if p.is_file() and p.name != MANIFEST_NAME
        }
        manifest.save(engine_dir)
        if out.exists():
            shutil.rmtree(out)
        engine_dir.rename(out)
        return manifest
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _limits(recipe: Recipe, checkpoint: Checkpoint) -> Limits:
    lim = recipe.limits
    context = min(lim.context_length, checkpoint.architecture.max_position_embeddings)
    return Limits(
        context_length=context,
        max_concurrency=lim.max_concurrency,
        prefill_chunk_size=lim.prefill_chunk_size,
        max_batch_tokens=lim.max_batch_tokens,
        default_max_tokens=min(lim.default_max_tokens, context),
        kv_pages=lim.kv_pages,
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
    else:
        source = (recipe.path.parent / recipe.template_source).read_text()
    if not source:
        return TemplateSpec(file=None, supports_system=False, supports_tools=False)
    (folder / "chat_template.jinja").write_text(source)
    return TemplateSpec(
        file="chat_template.jinja",
        supports_system=recipe.supports_system,
        supports_tools=recipe.supports_tools,
    )


def _validation_prompt(tokenizer_file: Path, checkpoint: Checkpoint) -> list[int]:
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(tokenizer_file)).encode(VALIDATION_PROMPT, add_special_tokens=False).ids
    vocab = checkpoint.architecture.vocab_size
    return [i for i in ids if i < vocab]


def decode_weight_bytes(onnx_path: Path) -> int:
    """Bytes of weights one decode step reads for one request.

    Every initializer counts in full except embedding tables read by Gather, of which a decode
    step reads one row.
    """
    model = onnx.load(str(onnx_path), load_external_data=False)
    gathered = {node.input[0] for node in model.graph.node if node.op_type == "Gather"}
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


def _toolchain() -> dict[str, str]:
    versions = {}
    for package in ("flare", "torch", "onnx", "onnxruntime", "gguf", "tokenizers"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            pass
    return versions

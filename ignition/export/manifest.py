"""The ignition side of core.json: every `helios.manifest.Manifest` field an export fills, from
the stages' products (the schema itself is helios/manifest.py, shared with helios).

assemble() builds the manifest once the engines are in the core; validate adds `parity` and
write seals it (`files`, `digest`, `content_digest`). The cache layouts and limits are computed
earlier, because trace and the --context-length check need them.
"""

from __future__ import annotations

from pathlib import Path

import onnx
from tokenizers import Tokenizer

from helios.manifest import (
    Engine,
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
    Vision,
)
from ignition.checkpoints.base import Checkpoint
from ignition.export.options import ExportError, ExportOptions
from ignition.export.quantize import manifest_quantization
from ignition.export.toolchain import toolchain
from ignition.models import attention_window, cache_layout
from ignition.recipes import Recipe

TOP_LOGPROBS = 20
MAX_EXPLICIT_TOKEN_IDS = 128  # api.md: logprob_token_ids takes at most 128 ids


def assemble(
    options: ExportOptions,
    checkpoint: Checkpoint,
    limits: Limits,
    kv: KVLayout,
    state: StateLayout | None,
    engines: list[Engine],
    vision: Vision | None,
    core: Path,
) -> Manifest:
    """The core's manifest without parity; writes the tokenizer and chat template it names."""
    recipe = options.recipe
    tokenizer = write_tokenizer(checkpoint, recipe, core)
    template = write_template(checkpoint, recipe, core)
    return Manifest(
        identity=Identity(
            recipe=recipe.name,
            checkpoint_id=checkpoint.checkpoint_id,
            checkpoint_sha256=checkpoint.sha256,
            aliases=list(recipe.aliases),
            source_format=checkpoint.source_format,
            source_quantization=checkpoint.source_quantization,
        ),
        architecture=checkpoint.architecture,
        precision=options.precision,
        limits=limits,
        kv=kv,
        engines=engines,
        tokenizer=tokenizer,
        template=template,
        sampling=Sampling(defaults=recipe.sampling_defaults, ranges=dict(recipe.sampling_ranges)),
        parsers=Parsers(tool=recipe.tool_parser, reasoning=recipe.reasoning_parser),
        logprobs=Logprobs(
            max_top_logprobs=TOP_LOGPROBS,
            explicit_token_ids=True,
            prompt_logprobs=options.prompt_logprobs,
            max_explicit_token_ids=MAX_EXPLICIT_TOKEN_IDS,
        ),
        decode_weight_bytes=decode_weight_bytes(core / engines[0].file),
        toolchain=toolchain(),
        state=state,
        quantization=manifest_quantization(options.precision),
        vision=vision,
    )


def cache_layouts(recipe: Recipe, checkpoint: Checkpoint) -> tuple[KVLayout, StateLayout | None]:
    """The paged KV pool's geometry and the recurrent state layout (None for attention-only
    families): recurrent layers have no K/V rows (docs/architecture.md)."""
    arch = checkpoint.architecture
    kv_layers, state = cache_layout(arch.family, checkpoint.model_config, arch.num_layers)
    kv = KVLayout(
        page_tokens=recipe.limits.page_tokens,
        num_layers=kv_layers,
        kv_heads=arch.num_kv_heads,
        head_dim=arch.head_dim,
        window=attention_window(arch.family, checkpoint.model_config),
    )
    return kv, state


def serving_context(recipe: Recipe, native: int, requested: int | None) -> int:
    """The core's prompt+output limit: the checkpoint's native context, narrowed by the recipe or
    by --context-length; never wider than what the checkpoint was trained for."""
    if requested is not None and not 0 < requested <= native:
        raise ExportError(f"--context-length {requested} must lie in 1..{native} (the checkpoint's native context)")
    return min(requested or recipe.limits.context_length or native, native)


def serving_limits(
    recipe: Recipe, checkpoint: Checkpoint, requested_context: int | None, kv_dtype: str = "auto"
) -> Limits:
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
        kv_dtype=kv_dtype,
    )


def write_tokenizer(checkpoint: Checkpoint, recipe: Recipe, folder: Path) -> TokenizerSpec:
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


def write_template(checkpoint: Checkpoint, recipe: Recipe, folder: Path) -> TemplateSpec:
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
        rejects=list(recipe.template_rejects),  # helios refuses these before rendering (format 1.6)
    )


def decode_weight_bytes(onnx_path: Path) -> int:
    """Bytes of weights one decode step reads for one request.

    Every initializer counts in full except embedding tables read by Gather, of which a decode
    step reads one row (for a 4-bit table, GatherBlockQuantized: one row of its data, scales and
    zero points), and the expert tables of flare's routed MoE / MoEInt4, of which a decode row
    reads its top_k experts (top_k / E of them, summed over the nodes that route one table).
    """
    model = onnx.load(str(onnx_path), load_external_data=False)
    gathered = {node.input[0] for node in model.graph.node if node.op_type == "Gather"}
    dims = {init.name: list(init.dims) for init in model.graph.initializer}
    routed: dict[str, tuple[int, int]] = {}  # expert table -> (top_k, experts)
    for node in model.graph.node:
        if node.op_type == "GatherBlockQuantized":  # inputs: data, indices, scales[, zero_points]
            gathered.update(name for i, name in enumerate(node.input) if i != 1 and name)
        if node.op_type in ("MoE", "MoEInt4") and node.domain == "ai.flare":  # h, idx, weights, tables...
            attrs = {a.name: a.i for a in node.attribute if a.name in ("top_k", "experts")}
            top_k = attrs.get("top_k")
            experts = attrs.get("experts") or dims.get(node.input[3], [0])[0]  # MoEInt4's tables are flat
            if top_k and experts:  # a table several nodes route (one per routing column) adds their top_k
                for name in (n for n in node.input[3:] if n):
                    routed[name] = (min(routed.get(name, (0, experts))[0] + top_k, experts), experts)
    total = 0
    for init in model.graph.initializer:
        size = _initializer_bytes(init)
        if init.name in gathered and len(init.dims) == 2:
            size //= max(int(init.dims[0]), 1)
        if init.name in routed:
            top_k, experts = routed[init.name]
            size = size * top_k // experts
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

"""Export a model's step forward (docs/architecture.md, "The step graph") as one ONNX file.

The graph has dynamic batch B, step length L, history pages per row M and pool pages P, and its
weights live in one external-data file next to it (a 0.5B model is ~2 GB in fp32, past the 2 GB
protobuf limit). The output is deterministic: the same model gives byte-identical files.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from pathlib import Path

import onnx
import torch

from helios.manifest import Architecture, Engine, KVLayout, StateLayout, TensorSpec
from ignition.models import TOP_K, DecoderLM, moe_ops, ops

# The exporter logs a warning per missing torchvision op it would have registered.
logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)

INPUT_NAMES = [
    "input_ids",
    "positions",
    "history_lens",
    "query_lens",
    "block_tables",
    "kv_pool",
    "logprob_token_ids",
    "logit_rows",
    "logit_positions",
]
OUTPUT_NAMES = ["logits", "logsumexp", "top_logprobs", "top_ids", "token_logprobs", "new_kv", "hidden"]
# A state-bearing graph (manifest `state`) appends these (docs/architecture.md, "Recurrent state").
STATE_INPUT_NAMES = ["state_pool", "state_slots"]
STATE_OUTPUT_NAMES = ["new_state"]
# A multimodal step graph (manifest `vision`) appends these (docs/architecture.md, "Images").
VISION_INPUT_NAMES = ["mrope_positions", "image_embeds", "image_slots"]
# Explicit logprob ids one step can score per row (api.md: at most 128 caller ids + the sampled one).
MAX_LOGPROB_TOKEN_IDS = 129
OPSET = 18
STEP_GRAPH_FILE = "step.onnx"  # in a core and in an export cache entry
# Graph metadata the exporter adds that is not part of the model: source file paths and line
# numbers (they differ between checkouts and virtual environments of the same code).
STRIPPED_METADATA = ("pkg.torch.onnx.stack_trace",)


def step_signature(
    arch: Architecture, kv: KVLayout, state: StateLayout | None = None, vision: bool = False
) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """The contract's I/O specs; symbolic dims are B, L, M, E, N (output positions: one per row in
    a plain step, k+1 for a row verifying k drafts), pool_rows (= layers*2*P), S (state slots) and
    I (image tokens among the step's new tokens)."""
    t, h, d = kv.page_tokens, kv.kv_heads, kv.head_dim
    inputs = [
        TensorSpec("input_ids", "int64", ["B", "L"]),
        TensorSpec("positions", "int64", ["B", "L"]),
        TensorSpec("history_lens", "int64", ["B"]),
        TensorSpec("query_lens", "int64", ["B"]),
        TensorSpec("block_tables", "int64", ["B", "M"]),
        TensorSpec("kv_pool", kv.dtype, ["pool_rows", t, h, d]),
        TensorSpec("logprob_token_ids", "int64", ["B", "E"]),
        TensorSpec("logit_rows", "int64", ["N"]),
        TensorSpec("logit_positions", "int64", ["N"]),
    ]
    outputs = [
        TensorSpec("logits", "float32", ["N", arch.vocab_size]),
        TensorSpec("logsumexp", "float32", ["N"]),
        TensorSpec("top_logprobs", "float32", ["N", TOP_K]),
        TensorSpec("top_ids", "int64", ["N", TOP_K]),
        TensorSpec("token_logprobs", "float32", ["N", "E"]),
        TensorSpec("new_kv", kv.dtype, [kv.num_layers, 2, "B", "L", h, d]),
        TensorSpec("hidden", "float32", ["B", "L", arch.hidden_size]),
    ]
    if state is not None:
        inputs += [TensorSpec("state_pool", state.dtype, ["S", state.width]), TensorSpec("state_slots", "int64", ["B"])]
        outputs.append(TensorSpec("new_state", state.dtype, ["B", state.width]))
    if vision:
        inputs += [
            TensorSpec("mrope_positions", "int64", [3, "B", "L"]),
            TensorSpec("image_embeds", "float32", ["I", arch.hidden_size]),
            TensorSpec("image_slots", "int64", ["I"]),
        ]
    return inputs, outputs


def sample_inputs(kv: KVLayout, state: StateLayout | None = None, hidden: int = 0) -> tuple[torch.Tensor | None, ...]:
    """Trace inputs with pairwise-distinct sizes (B=2, L=3, M=4, P=5, E=7, S=6, N=8, I=9) so the
    exporter cannot mistake one dynamic dim for another or specialize a 0/1-sized one. hidden > 0:
    a multimodal graph's inputs too."""
    batch, length, pool_pages = 2, 3, 5  # and M=4 block-table columns below
    history = torch.tensor([5, 17])
    positions = history.unsqueeze(1) + torch.arange(length)
    extra: tuple[torch.Tensor, ...] = ()
    if state is not None:
        extra = (torch.zeros(6, state.width), torch.tensor([4, 1]))
    if hidden:
        if state is None:
            extra = (None, None)
        slots = torch.tensor([0, 1, 2, 3, 4, 5, 0, 1, 2])  # duplicates: only the trace sees them
        extra += (positions.unsqueeze(0).expand(3, batch, length).clone(), torch.zeros(9, hidden), slots)
    return (
        torch.zeros(batch, length, dtype=torch.int64),
        positions,
        history,
        torch.tensor([length, 1]),
        torch.tensor([[0, 1, 2, 3], [4, 3, 2, 1]]),
        torch.zeros(kv.num_layers * 2 * pool_pages, kv.page_tokens, kv.kv_heads, kv.head_dim),
        torch.zeros(batch, 7, dtype=torch.int64),
        torch.tensor([0, 0, 0, 1, 0, 1, 0, 0]),  # logit_rows (row 1 has one valid token)
        torch.tensor([0, 1, 2, 0, 2, 0, 1, 2]),  # logit_positions
        *extra,
    )


def step_dynamic_shapes(model: DecoderLM, state: StateLayout | None, vision: bool) -> tuple:
    """torch.export's dynamic dims of the step module's inputs, in INPUT_NAMES order (+ state, vision)."""
    batch, length, pages = (torch.export.Dim(n, min=1) for n in ("B", "L", "M"))
    pool_rows = torch.export.Dim("pool_rows", min=1)
    explicit = torch.export.Dim("E", min=1, max=MAX_LOGPROB_TOKEN_IDS)
    outputs = torch.export.Dim("N", min=1)
    dynamic_shapes: tuple = (
        {0: batch, 1: length},
        {0: batch, 1: length},
        {0: batch},
        {0: batch},
        {0: batch, 1: pages},
        {0: pool_rows},
        {0: batch, 1: explicit},
        {0: outputs},
        {0: outputs},
    )
    if state is not None:
        if model.state_width != state.width:
            raise ValueError(f"the model's state width {model.state_width} != the layout's {state.width}")
        dynamic_shapes += ({0: torch.export.Dim("S", min=1)}, {0: batch})
    if vision:
        if state is None:
            dynamic_shapes += (None, None)
        images = torch.export.Dim("I", min=1)
        dynamic_shapes += ({1: batch, 2: length}, {0: images}, {0: images})
    return dynamic_shapes


def export_step_graph(
    model: DecoderLM,
    arch: Architecture,
    kv_layout: KVLayout,
    out_dir: Path,
    file_name: str = STEP_GRAPH_FILE,
    fused: bool = True,
    state: StateLayout | None = None,
) -> Engine:
    """Write out_dir/file_name (+ file_name.data) and return the manifest's "step" engine.

    fused: lower attention, rotary and add+RMSNorm to onnxruntime's contrib kernels
    (GroupQueryAttention, RotaryEmbedding, SkipSimplifiedLayerNormalization; ~3x fewer nodes,
    see ignition/models/ops.py). False exports the same math as standard ONNX ops only.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / file_name
    data_name = file_name + ".data"
    vision = model.mrope_section is not None
    dynamic_shapes = step_dynamic_shapes(model, state, vision)
    # The dynamo exporter: ~3x fewer nodes than the legacy tracer, no tracer warnings, and
    # dynamic shapes are checked symbolically rather than guessed from one trace.
    fusion = ops.fused_export() if fused else contextlib.nullcontext()
    with torch.no_grad(), warnings.catch_warnings(), fusion:
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            model.eval(),
            sample_inputs(kv_layout, state, arch.hidden_size if vision else 0),
            input_names=INPUT_NAMES + (STATE_INPUT_NAMES if state else []) + (VISION_INPUT_NAMES if vision else []),
            output_names=OUTPUT_NAMES + (STATE_OUTPUT_NAMES if state else []),
            dynamic_shapes=dynamic_shapes,
            opset_version=OPSET,
            dynamo=True,
            custom_translation_table={**ops.TRANSLATIONS, **moe_ops.TRANSLATIONS} if fused else None,
            optimize=True,
            verbose=False,
        )
    proto = program.model_proto
    _trim_unused_outputs(proto)
    _name_dims(proto, arch, kv_layout, state, vision)
    save_with_external_data(proto, path, data_name)
    inputs, outputs = step_signature(arch, kv_layout, state, vision)
    return Engine(name="step", file=file_name, inputs=inputs, outputs=outputs, data_files=[data_name])


def _name_dims(
    proto: onnx.ModelProto, arch: Architecture, kv: KVLayout, state: StateLayout | None = None, vision: bool = False
) -> None:
    """Give graph I/O the contract's dim names (the exporter's symbols are s0, s1, ...)."""
    inputs, outputs = step_signature(arch, kv, state, vision)
    specs = {s.name: s for s in inputs + outputs}
    for value in list(proto.graph.input) + list(proto.graph.output):
        spec = specs[value.name]
        dims = value.type.tensor_type.shape.dim
        if len(dims) != len(spec.shape):
            raise RuntimeError(f"exported {value.name} has rank {len(dims)}, contract says {len(spec.shape)}")
        for dim, want in zip(dims, spec.shape):
            if isinstance(want, str):
                dim.Clear()
                dim.dim_param = want
            elif dim.HasField("dim_value") and dim.dim_value != want:
                raise RuntimeError(f"exported {value.name} has a dim {dim.dim_value}, contract says {want}")


def _trim_unused_outputs(proto: onnx.ModelProto) -> None:
    """Blank the unused optional outputs of contrib nodes (the exporter names every output a
    schema lists): onnxruntime then skips them, and GroupQueryAttention rejects a named
    output_qk it was not asked for (but needs its present_key/value with query_seqlens)."""
    keep_first = {"GroupQueryAttention": 3}
    used = {name for node in proto.graph.node for name in node.input} | {o.name for o in proto.graph.output}
    for node in proto.graph.node:
        if not node.domain or not onnx.defs.has(node.op_type, node.domain):
            continue
        schema = onnx.defs.get_schema(node.op_type, node.domain)
        optional = onnx.defs.OpSchema.FormalParameterOption.Optional
        for i, name in enumerate(node.output):
            if i < keep_first.get(node.op_type, 0):
                continue
            if name not in used and i < len(schema.outputs) and schema.outputs[i].option == optional:
                node.output[i] = ""
        while node.output and not node.output[-1]:
            node.output.pop()


def save_with_external_data(proto: onnx.ModelProto, path: Path, data_name: str) -> None:
    """All initializers into one data file next to the graph (deterministic order and offsets)."""
    path = Path(path)
    data_path = path.parent / data_name
    for stale in (path, data_path):
        if stale.exists():
            os.remove(stale)  # onnx appends to an existing data file
    onnx.save_model(
        proto,
        str(path),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=data_name,
        size_threshold=1024,
    )


def canonicalize_graph(path: Path) -> None:
    """Strip metadata that records where the exporter ran, not what it built (see
    STRIPPED_METADATA), rewriting only the graph file: the weights file is untouched."""
    model = onnx.load(str(path), load_external_data=False)
    changed = False

    def strip(props) -> None:
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

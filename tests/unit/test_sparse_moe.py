"""Routed experts in exported cores (ignition.models.moe_ops -> flare's ai.flare.MoE). Every MoE
family's tiny checkpoint routes 4 of 32 experts, and tests/unit/test_families.py holds each
family's exported core to transformers at fp32 (prefill and batched paged decode): that is each
routing variant's parity at realistic sparsity. Here, on those same cores: the experts are one
routed node whose tables decode_weight_bytes counts at top_k / E; int4/int8 exports pack them;
the configured families' norms and attention fuse."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from helios import kernels as flare_kernels
from helios.engine.runner import Runner, StepRow
from helios.manifest import Manifest
from ignition.export.manifest import _initializer_bytes, decode_weight_bytes
from ignition.export.pipeline import ExportOptions, export_core
from ignition.recipes import load_recipe
from tests.unit.conftest import COMPILED
from tests.unit.family_checkpoints import write_quantizable_checkpoint

EXPERTS, TOP_K = 32, 4
DENSE_RECIPES = ("qwen38_dense", "qwen3", "mistral", "gemma3", "gemma2", "smollm3", "phi3")
MOE_RECIPES = [r for r in COMPILED if r not in DENSE_RECIPES]


@pytest.mark.parametrize("recipe", MOE_RECIPES)
def test_routed_expert_tables_are_counted_at_top_k_of_e(family_env, recipe, tmp_path):
    core, _ = family_env(recipe)
    manifest = Manifest.load(core)
    model = onnx.load(str(core / "step.onnx"), load_external_data=False)
    routed = [n for n in model.graph.node if n.op_type == "MoE" and n.domain == "ai.flare"]
    assert routed, "the experts were not exported as flare's routed MoE"
    sizes = {init.name: _initializer_bytes(init) for init in model.graph.initializer}
    tables = {name for node in routed for name in node.input[3:] if name}
    assert all(sizes[t] % EXPERTS == 0 for t in tables)
    reads = {
        t: sum(a.i for node in routed if t in node.input for a in node.attribute if a.name == "top_k") for t in tables
    }
    assert set(reads.values()) == {TOP_K}  # every table: 4 experts a row (one node, or one per routing column)
    for node in routed:  # the same graph counted as if every expert were read
        node.attribute.remove(next(a for a in node.attribute if a.name == "top_k"))
    onnx.save(model, str(tmp_path / "dense.onnx"))
    unread = sum(sizes[t] - sizes[t] * TOP_K // EXPERTS for t in tables)
    assert manifest.decode_weight_bytes == decode_weight_bytes(tmp_path / "dense.onnx") - unread


@pytest.mark.parametrize("precision,bits", [("int4", 4), ("int8", 8)])
def test_quantized_cores_route_packed_experts(precision, bits, tmp_path, monkeypatch):
    """An int4 (int8) export packs each routed expert's tables into MoEInt4 at 4 (8) bits, the
    dense layers' scheme, passes the same validation as dense families, and runs the same with
    flare's kernel and with the dense rewrite helios uses where that kernel cannot run."""
    checkpoint = write_quantizable_checkpoint(tmp_path / "ckpt", "qwen3_5_moe")
    core = tmp_path / "core"
    manifest = export_core(
        ExportOptions(
            recipe=load_recipe("qwen38"), checkpoint=str(checkpoint), out=core, precision=precision, cache=False
        )
    )
    model = onnx.load(str(core / "step.onnx"), load_external_data=False)
    packed = [n for n in model.graph.node if n.op_type == "MoEInt4"]
    assert packed and not [n for n in model.graph.node if n.op_type in ("MoE", "Einsum")]
    assert {next((a.i for a in n.attribute if a.name == "bits"), 4) for n in packed} == {bits}
    assert manifest.parity is not None and manifest.parity.top1_agreement >= 0.9
    ids = list(range(manifest.architecture.vocab_size - 40, manifest.architecture.vocab_size))
    logits = []
    for kernels in ("on", "off"):
        monkeypatch.setenv("FLARE_KERNELS", kernels)
        runner = Runner(core, manifest, num_pages=8)
        # "on" runs flare's kernel where this CPU can (AVX512-VNNI and a compiler), else falls back.
        flare = kernels == "on" and flare_kernels.available()[0] is not None
        assert runner.kernels == ("flare" if flare else "onnxruntime")
        logits.append(runner.step([StepRow(ids, 0, list(range(4)), state_slot=0)]).logits[0])
    assert np.abs(logits[0] - logits[1]).max() <= 0.05 * np.abs(logits[1]).max()


@pytest.mark.parametrize("recipe", ["qwen38"])
def test_configured_norms_and_attention_fuse_into_one_node_each(family_env, recipe, tmp_path, monkeypatch):
    """The configured families write their per-step RMSNorms (layer, final, QK) in the form
    onnxruntime fuses: every x / sqrt(mean(x^2) + eps) of the exported step graph becomes one
    SimplifiedLayerNormalization in the session's optimized graph (seven nodes each otherwise, a
    large share of a small MoE's decode step). Each full-attention layer (QK norms, partial
    rotary, gated output) is one PagedAttention reading the pool in place: no other node reads
    the pool (gathering its pages cost ~80 nodes a layer)."""
    core, _ = family_env(recipe)
    manifest = Manifest.load(core)
    graph = onnx.load(str(core / "step.onnx"), load_external_data=False).graph
    producers = {out: node.op_type for node in graph.node for out in node.output}
    fusable = [n for n in graph.node if n.op_type == "Div" and producers.get(n.input[1]) == "Sqrt"]
    assert len(fusable) >= 2 * manifest.architecture.num_layers + 1  # each layer's two norms, the final one
    attention = [n for n in graph.node if n.op_type == "PagedAttention"]
    assert manifest.kv.num_layers >= 1 and len(attention) == manifest.kv.num_layers
    assert [n.op_type for n in graph.node if "kv_pool" in n.input] == ["PagedAttention"] * len(attention)
    optimized = tmp_path / "optimized.onnx"
    session_options = Runner._session_options

    def saving_options(self):
        options = session_options(self)
        options.optimized_model_filepath = str(optimized)
        return options

    monkeypatch.setattr(Runner, "_session_options", saving_options)
    Runner(core, manifest, num_pages=8)
    fused = [
        n
        for n in onnx.load(str(optimized), load_external_data=False).graph.node
        if n.op_type == "SimplifiedLayerNormalization"
    ]
    assert len(fused) == len(fusable)

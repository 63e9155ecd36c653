"""Routed experts in exported cores (ignition.models.moe_ops -> flare's ai.flare.MoE): one case
per routing variant at realistic sparsity (32 experts), each matching transformers at fp32 on a
prefill and batched paged decode, with the graph's expert tables counted at top_k / E in
decode_weight_bytes."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from helios.engine.runner import Runner, StepRow
from helios.manifest import Manifest
from ignition.export.manifest import _initializer_bytes, decode_weight_bytes
from ignition.export.pipeline import ExportOptions, export_core
from ignition.recipes import load_recipe
from tests.unit.family_checkpoints import write_family_checkpoint, write_quantizable_checkpoint

RELATIVE = 1e-4
# recipe -> (family, config overrides): 32 experts with each family's routing.
VARIANTS = {
    "qwen38": ("qwen3_5_moe", dict(num_experts=32, num_experts_per_tok=4)),  # softmax top-k, gated shared expert
    "kimi3": ("deepseek_v3", dict(n_routed_experts=32, num_experts_per_tok=4, n_group=4, topk_group=2)),  # sigmoid,
    # correction bias, group-limited top-k, routed scaling
    "nemotron_h": ("nemotron_h", dict(n_routed_experts=32, num_experts_per_tok=4, n_group=4, topk_group=2)),  # relu2
    "gemma4": ("gemma4", dict(num_experts=32, top_k_experts=4)),  # gelu_tanh, per-expert scales
    "mimo_v2": ("mimo_v2_flash", dict(n_routed_experts=32, num_experts_per_tok=4)),
    "step5": ("step3p7", dict(n_routed_experts=32, num_experts_per_tok=4)),  # clamped SwiGLU (clamp_after)
    "minimax_m3": ("minimax_m3_vl", dict(num_local_experts=32, num_experts_per_tok=4)),  # SwiGLU-alpha
    "deepseek4": ("deepseek_v4", dict(n_routed_experts=32, num_experts_per_tok=4)),  # hash routing, clamp_before
    # projected-width experts with per-expert output norms: one routed call per routing column
    "muse_spark": ("muse_spark", dict(num_local_experts=32, num_experts_per_tok=4)),
}


def _relative(engine: np.ndarray, reference: np.ndarray) -> float:
    return float(np.abs(engine.astype(np.float64) - reference).max() / np.abs(reference).max())


@pytest.mark.parametrize("recipe", sorted(VARIANTS))
def test_routed_experts_match_transformers_at_32_experts(recipe, tmp_path):
    family, overrides = VARIANTS[recipe]
    checkpoint, reference = write_family_checkpoint(tmp_path / "ckpt", family, overrides=overrides)
    core = tmp_path / "core"
    export_core(ExportOptions(recipe=load_recipe(recipe), checkpoint=str(checkpoint), out=core, precision="fp32",
                              cache=False))
    manifest = Manifest.load(core)
    model = onnx.load(str(core / "step.onnx"), load_external_data=False)
    routed = [n for n in model.graph.node if n.op_type == "MoE" and n.domain == "ai.flare"]
    assert routed, "the experts were not exported as flare's routed MoE"
    # decode_weight_bytes counts top_k / E of every routed expert table.
    sizes = {init.name: _initializer_bytes(init) for init in model.graph.initializer}
    tables = {name for node in routed for name in node.input[3:] if name}
    reads = {t: sum(a.i for node in routed if t in node.input for a in node.attribute if a.name == "top_k")
             for t in tables}  # fmt: skip
    assert set(reads.values()) == {4}  # every table: 4 experts a row (one node, or one per routing column)
    for node in routed:  # the same graph counted as if every expert were read
        node.attribute.remove(next(a for a in node.attribute if a.name == "top_k"))
    onnx.save(model, str(tmp_path / "dense.onnx"))
    unread = sum(sizes[t] - sizes[t] * 4 // 32 for t in tables)
    assert manifest.decode_weight_bytes == decode_weight_bytes(tmp_path / "dense.onnx") - unread

    vocab = manifest.architecture.vocab_size
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, vocab, size=29).tolist(), rng.integers(0, vocab, size=17).tolist()]
    steps = 6
    sequences = []
    with torch.no_grad():
        for prompt in prompts:
            seq = list(prompt)
            for _ in range(steps):
                seq.append(int(reference(torch.tensor([seq])).logits[0, -1].argmax()))
            sequences.append((seq, reference(torch.tensor([seq])).logits[0].double().numpy()))
    page = manifest.kv.page_tokens
    pages_each = -(-max(len(s) for s, _ in sequences) // page)
    runner = Runner(core, manifest, num_pages=2 * pages_each + 1)
    tables_ = [list(range(pages_each)), list(range(pages_each, 2 * pages_each))]
    out = runner.step([StepRow(prompts[0], 0, tables_[0], state_slot=0),
                       StepRow(prompts[1], 0, tables_[1], state_slot=1)])  # fmt: skip
    errors = [_relative(out.logits[b], sequences[b][1][len(prompts[b]) - 1]) for b in range(2)]
    for step in range(steps):
        rows = [StepRow([seq[len(p) + step]], len(p) + step, t, state_slot=b)
                for b, ((seq, _), p, t) in enumerate(zip(sequences, prompts, tables_))]
        out = runner.step(rows)
        errors += [_relative(out.logits[b], sequences[b][1][len(prompts[b]) + step]) for b in range(2)]
    assert max(errors) <= RELATIVE, f"logits differ by {max(errors):.3g} relative"



@pytest.mark.parametrize("precision,bits", [("int4", 4), ("int8", 8)])
def test_quantized_cores_route_packed_experts(precision, bits, tmp_path, monkeypatch):
    """An int4 (int8) export packs each routed expert's tables into MoEInt4 at 4 (8) bits, the
    dense layers' scheme, passes the same validation as dense families, and runs the same with
    flare's kernel and with the dense rewrite helios uses where that kernel cannot run."""
    checkpoint = write_quantizable_checkpoint(tmp_path / "ckpt", "qwen3_5_moe", overrides=VARIANTS["qwen38"][1])
    core = tmp_path / "core"
    manifest = export_core(ExportOptions(recipe=load_recipe("qwen38"), checkpoint=str(checkpoint), out=core,
                                         precision=precision, cache=False))
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
        assert runner.kernels == ("flare" if kernels == "on" else "onnxruntime")
        logits.append(runner.step([StepRow(ids, 0, list(range(4)), state_slot=0)]).logits[0])
    assert np.abs(logits[0] - logits[1]).max() <= 0.05 * np.abs(logits[1]).max()


def test_configured_norms_and_attention_fuse_into_one_node_each(tmp_path, monkeypatch):
    """The configured families write their per-step RMSNorms (layer, final, QK) in the form
    onnxruntime fuses: every x / sqrt(mean(x^2) + eps) of the exported step graph becomes one
    SimplifiedLayerNormalization in the session's optimized graph (seven nodes each otherwise, a
    large share of a small MoE's decode step). Each full-attention layer (QK norms, partial
    rotary, gated output) is one PagedAttention reading the pool in place: no other node reads
    the pool (gathering its pages cost ~80 nodes a layer)."""
    checkpoint, _ = write_family_checkpoint(tmp_path / "ckpt", "qwen3_5_moe", overrides=VARIANTS["qwen38"][1])
    core = tmp_path / "core"
    manifest = export_core(ExportOptions(recipe=load_recipe("qwen38"), checkpoint=str(checkpoint), out=core,
                                         precision="fp32", cache=False))
    graph = onnx.load(str(core / "step.onnx"), load_external_data=False).graph
    producers = {out: node.op_type for node in graph.node for out in node.output}
    fusable = [n for n in graph.node if n.op_type == "Div" and producers.get(n.input[1]) == "Sqrt"]
    assert len(fusable) >= 2 * manifest.architecture.num_layers + 1  # each layer's two norms, the final one
    attention = [n for n in graph.node if n.op_type == "PagedAttention"]
    assert manifest.kv.num_layers >= 1 and len(attention) == manifest.kv.num_layers
    assert [n.op_type for n in graph.node if "kv_pool" in n.input] == ["PagedAttention"] * len(attention)
    optimized = tmp_path / "optimized.onnx"
    session_options = Runner._session_options

    def saving_options(self):  # noqa: ANN001, ANN202
        options = session_options(self)
        options.optimized_model_filepath = str(optimized)
        return options

    monkeypatch.setattr(Runner, "_session_options", saving_options)
    Runner(core, manifest, num_pages=8)
    fused = [n for n in onnx.load(str(optimized), load_external_data=False).graph.node
             if n.op_type == "SimplifiedLayerNormalization"]
    assert len(fused) == len(fusable)

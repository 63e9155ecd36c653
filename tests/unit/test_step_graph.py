"""The step graph end to end on tiny random checkpoints of both families: torch paged forward vs
the reference, ONNX export (fp32 and int4) through Runner, batching, logprob outputs, and that
validation catches a broken engine."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from helios import kernels
from helios.engine.runner import Runner, StepRow, pack_rows, scatter_new_kv
from helios.kernels.head import CANDIDATES
from helios.manifest import Architecture, KVLayout
from ignition.checkpoints.base import Checkpoint
from ignition.export.graph import INPUT_NAMES, export_step_graph
from ignition.export.manifest import decode_weight_bytes
from ignition.export.quantize import quantize
from ignition.export.validate import TOLERANCES, ParityError, validate
from ignition.models import build_model

FAMILIES = ["qwen2", "llama"]
VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, LAYERS = 512, 64, 4, 2, 16, 128, 2
PAGE = 16


def tiny_checkpoint(family: str, seed: int = 0, rope_theta: float = 10000.0) -> Checkpoint:
    arch = Architecture(
        family=family,
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        vocab_size=VOCAB,
        rope_theta=rope_theta,
        rms_norm_eps=1e-6,
        max_position_embeddings=1024,
        tie_word_embeddings=family == "llama",  # cover both lm_head layouts
        attention_bias=family == "qwen2",
    )
    rng = np.random.default_rng(seed)

    def w(*shape: int, scale: float = 0.1) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    t = {"model.embed_tokens.weight": w(VOCAB, HIDDEN, scale=1.0), "model.norm.weight": 1 + w(HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        t[p + "self_attn.q_proj.weight"] = w(HEADS * HEAD_DIM, HIDDEN, scale=0.3)
        t[p + "self_attn.k_proj.weight"] = w(KV_HEADS * HEAD_DIM, HIDDEN, scale=0.3)
        t[p + "self_attn.v_proj.weight"] = w(KV_HEADS * HEAD_DIM, HIDDEN)
        if arch.attention_bias:
            for name, width in (("q", HEADS * HEAD_DIM), ("k", KV_HEADS * HEAD_DIM), ("v", KV_HEADS * HEAD_DIM)):
                t[p + f"self_attn.{name}_proj.bias"] = w(width)
        t[p + "self_attn.o_proj.weight"] = w(HIDDEN, HEADS * HEAD_DIM)
        t[p + "mlp.gate_proj.weight"] = w(INTER, HIDDEN)
        t[p + "mlp.up_proj.weight"] = w(INTER, HIDDEN)
        t[p + "mlp.down_proj.weight"] = w(HIDDEN, INTER)
        t[p + "input_layernorm.weight"] = 1 + w(HIDDEN)
        t[p + "post_attention_layernorm.weight"] = 1 + w(HIDDEN)
    if not arch.tie_word_embeddings:
        t["lm_head.weight"] = w(VOCAB, HIDDEN, scale=0.3)
    return Checkpoint(
        checkpoint_id=f"tiny-{family}",
        sha256="0" * 64,
        architecture=arch,
        tensors=t,
        tokenizer_json="{}",
        chat_template=None,
        bos_token_id=None,
        eos_token_ids=[0],
        pad_token_id=None,
        add_bos=False,
    )


KV = KVLayout(page_tokens=PAGE, num_layers=LAYERS, kv_heads=KV_HEADS, head_dim=HEAD_DIM)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def model(family):
    return build_model(*tiny_checkpoint(family).model_inputs())


@pytest.fixture(scope="module")
def fp32_graph(family, model, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp(f"{family}-fp32")
    engine = export_step_graph(model, model.arch, KV, out)
    assert [s.name for s in engine.inputs] == INPUT_NAMES
    assert engine.data_files == ["step.onnx.data"] and (out / "step.onnx.data").is_file()
    return out / engine.file


@pytest.fixture(scope="module")
def int4_graph(fp32_graph, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("int4") / "step.onnx"
    quantize(fp32_graph, out, "int4")
    return out


def prompt(n: int, seed: int = 1) -> list[int]:
    return np.random.default_rng(seed).integers(0, VOCAB, n).tolist()


class TorchEngine:
    """The torch step forward driven exactly like Runner drives the ONNX graph."""

    def __init__(self, model, num_pages: int) -> None:
        self.model = model
        self.pool = np.zeros((LAYERS * 2 * num_pages, PAGE, KV_HEADS, HEAD_DIM), dtype=np.float32)

    @torch.no_grad()
    def step(self, rows: list[StepRow]) -> np.ndarray:
        feeds = {k: torch.from_numpy(v) for k, v in pack_rows(rows, PAGE).items()}
        logits, _, _, _, _, new_kv, _ = self.model(**feeds, kv_pool=torch.from_numpy(self.pool))
        pages = self.pool.reshape(LAYERS, 2, -1, PAGE, KV_HEADS, HEAD_DIM)
        scatter_new_kv(pages, rows, new_kv.numpy())
        return logits.numpy()


def test_torch_paged_forward_matches_reference(model):
    ids = prompt(45)
    ref = model.reference(torch.tensor(ids)).numpy()
    engine = TorchEngine(model, num_pages=8)
    table = [5, 2, 7]  # not in order, not from 0
    got = [engine.step([StepRow(ids[:20], 0, table)])[0], engine.step([StepRow(ids[20:30], 20, table)])[0]]
    got += [engine.step([StepRow([ids[p]], p, table)])[0] for p in range(30, 45)]
    positions = [19, 29] + list(range(30, 45))
    np.testing.assert_allclose(np.stack(got), ref[positions], atol=1e-4)


def test_export_is_deterministic(model, fp32_graph, tmp_path):
    export_step_graph(model, model.arch, KV, tmp_path)
    assert (tmp_path / "step.onnx").read_bytes() == fp32_graph.read_bytes()
    assert (tmp_path / "step.onnx.data").read_bytes() == (fp32_graph.parent / "step.onnx.data").read_bytes()


def test_quantize_is_deterministic(fp32_graph, int4_graph, tmp_path):
    quantize(fp32_graph, tmp_path / "step.onnx", "int4")
    assert (tmp_path / "step.onnx").read_bytes() == int4_graph.read_bytes()
    assert (tmp_path / "step.onnx.data").read_bytes() == (int4_graph.parent / "step.onnx.data").read_bytes()


def test_fused_graph_attends_in_the_pool(fp32_graph):
    ops = [n.op_type for n in onnx.load(str(fp32_graph), load_external_data=False).graph.node]
    # One flare PagedAttention per layer does rotary, reads the layer's pages in place and shares
    # each KV head across its query group: no page Gather/Transpose, no repeated KV heads.
    assert ops.count("PagedAttention") == LAYERS
    assert "GroupQueryAttention" not in ops and "RotaryEmbedding" not in ops
    assert ops.count("Transpose") == 1  # new_kv into the contract layout, once for all layers
    assert ops.count("SkipSimplifiedLayerNormalization") == 2 * LAYERS
    assert ops.count("MatMul") == 4 * LAYERS and "Tile" not in ops


def test_fallback_without_flare_kernels_matches(model, fp32_graph, monkeypatch):
    """Where flare's kernel library cannot run, helios rewrites PagedAttention into onnxruntime's
    RotaryEmbedding + page Gather + GroupQueryAttention: the same parity."""
    from helios.kernels.attention import to_group_query_attention

    graph = onnx.load(str(fp32_graph))
    assert to_group_query_attention(graph) == LAYERS
    ops = [n.op_type for n in graph.graph.node]
    assert ops.count("GroupQueryAttention") == LAYERS and ops.count("RotaryEmbedding") == LAYERS
    monkeypatch.setenv("FLARE_KERNELS", "off")
    ids = prompt(37)
    parity = validate(fp32_graph, model, KV, ids, decode_steps=16, precision="fp32")
    scale = float(model.reference(torch.tensor(ids)).abs().max())
    assert parity.max_abs_logit_error <= 1e-4 * scale, parity


def test_onnx_fp32_parity_prefill_and_decode(model, fp32_graph):
    ids = prompt(37)
    parity = validate(fp32_graph, model, KV, ids, decode_steps=16, precision="fp32")
    scale = float(model.reference(torch.tensor(ids)).abs().max())
    assert parity.max_abs_logit_error <= 1e-4 * scale, parity
    assert parity.top1_agreement == 1.0 and parity.decode_steps == 16


def test_plain_export_matches_too(tmp_path):
    """fused=False: the same math as standard ONNX ops only (no onnxruntime contrib kernels)."""
    model = build_model(*tiny_checkpoint("qwen2").model_inputs())
    export_step_graph(model, model.arch, KV, tmp_path, fused=False)
    graph = onnx.load(str(tmp_path / "step.onnx"), load_external_data=False)
    assert all(node.domain in ("", "ai.onnx") for node in graph.graph.node)
    parity = validate(tmp_path / "step.onnx", model, KV, prompt(20), precision="fp32")
    assert parity.max_abs_logit_error < 1e-4


@pytest.mark.parametrize("split_mixed", [False, True])
def test_mixed_batch_equals_separate_steps(fp32_graph, split_mixed):
    """Two prefill chunks of different lengths (one continuing a prompt, one fresh) and two
    decode rows in one step == four separate steps. split_mixed=False forces a single padded
    graph call; True lets the runner split it (decode rows vs prefill rows)."""
    a, b, c, d = prompt(25, 2), prompt(21, 3), prompt(34, 4), prompt(12, 7)
    tables = {"a": [3, 9], "b": [1, 6], "c": [8, 4, 11], "d": [10]}

    def setup(runner: Runner) -> None:
        runner.step([StepRow(a[:9], 0, tables["a"])])
        runner.step([StepRow(b[:20], 0, tables["b"])])
        runner.step([StepRow(c[:33], 0, tables["c"])])

    rows = [
        StepRow(a[9:25], 9, tables["a"]),
        StepRow(b[20:21], 20, tables["b"]),
        StepRow(d, 0, tables["d"]),
        StepRow(c[33:34], 33, tables["c"]),
    ]
    mixed = Runner.from_graph(fp32_graph, KV, num_pages=12)
    mixed.split_mixed = split_mixed
    alone = Runner.from_graph(fp32_graph, KV, num_pages=12)
    setup(mixed)
    setup(alone)
    together = mixed.step(rows)
    separate = [alone.step([row]) for row in rows]
    for field in ("logits", "logsumexp", "top_logprobs"):
        want = np.concatenate([getattr(s, field) for s in separate])
        np.testing.assert_allclose(getattr(together, field), want, rtol=1e-5, atol=1e-5, err_msg=field)
    np.testing.assert_array_equal(together.top_ids, np.concatenate([s.top_ids for s in separate]))
    if kernels.available()[0] is not None:  # the fused head's sampling candidates
        np.testing.assert_array_equal(together.candidate_ids, np.concatenate([s.candidate_ids for s in separate]))
        np.testing.assert_allclose(
            together.outside_logit, np.concatenate([s.outside_logit for s in separate]), atol=1e-5
        )
    np.testing.assert_allclose(mixed.pool, alone.pool, rtol=1e-5, atol=1e-5)  # same K/V, same slots


def test_logprob_outputs_consistent_with_logits(fp32_graph):
    runner = Runner.from_graph(fp32_graph, KV, num_pages=8)
    out = runner.step([StepRow(prompt(7, 5), 0, [2]), StepRow(prompt(12, 6), 0, [4])])
    logits = out.logits.astype(np.float64)
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    np.testing.assert_allclose(out.logsumexp, lse, atol=1e-4)
    assert out.top_ids.shape == (2, 20) and out.top_ids.dtype == np.int64
    np.testing.assert_array_equal(out.top_ids, np.argsort(-out.logits, axis=-1, kind="stable")[:, :20])
    np.testing.assert_allclose(out.top_logprobs, np.take_along_axis(logits, out.top_ids, -1) - lse[:, None], atol=1e-4)
    assert (np.diff(out.top_logprobs, axis=-1) <= 0).all()
    if kernels.available()[0] is None:  # onnxruntime's own head reports no candidates
        assert out.candidate_ids is None and out.outside_logit is None
        return
    # The fused head's sampling candidates: the CANDIDATES largest logits, and the largest left out.
    ids, outside = out.sampling_candidates()
    order = np.argsort(-out.logits, axis=-1, kind="stable")
    np.testing.assert_array_equal(ids, order[:, :CANDIDATES])
    np.testing.assert_array_equal(
        outside, np.take_along_axis(out.logits, order[:, CANDIDATES : CANDIDATES + 1], -1)[:, 0]
    )


def test_copy_page(fp32_graph):
    runner = Runner.from_graph(fp32_graph, KV, num_pages=4)
    runner.step([StepRow(prompt(16), 0, [1])])
    runner.copy_page(1, 3)
    pages = runner.pool.reshape(LAYERS, 2, 4, PAGE, KV_HEADS, HEAD_DIM)
    np.testing.assert_array_equal(pages[:, :, 3], pages[:, :, 1])
    assert np.abs(pages[:, :, 1]).sum() > 0


def test_int4_export_passes_tolerance(model, int4_graph):
    nodes = onnx.load(str(int4_graph), load_external_data=False).graph.node
    ops = [n.op_type for n in nodes]
    # qkv, o, gate_up, down per layer in flare's tiled layout; the lm_head's K (64) is shorter
    # than its 128-weight block, which only MatMulNBits pads, so it stays MatMulNBits.
    assert ops.count("MatMulInt4") == 4 * LAYERS and ops.count("MatMulNBits") == 1
    assert "Gemm" not in ops and "MatMul" not in ops
    assert ops.count("GatherBlockQuantized") == 1  # the 4-bit token table
    parity = validate(int4_graph, model, KV, prompt(30), decode_steps=8, precision="int4")
    # Random weights give near-flat logits, where top-1 flips on noise (block 32: 0.8, block
    # 64: 0.6 for qwen2); the distribution distance is the meaningful check (both ~0.27-0.29).
    assert parity.mean_kl < 0.8 * TOLERANCES["int4"].max_kl


def test_decode_weight_bytes_reads_one_row_of_the_4bit_table(int4_graph):
    graph = onnx.load(str(int4_graph)).graph
    # Stored bytes (a 4-bit tensor's raw data is packed; numpy_helper would unpack it).
    sizes = {t.name: len(t.raw_data) or numpy_helper.to_array(t).nbytes for t in graph.initializer}
    gather = next(n for n in graph.node if n.op_type == "GatherBlockQuantized")
    table = [gather.input[0], gather.input[2]]  # 4-bit data and its scales, one row per token
    expected = sum(sizes.values()) - sum(sizes[name] - sizes[name] // VOCAB for name in table)
    assert decode_weight_bytes(int4_graph) == expected


def test_int8_export_passes_tolerance(model, fp32_graph, tmp_path):
    quantize(fp32_graph, tmp_path / "step.onnx", "int8")
    ops = [n.op_type for n in onnx.load(str(tmp_path / "step.onnx"), load_external_data=False).graph.node]
    assert ops.count("MatMulNBits") == 4 * LAYERS + 1
    parity = validate(tmp_path / "step.onnx", model, KV, prompt(30), decode_steps=8, precision="int8")
    assert parity.top1_agreement >= 0.8


def test_validation_catches_a_wrong_rotary(family, model, tmp_path):
    """An engine exported with the wrong rope theta must fail validation, fp32 and int4."""
    broken = build_model(*tiny_checkpoint(family, rope_theta=500.0).model_inputs())
    export_step_graph(broken, broken.arch, KV, tmp_path)
    with pytest.raises(ParityError, match="disagrees"):
        validate(tmp_path / "step.onnx", model, KV, prompt(30), precision="fp32")
    quantize(tmp_path / "step.onnx", tmp_path / "int4.onnx", "int4")
    with pytest.raises(ParityError, match="disagrees"):
        validate(tmp_path / "int4.onnx", model, KV, prompt(30), precision="int4")


def test_runner_rejects_bad_rows(fp32_graph):
    runner = Runner.from_graph(fp32_graph, KV, num_pages=4)
    with pytest.raises(ValueError, match="at least one token"):
        runner.step([StepRow([], 0, [1])])
    with pytest.raises(ValueError, match="need"):
        runner.step([StepRow(prompt(17), 0, [1])])
    with pytest.raises(ValueError, match="out of range"):
        runner.step([StepRow(prompt(3), 0, [4])])

"""SkipSimplifiedLayerNormalization folded into the int4 matmul it feeds (helios.kernels.norm_fusion
and MatMulInt4's epsilon): the same bits as the two nodes, on a graph and on the real default
core's step graph."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from helios import kernels
from helios.kernels.int4_layout import to_int4_tiles
from helios.kernels.norm_fusion import fuse_norms
from tests.unit.test_int4_kernel import _nbits_model

pytestmark = pytest.mark.skipif(kernels.available()[0] is None, reason="flare's kernel library cannot run here")

K, N = 128, 48


def _norm_then_matmul(bias: bool, extra_reader: bool = False, sum_read: bool = True) -> onnx.ModelProto:
    """a, skip [M, K] -> SkipSimplifiedLayerNormalization -> MatMulInt4 -> y [M, N]; the norm's
    sum is a graph output (when `sum_read`), and with `extra_reader` an Identity reads the normed
    tensor too."""
    model = _nbits_model(K, N, 32, bias, seed=3)
    assert to_int4_tiles(model) == 1
    graph = model.graph
    matmul = graph.node[0]
    matmul.input[0] = "normed"
    gamma = np.random.default_rng(4).uniform(0.5, 1.5, K).astype(np.float32)
    graph.initializer.append(numpy_helper.from_array(gamma, "gamma"))
    norm = helper.make_node(
        "SkipSimplifiedLayerNormalization",
        ["a", "skip", "gamma"],
        ["normed", "", "", "sum" if sum_read else ""],
        domain="com.microsoft",
        epsilon=1e-6,
    )
    graph.node.insert(0, norm)
    graph.input.append(helper.make_tensor_value_info("skip", TensorProto.FLOAT, ["M", K]))
    if sum_read:
        graph.output.append(helper.make_tensor_value_info("sum", TensorProto.FLOAT, ["M", K]))
    if extra_reader:
        graph.node.append(helper.make_node("Identity", ["normed"], ["normed_copy"]))
        graph.output.append(helper.make_tensor_value_info("normed_copy", TensorProto.FLOAT, ["M", K]))
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return model


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    options.register_custom_ops_library(str(kernels.available()[0]))
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _feeds(rows: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(rows)
    return {
        "a": (rng.standard_normal((rows, K)) * 3).astype(np.float32),
        "skip": rng.standard_normal((rows, K)).astype(np.float32),
    }


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("sum_read", [True, False])
def test_fused_norm_gives_the_two_nodes_bits(bias, sum_read):
    plain = _norm_then_matmul(bias, sum_read=sum_read)
    fused = onnx.ModelProto()
    fused.CopyFrom(plain)
    assert fuse_norms(fused) == 1
    assert [(n.op_type, n.domain) for n in fused.graph.node] == [("MatMulInt4", kernels.DOMAIN)]
    matmul = plain.graph.node[1]
    bias_input = matmul.input[3] if bias else ""
    assert list(fused.graph.node[0].input) == ["a", *matmul.input[1:3], bias_input, "skip", "gamma"]
    for rows in (1, 5, 40, 0):  # one row, a decode batch, a prefill chunk (threaded), none
        want, got = _run(plain, _feeds(rows)), _run(fused, _feeds(rows))
        assert len(want) == len(got)
        for w, g in zip(want, got):
            assert w.shape == g.shape and w.tobytes() == g.tobytes()
        assert rows == 0 or np.abs(want[0]).max() > 0


def test_norms_read_elsewhere_or_by_other_operators_stay():
    shared = _norm_then_matmul(False, extra_reader=True)
    assert fuse_norms(shared) == 0
    assert [n.op_type for n in shared.graph.node][:2] == ["SkipSimplifiedLayerNormalization", "MatMulInt4"]
    exposed = _norm_then_matmul(False)
    exposed.graph.output.append(helper.make_tensor_value_info("normed", TensorProto.FLOAT, ["M", K]))
    assert fuse_norms(exposed) == 0


def test_a_fused_matmul_refuses_a_skip_of_another_shape():
    fused = _norm_then_matmul(True)
    assert fuse_norms(fused) == 1
    feeds = _feeds(4)
    feeds["skip"] = feeds["skip"][:3]
    with pytest.raises(Exception, match="skip shaped like A"):
        _run(fused, feeds)


def test_the_default_cores_step_graph_keeps_its_bits(default_core):
    """Every norm before an int4 matmul is folded (all but the one that feeds the hidden-state
    output) and a prefill then a mixed decode step write the same logits, candidates and pool."""
    from helios.engine.runner import Runner
    from helios.engine.step_io import StepRow
    from helios.kernels import session
    from helios.manifest import Manifest

    manifest = Manifest.load(default_core)
    model = onnx.load(str(default_core / manifest.engine("step").file), load_external_data=False)
    norms = sum(n.op_type == "SkipSimplifiedLayerNormalization" for n in model.graph.node)
    assert fuse_norms(model) == norms - 1 > 0

    def outputs(fuse: bool) -> tuple[list, np.ndarray]:
        original = session.fuse_norms
        if not fuse:
            session.fuse_norms = lambda model: 0
        try:
            runner = Runner(default_core, manifest, 16, threads=2, kv_dtype="bfloat16")
        finally:
            session.fuse_norms = original
        prompt = np.random.default_rng(0).integers(0, 150000, 40).tolist()
        steps = [runner.step([StepRow(prompt, 0, [0, 1, 2])])]
        steps.append(runner.step([StepRow([5], 40, [0, 1, 2]), StepRow(prompt[:9], 0, [5])]))
        return steps, runner.pool

    (plain, plain_pool), (fused, fused_pool) = outputs(False), outputs(True)
    for want, got in zip(plain, fused):
        for field in ("logits", "logsumexp", "top_ids", "candidate_ids", "outside_logit"):
            assert getattr(want, field).tobytes() == getattr(got, field).tobytes(), field
    assert plain_pool.tobytes() == fused_pool.tobytes()

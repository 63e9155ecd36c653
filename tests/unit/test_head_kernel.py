"""ai.flare.LogSoftmaxTopK (helios/kernels/head_kernels.cc) against onnxruntime's LogSoftmax and
TopK, and the load-time rewrite that fuses them (helios.kernels.head)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from helios import kernels
from helios.kernels import DOMAIN
from helios.kernels.head import CANDIDATES, OP, candidate_ids_name, fuse_logprob_head, outside_logit_name

pytestmark = pytest.mark.skipif(kernels.available()[0] is None, reason="flare's kernel library cannot run here")


def _head_model(k: int, vocab: int | str = "V") -> onnx.ModelProto:
    """logits -> LogSoftmax -> TopK(k), plus a GatherElements reader of the log-softmax (the step
    graph's explicit logprob ids), as ignition's logprob_stats exports it."""
    nodes = [
        helper.make_node("LogSoftmax", ["logits"], ["log_softmax"], name="soft", axis=-1),
        helper.make_node("TopK", ["log_softmax", "k"], ["top_logprobs", "top_ids"], name="top", axis=-1),
        helper.make_node("GatherElements", ["log_softmax", "ids"], ["token_logprobs"], name="gather", axis=1),
    ]
    graph = helper.make_graph(
        nodes,
        "head",
        [
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", vocab]),
            helper.make_tensor_value_info("ids", TensorProto.INT64, ["N", "E"]),
        ],
        [
            helper.make_tensor_value_info("top_logprobs", TensorProto.FLOAT, ["N", k]),
            helper.make_tensor_value_info("top_ids", TensorProto.INT64, ["N", k]),
            helper.make_tensor_value_info("token_logprobs", TensorProto.FLOAT, ["N", "E"]),
            helper.make_tensor_value_info("log_softmax", TensorProto.FLOAT, ["N", "V"]),
        ],
        [numpy_helper.from_array(np.array([k], dtype=np.int64), "k")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _run(model: onnx.ModelProto, logits: np.ndarray, ids: np.ndarray) -> dict[str, np.ndarray]:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    options.register_custom_ops_library(str(kernels.available()[0]))
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, {"logits": logits, "ids": ids})))


def _logits(rows: int, vocab: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((rows, vocab)) * 4).astype(np.float32)
    # Ties across chunks and within a vector, at and around the top: equal values must come out
    # by lower id first, as onnxruntime's TopK orders them.
    for row in range(rows):
        top = float(logits[row].max()) + 1.0
        for at in rng.choice(vocab, size=min(vocab, 6), replace=False):
            logits[row, at] = top
        logits[row, rng.integers(0, vocab)] = -np.inf
    return logits


@pytest.mark.parametrize(
    ("rows", "vocab", "k"), [(1, 151936, 20), (8, 151936, 20), (3, 8193, 20), (2, 37, 5), (1, 20, 20)]
)
def test_fused_head_matches_log_softmax_and_top_k(rows, vocab, k):
    reference = _head_model(k)
    fused = _head_model(k, vocab)
    assert fuse_logprob_head(fused, candidates=True) == 1
    assert [n.op_type for n in fused.graph.node] == [OP, "GatherElements"]
    assert fused.graph.node[0].domain == DOMAIN
    logits = _logits(rows, vocab, seed=rows * vocab)
    ids = np.random.default_rng(1).integers(0, vocab, (rows, 3)).astype(np.int64)
    want = _run(reference, logits, ids)
    want_values, want_ids, want_soft = want["top_logprobs"], want["top_ids"], want["log_softmax"]
    got = _run(fused, logits, ids)
    values, top_ids, tokens, soft = (got[n] for n in ("top_logprobs", "top_ids", "token_logprobs", "log_softmax"))
    finite = np.isfinite(want_soft)
    np.testing.assert_array_equal(np.isfinite(soft), finite)
    # Against float64: the fused sum is the closer one (onnxruntime's float sum over a 152k row
    # drifts ~1.4e-5; the fused chunks, summed in double, ~2.6e-6).
    wide = logits.astype(np.float64)
    with np.errstate(invalid="ignore"):
        peak = np.nanmax(np.where(np.isfinite(wide), wide, np.nan), axis=1, keepdims=True)
        exact = wide - (peak + np.log(np.exp(wide - peak).sum(axis=1, keepdims=True)))
    np.testing.assert_allclose(soft[finite], exact[finite], rtol=0, atol=1e-5)
    np.testing.assert_allclose(soft[finite], want_soft[finite], rtol=0, atol=5e-5)
    # TopK's order on the fused log-softmax: larger first, equal values by larger logit, then
    # lower id: the ids are the k largest logits.
    order = np.lexsort((np.broadcast_to(np.arange(vocab), soft.shape), -logits, -soft), axis=1)
    np.testing.assert_array_equal(top_ids, order[:, :k])
    # The sampler's candidates: the CANDIDATES largest logits in the same order, and the largest
    # logit left out, exactly. A vocabulary smaller than that gets neither.
    if vocab >= CANDIDATES:
        np.testing.assert_array_equal(got[candidate_ids_name("top_ids")], order[:, :CANDIDATES])
        rest = np.take_along_axis(logits, order[:, CANDIDATES:], axis=1)
        np.testing.assert_array_equal(got[outside_logit_name("top_ids")], rest.max(axis=1, initial=-np.inf))
    else:
        assert candidate_ids_name("top_ids") not in got and outside_logit_name("top_ids") not in got
    np.testing.assert_array_equal(values, np.take_along_axis(soft, top_ids, axis=1))  # Y's own elements
    np.testing.assert_allclose(values, want_values, rtol=0, atol=5e-5)
    np.testing.assert_array_equal(np.sort(top_ids[:, :5], axis=1), np.sort(want_ids[:, :5], axis=1))  # the tied top
    np.testing.assert_array_equal(tokens, np.take_along_axis(soft, ids, axis=1))


def test_only_a_last_axis_top_k_of_a_two_dimensional_log_softmax_is_fused():
    model = _head_model(20)
    model.graph.node[1].attribute.append(helper.make_attribute("largest", 0))
    assert fuse_logprob_head(model) == 0
    model = _head_model(20)
    del model.graph.input[0].type.tensor_type.shape.dim[:]  # rank unknown: left alone
    assert fuse_logprob_head(model) == 0
    model = _head_model(20)
    model.graph.node[1].input[1] = "k_input"  # k computed at run time: left alone
    assert fuse_logprob_head(model) == 0
    model = _head_model(20)  # a vocabulary the graph does not state: fused, without candidates
    assert fuse_logprob_head(model, candidates=True) == 1
    assert [o.name for o in model.graph.output] == ["top_logprobs", "top_ids", "token_logprobs", "log_softmax"]


@pytest.mark.parametrize("vocab", [151936, 1000])
def test_logits_the_log_softmax_rounds_together_rank_by_logit(vocab):
    """Logits in [0, 1e-5) land on a few dozen log-softmax values (its ulp near -log(V) is
    ~5e-7 to 1e-6, theirs ~1e-11): the fused head's ids and candidates are still the largest
    logits, and its outside figure the largest logit left out, where onnxruntime's TopK would
    take lower ids."""
    k = 20
    model = _head_model(k, vocab)
    assert fuse_logprob_head(model, candidates=True) == 1
    logits = (np.random.default_rng(vocab).random((2, vocab)) * 1e-5).astype(np.float32)
    got = _run(model, logits, np.zeros((2, 1), dtype=np.int64))
    soft, top_ids = got["log_softmax"], got["top_ids"]
    assert (soft[:, :1] == soft).sum(axis=1).min() > k  # the top value alone is > k logits wide
    by_logit = np.argsort(-logits, axis=1, kind="stable")
    np.testing.assert_array_equal(top_ids, by_logit[:, :k])
    np.testing.assert_array_equal(got["top_logprobs"], np.take_along_axis(soft, top_ids, axis=1))
    np.testing.assert_array_equal(got[candidate_ids_name("top_ids")], by_logit[:, :CANDIDATES])
    outside = np.take_along_axis(logits, by_logit[:, CANDIDATES : CANDIDATES + 1], axis=1)[:, 0]
    np.testing.assert_array_equal(got[outside_logit_name("top_ids")], outside)


@pytest.mark.parametrize(("rows", "vocab"), [(8, 151936), (3, 8193), (2, 37)])
def test_a_gather_that_only_reads_the_log_softmax_is_folded_and_it_is_never_written(rows, vocab):
    """The step graph's head: the log-softmax feeds only TopK and the explicit-ids gather. Fused
    with the gather, the operator writes no [N, V] log-softmax and reads only the blocks holding a
    candidate; every output keeps the bits of the fused head that writes it."""
    k = 20
    writing = _head_model(k, vocab)  # log_softmax is a graph output: written, the gather kept
    folded = _head_model(k, vocab)
    del folded.graph.output[3]  # nothing but TopK and the gather reads log_softmax now
    assert fuse_logprob_head(writing, candidates=True) == 1 and fuse_logprob_head(folded, candidates=True) == 1
    assert [n.op_type for n in folded.graph.node] == [OP]
    assert folded.graph.node[0].output[0] == "" and list(folded.graph.node[0].input) == ["logits", "ids"]
    logits = _logits(rows, vocab, seed=vocab + rows)
    ids = np.random.default_rng(2).integers(-vocab, vocab, (rows, 5)).astype(np.int64)  # negatives count from the end
    want, got = _run(writing, logits, ids), _run(folded, logits, ids)
    assert set(got) == set(want) - {"log_softmax"}
    for name, value in got.items():
        assert value.tobytes() == want[name].tobytes(), name
    with pytest.raises(Exception, match="outside the vocabulary"):
        _run(folded, logits, np.full((rows, 1), vocab, dtype=np.int64))


def test_a_nan_logit_makes_its_row_nan_as_onnxruntime_does():
    """A finite logsumexp certifies a row's logits to the sampler, so one NaN logit must make the
    row's log-softmax, values and gathered logprobs NaN (Exp clamps a NaN to a finite term),
    while its neighbour is untouched."""
    vocab = 20000
    logits = _logits(2, vocab, seed=5)
    logits[0, 12345] = np.nan
    ids = np.array([[3, 12345], [7, 9]], dtype=np.int64)
    model = _head_model(20, vocab)
    assert fuse_logprob_head(model, candidates=True) == 1
    got, want = _run(model, logits, ids), _run(_head_model(20, vocab), logits, ids)
    for name in ("log_softmax", "top_logprobs", "token_logprobs"):
        assert np.isnan(got[name][0]).all() and np.isnan(want[name][0]).all(), name
        np.testing.assert_allclose(got[name][1], want[name][1], rtol=0, atol=5e-5)
    assert 12345 not in got[candidate_ids_name("top_ids")][0]  # NaN never ranks


def test_the_log_softmax_is_not_written_where_only_the_top_k_reads_it():
    model = _head_model(20, 1000)
    del model.graph.output[3]  # log_softmax: now read by the TopK and the gather only
    model.graph.node[2].input[0] = "logits"  # the gather reads the logits instead
    assert fuse_logprob_head(model) == 1
    assert [n.op_type for n in model.graph.node] == [OP, "GatherElements"]
    assert model.graph.node[0].output[0] == ""
    logits = _logits(2, 1000, seed=9)
    got, want = (
        _run(model, logits, np.zeros((2, 1), dtype=np.int64)),
        _run(_head_model(20, 1000), logits, np.zeros((2, 1), dtype=np.int64)),
    )
    np.testing.assert_array_equal(got["top_ids"], want["top_ids"])


def test_a_gather_whose_ids_come_from_the_head_or_are_int32_is_left_as_it_is():
    model = _head_model(20, 1000)
    del model.graph.output[3]
    model.graph.node.insert(2, helper.make_node("Slice", ["top_ids", "zero", "one", "one_axis"], ["first_id"]))
    model.graph.initializer.extend(
        numpy_helper.from_array(np.array([v], dtype=np.int64), n) for v, n in ((0, "zero"), (1, "one"), (1, "one_axis"))
    )
    model.graph.node[3].input[1] = "first_id"  # gather(log_softmax, top_ids[:, :1]): a cycle if folded
    assert fuse_logprob_head(model) == 1
    assert [n.op_type for n in model.graph.node] == [OP, "Slice", "GatherElements"]
    logits = _logits(2, 1000, seed=4)
    got = _run(model, logits, np.zeros((2, 1), dtype=np.int64))
    np.testing.assert_array_equal(got["token_logprobs"][:, 0], got["top_logprobs"][:, 0])
    model = _head_model(20, 1000)
    del model.graph.output[3]
    model.graph.input[1].type.tensor_type.elem_type = TensorProto.INT32  # the operator takes int64 ids
    assert fuse_logprob_head(model) == 1
    assert [n.op_type for n in model.graph.node] == [OP, "GatherElements"]

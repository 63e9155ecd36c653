"""flare's int4 matmul (helios/kernels): the tiled layout, the rewrites to and from onnxruntime's
MatMulNBits, and the AVX512-VNNI kernel against MatMulNBits on the same weights."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from helios import kernels
from helios.kernels import DOMAIN
from helios.kernels.int4_layout import (
    nbits_to_q,
    pack,
    q_to_nbits,
    to_int4_tiles,
    to_matmul_nbits,
    unpack,
)
from helios.kernels.session import open_session, uses_flare_ops


def _nbits_model(k: int, n: int, block: int, bias: bool, seed: int = 0) -> onnx.ModelProto:
    """One MatMul (optionally + bias) quantized by onnxruntime's quantizer exactly as ignition does."""
    from ignition.export.quantize import QuantSettings, quantize_weights

    rng = np.random.default_rng(seed)
    weight = (rng.standard_normal((k, n)) * 0.05).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["a", "w"], ["mm" if bias else "y"], name="proj")]
    inits = [numpy_helper.from_array(weight, "w")]
    if bias:
        inits.append(numpy_helper.from_array(rng.standard_normal(n).astype(np.float32), "b"))
        nodes.append(helper.make_node("Add", ["mm", "b"], ["y"], name="proj.bias"))
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["M", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", n])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    settings = QuantSettings(bits=4, block_size=block, accuracy_level=4, lm_head_bits=None, embedding_bits=None)
    quantize_weights(model, settings)
    assert [node.op_type for node in model.graph.node] == ["MatMulNBits"]
    return model


def _session(model: onnx.ModelProto, library: str | None = None) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    if library:
        options.register_custom_ops_library(library)
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def test_pack_unpack_round_trip_with_a_partial_tile():
    rng = np.random.default_rng(1)
    n, k, block = 37, 192, 64  # 37 columns: the third tile is partial
    q = rng.integers(0, 16, (n, k), dtype=np.uint8)
    scales = rng.random((n, k // block), dtype=np.float32)
    packed, tiled = pack(q, scales, block)
    assert packed.shape == (3 * k * 8,) and tiled.shape == (3, k // block, 16)
    back_q, back_s = unpack(packed, tiled, n, k, block)
    np.testing.assert_array_equal(back_q, q)
    np.testing.assert_array_equal(back_s, scales)
    np.testing.assert_array_equal(nbits_to_q(q_to_nbits(q, block), n, k, block), q)
    # The padding columns multiply to zero: q = 8 (the zero point) with scale 0.
    pad_q, pad_s = unpack(packed, tiled, 48, k, block)
    assert (pad_q[n:] == 8).all() and (pad_s[n:] == 0).all()


@pytest.mark.parametrize("bias", [False, True])
def test_rewrites_are_exact_inverses(bias):
    original = _nbits_model(128, 40, 32, bias)
    model = onnx.ModelProto()
    model.CopyFrom(original)
    assert to_int4_tiles(model) == 1 and uses_flare_ops(model)
    node = model.graph.node[0]
    assert (node.domain, node.op_type) == (DOMAIN, "MatMulInt4") and (node.input[3:] == ["b"]) == bias
    assert to_matmul_nbits(model) == 1 and not uses_flare_ops(model)
    before = {t.name: numpy_helper.to_array(t) for t in original.graph.initializer}
    after = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    assert before.keys() == after.keys()
    for name in before:
        np.testing.assert_array_equal(after[name].reshape(-1), before[name].reshape(-1))
    a = np.random.default_rng(2).standard_normal((3, 128)).astype(np.float32)
    np.testing.assert_array_equal(_session(model).run(None, {"a": a})[0], _session(original).run(None, {"a": a})[0])


def _library() -> str:
    missing = kernels.cpu_missing_flags()
    if missing:
        pytest.skip(f"this CPU lacks {', '.join(missing)}")
    library, why = kernels.available()
    assert library is not None, why  # a VNNI machine must build and load the kernel
    return str(library)


@pytest.mark.parametrize(
    ("k", "n", "block", "bias"),
    [(128, 40, 32, True), (896, 1152, 64, False), (256, 96, 128, True)],
)
def test_kernel_matches_matmul_nbits(k, n, block, bias):
    """Rows 1..70 cover one pass, a pass remainder, several passes and two row chunks; 40 and 96
    columns a partial tile and a tile count that is not a multiple of the multi-tile pass."""
    library = _library()
    reference_model = _nbits_model(k, n, block, bias, seed=k + n)
    flare_model = onnx.ModelProto()
    flare_model.CopyFrom(reference_model)
    to_int4_tiles(flare_model)
    reference, flare = _session(reference_model), _session(flare_model, library)
    rng = np.random.default_rng(3)
    weight_scale = np.abs(numpy_helper.to_array(reference_model.graph.initializer[1])).max()
    for rows in (1, 2, 3, 5, 8, 9, 17, 70):
        a = rng.standard_normal((rows, k)).astype(np.float32)
        a[:, 7] *= 20  # an outlier channel, as real activations have
        want, got = reference.run(None, {"a": a})[0], flare.run(None, {"a": a})[0]
        # Same int8 activation blocks and int32 dot products; only float summation order differs.
        bound = 1e-5 * np.abs(a).sum(axis=1, keepdims=True) * weight_scale * 16
        assert got.shape == (rows, n)
        assert (np.abs(got - want) <= bound).all(), (rows, np.abs(got - want).max())


def test_kernel_takes_leading_dimensions_and_empty_batches():
    library = _library()
    model = _nbits_model(128, 40, 64, False)
    flat = _session(model)
    to_int4_tiles(model)
    model.graph.input[0].CopyFrom(helper.make_tensor_value_info("a", TensorProto.FLOAT, ["B", "L", 128]))
    model.graph.output[0].CopyFrom(helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", "L", 40]))
    session = _session(model, library)
    a = np.random.default_rng(4).standard_normal((2, 3, 128)).astype(np.float32)
    got = session.run(None, {"a": a})[0]
    assert got.shape == (2, 3, 40)
    np.testing.assert_allclose(got.reshape(6, 40), flat.run(None, {"a": a.reshape(6, 128)})[0], rtol=1e-5, atol=1e-5)
    assert session.run(None, {"a": np.zeros((0, 3, 128), np.float32)})[0].shape == (0, 3, 40)


def test_open_session_falls_back_to_matmul_nbits(tmp_path, monkeypatch):
    """Where the kernel cannot run, helios rewrites the graph back to MatMulNBits: same outputs."""
    model = _nbits_model(128, 40, 32, True)
    reference = _session(model)
    to_int4_tiles(model)
    path = tmp_path / "step.onnx"
    onnx.save(model, str(path), save_as_external_data=True, location="step.onnx.data", size_threshold=0)
    monkeypatch.setenv("FLARE_KERNELS", "off")
    session, used = open_session(path, ort.SessionOptions(), ["CPUExecutionProvider"])
    assert used == "onnxruntime"
    a = np.random.default_rng(5).standard_normal((4, 128)).astype(np.float32)
    np.testing.assert_array_equal(session.run(None, {"a": a})[0], reference.run(None, {"a": a})[0])
    assert kernels.available() == (None, "disabled by FLARE_KERNELS")


def _swiglu_model(k: int, n: int, block: int, rows: tuple[str, ...] = ("B", "L")) -> onnx.ModelProto:
    """The MLP's gate_up as ignition exports it: MatMul [*rows, K] -> Split over the last axis ->
    x * Sigmoid(x) * up (rows ["N"]: the flat rows of the experts' shared MLP)."""
    from ignition.export.quantize import QuantSettings, quantize_weights

    rng = np.random.default_rng(6)
    weight = (rng.standard_normal((k, n)) * 0.05).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["a", "w"], ["gate_up"], name="gate_up_proj"),
        helper.make_node("Split", ["gate_up"], ["gate", "up"], axis=len(rows), num_outputs=2),
        helper.make_node("Sigmoid", ["gate"], ["sig"]),
        helper.make_node("Mul", ["gate", "sig"], ["silu"]),
        helper.make_node("Mul", ["silu", "up"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [*rows, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [*rows, n // 2])],
        [numpy_helper.from_array(weight, "w")],
        value_info=[helper.make_tensor_value_info("gate_up", TensorProto.FLOAT, [*rows, n])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    quantize_weights(
        model, QuantSettings(bits=4, block_size=block, accuracy_level=4, lm_head_bits=None, embedding_bits=None)
    )
    return model


def test_swiglu_is_folded_into_the_matmul_and_unfolded_exactly():
    original = _swiglu_model(128, 192, 64)
    model = onnx.ModelProto()
    model.CopyFrom(original)
    assert to_int4_tiles(model) == 1
    (node,) = model.graph.node
    assert node.op_type == "MatMulInt4" and {a.name: a.s for a in node.attribute}["activation"] == b"swiglu"
    assert list(node.output) == ["y"]
    assert to_matmul_nbits(model) == 1
    assert [n.op_type for n in model.graph.node] == ["MatMulNBits", "Split", "Sigmoid", "Mul", "Mul"]
    a = np.random.default_rng(7).standard_normal((2, 3, 128)).astype(np.float32)
    np.testing.assert_array_equal(_session(model).run(None, {"a": a})[0], _session(original).run(None, {"a": a})[0])


def test_swiglu_kernel_matches_the_unfused_graph():
    library = _library()
    reference = _swiglu_model(896, 2 * 160, 64)  # 160 output columns: 10 (gate, up) tile pairs
    model = onnx.ModelProto()
    model.CopyFrom(reference)
    to_int4_tiles(model)
    want_session, got_session = _session(reference), _session(model, library)
    rng = np.random.default_rng(8)
    for batch, length in ((1, 1), (8, 1), (2, 37)):
        a = rng.standard_normal((batch, length, 896)).astype(np.float32)
        want, got = want_session.run(None, {"a": a})[0], got_session.run(None, {"a": a})[0]
        assert got.shape == (batch, length, 160)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_swiglu_over_flat_rows_is_folded_by_its_last_axis():
    """The experts' shared MLP multiplies flat rows [N, K]: its Split is over axis 1, the last one
    (the graph's shape information says so), and folds like the layers' [B, L, K] form."""
    library = _library()
    reference = _swiglu_model(256, 2 * 64, 64, rows=["N"])
    model = onnx.ModelProto()
    model.CopyFrom(reference)
    assert to_int4_tiles(model) == 1
    (node,) = model.graph.node
    assert {a.name: a.s for a in node.attribute}["activation"] == b"swiglu"
    a = np.random.default_rng(9).standard_normal((3, 256)).astype(np.float32)
    want, got = _session(reference).run(None, {"a": a})[0], _session(model, library).run(None, {"a": a})[0]
    assert got.shape == (3, 64)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_kernel_rejects_weights_that_do_not_match_its_attributes():
    """A graph whose attributes disagree with its weights fails with onnxruntime's error, never a
    read past the weights."""
    library = _library()
    model = _nbits_model(128, 40, 64, False)
    to_int4_tiles(model)
    (node,) = model.graph.node
    attrs = {a.name: a for a in node.attribute}
    attrs["N"].i = 64  # one tile more than the weights hold
    with pytest.raises(Exception, match="sizes do not match"):
        _session(model, library).run(None, {"a": np.ones((1, 128), np.float32)})
    attrs["N"].i, attrs["block_size"].i = 40, 24  # not a multiple of 16
    with pytest.raises(Exception, match="block_size"):
        _session(model, library).run(None, {"a": np.ones((1, 128), np.float32)})


def _scales_of(model: onnx.ModelProto) -> onnx.TensorProto:
    node = next(n for n in model.graph.node if n.op_type in ("MatMulInt4", "MatMulNBits"))
    return next(t for t in model.graph.initializer if t.name == node.input[2])


@pytest.mark.parametrize(("k", "n", "block"), [(896, 1152, 64), (256, 40, 128)])
def test_half_scales_are_stored_as_float16_and_compute_the_same_numbers(k, n, block):
    """ignition rounds int4 scales to half floats (round_int4_scales); MatMulInt4 then stores them
    as float16, and computes exactly what the same scales held as float32 give. The rewrite back
    to MatMulNBits (float32 scales) is still exact."""
    from ignition.export.quantize import round_int4_scales

    library = _library()
    reference_model = _nbits_model(k, n, block, bias=True, seed=11)
    before = numpy_helper.to_array(_scales_of(reference_model)).copy()
    round_int4_scales(reference_model)
    rounded = numpy_helper.to_array(_scales_of(reference_model))
    assert rounded.dtype == np.float32 and not np.array_equal(rounded, before)
    assert (np.abs(rounded - before) <= np.abs(before) * 2.0**-11).all()
    np.testing.assert_array_equal(rounded.astype(np.float16).astype(np.float32), rounded)

    half_model = onnx.ModelProto()
    half_model.CopyFrom(reference_model)
    to_int4_tiles(half_model)
    assert _scales_of(half_model).data_type == TensorProto.FLOAT16
    float_model = onnx.ModelProto()
    float_model.CopyFrom(half_model)
    widened = numpy_helper.to_array(_scales_of(float_model)).astype(np.float32)
    _scales_of(float_model).CopyFrom(numpy_helper.from_array(widened, _scales_of(float_model).name))

    half, wide, reference = _session(half_model, library), _session(float_model, library), _session(reference_model)
    rng = np.random.default_rng(12)
    for rows in (1, 3, 8, 70):
        a = rng.standard_normal((rows, k)).astype(np.float32)
        got = half.run(None, {"a": a})[0]
        np.testing.assert_array_equal(got, wide.run(None, {"a": a})[0])
        bound = 1e-5 * np.abs(a).sum(axis=1, keepdims=True) * np.abs(rounded).max() * 8 * 16
        assert (np.abs(got - reference.run(None, {"a": a})[0]) <= bound).all()

    assert to_matmul_nbits(half_model) == 1
    np.testing.assert_array_equal(numpy_helper.to_array(_scales_of(half_model)).reshape(-1), rounded.reshape(-1))


def test_a_scale_outside_half_range_keeps_the_matrix_in_float32():
    """A scale below half's normal range is not rounded (it would lose its digits), and the
    matrix holding it keeps float32 scales in MatMulInt4: the rewrite never changes a number."""
    from ignition.export.quantize import round_int4_scales

    model = _nbits_model(128, 40, 64, bias=False, seed=13)
    scales = numpy_helper.to_array(_scales_of(model)).copy()
    scales.reshape(-1)[5] = 3e-6
    _scales_of(model).CopyFrom(numpy_helper.from_array(scales, _scales_of(model).name))
    round_int4_scales(model)
    kept = numpy_helper.to_array(_scales_of(model))
    assert kept.reshape(-1)[5] == np.float32(3e-6)
    to_int4_tiles(model)
    assert _scales_of(model).data_type == TensorProto.FLOAT
    to_matmul_nbits(model)
    np.testing.assert_array_equal(numpy_helper.to_array(_scales_of(model)).reshape(-1), kept.reshape(-1))

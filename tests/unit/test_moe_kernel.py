"""ai.flare.MoE (helios/kernels/moe_kernels.cc) against its torch meaning
(ignition.models.moe_ops.experts_ref), its rewrite into onnxruntime's kernels, and its counters:
a call reads the experts its rows are routed to, not the others."""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from helios import kernels
from helios.kernels.moe import quantize_experts, to_dense_experts
from helios.kernels.session import open_session
from ignition.export.manifest import decode_weight_bytes
from ignition.models.moe_ops import experts_ref

EXPERTS, INTER, WIDTH = 32, 48, 40  # widths that are not multiples of 16: the kernels' masked tails


LIMIT, ALPHA = 0.7, 1.702  # a limit small enough that random activations hit it


def _model(
    kind: str, glu: bool, seed: int, inter: int = INTER, width: int = WIDTH, top_k: int | None = None, unit: str = "glu"
) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    weights = {
        "up": rng.standard_normal((EXPERTS, inter, width)) / np.sqrt(width),
        "down": rng.standard_normal((EXPERTS, width, inter)) / np.sqrt(inter),
    }
    if glu:
        weights["gate"] = rng.standard_normal((EXPERTS, inter, width)) / np.sqrt(width)
    weights = {k: v.astype(np.float32) for k, v in weights.items()}
    names = ["h", "idx", "weights", "up", "down"] + (["gate"] if glu else [])
    extra = {"top_k": top_k} if top_k else {}
    if unit != "glu":
        extra |= {"unit": unit, "limit": LIMIT, "alpha": ALPHA}
    node = helper.make_node("MoE", names, ["out"], domain="ai.flare", name="moe", activation=kind, **extra)
    f, i = TensorProto.FLOAT, TensorProto.INT64
    inputs = [
        helper.make_tensor_value_info("h", f, ["N", width]),
        helper.make_tensor_value_info("idx", i, ["N", "k"]),
        helper.make_tensor_value_info("weights", f, ["N", "k"]),
    ]
    graph = helper.make_graph(
        [node],
        "g",
        inputs,
        [helper.make_tensor_value_info("out", f, None)],
        [numpy_helper.from_array(v, k) for k, v in weights.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("ai.flare", 1)])
    return model, weights


def _routing(rows: int, k: int, seed: int, width: int = WIDTH) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    idx = np.array([rng.choice(EXPERTS, k, replace=False) for _ in range(rows)], np.int64).reshape(rows, k)
    if rows > 1:
        idx[1, -1] = idx[1, 0]  # one row names an expert twice: it counts twice
    return {
        "h": rng.standard_normal((rows, width)).astype(np.float32),
        "idx": idx,
        "weights": rng.random((rows, k)).astype(np.float32),
    }


def _want(feeds: dict[str, np.ndarray], weights: dict[str, np.ndarray], kind: str, unit: str = "glu") -> np.ndarray:
    t = {k: torch.from_numpy(v) for k, v in {**feeds, **weights}.items()}
    return experts_ref(
        t["h"], t["idx"], t["weights"], t["up"], t["down"], t.get("gate"), kind, unit, LIMIT, ALPHA
    ).numpy()


def _session(model: onnx.ModelProto, tmp_path) -> tuple[ort.InferenceSession, str]:
    path = tmp_path / "moe.onnx"
    onnx.save(model, str(path))
    return open_session(path, ort.SessionOptions(), ["CPUExecutionProvider"])


# activation, gated (with a gate table), unit: every expert unit the families use.
CASES = [
    ("silu", True, "glu"),
    ("gelu_tanh", True, "glu"),
    ("relu2", False, "glu"),
    ("silu", True, "clamp_after"),
    ("silu", True, "clamp_before"),
    ("silu", True, "alpha"),
]


@pytest.mark.parametrize("kind,glu,unit", CASES)
@pytest.mark.parametrize("rows,k", [(1, 4), (8, 2), (37, 6), (0, 4)])
def test_kernel_matches_the_torch_meaning(kind, glu, unit, rows, k, tmp_path):
    if kernels.cpu_missing_flags():
        pytest.skip("no AVX512-VNNI")
    model, weights = _model(kind, glu, seed=rows + k, unit=unit)
    session, used = _session(model, tmp_path)
    assert used == "flare"
    feeds = _routing(rows, k, seed=rows)
    got = session.run(None, feeds)[0]
    assert got.shape == (rows, WIDTH)
    np.testing.assert_allclose(got, _want(feeds, weights, kind, unit), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind,glu,unit", CASES)
def test_rewrite_into_dense_einsums_matches(kind, glu, unit, tmp_path, monkeypatch):
    model, weights = _model(kind, glu, seed=5, unit=unit)
    monkeypatch.setenv("FLARE_KERNELS", "off")
    session, used = _session(model, tmp_path)
    assert used == "onnxruntime"
    feeds = _routing(9, 3, seed=9)
    np.testing.assert_allclose(session.run(None, feeds)[0], _want(feeds, weights, kind, unit), rtol=1e-4, atol=1e-5)


def _expert_reads() -> Callable[[], int]:
    """The kernel library's count of routed experts read (skips where it cannot run)."""
    library, why = kernels.available()
    if library is None:
        pytest.skip(why)
    counters = ctypes.CDLL(str(library))  # the library onnxruntime loaded: the same counters
    counters.flare_moe_expert_reads.restype = ctypes.c_uint64
    return counters.flare_moe_expert_reads


def test_a_call_reads_only_the_routed_experts(tmp_path):
    reads = _expert_reads()
    session, _ = _session(_model("silu", True, seed=1)[0], tmp_path)
    before = reads()
    feeds = _routing(1, 4, seed=2)  # one decode row: 4 of 32 experts
    session.run(None, feeds)
    assert reads() - before == 4
    batch = _routing(8, 2, seed=3)  # 8 rows x 2 choices: each distinct expert read once
    before = reads()
    session.run(None, batch)
    assert reads() - before == len(np.unique(batch["idx"]))


def test_kernel_rejects_an_expert_outside_the_table(tmp_path):
    if kernels.cpu_missing_flags():
        pytest.skip("no AVX512-VNNI")
    session, _ = _session(_model("silu", True, seed=1)[0], tmp_path)
    feeds = _routing(2, 2, seed=4)
    feeds["idx"][0, 1] = EXPERTS
    with pytest.raises(Exception, match="outside 0..E-1"):
        session.run(None, feeds)


@pytest.mark.parametrize("kind,glu,unit", CASES)
@pytest.mark.parametrize("rows,k", [(1, 4), (8, 2), (70, 4)])
@pytest.mark.parametrize("bits", [4, 8])
def test_int4_experts_match_their_dequantized_numbers(kind, glu, unit, rows, k, bits, tmp_path):
    """MoEInt4 (the packed tables, int8 activation blocks; bits = 8: the int8 cores' tables)
    against the same numbers dequantized into the dense fp32 chain: within activation-quantization
    error; and near the fp32 experts they came from."""
    library, why = kernels.available()
    if library is None:
        pytest.skip(why)
    model, weights = _model(kind, glu, seed=rows, inter=64, width=96, top_k=k, unit=unit)
    assert quantize_experts(model, bits=bits) == 1
    (node,) = model.graph.node
    assert node.op_type == "MoEInt4" and {i.name for i in model.graph.initializer} == set(node.input[3:])
    assert {a.name: a.i for a in node.attribute}.get("bits", 4) == bits
    session, used = _session(model, tmp_path)
    assert used == "flare"
    feeds = _routing(rows, k, seed=rows + 1, width=96)
    got = session.run(None, feeds)[0]
    dense = onnx.ModelProto()
    dense.CopyFrom(model)
    assert to_dense_experts(dense) == 1
    want = ort.InferenceSession(dense.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    scale = np.abs(want).max()
    assert np.abs(got - want).max() <= 0.03 * scale  # int8 activations per block of the int4 numbers
    fp32 = _want(feeds, weights, kind, unit)
    rms = float(np.sqrt(np.mean(fp32**2)))
    # Gaussian weights at 4 bits: ~9% RMS error each, compounded through two projections and the
    # GLU; at 8 bits the int8 activations dominate what is left.
    assert float(np.sqrt(np.mean((got - fp32) ** 2))) <= (0.25 if bits == 4 else 0.05) * rms
    # decode_weight_bytes: the packed tables count at top_k / E.
    onnx.save(model, str(tmp_path / "int4.onnx"))
    tables = sum(numpy_helper.to_array(i).nbytes for i in model.graph.initializer)
    assert abs(decode_weight_bytes(tmp_path / "int4.onnx") - tables * k / EXPERTS) <= 4


def test_int4_call_reads_only_the_routed_experts(tmp_path):
    reads = _expert_reads()
    model, _ = _model("silu", True, seed=1, inter=64, width=96)
    quantize_experts(model)
    session, _ = _session(model, tmp_path)
    before = reads()
    session.run(None, _routing(1, 4, seed=2, width=96))
    assert reads() - before == 4

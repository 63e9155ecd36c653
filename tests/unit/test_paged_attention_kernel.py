"""ai.flare.PagedAttention (helios/kernels/attention_kernels.cc) against its torch meaning
(ignition.models.ops.pool_attention_ref), its rewrite into onnxruntime's kernels, and its
numerics: a query's result does not depend on how a step splits the work."""

from __future__ import annotations

import math
import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from helios import kernels
from helios.kernels import kv_dtype
from helios.kernels.session import open_session
from ignition.models.ops import pool_attention_ref

INPUTS = ["qkv", "positions", "cos_cache", "sin_cache", "kv_pool", "block_tables", "history_lens", "query_lens"]


def _graph(
    heads: int,
    kv_heads: int,
    dim: int,
    layer: int,
    num_layers: int,
    cos: np.ndarray,
    sin: np.ndarray,
    precision: str | None = None,
) -> onnx.ModelProto:
    extra = {} if precision is None else {"precision": precision}
    node = helper.make_node(
        "PagedAttention",
        INPUTS,
        ["out", "k", "v"],
        domain="ai.flare",
        name="attn",
        num_heads=heads,
        kv_heads=kv_heads,
        layer=layer,
        num_layers=num_layers,
        scale=1.0 / math.sqrt(dim),
        **extra,
    )
    f, i = TensorProto.FLOAT, TensorProto.INT64
    inputs = [
        helper.make_tensor_value_info("qkv", f, ["B", "L", (heads + 2 * kv_heads) * dim]),
        helper.make_tensor_value_info("positions", i, ["B", "L"]),
        helper.make_tensor_value_info("kv_pool", f, ["R", "T", kv_heads, dim]),
        helper.make_tensor_value_info("block_tables", i, ["B", "M"]),
        helper.make_tensor_value_info("history_lens", i, ["B"]),
        helper.make_tensor_value_info("query_lens", i, ["B"]),
    ]
    outputs = [helper.make_tensor_value_info(n, f, None) for n in ("out", "k", "v")]
    inits = [numpy_helper.from_array(cos, "cos_cache"), numpy_helper.from_array(sin, "sin_cache")]
    graph = helper.make_graph([node], "g", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("ai.flare", 1)])


def _case(
    heads: int,
    kv_heads: int,
    dim: int,
    page: int,
    rows: list[tuple[int, int]],
    length: int,
    seed: int,
    precision: str | None = None,
):
    """Random inputs: rows = (history, valid new tokens) per batch row, pages shuffled in the pool."""
    rng = np.random.default_rng(seed)
    num_layers, layer = 3, 1
    max_pos = max(256, max(h for h, _ in rows) + length + 1)
    pages_per_row = [-(-(h + length) // page) for h, _ in rows]
    num_pages = sum(pages_per_row) + 3
    order = rng.permutation(num_pages)
    tables = np.zeros((len(rows), max(pages_per_row)), np.int64)
    at = 0
    for b, n in enumerate(pages_per_row):
        tables[b, :n] = order[at : at + n]
        at += n
    angles = np.arange(max_pos)[:, None] * (1.0 / 10000 ** (np.arange(0, dim, 2) / dim))[None]
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    feeds = {
        "qkv": rng.standard_normal((len(rows), length, (heads + 2 * kv_heads) * dim)).astype(np.float32),
        "positions": np.array([[h + i if i < q else 0 for i in range(length)] for h, q in rows], np.int64),
        "kv_pool": rng.standard_normal((num_layers * 2 * num_pages, page, kv_heads, dim)).astype(np.float32),
        "block_tables": tables,
        "history_lens": np.array([h for h, _ in rows], np.int64),
        "query_lens": np.array([q for _, q in rows], np.int64),
    }
    want = pool_attention_ref(
        *(torch.from_numpy(feeds[n]) for n in INPUTS[:2]),
        torch.from_numpy(cos),
        torch.from_numpy(sin),
        *(torch.from_numpy(feeds[n]) for n in INPUTS[4:]),
        layer,
        num_layers,
        heads,
        kv_heads,
    )
    return _graph(heads, kv_heads, dim, layer, num_layers, cos, sin, precision), feeds, [w.numpy() for w in want], rows


EIGHT_DECODES = [(600, 1), (40, 1), (257, 1), (0, 1), (511, 1), (256, 1), (900, 1), (300, 1)]
EIGHT_VERIFIES = [(300, 4), (20, 3), (700, 4), (256, 1), (0, 4), (513, 2), (64, 4), (290, 4)]
CASES = {
    # heads, kv heads, head dim, page tokens, (history, valid) per row, padded length
    "decode batch": (14, 2, 64, 16, [(0, 1), (5, 1), (16, 1), (47, 1), (130, 1)], 1),
    "prefill chunks": (8, 2, 32, 8, [(0, 37), (21, 40), (64, 1)], 40),
    "one kv head": (4, 1, 16, 4, [(3, 5), (0, 2)], 5),
    "wide heads": (4, 4, 128, 16, [(17, 3), (0, 20)], 20),
    # Keys in several chunks of 256: a decode splits them over items and merges the chunks...
    "long decode": (14, 2, 64, 16, [(700, 1)], 1),
    "long decode, pages of 12": (4, 2, 32, 12, [(600, 1), (40, 1), (257, 1)], 1),
    # ...as does a decode (or a verify) of eight rows and more, one query block each.
    "long decode, eight rows": (14, 2, 64, 16, EIGHT_DECODES, 1),
    "long verify, eight rows": (8, 2, 32, 16, EIGHT_VERIFIES, 4),
    # ...a long prefill walks them in one item per query block.
    "long prefill": (8, 2, 32, 16, [(300, 130)], 130),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_matches_the_torch_meaning(case, tmp_path):
    missing = kernels.cpu_missing_flags()
    if missing:
        pytest.skip(f"this CPU lacks {', '.join(missing)}")
    model, feeds, want, rows = _case(*CASES[case], seed=len(case))
    path = tmp_path / "attn.onnx"
    onnx.save(model, str(path))
    session, used = open_session(path, ort.SessionOptions(), ["CPUExecutionProvider"])
    assert used == "flare"
    got = session.run(None, feeds)
    for g, w in zip(got, want):
        assert g.shape == w.shape
    for b, (_, valid) in enumerate(rows):
        np.testing.assert_allclose(got[0][b, :valid], want[0][b, :valid], rtol=1e-4, atol=1e-5)
        assert (got[0][b, valid:] == 0).all()  # padded queries: zeros
        np.testing.assert_allclose(got[1][b, :valid], want[1][b, :valid], rtol=1e-5, atol=1e-5)  # rotated k
        np.testing.assert_array_equal(got[2][b], want[2][b])  # v passes through


def _session(model: onnx.ModelProto, path) -> ort.InferenceSession:
    onnx.save(model, str(path))
    session, used = open_session(path, ort.SessionOptions(), ["CPUExecutionProvider"])
    assert used == "flare"
    return session


def _session16(model: onnx.ModelProto, path, pool_dtype: str) -> ort.InferenceSession:
    """A session whose kv_pool is `pool_dtype`, as helios' runner opens a 16-bit pool."""
    onnx.save(model, str(path))
    session, used = open_session(path, ort.SessionOptions(), ["CPUExecutionProvider"], pool_dtype)
    assert used == "flare"
    return session


def _run(session: ort.InferenceSession, feeds: dict) -> list[np.ndarray]:
    """Run with the pool bound as an OrtValue (numpy has no bfloat16 onnxruntime takes directly)."""
    binding = session.io_binding()
    for name, value in feeds.items():
        if name == "kv_pool":
            binding.bind_ortvalue_input(name, kv_dtype.ort_value(value))
        else:
            binding.bind_cpu_input(name, value)
    for out in ("out", "k", "v"):
        binding.bind_output(out, "cpu")
    session.run_with_iobinding(binding)
    return [value.numpy() for value in binding.get_outputs()]


POOL_DTYPES = ["float32", "bfloat16", "float16"]


@pytest.mark.parametrize("pool_dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("case", ["decode batch", "prefill chunks", "wide heads", "long decode, pages of 12"])
def test_a_16bit_pool_is_read_in_place_and_new_keys_are_rounded_once(case, pool_dtype, tmp_path):
    """A bfloat16 or float16 pool: the kernel reads the 16-bit pages and rounds the step's own k
    and v to the pool's type (as numpy would) before attending, so k and v come out exactly as the
    pool will hold them; the output stays within 16-bit rounding of the fp32 meaning."""
    if kernels.cpu_missing_flags():
        pytest.skip("no AVX512-VNNI")
    model, feeds, want, rows = _case(*CASES[case], seed=len(case))
    narrow = kv_dtype.numpy_dtype(pool_dtype)
    fp32 = _run(_session16(model, tmp_path / "fp32.onnx", "float32"), feeds)
    got = _run(
        _session16(model, tmp_path / "16.onnx", pool_dtype), dict(feeds, kv_pool=feeds["kv_pool"].astype(narrow))
    )
    for name, g, f in zip(("k", "v"), got[1:], fp32[1:]):
        np.testing.assert_array_equal(g, f.astype(narrow).astype(np.float32), err_msg=name)  # rounded once, as numpy
    for b, (_, valid) in enumerate(rows):
        np.testing.assert_allclose(got[0][b, :valid], want[0][b, :valid], rtol=3e-2, atol=3e-2)
        assert np.abs(got[0][b, :valid] - want[0][b, :valid]).mean() < 5e-3
        assert (got[0][b, valid:] == 0).all()


@pytest.mark.parametrize("case", ["decode batch", "long decode", "long prefill", "wide heads"])
def test_a_bfloat16_pool_attends_as_a_float32_pool_of_the_same_values(case, tmp_path):
    """precision="bfloat16" over a float32 pool holding bf16 values and over a bfloat16 pool: the
    bf16 chunks round the step's own keys the same way in both, so the outputs are the same bits."""
    if kernels.cpu_missing_flags() or not _bf16_dot():
        pytest.skip("no bf16 dot product (AMX or AVX512-BF16)")
    model, feeds, _, _ = _case(*CASES[case], seed=len(case), precision="bfloat16")
    narrow = feeds["kv_pool"].astype(kv_dtype.numpy_dtype("bfloat16"))
    wide = _run(_session16(model, tmp_path / "fp32.onnx", "float32"), dict(feeds, kv_pool=narrow.astype(np.float32)))
    got = _run(_session16(model, tmp_path / "bf16.onnx", "bfloat16"), dict(feeds, kv_pool=narrow))
    np.testing.assert_array_equal(got[0], wide[0])


def test_bfloat16_rounding_for_the_pool_matches_ml_dtypes():
    # What the runner scatters into a bf16 pool: every float32 bit pattern rounds as ml_dtypes
    # rounds it (nearest even, overflow to infinity), NaN stays NaN whatever its payload.
    bits = np.random.default_rng(0).integers(0, 2**32, 1 << 20, dtype=np.uint64).astype(np.uint32)
    edges = np.array([0x7F7FFFFF, 0x7F7F8000, 0x3F808000, 0x3F818000, 0x00008000, 0x7F800001, 0xFFC00001], np.uint32)
    values = np.concatenate([bits, edges]).view(np.float32)
    got = kv_dtype.to_bfloat16(values)
    finite = ~np.isnan(values)
    with np.errstate(invalid="ignore"):
        want = values[finite].astype(kv_dtype.numpy_dtype("bfloat16"))
    np.testing.assert_array_equal(got[finite].view(np.uint16), want.view(np.uint16))
    assert np.isnan(got[~finite].astype(np.float32)).all()


def test_a_pool_of_another_type_is_refused(tmp_path):
    if kernels.cpu_missing_flags():
        pytest.skip("no AVX512-VNNI")
    model, feeds, _, _ = _case(*CASES["one kv head"], seed=2)
    model.graph.input[2].type.tensor_type.elem_type = TensorProto.DOUBLE
    path = tmp_path / "attn.onnx"
    onnx.save(model, str(path))
    session, _ = open_session(path, ort.SessionOptions(), ["CPUExecutionProvider"])
    with pytest.raises(Exception, match="kv_pool must be float, bfloat16 or float16"):
        session.run(None, dict(feeds, kv_pool=feeds["kv_pool"].astype(np.float64)))


@pytest.mark.parametrize("pool_dtype", POOL_DTYPES)
@pytest.mark.parametrize("precision", [None, "bfloat16"])
def test_a_query_gets_the_same_bits_from_a_prefill_and_from_a_decode(tmp_path, precision, pool_dtype):
    """The last query of a 140-token prefill over 300 history tokens (one item per query block,
    chunks folded in one item) against the same query decoded alone after the other 139 new
    tokens were written to the pool (one item per chunk, folded by the merge pass), for every
    pool type: a 16-bit pool's step keys are rounded as the pool stores them."""
    if kernels.cpu_missing_flags():
        pytest.skip("no AVX512-VNNI")
    heads, kv_heads, dim, page, history, length = 8, 2, 32, 16, 300, 140
    model, feeds, _, _ = _case(heads, kv_heads, dim, page, [(history, length)], length, seed=11, precision=precision)
    feeds = dict(feeds, kv_pool=feeds["kv_pool"].astype(kv_dtype.numpy_dtype(pool_dtype)))
    session = _session16(model, tmp_path / "attn.onnx", pool_dtype)
    out, k, v = _run(session, feeds)
    # The decode: 139 of the new tokens now live in the row's pages, the last one is the query.
    pool, table = feeds["kv_pool"].copy(), feeds["block_tables"][0]
    pages, layer = pool.shape[0] // 6, 1
    for i in range(length - 1):
        page_row, slot = table[(history + i) // page], (history + i) % page
        pool[(2 * layer) * pages + page_row, slot] = k[0, i].reshape(kv_heads, dim)
        pool[(2 * layer + 1) * pages + page_row, slot] = v[0, i].reshape(kv_heads, dim)
    decode = dict(
        feeds,
        kv_pool=pool,
        qkv=feeds["qkv"][:, length - 1 :],
        positions=feeds["positions"][:, length - 1 :],
        history_lens=np.array([history + length - 1], np.int64),
        query_lens=np.array([1], np.int64),
    )
    alone = _run(session, decode)[0]
    np.testing.assert_array_equal(alone[0, 0], out[0, length - 1])


def _amx() -> bool:
    text = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    return "amx_bf16" in text and "amx_tile" in text


def _bf16_dot() -> bool:
    """The CPU has a bf16 dot product: AMX tiles or AVX512-BF16 (the kernel's bf16 chunks)."""
    return _amx() or "avx512_bf16" in (kernels.cpu_flags() or set())


@pytest.mark.parametrize("case", sorted(CASES))
def test_bfloat16_precision_matches_the_torch_meaning_within_bf16(case, tmp_path):
    """precision="bfloat16": Q, K, P and V rounded to bf16 on AMX tiles or with AVX512-BF16, fp32
    accumulation and softmax; where the CPU has either the numbers differ from the fp32 kernel's
    (the bf16 chunks ran), within bf16 rounding of the torch meaning; heads of 16 dims, and CPUs
    with neither, run fp32."""
    if kernels.cpu_missing_flags():
        pytest.skip("no AVX512-VNNI")
    heads, kv_heads, dim, page, rows, length = CASES[case]
    model, feeds, want, rows = _case(*CASES[case], seed=len(case), precision="bfloat16")
    got = _session(model, tmp_path / "bf16.onnx").run(None, feeds)
    fp32_model, _, _, _ = _case(*CASES[case], seed=len(case))
    fp32 = _session(fp32_model, tmp_path / "fp32.onnx").run(None, feeds)
    tiles = _bf16_dot() and dim % 32 == 0
    for b, (_, valid) in enumerate(rows):
        np.testing.assert_allclose(got[0][b, :valid], want[0][b, :valid], rtol=3e-2, atol=3e-2)
        assert np.abs(got[0][b, :valid] - want[0][b, :valid]).mean() < 5e-3
        assert (got[0][b, valid:] == 0).all()
        np.testing.assert_array_equal(got[1], fp32[1])  # rotated k and v stay fp32
        np.testing.assert_array_equal(got[2], fp32[2])
    assert (not np.array_equal(got[0], fp32[0])) == tiles


def test_kernel_rejects_an_unknown_precision(tmp_path):
    if kernels.cpu_missing_flags():
        pytest.skip("no AVX512-VNNI")
    model, _, _, _ = _case(*CASES["decode batch"], seed=4, precision="float16")
    path = tmp_path / "attn.onnx"
    onnx.save(model, str(path))
    with pytest.raises(Exception, match="precision must be float32 or bfloat16"):
        open_session(path, ort.SessionOptions(), ["CPUExecutionProvider"])


def test_rewrite_into_group_query_attention_matches(tmp_path, monkeypatch):
    model, feeds, want, rows = _case(*CASES["prefill chunks"], seed=3)
    path = tmp_path / "attn.onnx"
    onnx.save(model, str(path))
    monkeypatch.setenv("FLARE_KERNELS", "off")
    session, used = open_session(path, ort.SessionOptions(), ["CPUExecutionProvider"])
    assert used == "onnxruntime"
    got = session.run(None, feeds)
    for b, (_, valid) in enumerate(rows):
        np.testing.assert_allclose(got[0][b, :valid], want[0][b, :valid], rtol=1e-4, atol=1e-5)
        assert (got[0][b, valid:] == 0).all()
        np.testing.assert_allclose(got[1][b, :valid], want[1][b, :valid], rtol=1e-5, atol=1e-5)


def test_kernel_rejects_a_block_table_outside_the_pool(tmp_path):
    if kernels.cpu_missing_flags():
        pytest.skip("no AVX512-VNNI")
    model, feeds, _, _ = _case(*CASES["decode batch"], seed=4)
    path = tmp_path / "attn.onnx"
    onnx.save(model, str(path))
    session, _ = open_session(path, ort.SessionOptions(), ["CPUExecutionProvider"])
    feeds["block_tables"][2, 0] = 10_000
    with pytest.raises(Exception, match="outside the pool"):
        session.run(None, feeds)

"""The kernel library's host helpers (helios/kernels/host_kernels.cc through helios.kernels.host)
against the numpy formulas they replace: the same bits in the pool, the same draws."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from helios import kernels
from helios.engine import top_ids_draw
from helios.engine.api import SamplingParams
from helios.engine.step_io import StepRow, new_token_slots, scatter_new_kv
from helios.kernels import host
from helios.kernels import kv_dtype as kv_types

pytestmark = pytest.mark.skipif(kernels.available()[0] is None, reason="flare's kernel library cannot run here")

ROWS = [StepRow([1, 2, 3, 4, 5], 0, [3, 7]), StepRow([1], 20, [1, 9]), StepRow([1, 2], 30, [4, 5, 11])]


def _new_kv(seed: int) -> np.ndarray:
    """[layers, 2, B, L, kvh, D] with signed zeros, infinities and NaNs of every payload size (a
    low-payload NaN must stay NaN in bf16, not round into infinity)."""
    new_kv = (np.random.default_rng(seed).standard_normal((4, 2, 3, 5, 2, 64)) * 100).astype(np.float32)
    flat = new_kv.reshape(-1)
    flat[:5] = [np.nan, np.inf, -np.inf, 0.0, -0.0]
    flat.view(np.uint32)[5:40] = np.uint32(0x7F800001) + np.arange(35, dtype=np.uint32) * 0x3A01
    flat.view(np.uint32)[40:45] = np.uint32(0x3F807FFF) + np.arange(5, dtype=np.uint32)  # ties and near-ties
    return new_kv


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_scatter_writes_the_bits_the_numpy_assignment_writes(dtype):
    pool = np.zeros((4, 2, 12, 16, 2, 64), dtype=kv_types.numpy_dtype(dtype))
    want = pool.copy()
    new_kv = _new_kv(1)
    slots = new_token_slots(ROWS, 16)
    assert host.scatter_kv(pool, new_kv, slots)
    page, offset, row, token = slots
    want[:, :, page, offset] = (kv_types.to_bfloat16(new_kv) if dtype == "bfloat16" else new_kv)[:, :, row, token]
    assert pool.view(np.uint8).tobytes() == want.view(np.uint8).tobytes()
    assert np.count_nonzero(pool.view(np.uint8)) > 0
    # The runner's entry point takes the library's path and writes the same.
    again = np.zeros_like(pool)
    scatter_new_kv(again, ROWS, new_kv)
    assert again.view(np.uint8).tobytes() == want.view(np.uint8).tobytes()


def test_scatter_leaves_pools_it_does_not_take_to_numpy_and_refuses_slots_outside():
    new_kv = _new_kv(2)
    slots = new_token_slots(ROWS, 16)
    half = np.zeros((4, 2, 12, 16, 2, 64), dtype=np.float16)
    assert not host.scatter_kv(half, new_kv, slots)  # fp16: numpy's rounding stays the one used
    scatter_new_kv(half, ROWS, new_kv)
    page, offset, row, token = slots
    np.testing.assert_array_equal(half[:, :, page, offset], new_kv[:, :, row, token].astype(np.float16))
    pool = np.zeros((4, 2, 12, 16, 2, 64), dtype=np.float32)
    with pytest.raises(IndexError):
        host.scatter_kv(pool, new_kv, (page + 12, offset, row, token))
    with pytest.raises(IndexError):
        host.scatter_kv(pool, new_kv, (page, offset, row, token - 1))
    assert not pool.any()


def test_exp_is_within_float32_rounding_of_numpys_and_zero_below_the_normal_range():
    x = np.concatenate([np.linspace(-87.0, 0.0, 100_003, dtype=np.float32), np.float32([0.5, 3.0, 20.0])])
    got = host.exp(x)
    np.testing.assert_allclose(got, np.exp(x), rtol=3e-7, atol=0)
    assert host.exp(np.float32([-np.inf, -88.0, -1000.0, 0.0])).tolist() == [0.0, 0.0, 0.0, 1.0]
    assert host.exp(np.zeros(0, np.float32)).shape == (0,)
    assert host.exp(np.float64([1.0])).dtype == np.float64  # not the library's: numpy's


def _draw_case(seed: int, rows: int = 8, k_ids: int = 64, vocab: int = 5000):
    """Logits from flat to peaked, each row's K raw-best ids (any order), parameters covering every
    filter and penalty, prompts and outputs among the candidates."""
    rng = np.random.default_rng(seed)
    scale = rng.choice([0.05, 0.5, 2.0, 8.0, 30.0], size=(rows, 1)).astype(np.float32)
    logits = (rng.standard_normal((rows, vocab)).astype(np.float32) * scale).astype(np.float32)
    logits[:, rng.integers(0, vocab, 40)] = logits[:, :1]  # ties
    top = np.argsort(-logits, axis=1, kind="stable")[:, :k_ids]
    top = np.take_along_axis(top, rng.permuted(np.tile(np.arange(k_ids), (rows, 1)), axis=1), axis=1)
    params, seen, counts = [], [], []
    for b in range(rows):
        params.append(
            SamplingParams(
                top_k=int(rng.integers(1, k_ids + 1)),
                temperature=float(rng.choice([0.05, 0.7, 1.0, 1.7])),
                top_p=float(rng.choice([1.0, 0.95, 0.8, 0.3])),
                min_p=float(rng.choice([0.0, 0.0, 0.05, 0.3])),
                repetition_penalty=float(rng.choice([1.0, 1.05, 1.3])),
                presence_penalty=float(rng.choice([0.0, 0.4])),
                frequency_penalty=float(rng.choice([0.0, 0.3, 1.1])),
            )
        )
        picked = rng.choice(top[b], size=12).tolist() + rng.integers(0, vocab, 20).tolist()
        seen.append(set(picked[::2]))
        counts.append(collections.Counter(picked[1::3]))
    return logits, top, params, seen, counts


@pytest.mark.parametrize("seed", range(5))
def test_the_librarys_draw_equals_numpys_for_every_row_it_takes(seed):
    logits, top, params, seen, counts = _draw_case(seed)
    rows = list(range(len(params)))
    rng = np.random.default_rng(1000 + seed)
    outside = None
    for turn in range(60):
        if turn == 30:  # the fused head's bound on the logits outside the candidates
            rest = logits.copy()
            np.put_along_axis(rest, top, -np.inf, axis=1)
            outside = rest.max(axis=1)
        uniforms = rng.random(len(rows)).tolist()
        batch = top_ids_draw.CandidateRows(logits, top, rows, params, seen, counts, uniforms, outside)
        library = top_ids_draw._draw_in_library(batch)
        numpy_tokens, drawn = top_ids_draw._draw_in_numpy(batch)
        taken = library >= 0
        assert taken.any()
        assert library[taken].tolist() == numpy_tokens[taken].tolist()
        together, together_drawn = top_ids_draw.draw_rows(batch)
        assert together.tolist() == numpy_tokens.tolist() and together_drawn.tolist() == drawn.tolist()


def test_the_library_leaves_rows_that_need_the_vocabulary_pass():
    # A heavily penalized candidate set: its k-th value falls below tokens outside the candidates.
    logits = (np.random.default_rng(7).standard_normal((1, 600)) * 0.5).astype(np.float32)
    top = np.argsort(-logits, axis=1)[:, :64]
    ids = top[0].tolist()
    params = [SamplingParams(top_k=64, temperature=1.0, repetition_penalty=1.0, frequency_penalty=30.0)]
    counts = [collections.Counter(ids)]
    batch = top_ids_draw.CandidateRows(logits, top, [0], params, [set()], counts, [0.5])
    assert top_ids_draw._draw_in_library(batch).tolist() == [-1]
    token, drawn = top_ids_draw.draw_rows(batch)
    assert drawn.tolist() == [True] and int(token[0]) not in ids  # drawn by the numpy path


def test_the_librarys_draw_refuses_rows_and_top_k_outside_its_arrays():
    logits, top, _, _, _ = _draw_case(3, rows=2)
    table = np.zeros((1, len(host.DRAW_COLUMNS)))
    table[0, host.DRAW_COLUMNS.index("temperature")] = 1.0
    table[0, host.DRAW_COLUMNS.index("top_k")] = 65
    penalties = np.zeros((1, 2, 64), np.float32)
    with pytest.raises(IndexError):
        host.draw_top_k(logits, top, [0], table, penalties)
    table[0, host.DRAW_COLUMNS.index("top_k")] = 5
    with pytest.raises(IndexError):
        host.draw_top_k(logits, top, [2], table, penalties)
    with pytest.raises(ValueError):
        host.draw_top_k(logits, top, [0, 1], table, penalties)
    assert host.draw_top_k(logits, top, [1], table, penalties).tolist()[0] in top[1].tolist()

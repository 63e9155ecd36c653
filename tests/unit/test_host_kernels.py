"""The kernel library's host helpers (helios/kernels/host_kernels.cc through helios.kernels.host)
against the numpy formulas they replace: the same bits in the pool."""

from __future__ import annotations

import numpy as np
import pytest

from helios import kernels
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

"""Host helpers from flare's kernel library (host_kernels.cc), called through ctypes between
graph runs. Each returns False where it does not apply (no library here, a layout it does not
take), and the caller then runs the numpy formula it replaces, which gives the same bits."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import numpy as np

from helios import kernels
from helios.kernels import kv_dtype as kv_types

_I64 = ctypes.c_int64
_POINTER = ctypes.c_void_p


@functools.cache
def _scatter_kv_function() -> Callable[..., int] | None:
    library, _ = kernels.available()
    if library is None:
        return None
    function = ctypes.CDLL(str(library)).flare_scatter_kv
    function.restype = ctypes.c_int32
    function.argtypes = [_POINTER, ctypes.c_int32, *[_I64] * 4, _POINTER, _I64, _I64, *[_POINTER] * 4, _I64]
    return function


def scatter_kv(pages: np.ndarray, new_kv: np.ndarray, slots: tuple[np.ndarray, ...]) -> bool:
    """pages [layers, 2, num_pages, page_tokens, kvh, D] (a contiguous float32 or bfloat16 pool)
    [:, :, page[i], offset[i]] = new_kv [layers, 2, B, L, kvh, D] [:, :, row[i], token[i]], rounded
    to the pool's type as kv_dtype.to_bfloat16 rounds; slots: (page, offset, row, token) int64."""
    bf16 = pages.dtype == kv_types.numpy_dtype("bfloat16")
    if not (bf16 or pages.dtype == np.float32) or not pages.flags.c_contiguous or pages.ndim != 6:
        return False
    function = _scatter_kv_function()
    if function is None:
        return False
    layers, kinds, num_pages, page_tokens, kv_heads, head_dim = pages.shape  # kinds: K and V
    if new_kv.shape[:2] != (layers, kinds) or new_kv.shape[4:] != (kv_heads, head_dim):
        raise ValueError(f"new_kv of shape {new_kv.shape} for a pool of shape {pages.shape}")
    source = np.ascontiguousarray(new_kv, dtype=np.float32)
    page, offset, row, token = (np.ascontiguousarray(s, dtype=np.int64) for s in slots)
    batch, length = source.shape[2:4]
    status = function(
        pages.ctypes.data,
        int(bf16),
        layers * kinds,  # the C side's planes
        num_pages,
        page_tokens,
        kv_heads * head_dim,
        source.ctypes.data,
        batch,
        length,
        page.ctypes.data,
        offset.ctypes.data,
        row.ctypes.data,
        token.ctypes.data,
        page.size,
    )
    if status != 0:
        raise IndexError("a new K/V slot lies outside the pool or new_kv")
    return True

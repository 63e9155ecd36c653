"""Host helpers from flare's kernel library (host_kernels.cc), called through ctypes between
graph runs: the K/V scatter, the sampler's exp and its usual top-k draw. Each has a numpy twin
the caller runs where the library does not (no library here, a layout it does not take); the
scatter's gives the same bits, and the sampler takes every weight from `exp`, so its draws agree
across its paths either way."""

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
def _library_function(name: str) -> Callable[..., int] | None:
    """One of the library's host helpers with its ctypes signature, or None without a library."""
    library, _ = kernels.available()
    if library is None:
        return None
    # PyDLL: the call keeps the GIL. A decode step's calls take microseconds; releasing the GIL
    # for each lets the server's event-loop thread take it, and the engine thread then waits to
    # get it back. Served decode at one row, two servers in turns on Zen 4 (with the draw's
    # cached columns): +2.5%, +1.0%, -4.0% and +2.7% tok/s in four sets, within the host's noise.
    function = getattr(ctypes.PyDLL(str(library)), name)
    function.restype, function.argtypes = _SIGNATURES[name]
    return function


_SIGNATURES = {
    "flare_scatter_kv": (
        ctypes.c_int32,
        [_POINTER, ctypes.c_int32, *[_I64] * 4, _POINTER, _I64, _I64, _POINTER, _I64],
    ),
    "flare_exp_f32": (None, [_POINTER, _POINTER, _I64]),
    "flare_draw_top_k": (ctypes.c_int32, [_POINTER, _I64, _I64, _POINTER, _I64, _I64, *[_POINTER] * 3]),
}


def scatter_kv(pages: np.ndarray, new_kv: np.ndarray, slots: np.ndarray | tuple[np.ndarray, ...]) -> bool:
    """pages [layers, 2, num_pages, page_tokens, kvh, D] (a contiguous float32 or bfloat16 pool)
    [:, :, page[i], offset[i]] = new_kv [layers, 2, B, L, kvh, D] [:, :, row[i], token[i]], rounded
    to the pool's type as kv_dtype.to_bfloat16 rounds; slots: int64 [4, N] (page, offset, row,
    token; helios.engine.step_io.new_token_slots), or those four columns."""
    bf16 = pages.dtype == kv_types.numpy_dtype("bfloat16")
    if not (bf16 or pages.dtype == np.float32) or not pages.flags.c_contiguous or pages.ndim != 6:
        return False
    function = _library_function("flare_scatter_kv")
    if function is None:
        return False
    layers, kinds, num_pages, page_tokens, kv_heads, head_dim = pages.shape  # kinds: K and V
    if new_kv.shape[:2] != (layers, kinds) or new_kv.shape[4:] != (kv_heads, head_dim):
        raise ValueError(f"new_kv of shape {new_kv.shape} for a pool of shape {pages.shape}")
    source = np.ascontiguousarray(new_kv, dtype=np.float32)
    table = np.ascontiguousarray(slots, dtype=np.int64)
    if table.ndim != 2 or table.shape[0] != 4:
        raise ValueError(f"slots of shape {table.shape}: four columns of equal length are needed")
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
        table.ctypes.data,
        table.shape[1],
    )
    if status != 0:
        raise IndexError("a new K/V slot lies outside the pool or new_kv")
    return True


# draw_top_k's parameter columns, in order (host_kernels.cc's DrawColumn), as float64: the C side
# rounds temperature, log_min_p, the penalties and outside to float32 as numpy's astype does
# (both round to nearest); outside is NaN where none is given.
DRAW_COLUMNS = (
    "top_k",
    "temperature",
    "top_p",
    "log_min_p",
    "repetition",
    "presence",
    "frequency",
    "uniform",
    "outside",
)


def exp(x: np.ndarray) -> np.ndarray:
    """float32 e^x for the sampler's weights: the library's (0 below -87.3) where it runs, else
    numpy's. Every sampling path calls this, so their draws agree bit for bit either way."""
    function = _library_function("flare_exp_f32")
    if function is None or x.dtype != np.float32:
        return np.exp(x)
    source = np.ascontiguousarray(x)
    out = np.empty_like(source)
    function(source.ctypes.data, out.ctypes.data, source.size)
    return out


def can_draw() -> bool:
    """Whether `draw_top_k` runs here (it takes the rows the caller would otherwise draw in numpy)."""
    return _library_function("flare_draw_top_k") is not None


def draw_top_k(
    logits: np.ndarray, top_ids: np.ndarray, rows: list[int], params: np.ndarray, penalties: np.ndarray
) -> np.ndarray:
    """helios.engine.top_ids_draw's draw for `rows` of logits [B, V] over top_ids [B, K]: a token
    per row, or -1 for a row whose top-k survivors may lie outside its candidates (the caller's
    vocabulary pass). params [rows, DRAW_COLUMNS] float64; penalties [rows, 2, K] float32 in
    top_ids' order: 1 where the repetition penalty applies, and how often the id was generated.
    (Few arrays on purpose: each pointer handed to ctypes costs ~1 us.)"""
    function = _library_function("flare_draw_top_k")
    if function is None:
        raise RuntimeError("flare's kernel library is not available")
    logits = np.ascontiguousarray(logits, dtype=np.float32)
    top_ids = np.ascontiguousarray(top_ids, dtype=np.int64)
    params = np.ascontiguousarray(params, dtype=np.float64)
    penalties = np.ascontiguousarray(penalties, dtype=np.float32)
    count, k_ids = len(rows), top_ids.shape[1]
    if params.shape != (count, len(DRAW_COLUMNS)) or penalties.shape != (count, 2, k_ids):
        raise ValueError(f"params must be [{count}, {len(DRAW_COLUMNS)}] and penalties [{count}, 2, {k_ids}]")
    rows_tokens = np.empty((2, count), dtype=np.int64)
    rows_tokens[0] = rows
    status = function(
        logits.ctypes.data,
        logits.shape[0],
        logits.shape[1],
        top_ids.ctypes.data,
        k_ids,
        count,
        params.ctypes.data,
        penalties.ctypes.data,
        rows_tokens.ctypes.data,
    )
    if status != 0:
        raise IndexError("a row, candidate id or top_k lies outside the logits")
    return rows_tokens[1]

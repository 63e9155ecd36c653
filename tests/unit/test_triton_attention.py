"""helios.kernels.triton_attention (flare::pool_attention's CUDA kernels) against the op's torch
reference, run on CPU tensors under Triton's interpreter. TRITON_INTERPRET must be set before the
kernel module is imported: @triton.jit picks the interpreter when it decorates. The interpreter
costs ~0.2-2 s a call, so every case is small; bf16 (which the interpreter's tl.dot mishandles) and
speed are left to the device check."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest

triton = pytest.importorskip("triton")

import numpy
import torch

from helios.kernels import triton_attention as ta
from helios.kernels.torch_ops import pool_attention_ref


def version(module) -> tuple[int, int]:
    return tuple(int(part) for part in module.__version__.split(".")[:2])


if version(triton) < (3, 8) and version(numpy) >= (2, 4):
    pytest.skip(
        "triton < 3.8's interpreter fails on runtime loop bounds with numpy >= 2.4 (triton#9171)",
        allow_module_level=True,
    )

T = 16  # page tokens, as in every recipe
NUM_LAYERS, LAYER = 2, 1  # layer 1: the K/V halves sit at a non-zero pool offset
CONFIGS = {"g2d16": (4, 2, 16), "g7d64": (14, 2, 64), "g6d128": (12, 2, 128)}  # (H, KVH, D): G = 2, 7, 6


def make_args(
    heads: int,
    kv_heads: int,
    dim: int,
    hist: list[int],
    qlens: list[int],
    length: int,
    dtype: torch.dtype,
    seed: int = 0,
    wide_table: bool = False,
) -> tuple:
    """The op's positional arguments: a pool with spare random pages, shuffled page tables (pages of
    a row neither contiguous nor ordered), positions continuing each row's history."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(hist)
    max_pages = max(1, max(-(-h // T) for h in hist))
    pages = batch * max_pages + 3
    pool = torch.randn(NUM_LAYERS * 2 * pages, T, kv_heads, dim, generator=gen).to(dtype)
    tables = torch.randperm(pages, generator=gen)[: batch * max_pages].reshape(batch, max_pages)
    if wide_table:  # a column slice of a wider table: not contiguous
        wide = torch.full((batch, max_pages + 3), 10**6, dtype=torch.int64)
        wide[:, :max_pages] = tables
        tables = wide[:, :max_pages]
    qkv = torch.randn(batch, length, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    positions = torch.tensor(hist).unsqueeze(1) + torch.arange(length)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = torch.arange(max(hist) + length + 4, dtype=torch.float32).unsqueeze(1) * inv_freq
    return (
        qkv,
        positions,
        angles.cos().to(dtype),
        angles.sin().to(dtype),
        pool,
        tables,
        torch.tensor(hist),
        torch.tensor(qlens),
        LAYER,
        NUM_LAYERS,
        heads,
        kv_heads,
        dim**-0.5,
    )


def check(args: tuple, **knobs) -> torch.Tensor:
    """Kernel vs the reference computed in fp32 from the same values; returns the kernel's out."""
    out, k, v = ta.pool_attention_triton(*args, **knobs)
    wide = [a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args]
    ref_out, ref_k, ref_v = pool_attention_ref(*wide)
    dtype = args[0].dtype
    assert out.dtype == k.dtype == v.dtype == dtype and k.is_contiguous() and v.is_contiguous()
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(out.float(), ref_out, **tol)
    kv_tol = dict(atol=1e-6, rtol=0) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(k.float(), ref_k, **kv_tol)
    torch.testing.assert_close(v.float(), ref_v, atol=0, rtol=0)
    padded = torch.arange(args[0].shape[1]).unsqueeze(0) >= args[7].unsqueeze(1)
    assert not out[padded].any(), "padded queries must be zeros"
    return out


DECODE = {  # scenario -> (histories, query lens, knobs, expect split)
    "short": ([0, 15, 16], [1, 1, 1], {}, False),
    "b1": ([17], [1], {}, False),
    "split": ([17, 600, 0], [1, 1, 0], {"segment_keys": 64}, True),  # 10 segments; a padded row
    "split_b1": ([600], [1], {"segment_keys": 64}, True),
    "split_edges": ([0, 15, 16, 17], [1, 1, 1, 1], {"segment_keys": 16}, True),  # 1 / 1 / 1 full / 2 segments
}
DECODE_CASES = [("g2d16", torch.float32, s) for s in DECODE] + [
    ("g7d64", torch.float32, "short"),
    ("g7d64", torch.float32, "split"),
    ("g7d64", torch.float16, "b1"),
    ("g7d64", torch.float16, "split_b1"),
    ("g6d128", torch.float32, "b1"),
    ("g6d128", torch.float32, "split_b1"),
    ("g6d128", torch.float16, "short"),
    ("g6d128", torch.float16, "split"),
]


def case_id(value) -> str:
    return {torch.float32: "fp32", torch.float16: "fp16"}.get(value, str(value))


@pytest.mark.parametrize("config,dtype,scenario", DECODE_CASES, ids=case_id)
def test_decode(config, dtype, scenario):
    heads, kv_heads, dim = CONFIGS[config]
    hist, qlens, knobs, split = DECODE[scenario]
    args = make_args(heads, kv_heads, dim, hist, qlens, 1, dtype, seed=len(hist))
    capacity = args[5].shape[1] * T
    assert ta._use_split(len(hist), 1, kv_heads, capacity, knobs.get("segment_keys", ta.SEGMENT_KEYS)) == split
    check(args, **knobs)


PREFILL = {  # scenario -> (histories, query lens, L, knobs); L = 20 spans several q-blocks at G_PAD 8
    "fresh": ([0], [20], 20, {}),
    "history_padded": ([37, 0], [20, 13], 20, {}),
    "long_history": ([300], [20], 20, {"segment_keys": 64}),  # the fused path folds 5 segments
}
PREFILL_CASES = [("g2d16", torch.float32, s) for s in PREFILL] + [
    ("g7d64", torch.float32, "fresh"),
    ("g7d64", torch.float16, "history_padded"),
    ("g6d128", torch.float16, "fresh"),
    ("g6d128", torch.float32, "history_padded"),
]


@pytest.mark.parametrize("config,dtype,scenario", PREFILL_CASES, ids=case_id)
def test_prefill(config, dtype, scenario):
    heads, kv_heads, dim = CONFIGS[config]
    hist, qlens, length, knobs = PREFILL[scenario]
    check(make_args(heads, kv_heads, dim, hist, qlens, length, dtype, seed=7, wide_table=True), **knobs)


def solo(args: tuple, row: int) -> tuple:
    """Row `row` of a batch as its own call, its table cut to the pages its history uses."""
    qkv, positions, cos, sin, pool, tables, hist, qlens, *rest = args
    pages = max(1, -(-int(hist[row]) // T))
    one = slice(row, row + 1)
    return (qkv[one], positions[one], cos, sin, pool, tables[one, :pages], hist[one], qlens[one], *rest)


def test_batch_invariance():
    """A row's out in a batch equals its solo out bit for bit, whichever path either call takes
    (rows of 17 and 0 keys run fused alone, those of 600 and 300 split), and split == fused."""
    torch.manual_seed(0)
    heads, kv_heads, dim = CONFIGS["g7d64"]
    args = make_args(heads, kv_heads, dim, [17, 600, 0, 300], [1, 1, 1, 1], 1, torch.float32, seed=3)
    batched = check(args, segment_keys=64)
    assert torch.equal(ta.pool_attention_triton(*args, segment_keys=64, split=False)[0], batched)
    for row in range(4):
        alone = ta.pool_attention_triton(*solo(args, row), segment_keys=64)[0]
        assert torch.equal(alone, batched[row : row + 1]), f"row {row}"
    # Prefill rows (the fused path, several segments for the 300-key row).
    heads, kv_heads, dim = CONFIGS["g2d16"]
    args = make_args(heads, kv_heads, dim, [37, 300], [20, 11], 20, torch.float32, seed=4)
    batched = check(args, segment_keys=64)
    for row in range(2):
        alone = ta.pool_attention_triton(*solo(args, row), segment_keys=64)[0]
        assert torch.equal(alone, batched[row : row + 1]), f"prefill row {row}"


def test_rejects_bad_shapes():
    args = list(make_args(4, 2, 16, [3], [1], 1, torch.float32))
    with pytest.raises(ValueError, match="heads"):
        ta.pool_attention_triton(*args[:10], 5, *args[11:])  # 5 query heads over 2 KV heads
    with pytest.raises(ValueError, match="segment_keys"):
        ta.pool_attention_triton(*args, segment_keys=48)


def test_register_cuda_kernel_is_idempotent():
    ta.register_cuda_kernel()
    ta.register_cuda_kernel()
    assert torch._C._dispatch_has_kernel_for_dispatch_key("flare::pool_attention", "CUDA")

"""Runs the core's step graph on onnxruntime and owns the paged KV pool.

The pool is one zeroed float32 numpy array of the contract shape
[layers * 2 * num_pages, page_tokens, kv_heads, head_dim] (docs/architecture.md). onnxruntime
reads it in place through an OrtValue that wraps the numpy memory (never copied per call); only
the runner writes it, by scattering each step's new K/V into the rows' pages.

Plain data in and out: `StepRow`s (token ids, history length, page table) go in, a `StepOutput`
with one row of logits/logprob stats per input row comes out. No torch, no scheduler state.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from helios.manifest import KVLayout, Manifest

# A step mixing prefill chunks with decode rows pads every row to the longest chunk (the graph
# is [B, L]). Past this many padded (wasted) tokens the runner splits the step into separate
# graph calls (decode rows together, prefill rows by similar length): an extra call costs one
# more read of the weights (~ a few prefill tokens' worth of compute on the 0.5B int4), while
# padding 7 decode rows up to a 512-token chunk would cost 7 x 511 tokens of compute.
PAD_WASTE_TOKENS = 16


@dataclass
class StepRow:
    token_ids: list[int]  # new tokens of this row (a prefill chunk, or 1 for decode)
    history_len: int  # tokens of this row already in the pool
    block_table: list[int]  # pool pages covering history_len + len(token_ids), in order


@dataclass
class StepOutput:
    logits: np.ndarray  # [B, V] float32, at each row's last new token
    logsumexp: np.ndarray  # [B] float32
    top_logprobs: np.ndarray  # [B, K] float32, decreasing
    top_ids: np.ndarray  # [B, K] int64


class Runner:
    def __init__(self, core_dir: Path, manifest: Manifest, num_pages: int, threads: int | None = None) -> None:
        engine = manifest.engine("step")
        self._setup(Path(core_dir) / engine.file, manifest.kv, num_pages, threads)
        # Positions past the graph's rotary tables would read out of range.
        self.max_positions = manifest.architecture.max_position_embeddings

    @classmethod
    def from_graph(cls, graph_path: Path, kv: KVLayout, num_pages: int, threads: int | None = None) -> "Runner":
        """A runner over a bare step graph (export validation has no core.json yet)."""
        runner = cls.__new__(cls)
        runner._setup(Path(graph_path), kv, num_pages, threads)
        return runner

    def _setup(self, graph_path: Path, kv: KVLayout, num_pages: int, threads: int | None) -> None:
        if num_pages < 1:
            raise ValueError("num_pages must be >= 1")
        if kv.dtype != "float32":
            raise ValueError(f"this runner supports a float32 KV pool, not {kv.dtype}")
        self.kv = kv
        self.num_pages = num_pages
        self.max_positions: int | None = None
        self.split_mixed = True  # False: one graph call per step whatever the padding (tests)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads or os.cpu_count() or 1
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        # Shapes change every step (B, L, and M every page_tokens tokens). onnxruntime caches
        # a memory pattern per distinct input-shape set, which would only grow here; the arena
        # still reuses buffers. For the same reason the runner does not pad B/L to buckets: the
        # CPU provider compiles nothing per shape, so padding would only add work.
        opts.enable_mem_pattern = False
        self.session = ort.InferenceSession(str(graph_path), opts, providers=["CPUExecutionProvider"])
        self.pool = np.zeros(
            (kv.num_layers * 2 * num_pages, kv.page_tokens, kv.kv_heads, kv.head_dim), dtype=np.float32
        )
        # Wraps the numpy buffer (no copy): writes to self.pool are what the next call reads.
        self._pool_value = ort.OrtValue.ortvalue_from_numpy(self.pool)
        # The same memory as [layers, 2, pages, tokens, kvh, D]: the scatter/copy view.
        self._pages = self.pool.reshape(kv.num_layers, 2, num_pages, kv.page_tokens, kv.kv_heads, kv.head_dim)
        self._output_names = [o.name for o in self.session.get_outputs()]

    # -- public API -----------------------------------------------------------------------------

    def step(self, rows: list[StepRow]) -> StepOutput:
        """Run one engine step over `rows`, write their new K/V into the pool, return one output
        row per input row (same order)."""
        if not rows:
            raise ValueError("step needs at least one row")
        for row in rows:
            self._check(row)
        groups = self._groups(rows) if self.split_mixed else [list(range(len(rows)))]
        if len(groups) == 1:
            return self._run(rows)
        parts = [(g, self._run([rows[i] for i in g])) for g in groups]
        order = np.argsort(np.concatenate([np.asarray(g) for g, _ in parts]), kind="stable")
        return StepOutput(
            *(np.concatenate([getattr(out, f) for _, out in parts])[order] for f in StepOutput.__dataclass_fields__)
        )

    def copy_page(self, src: int, dst: int) -> None:
        """Copy one page (every layer's K and V) onto another: copy-on-write for shared prefixes."""
        if not (0 <= src < self.num_pages and 0 <= dst < self.num_pages):
            raise IndexError(f"page out of range 0..{self.num_pages - 1}: {src} -> {dst}")
        self._pages[:, :, dst] = self._pages[:, :, src]

    # -- internals ------------------------------------------------------------------------------

    def _check(self, row: StepRow) -> None:
        if not row.token_ids:
            raise ValueError("a step row needs at least one token")
        if self.max_positions is not None and row.history_len + len(row.token_ids) > self.max_positions:
            raise ValueError(f"row reaches position {row.history_len + len(row.token_ids)} > {self.max_positions}")
        need = -(-(row.history_len + len(row.token_ids)) // self.kv.page_tokens)
        if len(row.block_table) < need:
            raise ValueError(
                f"block table has {len(row.block_table)} pages; {row.history_len}+{len(row.token_ids)} tokens need {need}"
            )
        pages = row.block_table[:need]
        if min(pages) < 0 or max(pages) >= self.num_pages:
            raise ValueError(f"block table page out of range 0..{self.num_pages - 1}")

    @staticmethod
    def _groups(rows: list[StepRow]) -> list[list[int]]:
        """Partition rows into graph calls that keep [B, L] padding small (see PAD_WASTE_TOKENS)."""
        lens = [len(r.token_ids) for r in rows]

        def waste(group: list[int]) -> int:
            return max(lens[i] for i in group) * len(group) - sum(lens[i] for i in group)

        if waste(list(range(len(rows)))) <= PAD_WASTE_TOKENS:
            return [list(range(len(rows)))]
        groups = [[i for i, n in enumerate(lens) if n == 1]]
        current: list[int] = []
        for i in sorted((i for i, n in enumerate(lens) if n > 1), key=lambda i: lens[i]):
            if current and waste(current + [i]) > PAD_WASTE_TOKENS:
                groups.append(current)
                current = []
            current.append(i)
        return [g for g in groups + [current] if g]

    def _run(self, rows: list[StepRow]) -> StepOutput:
        binding = self.session.io_binding()
        for name, value in pack_rows(rows, self.kv.page_tokens).items():
            binding.bind_cpu_input(name, value)
        binding.bind_ortvalue_input("kv_pool", self._pool_value)
        for name in self._output_names:
            binding.bind_output(name, "cpu")
        self.session.run_with_iobinding(binding)
        out = dict(zip(self._output_names, binding.copy_outputs_to_cpu()))
        scatter_new_kv(self._pages, rows, out["new_kv"])
        return StepOutput(out["logits"], out["logsumexp"], out["top_logprobs"], out["top_ids"])


def pack_rows(rows: list[StepRow], page_tokens: int) -> dict[str, np.ndarray]:
    """The step graph's inputs (all but kv_pool) for `rows`, right-padded to [B, L] and [B, M]."""
    batch = len(rows)
    length = max(len(r.token_ids) for r in rows)
    hist_pages = [-(-r.history_len // page_tokens) for r in rows]
    pages = max(1, max(hist_pages))  # M >= 1 keeps every dim non-empty; page 0 is then masked
    input_ids = np.zeros((batch, length), dtype=np.int64)
    positions = np.zeros((batch, length), dtype=np.int64)
    block_tables = np.zeros((batch, pages), dtype=np.int64)
    for b, row in enumerate(rows):
        n = len(row.token_ids)
        input_ids[b, :n] = row.token_ids
        positions[b, :n] = np.arange(row.history_len, row.history_len + n)
        block_tables[b, : hist_pages[b]] = row.block_table[: hist_pages[b]]
    return {
        "input_ids": input_ids,
        "positions": positions,
        "history_lens": np.array([r.history_len for r in rows], dtype=np.int64),
        "query_lens": np.array([len(r.token_ids) for r in rows], dtype=np.int64),
        "block_tables": block_tables,
    }


def scatter_new_kv(pages: np.ndarray, rows: list[StepRow], new_kv: np.ndarray) -> None:
    """Write new_kv [layers, 2, B, L, kvh, D] of each row's valid tokens into its pool slots.

    pages: the pool viewed as [layers, 2, num_pages, page_tokens, kvh, D]. One fancy-indexed
    assignment for the whole step."""
    page_tokens = pages.shape[3]
    b_idx, t_idx, slot_page, slot_off = [], [], [], []
    for b, row in enumerate(rows):
        n = len(row.token_ids)
        pos = np.arange(row.history_len, row.history_len + n)
        table = np.asarray(row.block_table, dtype=np.int64)
        b_idx.append(np.full(n, b))
        t_idx.append(np.arange(n))
        slot_page.append(table[pos // page_tokens])
        slot_off.append(pos % page_tokens)
    cat = np.concatenate
    pages[:, :, cat(slot_page), cat(slot_off)] = new_kv[:, :, cat(b_idx), cat(t_idx)]

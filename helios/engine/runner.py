"""Runs the core's step graph on onnxruntime and owns the paged KV pool.

The pool is one zeroed float32 numpy array of the contract shape
[layers * 2 * num_pages, page_tokens, kv_heads, head_dim] (docs/architecture.md). onnxruntime
reads it in place through an OrtValue that wraps the numpy memory (never copied per call); only
the runner writes it, by scattering each step's new K/V into the rows' pages.

Plain data in and out: `StepRow`s (token ids, history length, page table) go in, a `StepOutput`
with one row of logits/logprob stats per input row comes out. No torch, no scheduler state.

A core with recurrent layers (manifest `state`) also gets a state pool [slots, width] float32,
bound the same way; each row names its sequence's slot (`StepRow.state_slot`) and the runner
writes the row's `new_state` back into that slot after the call.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from helios.kernels.session import open_session
from helios.manifest import KVLayout, Manifest, StateLayout

# A step mixing prefill chunks with decode rows pads every row to the longest chunk (the graph
# is [B, L]). Past this many padded (wasted) tokens the runner splits the step into separate
# graph calls (decode rows together, prefill rows by similar length): an extra call costs one
# more read of the weights (~ a few prefill tokens' worth of compute on the 0.5B int4), while
# padding 7 decode rows up to a 512-token chunk would cost 7 x 511 tokens of compute.
PAD_WASTE_TOKENS = 16


# Prompt positions the score graph takes per call: its [N, V] logits and log-softmax are
# ~1.2 MB per position on a 152k vocabulary, so a 512-token chunk is scored in 4 slices.
SCORE_POSITIONS_PER_CALL = 128

# State slots beyond the engine's concurrency (tests and validation use a few of their own).
SPARE_STATE_SLOTS = 4


@dataclass
class StepRow:
    token_ids: list[int]  # new tokens of this row (a prefill chunk, or 1 for decode)
    history_len: int  # tokens of this row already in the pool
    block_table: list[int]  # pool pages covering history_len + len(token_ids), in order
    # Explicit ids whose full-vocabulary logprobs the row's last position reports (<= 129).
    logprob_ids: list[int] | None = None
    # Prompt scoring: per new token, the id that follows it (scored at that position), or -1
    # for a position not to score. Needs a core exported with --prompt-logprobs.
    score_targets: list[int] | None = None
    # The sequence's recurrent-state slot (cores with manifest `state`; ignored without one).
    state_slot: int | None = None
    # Positions among the new tokens whose outputs the step returns, ascending (None: the last
    # one). A speculative round asks for every position of [last token, draft 1..k].
    output_positions: list[int] | None = None
    # Multimodal step graphs: per-axis (t, h, w) rotary positions of the new tokens [3, n] (None:
    # every axis at the token's index), and image features placed at some of them: (offsets
    # among the new tokens [k], features [k, hidden]).
    rope_positions: np.ndarray | None = None
    image_features: tuple[np.ndarray, np.ndarray] | None = None

    @property
    def num_outputs(self) -> int:
        return 1 if self.output_positions is None else len(self.output_positions)


@dataclass
class PromptScores:
    """Scores of a row's scored positions, in position order (api.md prompt logprobs)."""

    target_logprobs: np.ndarray  # [n] float32: logprob of the token that follows
    target_ranks: np.ndarray  # [n] int64: 1 + count of strictly greater logprobs
    top_logprobs: np.ndarray  # [n, K] float32, decreasing
    top_ids: np.ndarray  # [n, K] int64


@dataclass
class StepOutput:
    """Outputs at N positions: row b's outputs are rows first[b], first[b] + 1, ... (one per entry
    of its output_positions; first[b] == b when every row asks for its last token only)."""

    logits: np.ndarray  # [N, V] float32
    logsumexp: np.ndarray  # [N] float32
    top_logprobs: np.ndarray  # [N, K] float32, decreasing
    top_ids: np.ndarray  # [N, K] int64
    # [N, E] float32: logprobs of the row's logprob_ids (padded columns are meaningless).
    token_logprobs: np.ndarray | None = None
    prompt_scores: list[PromptScores | None] | None = None  # per row, for rows with score_targets
    first: list[int] | None = None  # None: first[b] == b

    def index(self, row: int, position: int = 0) -> int:
        """The output row of `row`'s `position`-th requested output."""
        return (row if self.first is None else self.first[row]) + position


class Runner:
    def __init__(
        self, core_dir: Path, manifest: Manifest, num_pages: int, threads: int | None = None, state_slots: int | None = None
    ) -> None:
        """state_slots: recurrent-state slots (cores with `state`); default the core's concurrency
        plus SPARE_STATE_SLOTS."""
        engine = manifest.engine("step")
        if state_slots is None:
            state_slots = manifest.limits.max_concurrency + SPARE_STATE_SLOTS
        self._setup(Path(core_dir) / engine.file, manifest.kv, num_pages, threads, manifest.state, state_slots)
        score = next((e for e in manifest.engines if e.name == "score"), None)
        self._score_path = Path(core_dir) / score.file if score is not None else None
        # Positions past the graph's rotary tables would read out of range.
        self.max_positions = manifest.architecture.max_position_embeddings

    @classmethod
    def from_graph(
        cls, graph_path: Path, kv: KVLayout, num_pages: int, threads: int | None = None, score_graph: Path | None = None,
        state: StateLayout | None = None, state_slots: int = SPARE_STATE_SLOTS,
    ) -> "Runner":  # fmt: skip
        """A runner over a bare step graph (export validation has no core.json yet)."""
        runner = cls.__new__(cls)
        runner._setup(Path(graph_path), kv, num_pages, threads, state, state_slots)
        runner._score_path = Path(score_graph) if score_graph is not None else None
        return runner

    def _setup(
        self, graph_path: Path, kv: KVLayout, num_pages: int, threads: int | None, state: StateLayout | None = None,
        state_slots: int = 0,
    ) -> None:  # fmt: skip
        if num_pages < 1:
            raise ValueError("num_pages must be >= 1")
        if kv.dtype != "float32":
            raise ValueError(f"this runner supports a float32 KV pool, not {kv.dtype}")
        self.kv = kv
        self.num_pages = num_pages
        self.threads = threads
        self._score_path: Path | None = None  # the core's score graph, when it has one
        self._score_session: ort.InferenceSession | None = None  # loaded on first use
        self.max_positions: int | None = None
        self.split_mixed = True  # False: one graph call per step whatever the padding (tests)
        self.graph_seconds = 0.0  # time inside the step graph's runs (EngineStats.graph_seconds_total)
        # kernels: what runs the graph's ai.flare operators ("flare", "onnxruntime" or "").
        self.session, self.kernels = open_session(graph_path, self._session_options(), ["CPUExecutionProvider"])
        self.pool = np.zeros(
            (kv.num_layers * 2 * num_pages, kv.page_tokens, kv.kv_heads, kv.head_dim), dtype=np.float32
        )
        # Wraps the numpy buffer (no copy): writes to self.pool are what the next call reads.
        self._pool_value = ort.OrtValue.ortvalue_from_numpy(self.pool)
        # The same memory as [layers, 2, pages, tokens, kvh, D]: the scatter/copy view.
        self._pages = self.pool.reshape(kv.num_layers, 2, num_pages, kv.page_tokens, kv.kv_heads, kv.head_dim)
        self._output_names = [o.name for o in self.session.get_outputs()]
        self._input_names = {i.name for i in self.session.get_inputs()}
        # A multimodal step graph (manifest `vision`) takes image features of this width.
        self.takes_images = "image_embeds" in self._input_names
        self.hidden_size = next((i.shape[1] for i in self.session.get_inputs() if i.name == "image_embeds"), 0)
        # Recurrent state: [slots, width], zeroed; the graph ignores a slot's contents for a row
        # without history, so a slot is reused without clearing.
        self.state = state
        self.state_pool: np.ndarray | None = None
        if state is not None:
            if state.dtype != "float32":
                raise ValueError(f"this runner supports a float32 state pool, not {state.dtype}")
            if state_slots < 1:
                raise ValueError("a core with recurrent state needs state_slots >= 1")
            if "state_pool" not in self._input_names:
                raise ValueError("the core declares recurrent state but its step graph has no state_pool input")
            self.state_pool = np.zeros((state_slots, state.width), dtype=np.float32)
            self._state_value = ort.OrtValue.ortvalue_from_numpy(self.state_pool)

    @property
    def num_state_slots(self) -> int:
        """Recurrent-state slots (0: the core keeps no per-sequence state)."""
        return 0 if self.state_pool is None else self.state_pool.shape[0]

    def _session_options(self) -> ort.SessionOptions:
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = self.threads or os.cpu_count() or 1
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        # Shapes change every step (B, L, and M every page_tokens tokens). onnxruntime caches
        # a memory pattern per distinct input-shape set, which would only grow here; the arena
        # still reuses buffers. For the same reason the runner does not pad B/L to buckets: the
        # CPU provider compiles nothing per shape, so padding would only add work.
        opts.enable_mem_pattern = False
        return opts

    # -- public API -----------------------------------------------------------------------------

    def step(self, rows: list[StepRow]) -> StepOutput:
        """Run one engine step over `rows`, write their new K/V into the pool, return each row's
        outputs (one, or one per output position), in row order."""
        if not rows:
            raise ValueError("step needs at least one row")
        for row in rows:
            self._check(row)
        if self.state_pool is not None and len({r.state_slot for r in rows}) != len(rows):
            raise ValueError("two rows of one step share a state slot")
        groups = self._groups(rows) if self.split_mixed else [list(range(len(rows)))]
        if len(groups) == 1:
            return self._run(rows)
        parts = [(g, self._run([rows[i] for i in g])) for g in groups]
        # Outputs in row order: each row's block of outputs, taken from its group's output.
        first, take, at = [0] * len(rows), [], 0
        offsets = np.cumsum([0] + [len(out.logits) for _, out in parts])
        where = {i: (k, j) for k, (g, _) in enumerate(parts) for j, i in enumerate(g)}
        for i, row in enumerate(rows):
            k, j = where[i]
            start = offsets[k] + parts[k][1].index(j)
            first[i] = at
            take.extend(range(start, start + row.num_outputs))
            at += row.num_outputs
        arrays = {f: np.concatenate([getattr(out, f) for _, out in parts])[take]
                  for f in ("logits", "logsumexp", "top_logprobs", "top_ids")}
        explicit = None
        if any(out.token_logprobs is not None for _, out in parts):
            width = max(out.token_logprobs.shape[1] for _, out in parts if out.token_logprobs is not None)
            merged = np.zeros((int(offsets[-1]), width), dtype=np.float32)
            for k, (_, out) in enumerate(parts):
                if out.token_logprobs is not None:
                    merged[offsets[k]:offsets[k + 1], : out.token_logprobs.shape[1]] = out.token_logprobs
            explicit = merged[take]
        scores = None
        if any(out.prompt_scores is not None for _, out in parts):
            scores = [None] * len(rows)
            for g, out in parts:
                for i, score in zip(g, out.prompt_scores or [None] * len(g)):
                    scores[i] = score
        return StepOutput(**arrays, token_logprobs=explicit, prompt_scores=scores, first=first)

    @property
    def can_score_prompts(self) -> bool:
        return self._score_path is not None

    def copy_page(self, src: int, dst: int) -> None:
        """Copy one page (every layer's K and V) onto another: copy-on-write for shared prefixes."""
        if not (0 <= src < self.num_pages and 0 <= dst < self.num_pages):
            raise IndexError(f"page out of range 0..{self.num_pages - 1}: {src} -> {dst}")
        self._pages[:, :, dst] = self._pages[:, :, src]

    # -- internals ------------------------------------------------------------------------------

    def _check(self, row: StepRow) -> None:
        if not row.token_ids:
            raise ValueError("a step row needs at least one token")
        if row.output_positions is not None:
            wanted = row.output_positions
            if not wanted or wanted != sorted(set(wanted)) or wanted[0] < 0 or wanted[-1] >= len(row.token_ids):
                raise ValueError("output_positions must be ascending positions among the row's new tokens")
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
        if self.state_pool is not None:
            if row.state_slot is None:
                raise ValueError("this core keeps recurrent state: every row needs a state_slot")
            if not 0 <= row.state_slot < self.num_state_slots:
                raise ValueError(f"state slot {row.state_slot} out of range 0..{self.num_state_slots - 1}")

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

    @property
    def can_verify(self) -> bool:
        """The step graph returns outputs at chosen positions (format 1.7): speculation can run."""
        return "logit_positions" in self._input_names

    def _run(self, rows: list[StepRow]) -> StepOutput:
        if not self.can_verify and any(r.output_positions is not None for r in rows):
            raise ValueError("this core's step graph returns each row's last position only (re-export it)")
        binding = self.session.io_binding()
        packed = pack_rows(rows, self.kv.page_tokens)
        if self.takes_images:
            packed.update(pack_images(rows, packed["positions"], self.hidden_size))
        elif any(r.image_features is not None for r in rows):
            raise ValueError("this core's step graph takes no image features")
        for name, value in packed.items():
            if name in self._input_names:  # a 1.1 core's graph has no logprob_token_ids
                binding.bind_cpu_input(name, value)
        binding.bind_ortvalue_input("kv_pool", self._pool_value)
        slots = None
        if self.state_pool is not None:
            slots = np.array([r.state_slot for r in rows], dtype=np.int64)
            binding.bind_ortvalue_input("state_pool", self._state_value)
            binding.bind_cpu_input("state_slots", slots)
        for name in self._output_names:
            binding.bind_output(name, "cpu")
        start = time.perf_counter()
        self.session.run_with_iobinding(binding)
        self.graph_seconds += time.perf_counter() - start
        # OrtValues stay in onnxruntime's memory; only the outputs used are turned into arrays.
        values = dict(zip(self._output_names, binding.get_outputs()))
        out = {name: values[name].numpy() for name in ("logits", "logsumexp", "top_logprobs", "top_ids")}
        scatter_new_kv(self._pages, rows, values["new_kv"].numpy())
        if slots is not None:  # the state after each row's last new token
            self.state_pool[slots] = values["new_state"].numpy()
        explicit = None
        if any(r.logprob_ids for r in rows):
            if "token_logprobs" not in values:
                raise ValueError("this core's step graph has no explicit logprob ids (re-export it)")
            explicit = values["token_logprobs"].numpy()
        scores = None
        if any(r.score_targets is not None for r in rows):
            scores = self._score(rows, values["hidden"].numpy())
        first = None
        if any(r.output_positions is not None for r in rows):
            first = np.cumsum([0] + [r.num_outputs for r in rows])[:-1].tolist()
        return StepOutput(**out, token_logprobs=explicit, prompt_scores=scores, first=first)

    def _score(self, rows: list[StepRow], hidden: np.ndarray) -> list[PromptScores | None]:
        """Run the score graph over every scored position of `rows` (hidden: [B, L, H])."""
        picked, targets, owners = [], [], []
        for b, row in enumerate(rows):
            if row.score_targets is None:
                continue
            t = np.asarray(row.score_targets, dtype=np.int64)
            if t.shape != (len(row.token_ids),):
                raise ValueError("score_targets needs one entry per new token")
            keep = np.nonzero(t >= 0)[0]
            picked.append(hidden[b, keep])
            targets.append(t[keep])
            owners.append((b, len(keep)))
        flat_hidden = np.ascontiguousarray(np.concatenate(picked), dtype=np.float32)
        flat_targets = np.concatenate(targets)
        results = []
        for lo in range(0, len(flat_targets), SCORE_POSITIONS_PER_CALL):
            hi = lo + SCORE_POSITIONS_PER_CALL
            results.append(self.score_session.run(None, {"hidden": flat_hidden[lo:hi], "targets": flat_targets[lo:hi]}))
        if results:
            merged = [np.concatenate(parts) for parts in zip(*results)]
        else:
            merged = [np.zeros((0,), np.float32), np.zeros((0,), np.int64),
                      np.zeros((0, 0), np.float32), np.zeros((0, 0), np.int64)]
        scores: list[PromptScores | None] = [None] * len(rows)
        at = 0
        for b, n in owners:
            scores[b] = PromptScores(*(m[at : at + n] for m in merged))
            at += n
        return scores

    @property
    def score_session(self) -> ort.InferenceSession:
        if self._score_session is None:
            if self._score_path is None:
                raise ValueError("this core has no prompt-scoring graph (export it with --prompt-logprobs)")
            self._score_session, _ = open_session(self._score_path, self._session_options(), ["CPUExecutionProvider"])
        return self._score_session


def pack_rows(rows: list[StepRow], page_tokens: int) -> dict[str, np.ndarray]:
    """The step graph's inputs (all but kv_pool) for `rows`, right-padded to [B, L], [B, M], [B, E]."""
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
    width = max(1, max(len(r.logprob_ids or ()) for r in rows))  # E >= 1; padding reads id 0
    logprob_ids = np.zeros((batch, width), dtype=np.int64)
    for b, row in enumerate(rows):
        if row.logprob_ids:
            logprob_ids[b, : len(row.logprob_ids)] = row.logprob_ids
    out_rows = [b for b, row in enumerate(rows) for _ in range(row.num_outputs)]
    out_positions = [p for row in rows for p in (row.output_positions or [len(row.token_ids) - 1])]
    return {
        "input_ids": input_ids,
        "positions": positions,
        "history_lens": np.array([r.history_len for r in rows], dtype=np.int64),
        "query_lens": np.array([len(r.token_ids) for r in rows], dtype=np.int64),
        "block_tables": block_tables,
        "logprob_token_ids": logprob_ids,
        "logit_rows": np.array(out_rows, dtype=np.int64),
        "logit_positions": np.array(out_positions, dtype=np.int64),
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


def pack_images(rows: list[StepRow], positions: np.ndarray, hidden: int) -> dict[str, np.ndarray]:
    """A multimodal step graph's inputs: mrope_positions [3, B, L] (each row's rope_positions, else
    its token positions on every axis), image_embeds [I, hidden] and their flat slots [I]."""
    batch, length = positions.shape
    mrope = np.repeat(positions[None], 3, axis=0)
    slots, features = [], []
    for b, row in enumerate(rows):
        if row.rope_positions is not None:
            mrope[:, b, : len(row.token_ids)] = row.rope_positions
        if row.image_features is not None:
            offsets, values = row.image_features
            if values.shape != (len(offsets), hidden):
                raise ValueError(f"image features of shape {values.shape} for {len(offsets)} slots of width {hidden}")
            slots.append(b * length + np.asarray(offsets, dtype=np.int64))
            features.append(values)
    return {
        "mrope_positions": mrope,
        "image_embeds": np.ascontiguousarray(np.concatenate(features), dtype=np.float32) if features
        else np.zeros((0, hidden), np.float32),
        "image_slots": np.concatenate(slots) if slots else np.zeros(0, np.int64),
    }

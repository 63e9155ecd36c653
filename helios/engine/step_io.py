"""What a step runner takes and gives (plain data), and the runner as the engine sees it.

`StepRunner` is the seam between the engine (with its prefix cache, host store and speculation)
and whatever runs the core's step engine: `Runner` (the ONNX step graph on onnxruntime,
helios/engine/runner.py) and `TorchRunner` (the torch step program on a GPU or CPU torch,
helios/engine/torch_runner.py) both implement it. Rows go in as `StepRow`s, one `StepOutput`
comes out; pages move in and out of the pool as numpy arrays in the pool's dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from helios.kernels import host
from helios.kernels import kv_dtype as kv_types
from helios.manifest import KVLayout


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
    # The fused head's sampling candidates (None where the graph does not report them): the ids
    # of each row's C >= K largest raw logits, best first [N, C] int64, and the largest raw
    # logit outside them [N] float32, the sampler's proof that no other token survives top-k.
    candidate_ids: np.ndarray | None = None
    outside_logit: np.ndarray | None = None
    # [N, E] float32: logprobs of the row's logprob_ids (padded columns are meaningless).
    token_logprobs: np.ndarray | None = None
    prompt_scores: list[PromptScores | None] | None = None  # per row, for rows with score_targets
    first: list[int] | None = None  # None: first[b] == b

    def sampling_candidates(self) -> tuple[np.ndarray, np.ndarray | None]:
        """(ids [N, C] of each row's largest raw logits, the largest raw logit outside them or
        None): the head's candidates where it reports them, else the top ids alone."""
        if self.candidate_ids is None:
            return self.top_ids, None
        return self.candidate_ids, self.outside_logit

    def index(self, row: int, position: int = 0) -> int:
        """The output row of `row`'s `position`-th requested output."""
        return (row if self.first is None else self.first[row]) + position


# A step mixing prefill chunks with decode rows pads every row to the longest chunk (the graph
# is [B, L]). Past this many padded (wasted) tokens the runner splits the step into separate
# graph calls (decode rows together, prefill rows by similar length): an extra call costs one
# more read of the weights (~ a few prefill tokens' worth of compute on the 0.5B int4), while
# padding 7 decode rows up to a 512-token chunk would cost 7 x 511 tokens of compute.
PAD_WASTE_TOKENS = 16


def check_rows(rows: list[StepRow], kv: KVLayout, num_pages: int, max_positions: int | None, state_slots: int) -> None:
    """Raise ValueError for a step no runner may run (state_slots: 0 for a core without state)."""
    if not rows:
        raise ValueError("step needs at least one row")
    for row in rows:
        _check_row(row, kv, num_pages, max_positions, state_slots)
    if state_slots and len({r.state_slot for r in rows}) != len(rows):
        raise ValueError("two rows of one step share a state slot")


def _check_row(row: StepRow, kv: KVLayout, num_pages: int, max_positions: int | None, state_slots: int) -> None:
    if not row.token_ids:
        raise ValueError("a step row needs at least one token")
    if row.output_positions is not None:
        wanted = row.output_positions
        if not wanted or wanted != sorted(set(wanted)) or wanted[0] < 0 or wanted[-1] >= len(row.token_ids):
            raise ValueError("output_positions must be ascending positions among the row's new tokens")
    if max_positions is not None and row.history_len + len(row.token_ids) > max_positions:
        raise ValueError(f"row reaches position {row.history_len + len(row.token_ids)} > {max_positions}")
    need = -(-(row.history_len + len(row.token_ids)) // kv.page_tokens)
    if len(row.block_table) < need:
        raise ValueError(
            f"block table has {len(row.block_table)} pages; {row.history_len}+{len(row.token_ids)} tokens need {need}"
        )
    pages = row.block_table[:need]
    if min(pages) < 0 or max(pages) >= num_pages:
        raise ValueError(f"block table page out of range 0..{num_pages - 1}")
    if state_slots:
        if row.state_slot is None:
            raise ValueError("this core keeps recurrent state: every row needs a state_slot")
        if not 0 <= row.state_slot < state_slots:
            raise ValueError(f"state slot {row.state_slot} out of range 0..{state_slots - 1}")


def step_groups(rows: list[StepRow]) -> list[list[int]]:
    """Partition rows into engine calls that keep [B, L] padding small (see PAD_WASTE_TOKENS)."""
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


def run_in_groups(rows: list[StepRow], run: Callable[[list[StepRow]], StepOutput], split: bool = True) -> StepOutput:
    """`run` over the rows in padding-bounded groups (one call when split is False), the outputs
    merged back into row order."""
    groups = step_groups(rows) if split else [list(range(len(rows)))]
    if len(groups) == 1:
        return run(rows)
    parts = [(g, run([rows[i] for i in g])) for g in groups]
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
    arrays = {
        f: np.concatenate([getattr(out, f) for _, out in parts])[take]
        for f in ("logits", "logsumexp", "top_logprobs", "top_ids")
    }
    explicit = None
    if any(out.token_logprobs is not None for _, out in parts):
        width = max(out.token_logprobs.shape[1] for _, out in parts if out.token_logprobs is not None)
        merged = np.zeros((int(offsets[-1]), width), dtype=np.float32)
        for k, (_, out) in enumerate(parts):
            if out.token_logprobs is not None:
                merged[offsets[k] : offsets[k + 1], : out.token_logprobs.shape[1]] = out.token_logprobs
        explicit = merged[take]
    scores = None
    if any(out.prompt_scores is not None for _, out in parts):
        scores = [None] * len(rows)
        for g, out in parts:
            for i, score in zip(g, out.prompt_scores or [None] * len(g)):
                scores[i] = score
    if all(out.candidate_ids is not None and out.outside_logit is not None for _, out in parts):
        arrays["candidate_ids"] = np.concatenate([out.candidate_ids for _, out in parts])[take]
        arrays["outside_logit"] = np.concatenate([out.outside_logit for _, out in parts])[take]
    return StepOutput(**arrays, token_logprobs=explicit, prompt_scores=scores, first=first)


@runtime_checkable
class StepRunner(Protocol):
    """The runner as the engine, the prefix cache, the host store and speculation see it."""

    kv: KVLayout
    num_pages: int  # pages in the KV pool
    max_positions: int | None  # positions past the step engine's rotary tables are refused
    graph_seconds: float  # time inside the step engine's runs (EngineStats.graph_seconds_total)
    decode_graph_launches: int  # steps run as captured decode graphs (0 where none are captured)
    replay_gpu_ns: int  # summed device time of those replays (CUDA events; 0 off a GPU)
    # Capabilities a test double may lack (each False turns its feature off, in the open):
    copies_pages: bool  # copy_page works (prefix checkpoints' copy-on-write)
    exports_pages: bool  # read_pages / write_pages work (the host prefix store)

    @property
    def num_state_slots(self) -> int:
        """Recurrent-state slots (0: the core keeps no per-sequence state)."""
        ...

    @property
    def can_verify(self) -> bool:
        """The step engine returns outputs at chosen positions (speculation can run)."""
        ...

    @property
    def can_score_prompts(self) -> bool:
        """The core has a prompt-scoring engine this runner can run."""
        ...

    @property
    def pool_bytes(self) -> int:
        """Bytes the KV pool holds (the start-up line reports it)."""
        ...

    @property
    def pool_dtype(self) -> str:
        """The KV pool's element type ("float32", "bfloat16", ...): host-store records name it."""
        ...

    def step(self, rows: list[StepRow]) -> StepOutput:
        """Run one step over `rows`, write their new K/V into the pool, return their outputs."""
        ...

    def copy_page(self, src: int, dst: int) -> None:
        """Copy one page (every layer's K and V) onto another."""
        ...

    def read_pages(self, pages: list[int]) -> np.ndarray:
        """A copy of `pages` in the pool's dtype: [layers, 2, len(pages), page_tokens, kv_heads, head_dim]."""
        ...

    def write_pages(self, pages: list[int], data: np.ndarray) -> None:
        """Write `data` (read_pages' layout; another dtype is rounded to the pool's) into `pages`."""
        ...

    def read_state(self, slot: int) -> np.ndarray:
        """A float32 copy of one recurrent-state slot [width]."""
        ...

    def write_state(self, slot: int, state: np.ndarray) -> None: ...


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


def new_token_slots(rows: list[StepRow], page_tokens: int) -> np.ndarray:
    """Where each row's valid new tokens go: int64 [4, N], its rows (page, offset) in the pool and
    (row, token) in new_kv (one array: the kernel library's scatter takes it in one pointer)."""
    pages, offsets, row_index, token_index = [], [], [], []
    for b, row in enumerate(rows):
        positions = range(row.history_len, row.history_len + len(row.token_ids))
        pages += [row.block_table[p // page_tokens] for p in positions]
        offsets += [p % page_tokens for p in positions]
        row_index += [b] * len(positions)
        token_index += range(len(positions))
    return np.array([pages, offsets, row_index, token_index], dtype=np.int64)


def scatter_new_kv(pages: np.ndarray, rows: list[StepRow], new_kv: np.ndarray) -> None:
    """Write new_kv [layers, 2, B, L, kvh, D] of each row's valid tokens into its pool slots.

    pages: the pool viewed as [layers, 2, num_pages, page_tokens, kvh, D]. One call of the kernel
    library's scatter where it runs, else one fancy-indexed assignment: the same bits."""
    slots = new_token_slots(rows, pages.shape[3])
    if host.scatter_kv(pages, new_kv, slots):
        return
    slot_page, slot_offset, row_index, token_index = slots
    if pages.dtype == kv_types.numpy_dtype("bfloat16"):
        new_kv = kv_types.to_bfloat16(new_kv)
    pages[:, :, slot_page, slot_offset] = new_kv[:, :, row_index, token_index]


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
        "image_embeds": np.ascontiguousarray(np.concatenate(features), dtype=np.float32)
        if features
        else np.zeros((0, hidden), np.float32),
        "image_slots": np.concatenate(slots) if slots else np.zeros(0, np.int64),
    }

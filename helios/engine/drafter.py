"""The learned drafter: a smaller model compiled into the core (manifest `drafter`) whose greedy
continuation of a request is the draft its next speculative round verifies.

Its K/V lives in a pool of its own with the target's page count and page size, addressed by the
target's block tables: a sequence's page p holds the target's K/V in one pool and the drafter's
in the other, so allocation, sharing, preemption and prefix checkpoints need no second book.
The drafter is lazy: it reads a request's tokens only when it drafts for it, catching up from
`Sequence.drafter_len` (the leading tokens whose drafter K/V the pages hold) in the first of its
steps. A prefix checkpoint records how far its pages hold drafter K/V too (restored requests
start from there; `share_reads` extends it when a request reads into pages it shares with one),
page copies are mirrored, and pages restored from the host store hold none.

Rollback needs nothing: the drafter feeds its drafts at positions past the committed tokens; at
its next round the drafts that were committed count as read (`drafter_pending`) and the rest are
overwritten, as the target's rejected positions are.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Protocol

from helios.engine.runner import Runner, StepRow
from helios.engine.sequence import Sequence
from helios.manifest import Manifest

log = logging.getLogger("helios.engine")


class DraftRow(Protocol):
    """A scheduled row the drafter fills in (helios.engine.scheduler.ScheduledRow, whose module
    reaches this one through the speculator)."""

    seq: Sequence
    learned_width: int
    drafts: list[int]


class LearnedDrafter:
    def __init__(self, runner: Runner, *, cost: float, stop_ids: list[int], catch_up_tokens: int):
        self.runner = runner  # its max_positions bounds what it may draft
        self.cost = cost  # one drafter step relative to one target decode step
        self.stop_ids = set(stop_ids)  # a draft ends at a token that would end the request
        self.catch_up_tokens = catch_up_tokens
        self.steps = 0  # draft positions run (api.md draft_steps)

    @classmethod
    def load(cls, core_dir: Path, manifest: Manifest, target: Runner, catch_up_tokens: int) -> LearnedDrafter:
        spec = manifest.drafter
        assert spec is not None
        engine = manifest.engine(spec.engine)
        path = Path(core_dir) / engine.file
        runner = Runner.from_graph(path, spec.kv, target.num_pages, target.threads, kv_dtype=target.pool_dtype)
        runner.max_positions = spec.architecture.max_position_embeddings
        # Decode is bound by reading the weights: a drafter step costs about what it reads, and
        # what the two graphs' one-token steps take here says how much more.
        cost = step_cost(target, runner) or spec.decode_weight_bytes / max(1, manifest.decode_weight_bytes)
        return cls(runner, cost=cost, stop_ids=list(manifest.tokenizer.eos_token_ids), catch_up_tokens=catch_up_tokens)

    def copy_page(self, src: int, dst: int) -> None:
        self.runner.copy_page(src, dst)

    def can_draft(self, seq: Sequence, width: int) -> bool:
        """Whether `seq` may take `width` learned drafts: its drafter K/V lags by at most
        catch_up_tokens, and every drafted position lies within the drafter's positions."""
        settle(seq)
        lag = seq.num_tokens - seq.drafter_len
        return lag <= self.catch_up_tokens and seq.num_tokens + width - 1 <= self.runner.max_positions

    def draft(self, rows: list[DraftRow]) -> None:
        """Fill `drafts` of the scheduled rows with a `learned_width`: one drafter step reads each
        row's unread tokens and proposes its first draft, each further step (the rows still
        drafting, batched) one more. A failed drafter step leaves those rows without drafts."""
        todo = [r for r in rows if r.learned_width > 0]
        if not todo:
            return
        feeds = []
        for r in todo:
            seq = r.seq
            settle(seq)
            feeds.append(StepRow(seq.token_ids[seq.drafter_len :], seq.drafter_len, list(seq.page_table)))
        drafts: list[list[int]] = [[] for _ in todo]
        active = list(range(len(todo)))
        try:
            for r in todo:  # the first step reads every committed token
                r.seq.drafter_len = r.seq.num_tokens
            while active:
                out = self.runner.step([feeds[i] for i in active])
                following = []
                for j, i in enumerate(active):
                    token = int(out.top_ids[out.index(j), 0])
                    drafts[i].append(token)
                    if len(drafts[i]) < todo[i].learned_width and token not in self.stop_ids:
                        fed = feeds[i]
                        feeds[i] = StepRow([token], fed.history_len + len(fed.token_ids), fed.block_table)
                        following.append(i)
                active = following
        except Exception:
            log.exception("the learned drafter's step failed; these rounds carry no drafts")
            for r in todo:
                r.seq.drafter_len, r.seq.drafter_pending, r.drafts = 0, [], []
            return
        for r, proposed in zip(todo, drafts):
            r.drafts = proposed
            r.seq.drafter_pending = proposed[:-1]  # every draft but the last was fed
            self.steps += len(proposed)
            share_reads(r.seq, self.runner.kv.page_tokens)


PROBE_HISTORY_PAGES = 32  # the probe's rows attend to this many (unallocated, zero) pages
PROBE_STEPS = 3


def step_cost(target: Runner, drafter: Runner) -> float | None:
    """The drafter's one-token step time over the target's, measured at start-up on rows with a
    few hundred tokens of (unallocated pages') history; None when the pool is too small. The K/V
    the probe writes lands in free pages, which their next owner overwrites."""
    pages = PROBE_HISTORY_PAGES + 1
    if min(target.num_pages, drafter.num_pages) < pages:
        return None
    history = PROBE_HISTORY_PAGES * target.kv.page_tokens

    def seconds(runner: Runner) -> float:
        row = StepRow([0], history, list(range(pages)))
        runner.step([row])  # warm-up
        started = time.perf_counter()
        for _ in range(PROBE_STEPS):
            runner.step([row])
        return (time.perf_counter() - started) / PROBE_STEPS

    return seconds(drafter) / seconds(target)


def share_reads(seq: Sequence, page_tokens: int) -> None:
    """Checkpoints sharing `seq`'s leading pages (captured from it, or restored into it) hold the
    drafter K/V it has read into those pages: a later request restoring them starts from there.
    Checkpoints are captured while the prompt is computed, before a lazy drafter reads it."""
    for ckpt in seq.shared_checkpoints:
        same = 0
        for ours, theirs in zip(seq.page_table, ckpt.pages):
            if ours != theirs:
                break
            same += 1
        ckpt.drafter_len = max(ckpt.drafter_len, min(seq.drafter_len, same * page_tokens, ckpt.length))


def settle(seq: Sequence) -> None:
    """Count the drafts the drafter fed in `seq`'s last round that were committed as read."""
    n = seq.drafter_len
    for token in seq.drafter_pending:
        if n >= len(seq.token_ids) or seq.token_ids[n] != token:
            break
        n += 1
    seq.drafter_len, seq.drafter_pending = n, []

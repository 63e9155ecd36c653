"""Continuous batching with chunked prefill and preemption by recompute.

Each step is built in three passes over a token budget (`max_batch_tokens`):

1. Decodes: every running sequence whose prompt is fully computed feeds its last sampled token
   (one token each), oldest first. If the pool has no page for one, the newest running sequence
   is preempted (pages freed, put back at the front of the waiting queue, recomputed later with
   its generated tokens kept) until the page fits, or the sequence itself is the newest.
2. Partially prefilled running sequences get their next chunk (<= `prefill_chunk_size`), oldest
   first, shrunk to the free pages if needed.
3. Waiting sequences are admitted FCFS while fewer than `max_concurrency` are running and the
   pool can hold the head's whole remaining prefill plus its first decode on top of what running
   sequences were already promised. The head is never skipped (no starvation of long prompts).

Recurrent state (cores with manifest `state`, `state_slots` > 0): every running sequence owns one
state slot, taken at admission and given back when it finishes, is aborted or is preempted (a
recompute restarts from history 0, and a row without history ignores its slot's contents, so a
slot is reused without clearing). With no free slot the head of the queue waits, as it does for
pages.
Prefix checkpoints of such a core hold state snapshots taken exactly at their boundary, so a
prefill chunk never crosses a planned boundary (`_chunk` ends it there).

Age is arrival order, not admission order: a preempted and re-admitted request keeps its age,
so the oldest request always makes progress and two requests cannot preempt each other forever.
A sequence that cannot fit in the pool even alone finishes with LENGTH.

Prefix checkpoints (helios.engine.prefix_cache), when a cache is given: admission restores the
longest checkpoint that is a prefix of the sequence (shared pages need no free pages; the
prefill starts after the restored tokens), selects the request's checkpoint boundaries at its
first admission, and `commit` captures the boundaries each step's K/V reaches. Whenever pages
run short (admission, a prefill chunk, a decode), least recently used checkpoints are evicted
before any live sequence is preempted or held back.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

from helios.engine.api import FinishReason
from helios.engine.block_manager import BlockManager
from helios.engine.prefix_cache import PrefixCache
from helios.engine.sequence import Sequence, SequenceStatus
from helios.engine.speculation import Speculator
from helios.engine.step_io import StepRow


@dataclass
class ScheduledRow:
    seq: Sequence
    start: int  # tokens already in the pool (the row's history_len)
    num_tokens: int  # new tokens fed this step (of seq.token_ids)
    is_decode: bool
    drafts: list[int] = field(default_factory=list)  # fed after them: a speculative round
    learned_width: int = 0  # drafts the learned drafter is to fill in before the step runs

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids[self.start : self.start + self.num_tokens] + self.drafts

    @property
    def samples(self) -> bool:
        """The row reaches the sequence's last token, so its logits give the next token."""
        return self.start + self.num_tokens == self.seq.num_tokens


@dataclass
class Batch:
    rows: list[ScheduledRow] = field(default_factory=list)  # decodes first, then prefill chunks
    finished: list[Sequence] = field(default_factory=list)  # ended here (LENGTH: no room)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.rows)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_concurrency: int,
        max_batch_tokens: int,
        prefill_chunk_size: int,
        prefix_cache: PrefixCache | None = None,
        state_slots: int = 0,
        speculator: Speculator | None = None,
        window: int | None = None,
    ):
        """window: the core's kv.window (every layer attends at most that far back): a sequence
        gives back the pages wholly before the next step's window once no prefix checkpoint
        still has to be captured from its table."""
        if min(max_concurrency, max_batch_tokens, prefill_chunk_size) < 1:
            raise ValueError("max_concurrency, max_batch_tokens and prefill_chunk_size must be >= 1")
        self.bm = block_manager
        # More running sequences than the token budget would leave the newest decodes unserved
        # every step; cap concurrency instead.
        self.max_concurrency = min(max_concurrency, max_batch_tokens)
        self.max_batch_tokens = max_batch_tokens
        self.prefill_chunk_size = prefill_chunk_size
        self.cache = prefix_cache if prefix_cache is not None and prefix_cache.enabled else None
        self.speculator = speculator
        self.window = window
        self.waiting: deque[Sequence] = deque()  # arrival order
        self.running: list[Sequence] = []  # arrival order; the last one is preempted first
        self.num_preemptions = 0
        self.num_admissions = 0
        # Free recurrent-state slots (None: the core keeps no per-sequence state), lowest first.
        self.free_state_slots: list[int] | None = list(range(state_slots - 1, -1, -1)) if state_slots else None

    # -- queue management ----------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self._enqueue(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Drop a sequence (finished, aborted or failed) and release its pages."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.FINISHED

    def finish(self, seq: Sequence, reason: FinishReason, stop_reason: str | int | list[int] | None = None) -> None:
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        self.remove(seq)

    def _enqueue(self, seq: Sequence) -> None:
        """Insert keeping arrival order: new arrivals go to the back (O(1)); preempted sequences
        are older than everything never admitted, so they land at the front (a short scan)."""
        if not self.waiting or self.waiting[-1].arrival < seq.arrival:
            self.waiting.append(seq)
            return
        i = 0
        while self.waiting[i].arrival < seq.arrival:
            i += 1
        self.waiting.insert(i, seq)

    def _release(self, seq: Sequence) -> None:
        self.bm.release(seq.page_table[seq.released_pages :])
        seq.page_table, seq.released_pages = [], 0
        seq.num_computed_tokens = 0
        seq.drafter_len, seq.drafter_pending, seq.shared_checkpoints = 0, [], []
        if seq.state_slot is not None and self.free_state_slots is not None:
            self.free_state_slots.append(seq.state_slot)
        seq.state_slot = None

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(seq)

    def _fits_alone(self, seq: Sequence, num_tokens: int) -> bool:
        """Its live pages (those not given back before a window) fit the pool."""
        return self.bm.pages_for(num_tokens) - seq.released_pages <= self.bm.num_pages

    # -- the step ------------------------------------------------------------------------------

    def schedule(self) -> Batch:
        batch = Batch()
        while True:
            self._schedule_into(batch)
            if batch.rows or not self.running:
                return batch
            # Running sequences exist but none could move (partial prefills starved of pages by
            # decodes that have since finished or been preempted): free the newest and retry.
            # The oldest alone always fits, so this terminates.
            victim = self.running[-1]
            self._preempt(victim)
            batch.preempted.append(victim)

    def _schedule_into(self, batch: Batch) -> None:
        budget = self.max_batch_tokens
        bm = self.bm

        # 1. Decodes, oldest first.
        decoding = sum(1 for seq in self.running if seq.is_decoding)
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING or not seq.is_decoding:
                continue
            need = seq.num_tokens  # K/V for every token once the last one is fed
            if not self._fits_alone(seq, need):
                self.finish(seq, FinishReason.LENGTH)
                batch.finished.append(seq)
                continue
            while not bm.can_grow(seq.page_table, need):
                # Checkpoints go before live sequences (a preempted sequence's pages may have
                # become reclaimable checkpoint pages, so this is retried after each preemption).
                self._reclaim(bm.pages_to_grow(seq.page_table, need))
                if bm.can_grow(seq.page_table, need):
                    break
                victim = self.running[-1]  # newest; never an already scheduled (older) row
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break  # it was the newest running sequence: nothing after it is left
            bm.grow(seq.page_table, need)
            batch.rows.append(ScheduledRow(seq, seq.num_computed_tokens, 1, True))
            budget -= 1
        if self.speculator is not None:
            budget = self._add_drafts(batch, decoding, budget)

        # 2. Next chunks of partially prefilled running sequences, oldest first.
        for seq in self.running:
            if budget == 0:
                break
            if seq.is_decoding or seq.num_uncomputed == 0:
                continue
            n = self._chunk(seq, budget)
            if n > 0:
                bm.grow(seq.page_table, seq.num_computed_tokens + n)
                batch.rows.append(ScheduledRow(seq, seq.num_computed_tokens, n, False))
                budget -= n

        # 3. Admissions, FCFS.
        while self.waiting and budget > 0 and len(self.running) < self.max_concurrency:
            if self.free_state_slots is not None and not self.free_state_slots:
                break  # every state slot is owned by a running sequence: wait, as for pages
            seq = self.waiting[0]
            # Room for the whole (re)prefill and the first decode after it.
            total = bm.pages_for(seq.num_tokens + 1)
            if total > bm.num_pages:
                self.waiting.popleft()
                self.finish(seq, FinishReason.LENGTH)
                batch.finished.append(seq)
                continue
            # A scored prompt is computed from its start (api.md: scoring is never restored).
            reuse = self.cache is not None and not seq.scores_prompt
            if reuse and seq.num_preemptions == 0:  # a longer host chain joins the pool first
                self.cache.fetch(seq.token_ids, bm.num_free - self._promised_pages(), total, not seq.host_looked_up)
                seq.host_looked_up = True
            ckpt, restored = self.cache.match(seq.token_ids) if reuse else (None, 0)
            # Pages a restore shares need no free page (its copied tail page does).
            need = total - (self.cache.shared_pages(restored) if ckpt else 0)
            promised = self._promised_pages()
            if need > bm.num_free - promised:
                if self.cache and need <= bm.num_free - promised + self.cache.reclaimable_pages(ckpt):
                    self.cache.reclaim(need + promised, protect=ckpt)
                if need > bm.num_free - promised:
                    break  # wait for room; do not let later (smaller) requests overtake the head
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            if self.free_state_slots is not None:
                seq.state_slot = self.free_state_slots.pop()
            self.running.insert(bisect.bisect([s.arrival for s in self.running], seq.arrival), seq)
            first = seq.num_preemptions == 0
            if first:
                self.num_admissions += 1  # first admissions only; re-admissions are recompute
            if ckpt is not None:
                self.cache.restore(seq, ckpt, restored)
            if first:
                seq.cached_tokens = restored  # usage reports the first admission's reuse
            if self.cache and seq.checkpoint_plan is None:
                seq.checkpoint_plan = self.cache.plan(seq, self.prefill_chunk_size)
            n = self._chunk(seq, budget)
            start = seq.num_computed_tokens
            bm.grow(seq.page_table, start + n)
            batch.rows.append(ScheduledRow(seq, start, n, False))
            budget -= n

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """Tokens of `seq`'s prefill to feed now: bounded by chunk size, budget and free pages
        (and, for recurrent-state checkpoints, by the next planned boundary: its snapshot is the
        state right after it)."""
        n = min(seq.num_uncomputed, self.prefill_chunk_size, budget)
        if self.cache is not None and self.cache.snapshots and seq.checkpoint_plan:
            start = seq.num_computed_tokens
            cut = next((c.position for c in seq.checkpoint_plan if c.position > start), None)
            if cut is not None and cut < start + n:
                n = cut - start
        short = self.bm.pages_to_grow(seq.page_table, seq.num_computed_tokens + n)
        if short > self.bm.num_free:
            self._reclaim(short)
        room = (len(seq.page_table) + self.bm.num_free) * self.bm.page_tokens - seq.num_computed_tokens
        return max(0, min(n, room))

    def _reclaim(self, free_pages: int) -> None:
        """Evict checkpoints (LRU) until `free_pages` pages are free, if they can provide them."""
        cache = self.cache
        if cache is not None and free_pages <= self.bm.num_free + cache.reclaimable_pages():
            cache.reclaim(free_pages)

    def _add_drafts(self, batch: Batch, decoding: int, budget: int) -> int:
        """Drafts for the step's decode rows, once every decode has its page and token: they take
        only budget and pages left beyond what other running sequences' prefill was promised,
        so they never evict, preempt or hold back anyone. History drafts are set here; a row the
        learned drafter serves gets its width (and pages) and the engine fills it in. Returns the
        budget left."""
        speculator = self.speculator
        assert speculator is not None
        for row in batch.rows:
            if budget == 0:
                break
            seq, need = row.seq, row.seq.num_tokens
            drafts = speculator.drafts(seq, decoding, budget)
            width = len(drafts) or speculator.learned_width(seq, decoding, budget)
            if width and not (
                self._fits_alone(seq, need + width)
                and self.bm.pages_to_grow(seq.page_table, need + width) <= self.bm.num_free - self._promised_pages()
            ):
                drafts, width = [], 0
            self.bm.grow(seq.page_table, need + width)
            row.drafts, row.learned_width = drafts, 0 if drafts else width
            budget -= width
        return budget

    def _promised_pages(self) -> int:
        """Pages running sequences still need to finish their prefill and take a first decode."""
        return sum(
            max(0, self.bm.pages_for(s.num_tokens + 1) - len(s.page_table)) for s in self.running if not s.is_decoding
        )

    def commit(self, batch: Batch) -> None:
        """The runner wrote the batch's K/V: advance each row's sequence."""
        reserve: int | None = None
        for row in batch.rows:
            seq = row.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue
            seq.num_computed_tokens = row.start + row.num_tokens
            plan = seq.checkpoint_plan
            if self.cache is not None and plan and plan[0].position <= seq.num_computed_tokens:
                if reserve is None:
                    reserve = self._promised_pages()
                self.cache.capture_reached(seq, reserve)
            if self.window is not None and not seq.checkpoint_plan:
                self._release_before_window(seq, self.window)

    def _release_before_window(self, seq: Sequence, window: int) -> None:
        """Give back the pages wholly before the window of the sequence's next token (position
        num_computed_tokens sees keys from num_computed_tokens - window + 1 on; positions never
        go back, drafts included, since only committed tokens count). Their columns then name
        the first kept page, which no step reads through them."""
        dead = max(0, seq.num_computed_tokens - window + 1) // self.bm.page_tokens
        dead = min(dead, len(seq.page_table) - 1)
        if dead <= seq.released_pages:
            return
        self.bm.release(seq.page_table[seq.released_pages : dead])
        seq.page_table[seq.released_pages : dead] = [seq.page_table[dead]] * (dead - seq.released_pages)
        seq.released_pages = dead


def step_rows(batch: Batch) -> list[StepRow]:
    """The runner's inputs for a scheduled batch, row for row."""
    return [
        StepRow(
            token_ids=r.token_ids,
            history_len=r.start,
            block_table=list(r.seq.page_table),
            logprob_ids=r.seq.sampling.logprob_token_ids if r.samples else None,
            score_targets=score_targets(r.seq, r.start, r.num_tokens),
            state_slot=r.seq.state_slot,
            output_positions=list(range(1 + len(r.drafts))) if r.drafts else None,
        )
        for r in batch.rows
    ]


def score_targets(seq: Sequence, start: int, num_tokens: int) -> list[int] | None:
    """Per fed position, the prompt token that follows it when that prompt position still needs
    its score (api.md: entry j scores token j from position j - 1), else -1. An image token
    (negative identity id) is scored as id 0 and its entry is then null (_prompt_event)."""
    if not seq.scores_prompt or start >= seq.prompt_len:
        return None
    first = max(seq.prompt_scored, 1)  # the first entry still owed (entry 0 is always null)
    targets = [
        max(seq.token_ids[p + 1], 0) if first <= p + 1 < seq.prompt_len else -1
        for p in range(start, start + num_tokens)
    ]
    if all(t < 0 for t in targets):
        # Nothing to score in this chunk; a 1-token prompt still owes its null entry.
        return targets if seq.prompt_scored == 0 and start + num_tokens >= seq.prompt_len else None
    return targets

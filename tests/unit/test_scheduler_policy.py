"""The block manager's pages and the scheduler's policy (chunked prefill, decode rows first, the
token budget, concurrency, FCFS admission, preemption), driven by hand: no runner, rows are
committed and sampled tokens appended by the test."""

from __future__ import annotations

import pytest

from helios.engine.api import FinishReason
from helios.engine.block_manager import BlockManager, OutOfPages
from helios.engine.scheduler import Scheduler
from helios.engine.sequence import Sequence, SequenceStatus
from tests.unit.test_engine_core import EOS, req

# -- block manager ----------------------------------------------------------------------------


def test_block_manager_alloc_share_release():
    bm = BlockManager(num_pages=6, page_tokens=4)
    assert bm.pages_for(0) == 0 and bm.pages_for(1) == 1 and bm.pages_for(4) == 1 and bm.pages_for(5) == 2
    table: list[int] = []
    bm.grow(table, 9)
    assert len(table) == 3 and bm.num_free == 3 and all(bm.ref_count(p) == 1 for p in table)
    bm.grow(table, 12)  # still fits in 3 pages
    assert len(table) == 3
    bm.share(table[:2])  # e.g. a prefix checkpoint keeps the first two pages
    assert bm.is_shared(table[0]) and not bm.is_shared(table[2])
    bm.release(table)
    assert bm.num_free == 4 and bm.ref_count(table[0]) == 1
    bm.release(table[:2])
    assert bm.num_free == 6
    with pytest.raises(ValueError):
        bm.release([table[0]])
    with pytest.raises(ValueError):
        bm.share([table[0]])
    assert not bm.can_grow([], 25)
    with pytest.raises(OutOfPages):
        bm.allocate(7)
    pages = bm.allocate(6)
    assert sorted(pages) == list(range(6)) and bm.num_free == 0  # page 0 is an ordinary page


# -- scheduler (no runner: rows are committed by hand, sampled tokens appended by hand) --------


def _seq(rid: str, n_prompt: int, arrival: int, max_tokens: int = 8, context: int = 10_000) -> Sequence:
    return Sequence.create(req(rid, [1] * n_prompt, max_tokens=max_tokens), arrival, None, [EOS], context)


def _advance(sched: Scheduler, batch, token: int = 7) -> None:
    sched.commit(batch)
    for row in batch.rows:
        if row.samples:
            row.seq.append_token(token)


def test_chunked_prefill_splits_long_prompt():
    sched = Scheduler(BlockManager(64, 4), max_concurrency=4, max_batch_tokens=64, prefill_chunk_size=32)
    seq = _seq("a", 100, 0)
    sched.add(seq)
    sizes = []
    for _ in range(4):
        batch = sched.schedule()
        assert len(batch.rows) == 1
        row = batch.rows[0]
        sizes.append((row.start, row.num_tokens, row.samples))
        assert len(seq.page_table) == -(-(row.start + row.num_tokens) // 4)
        _advance(sched, batch)
    assert sizes == [(0, 32, False), (32, 32, False), (64, 32, False), (96, 4, True)]
    batch = sched.schedule()
    assert [(r.start, r.num_tokens, r.is_decode) for r in batch.rows] == [(100, 1, True)]


def test_decode_rows_first_and_batch_token_budget():
    sched = Scheduler(BlockManager(256, 4), max_concurrency=8, max_batch_tokens=20, prefill_chunk_size=16)
    a = _seq("a", 5, 0)
    sched.add(a)
    _advance(sched, sched.schedule())  # a is now decoding
    for i, n in enumerate([40, 40, 3]):
        sched.add(_seq(f"p{i}", n, i + 1))
    seen = []
    for _ in range(12):
        batch = sched.schedule()
        if not batch.rows:
            break
        assert batch.num_tokens <= 20
        kinds = [r.is_decode for r in batch.rows]
        assert kinds == sorted(kinds, reverse=True), "decode rows come first"
        assert all(r.num_tokens <= 16 for r in batch.rows)
        seen.append([(r.seq.request_id, r.num_tokens) for r in batch.rows])
        _advance(sched, batch)
    # Step 1: a's decode, then p0 gets a full chunk and p1 the rest of the budget.
    assert seen[0] == [("a", 1), ("p0", 16), ("p1", 3)]
    # The short prompt behind the long ones is admitted in order, not ahead of them.
    first = {rid: next(i for i, s in enumerate(seen) if any(r == rid for r, _ in s)) for rid in ("p0", "p1", "p2")}
    assert first["p0"] <= first["p1"] <= first["p2"]


def test_max_concurrency_bounds_active_sequences():
    sched = Scheduler(BlockManager(256, 4), max_concurrency=2, max_batch_tokens=64, prefill_chunk_size=8)
    seqs = [_seq(f"s{i}", 10, i, max_tokens=3) for i in range(5)]
    for seq in seqs:
        sched.add(seq)
    order = []
    while sched.has_work():
        batch = sched.schedule()
        assert len(sched.running) <= 2
        _advance(sched, batch)
        for row in batch.rows:
            if row.seq.num_generated >= 3:
                order.append(row.seq.request_id)
                sched.finish(row.seq, FinishReason.LENGTH)
    assert order == [f"s{i}" for i in range(5)]  # FCFS completion for equal work
    assert sched.bm.num_free == 256


def test_fcfs_admission_never_overtakes_the_head():
    # 10 pages of 4 tokens. A big request waits behind a running one; a small one arriving later
    # would fit but must not overtake it.
    sched = Scheduler(BlockManager(10, 4), max_concurrency=4, max_batch_tokens=64, prefill_chunk_size=64)
    a, big, small = _seq("a", 20, 0), _seq("big", 34, 1), _seq("small", 5, 2)
    for s in (a, big, small):
        sched.add(s)
    batch = sched.schedule()
    assert [r.seq.request_id for r in batch.rows] == ["a"]  # big needs 9 pages, 4 left
    _advance(sched, batch)
    assert [s.request_id for s in sched.waiting] == ["big", "small"]
    sched.finish(a, FinishReason.STOP)
    batch = sched.schedule()
    assert [r.seq.request_id for r in batch.rows] == ["big"]  # small (2 pages) does not fit beside it
    _advance(sched, batch)
    sched.finish(big, FinishReason.STOP)
    assert [r.seq.request_id for r in sched.schedule().rows] == ["small"]


def test_preemption_frees_newest_and_requeues_it_first():
    # Concurrency 2 keeps "later" queued behind the two running sequences.
    sched = Scheduler(BlockManager(6, 4), max_concurrency=2, max_batch_tokens=64, prefill_chunk_size=64)
    old, new, later = _seq("old", 7, 0), _seq("new", 7, 1), _seq("later", 3, 2)
    for s in (old, new):
        sched.add(s)
    _advance(sched, sched.schedule())  # both prefilled: 2 pages each, 2 free
    sched.add(later)
    preempted = []
    for _ in range(12):
        batch = sched.schedule()
        preempted += [s.request_id for s in batch.preempted]
        # No prefix cache here: every page in use belongs to exactly one running sequence.
        assert sched.bm.num_free + sum(len(s.page_table) for s in sched.running) == sched.bm.num_pages
        _advance(sched, batch)
        if preempted:
            break
    assert preempted == ["new"]  # the newest running sequence, never the oldest
    assert new.status is SequenceStatus.WAITING and new.page_table == [] and new.num_computed_tokens == 0
    assert new.num_generated > 0  # generated tokens are kept, to be recomputed
    assert sched.waiting[0] is new  # back at the front, ahead of the later arrival
    sched.finish(old, FinishReason.STOP)
    batch = sched.schedule()
    assert batch.rows[0].seq is new and batch.rows[0].start == 0 and batch.rows[0].num_tokens == new.num_tokens
    assert batch.rows[0].samples  # the recompute ends by sampling the next token


def test_sequence_that_cannot_fit_alone_finishes_with_length():
    sched = Scheduler(BlockManager(4, 4), max_concurrency=4, max_batch_tokens=64, prefill_chunk_size=64)
    huge, ok = _seq("huge", 16, 0), _seq("ok", 3, 1)  # 16 + 1 tokens need 5 pages > 4
    sched.add(huge)
    sched.add(ok)
    batch = sched.schedule()
    assert batch.finished == [huge] and huge.finish_reason is FinishReason.LENGTH
    assert [r.seq for r in batch.rows] == [ok]
    assert sched.bm.num_free == 3

"""Prefix reuse through immutable KV checkpoints (api.md: GPU checkpoint retention).

A checkpoint is the KV state of an exact token prefix: its token ids and the pool pages that
hold their K/V. It is captured only at a boundary the frontend offered for the request
(`GenerationRequest.checkpoints`: the conversation anchor, client cache hints, message ends,
the exact prompt endpoint) and is never written again. Reuse is the longest checkpoint whose
ids are a prefix of a new prompt; nothing is reused at an unmarked position.

Pages and immutability. The runner writes K/V only at the positions a step feeds, so a page
whose every slot is computed never changes again. Capturing position p shares (refcount) the
pages wholly below p; the page holding p-1 is shared too when it is already complete, and is
copied into a fresh page when the live sequence is still filling it (its later appends would
land in the checkpoint's page otherwise). Restoring r tokens shares the checkpoint's pages
wholly below r and copies the page holding r-1..r when r is not page aligned, because the new
sequence writes position r onward into it. So a page with several owners is always complete.
At least the last prompt token is recomputed (its logits pick the first output token).

Selection. At a request's first admission its candidates are ordered by role priority (anchor,
hints, endpoint, message ends; later message ends first) and charged their predicted extra work
(a page copy when the prefill commit that reaches the position will leave its page unfinished,
typically the endpoint) against a per-request work allowance;
the rest are skipped (`work_budget`). A position whose cost cannot be predicted (a runner
without page copies) is skipped as `unknown_cost`. Capture checks the storage budget (pages
owned by checkpoints, a fraction of the pool): least recently used checkpoints are evicted to
make room, anchors last; when that cannot make room the capture is skipped (`storage`).
The scheduler also evicts checkpoints (LRU) before it preempts a live sequence for pages.

Recurrent state. A core whose layers keep per-sequence recurrent state (manifest `state`) cannot
resume from K/V pages alone: the state at the boundary is not in them. Such a cache
(`recurrent_state=True`) snapshots the sequence's state slot with each capture (`read_state`) and
writes it into the restoring sequence's slot (`write_state`). A snapshot exists only at the exact
boundary, so: the scheduler ends prefill chunks at planned boundaries (a boundary passed inside a
chunk counts as a `recurrent_state` skip), a restore resumes exactly at a checkpoint's length
(never part way into it, and only below the prompt's last token), and the page holding p-1 is
copied whenever p is not page aligned. Snapshots count against their own byte budget
(`state_storage_bytes`, LRU eviction as for pages). Without state callbacks (or with no room for
one snapshot) the cache neither captures nor restores; every offered candidate counts as a
`recurrent_state` skip, and requests report no cached tokens.

Host store (helios.engine.host_store). With one, anchor, hint and endpoint captures are also
offered to it (the pages beyond the longest prefix it holds are copied out with `read_pages`,
with the state snapshot on state cores), and admission first `fetch`es a host chain longer than
the pool's best match back into fresh pages (`write_pages`) as a pool checkpoint (an `intake`
checkpoint until evicted), which the restore then serves, when its predicted transfer is cheaper
than the prefill it replaces.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from helios.engine.api import CheckpointCandidate, CheckpointRole
from helios.engine.block_manager import BlockManager
from helios.engine.host_store import HostStore, prefix_key, prefix_keys
from helios.engine.sequence import Sequence

# Selection order: the anchor is shared by every conversation with the same preamble; hints are
# the client's own boundaries; the endpoint serves repeats and the next turn; message ends last.
ROLE_PRIORITY = {
    CheckpointRole.ANCHOR: 0,
    CheckpointRole.HINT: 1,
    CheckpointRole.ENDPOINT: 2,
    CheckpointRole.MESSAGE: 3,
}
# Exported roles (api.md): a hinted block end is a message-part boundary.
METRIC_ROLES = ("anchor", "message", "endpoint")
METRIC_ROLE = {
    CheckpointRole.ANCHOR: "anchor",
    CheckpointRole.HINT: "message",
    CheckpointRole.MESSAGE: "message",
    CheckpointRole.ENDPOINT: "endpoint",
}
SKIP_REASONS = ("unknown_cost", "work_budget", "storage", "recurrent_state")


@dataclass
class PrefixCacheConfig:
    enabled: bool = True
    # Most pages that checkpoints may own, as a fraction of the pool.
    storage_fraction: float = 0.5
    # Predicted extra work (page copies) one request may spend on captures, in nanoseconds.
    work_allowance_ns: int = 5_000_000
    # Copy bandwidth that prices a page copy (a prediction: wall-clock timings of single copies
    # on a loaded CPU are too noisy to steer selection).
    copy_bytes_per_second: float = 4e9
    # Recurrent-state snapshots (cores with manifest `state`) checkpoints may hold, in bytes.
    state_storage_bytes: int = 1 << 30

    def validate(self) -> None:
        if not 0.0 <= self.storage_fraction <= 1.0:
            raise ValueError("storage_fraction must be in [0, 1]")
        if self.work_allowance_ns < 0:
            raise ValueError("work_allowance_ns must be >= 0")
        if self.copy_bytes_per_second <= 0:
            raise ValueError("copy_bytes_per_second must be > 0")
        if self.state_storage_bytes < 0:
            raise ValueError("state_storage_bytes must be >= 0")


class Checkpoint:
    __slots__ = ("ids", "length", "pages", "role", "key", "uses", "state", "drafter_len")

    def __init__(
        self, ids: np.ndarray, pages: list[int], role: CheckpointRole, key: bytes, state: np.ndarray | None = None
    ):
        self.ids = ids  # int64 [length]
        self.length = int(ids.shape[0])
        self.pages = pages  # covers `length` tokens; every page is immutable
        self.role = role
        self.key = key
        self.uses = 0  # restores served
        self.state = state  # recurrent state after `length` tokens (cores with state), else None
        self.drafter_len = 0  # leading tokens whose learned-drafter K/V its pages hold too

    def __repr__(self) -> str:
        return f"Checkpoint({self.role.value}, length={self.length}, pages={self.pages})"


class PrefixCache:
    """Checkpoint index, capture, restore and eviction over a BlockManager.

    Engine-thread only. `copy_page(src, dst)` copies one page of K/V (the runner's); without it
    only page-aligned or already complete boundaries can be captured and restores round down to
    a page boundary."""

    def __init__(
        self,
        bm: BlockManager,
        *,
        copy_page: Callable[[int, int], None] | None,
        page_bytes: int,
        config: PrefixCacheConfig | None = None,
        recurrent_state: bool = False,
        read_state: Callable[[int], np.ndarray] | None = None,
        write_state: Callable[[int, np.ndarray], None] | None = None,
        state_bytes: int = 0,
        host: HostStore | None = None,
        read_pages: Callable[[list[int]], np.ndarray] | None = None,
        write_pages: Callable[[list[int], np.ndarray], None] | None = None,
    ):
        self.config = config or PrefixCacheConfig()
        self.config.validate()
        # K/V pages alone cannot resume the core (see above): checkpoints need state snapshots,
        # read from / written to a sequence's state slot by these callbacks (the runner's pool).
        self.recurrent_state = recurrent_state
        self._read_state, self._write_state = read_state, write_state
        self.max_snapshots = 0
        if recurrent_state and read_state is not None and write_state is not None and state_bytes > 0:
            self.max_snapshots = self.config.state_storage_bytes // state_bytes
        self._state_ns = state_bytes / self.config.copy_bytes_per_second * 1e9  # predicted snapshot cost
        self.bm = bm
        self.pt = bm.page_tokens
        self._copy_page = copy_page
        self.page_bytes = page_bytes
        self.storage_pages = int(bm.num_pages * self.config.storage_fraction)
        self._copy_ns = page_bytes / self.config.copy_bytes_per_second * 1e9  # predicted cost of one copy
        self._by_length: dict[int, dict[bytes, Checkpoint]] = {}
        self._lru: OrderedDict[int, Checkpoint] = OrderedDict()  # id -> checkpoint, oldest first
        self._page_owners: dict[int, int] = {}  # page -> checkpoints holding it
        # Counters (read by Engine.stats from other threads: plain ints and fixed-key dicts).
        self.captures = {role: 0 for role in CheckpointRole}
        self.skips = {reason: 0 for reason in SKIP_REASONS}
        self.hits = 0
        self.reused_tokens = 0
        self.evictions = 0
        self.copies = 0
        self.copy_seconds = 0.0  # measured, for reports
        self.extra_work_ns = 0
        # State cores keep host records only when they can snapshot (the record carries the state).
        usable = host is not None and read_pages is not None and write_pages is not None
        self.host = host if usable and (self.snapshots or not recurrent_state) else None
        self._read_pages, self._write_pages = read_pages, write_pages
        self._intake: set[int] = set()  # ids of checkpoints fetched from the host store

    # -- queries ---------------------------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        return self.config.enabled and self.storage_pages > 0

    @property
    def snapshots(self) -> bool:
        """Checkpoints carry recurrent-state snapshots (a state core with room for at least one)."""
        return self.max_snapshots > 0

    @property
    def cached_pages(self) -> int:
        """Pages owned by at least one checkpoint."""
        return len(self._page_owners)

    @property
    def num_checkpoints(self) -> int:
        return len(self._lru)

    @property
    def intake_pages(self) -> int:
        """Pages held by checkpoints that came from the host store."""
        return sum(len(ckpt.pages) for ckpt in self._lru.values() if id(ckpt) in self._intake)

    def checkpoints(self) -> list[Checkpoint]:
        """Least recently used first."""
        return list(self._lru.values())

    def capture_counts(self) -> dict[str, int]:
        out = dict.fromkeys(METRIC_ROLES, 0)
        for role, n in self.captures.items():
            out[METRIC_ROLE[role]] += n
        return out

    def lookup(self, token_ids: list[int], limit: int | None = None) -> Checkpoint | None:
        """The longest checkpoint whose ids are a prefix of `token_ids` (length <= limit)."""
        if not self._by_length:
            return None
        n = len(token_ids) if limit is None else min(limit, len(token_ids))
        lengths = sorted(length for length in self._by_length if length <= n)
        best: Checkpoint | None = None
        for length, digest in prefix_keys(token_ids, lengths):
            found = self._by_length[length].get(digest)
            if found is not None and np.array_equal(found.ids, token_ids[:length]):
                best = found
        return best

    def restorable(self, ckpt: Checkpoint, num_tokens: int) -> int:
        """Tokens a sequence of `num_tokens` tokens may restore from `ckpt` (0: none)."""
        if self.recurrent_state:  # the state exists only at the checkpoint's own length
            whole = ckpt.state is not None and ckpt.length <= num_tokens - 1
            return ckpt.length if whole and (self._copy_page is not None or ckpt.length % self.pt == 0) else 0
        r = min(ckpt.length, num_tokens - 1)  # the last token is always computed
        if self._copy_page is None:
            r -= r % self.pt
        return max(0, r)

    def match(self, token_ids: list[int]) -> tuple[Checkpoint | None, int]:
        """(checkpoint, tokens to restore) for a sequence holding `token_ids`."""
        if not self.enabled or (self.recurrent_state and not self.snapshots) or len(token_ids) < 2:
            return None, 0
        # With recurrent state only a whole checkpoint below the last token can be restored.
        ckpt = self.lookup(token_ids, len(token_ids) - 1 if self.recurrent_state else len(token_ids))
        if ckpt is None:
            return None, 0
        r = self.restorable(ckpt, len(token_ids))
        return (ckpt, r) if r > 0 else (None, 0)

    def shared_pages(self, r: int) -> int:
        """Pool pages a restore of r tokens shares rather than allocates."""
        return r // self.pt

    # -- restore ---------------------------------------------------------------------------------

    def restore(self, seq: Sequence, ckpt: Checkpoint, r: int) -> None:
        """Give an unstarted `seq` the K/V of its first r tokens from `ckpt` (pages must be free
        for the copied tail page: the scheduler checked)."""
        assert seq.num_computed_tokens == 0 and not seq.page_table and 0 < r <= ckpt.length
        full = r // self.pt
        shared = ckpt.pages[:full]
        self.bm.share(shared)
        table = list(shared)
        if r % self.pt:
            (page,) = self.bm.allocate(1)
            self._copy(ckpt.pages[full], page)
            table.append(page)
        seq.page_table = table
        seq.num_computed_tokens = r
        seq.drafter_len, seq.shared_checkpoints = min(r, ckpt.drafter_len), [ckpt]
        if self.recurrent_state:
            assert ckpt.state is not None and r == ckpt.length and seq.state_slot is not None
            self._write_state(seq.state_slot, ckpt.state)
        ckpt.uses += 1
        self._touch(ckpt)
        self.hits += 1
        self.reused_tokens += r

    # -- selection -------------------------------------------------------------------------------

    def plan(self, seq: Sequence, chunk_size: int | None = None) -> list[CheckpointCandidate]:
        """Choose which of the request's candidates to capture (sorted by position).

        Called at the first admission, after any restore. `chunk_size` (the prefill chunk) predicts
        where prefill commits land, hence which boundaries share a page the sequence is still
        filling at capture time (a copy) and which are complete by then (free)."""
        if not self.enabled:
            return []
        request = seq.request
        if self.recurrent_state and not self.snapshots:
            offered = {int(c.position) for c in request.checkpoints} | {int(p) for p in request.checkpoint_hints}
            self.skips["recurrent_state"] += sum(1 for p in offered if 0 < p <= seq.prompt_len)
            return []
        prompt_len = seq.prompt_len
        best: dict[int, CheckpointRole] = {}
        offered = list(request.checkpoints) + [
            CheckpointCandidate(p, CheckpointRole.HINT) for p in request.checkpoint_hints
        ]
        for cand in offered:
            role = CheckpointRole(cand.role)
            p = int(cand.position)
            if self.recurrent_state and role is CheckpointRole.ENDPOINT and p == prompt_len:
                # A state core restores strictly less than a request's prompt (`match`), so the
                # prompt's own end would never serve the same prompt again: one token earlier does.
                p -= 1
            if not 0 < p <= prompt_len:
                continue
            if p not in best or ROLE_PRIORITY[role] < ROLE_PRIORITY[best[p]]:
                best[p] = role
        # Priority, then later positions first within a role (the most recent message ends).
        order = sorted(best.items(), key=lambda item: (ROLE_PRIORITY[item[1]], -item[0]))
        allowance = self.config.work_allowance_ns
        spent = 0.0
        chosen: list[CheckpointCandidate] = []
        ids = seq.token_ids
        for p, role in order:
            held = self._find(ids, p)
            if held is not None:  # already held: nothing to capture
                self._promote(held, role)
                self._touch(held)
                continue
            if self.recurrent_state:
                if p <= seq.num_computed_tokens:  # restored past it: no state snapshot there
                    self.skips["recurrent_state"] += 1
                    continue
                # The prefill stops at p (scheduler), so p's page is still filling unless aligned.
                copies = p % self.pt != 0
            else:
                copies = self._needs_copy(p, seq.num_computed_tokens, seq.num_tokens, chunk_size)
            if copies and self._copy_page is None:
                self.skips["unknown_cost"] += 1
                continue
            cost = (self._copy_ns if copies else 0.0) + (self._state_ns if self.recurrent_state else 0.0)
            if spent + cost > allowance:
                self.skips["work_budget"] += 1
                continue
            spent += cost
            chosen.append(CheckpointCandidate(p, role))
        self.extra_work_ns += int(spent)
        chosen.sort(key=lambda c: c.position)
        return chosen

    def _needs_copy(self, p: int, start: int, end: int, chunk_size: int | None) -> bool:
        """Whether the page holding p-1 will still be filling when the prefill first reaches p."""
        if p % self.pt == 0:
            return False
        page_end = -(-p // self.pt) * self.pt
        if chunk_size is None:
            return True
        reached = min(end, start + chunk_size * max(1, -(-(p - start) // chunk_size)))
        return reached < page_end

    # -- capture ---------------------------------------------------------------------------------

    def capture_reached(self, seq: Sequence, free_reserve: int = 0) -> None:
        """Capture every planned boundary the sequence's computed K/V now covers.

        `free_reserve`: pages the scheduler has promised to running sequences, which a copied
        tail page may not take."""
        plan = seq.checkpoint_plan
        if not plan:
            return
        computed = seq.num_computed_tokens
        while plan and plan[0].position <= computed:
            cand = plan.pop(0)
            if self.recurrent_state and cand.position != computed:  # passed inside a chunk: no state
                self.skips["recurrent_state"] += 1
                continue
            self.capture(seq, cand.position, CheckpointRole(cand.role), free_reserve)

    def capture(self, seq: Sequence, p: int, role: CheckpointRole, free_reserve: int = 0) -> Checkpoint | None:
        if not (0 < p <= seq.num_computed_tokens):
            raise ValueError(f"cannot capture position {p}: {seq.num_computed_tokens} tokens computed")
        ids = np.asarray(seq.token_ids[:p], dtype=np.int64)
        key = prefix_key(ids)
        existing = self._by_length.get(p, {}).get(key)
        if existing is not None and np.array_equal(existing.ids, ids):
            self._promote(existing, role)
            self._touch(existing)
            return existing
        pt = self.pt
        last = (p - 1) // pt  # page holding position p-1
        # The last page is immutable once the sequence has computed all of it.
        tail_complete = (last + 1) * pt <= seq.num_computed_tokens
        shared = seq.page_table[: last + 1] if tail_complete else seq.page_table[:last]
        copy = not tail_complete
        if copy and self._copy_page is None:
            self.skips["unknown_cost"] += 1
            return None

        def added() -> int:
            return sum(1 for page in shared if page not in self._page_owners) + int(copy)

        # Check that evictions can make room before evicting anything.
        if len(shared) + int(copy) > self.storage_pages or (
            copy and self.bm.num_free - free_reserve + self.reclaimable_pages() < 1
        ):
            self.skips["storage"] += 1
            return None
        while self.cached_pages + added() > self.storage_pages:
            if not self._evict_one(protect=None):
                self.skips["storage"] += 1
                return None
        if copy:
            while self.bm.num_free - free_reserve < 1:
                if not self._evict_one(protect=None, reclaimable_only=True):
                    self.skips["storage"] += 1
                    return None
        state = None
        if self.recurrent_state:
            if not (self.snapshots and p == seq.num_computed_tokens and seq.state_slot is not None):
                self.skips["recurrent_state"] += 1
                return None
            while len(self._lru) >= self.max_snapshots:  # every checkpoint holds one snapshot
                if not self._evict_one(protect=None):
                    self.skips["storage"] += 1
                    return None
            state = np.array(self._read_state(seq.state_slot), dtype=np.float32, copy=True)
        self.bm.share(shared)
        pages = list(shared)
        if copy:
            (page,) = self.bm.allocate(1)
            self._copy(seq.page_table[last], page)
            pages.append(page)
        ckpt = Checkpoint(ids, pages, role, key, state)
        ckpt.drafter_len = min(p, seq.drafter_len)
        seq.shared_checkpoints.append(ckpt)  # its pages may hold more drafter K/V later
        self._register(ckpt)
        self.captures[role] += 1
        if self.host is not None and role is not CheckpointRole.MESSAGE:
            # Records are whole prefixes: an earlier message end is a prefix of the same request's
            # endpoint, which a later turn extends, so only anchors, hints and endpoints go out.
            read = self._read_pages
            assert read is not None
            self.host.offer(ids, lambda first_page: read(pages[first_page:]), state)
        return ckpt

    def _register(self, ckpt: Checkpoint) -> None:
        self._by_length.setdefault(ckpt.length, {})[ckpt.key] = ckpt
        self._lru[id(ckpt)] = ckpt
        for page in ckpt.pages:
            self._page_owners[page] = self._page_owners.get(page, 0) + 1

    # -- host store ------------------------------------------------------------------------------

    def fetch(self, token_ids: list[int], free_pages: int, request_pages: int, first_lookup: bool = True) -> None:
        """Bring the host store's longest chain for `token_ids` into the pool when it covers more
        than the pool's own checkpoints and is predicted cheaper to restore than to recompute.
        `free_pages` are free for this admission, `request_pages` what the request needs in all;
        less recently used checkpoints are evicted to make room for the chain beside it. A request
        waiting for room looks again each step; only its `first_lookup` enters the histograms."""
        host = self.host
        if host is None or not self.enabled or len(token_ids) < 2:
            return
        promised = self.bm.num_free - free_pages  # pages other admissions already hold a claim on
        # With recurrent state only a whole checkpoint below the last token can be restored.
        limit = len(token_ids) - 1 if self.recurrent_state else len(token_ids)
        held = self.lookup(token_ids, limit)
        chain = host.find(token_ids, limit)
        if not host.worth_restoring(chain, held.length if held is not None else 0, len(token_ids), first_lookup):
            return
        assert chain is not None
        pages_needed = -(-chain.length // self.pt)
        # The request then shares the chain's whole pages and allocates only the rest.
        need = pages_needed + request_pages - self.shared_pages(min(chain.length, len(token_ids) - 1))
        if pages_needed > self.storage_pages or need > free_pages + self.reclaimable_pages(held):
            return
        while self.cached_pages + pages_needed > self.storage_pages or (
            self.recurrent_state and len(self._lru) >= self.max_snapshots
        ):
            if not self._evict_one(protect=held):
                return
        if not self.reclaim(need + promised, protect=held):
            return
        records = host.load(chain, token_ids)
        if records is None or (self.recurrent_state and records[-1].state is None):
            return
        if any(r.kv.shape[2] != -(-r.link.length // self.pt) - r.link.first_page for r in records):
            return
        pages = self.bm.allocate(pages_needed)
        assert self._write_pages is not None
        started = time.perf_counter()
        for record in records:  # root first: each page ends up with the leaf's copy
            first = record.link.first_page
            self._write_pages(pages[first : first + record.kv.shape[2]], record.kv)
        host.observe_copy(sum(r.nbytes for r in records), time.perf_counter() - started)
        ids = np.concatenate([r.ids for r in records])
        ckpt = Checkpoint(ids, pages, CheckpointRole.ENDPOINT, prefix_key(ids), records[-1].state)
        self._register(ckpt)
        self._intake.add(id(ckpt))
        host.hits += 1
        held_tokens = self.restorable(held, len(token_ids)) if held is not None else 0
        host.reused_tokens += self.restorable(ckpt, len(token_ids)) - held_tokens

    # -- eviction --------------------------------------------------------------------------------

    def reclaimable_pages(self, protect: Checkpoint | None = None) -> int:
        """Pages that evicting checkpoints (all but `protect`) would return to the pool."""
        kept = set(protect.pages) if protect is not None else ()
        ref = self.bm.ref_count
        return sum(1 for page, owners in self._page_owners.items() if ref(page) == owners and page not in kept)

    def reclaim(self, free_pages: int, protect: Checkpoint | None = None) -> bool:
        """Evict least recently used checkpoints until `free_pages` pages are free. Only
        checkpoints holding pages that no live sequence shares are evicted (others free nothing)."""
        while self.bm.num_free < free_pages:
            if not self._evict_one(protect=protect, reclaimable_only=True):
                return False
        return True

    def clear(self) -> None:
        for ckpt in list(self._lru.values()):
            self._drop(ckpt)

    def _evict_one(self, protect: Checkpoint | None, reclaimable_only: bool = False) -> bool:
        victim = None
        for anchors in (False, True):  # the anchor outlives other roles (api.md anchor priority)
            for ckpt in self._lru.values():
                if ckpt is protect or (ckpt.role is CheckpointRole.ANCHOR) != anchors:
                    continue
                if reclaimable_only and not self._reclaimable(ckpt):
                    continue
                victim = ckpt
                break
            if victim is not None:
                break
        if victim is None:
            return False
        self._drop(victim)
        self.evictions += 1
        return True

    def _reclaimable(self, ckpt: Checkpoint) -> bool:
        """Some page of `ckpt` is held by checkpoints only (evictions can return it to the pool)."""
        return any(self.bm.ref_count(page) == self._page_owners[page] for page in ckpt.pages)

    def _drop(self, ckpt: Checkpoint) -> None:
        del self._lru[id(ckpt)]
        self._intake.discard(id(ckpt))
        bucket = self._by_length[ckpt.length]
        del bucket[ckpt.key]
        if not bucket:
            del self._by_length[ckpt.length]
        for page in ckpt.pages:
            n = self._page_owners[page] - 1
            if n:
                self._page_owners[page] = n
            else:
                del self._page_owners[page]
        self.bm.release(ckpt.pages)

    # -- internals -------------------------------------------------------------------------------

    def _find(self, token_ids: list[int], p: int) -> Checkpoint | None:
        bucket = self._by_length.get(p)
        if not bucket:
            return None
        ids = np.asarray(token_ids[:p], dtype=np.int64)
        found = bucket.get(prefix_key(ids))
        return found if found is not None and np.array_equal(found.ids, ids) else None

    @staticmethod
    def _promote(ckpt: Checkpoint, role: CheckpointRole) -> None:
        """The same prefix offered under a higher-priority role keeps that role (anchor eviction
        order)."""
        if ROLE_PRIORITY[role] < ROLE_PRIORITY[ckpt.role]:
            ckpt.role = role

    def _touch(self, ckpt: Checkpoint) -> None:
        self._lru.move_to_end(id(ckpt))

    def _copy(self, src: int, dst: int) -> None:
        assert self._copy_page is not None
        t0 = time.perf_counter()
        self._copy_page(src, dst)
        self.copy_seconds += time.perf_counter() - t0
        self.copies += 1

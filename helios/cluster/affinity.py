"""Prefix affinity: which engine replica most likely holds a request's prefix.

Plain data and no Ray, so the policy is tested on its own. A request's `RouteKey` is a chain of
hashes over whole blocks of its rendered prompt tokens (image digests mixed into the block they
fall in), plus the client's session hint. `AffinityTable` remembers which replica each block
chain was sent to and ranks candidates: the replica holding the longest leading run of blocks
first, the session's last replica breaking ties, the least-loaded replica when the preferred one
is saturated (it already runs `capacity` requests while another has room) or nothing matches,
and rendezvous hashing when loads tie too, so independent frontends agree on where a new prefix
goes. Saturation is capacity, not imbalance: waiting for a batch slot on the replica that holds
a prefix is far cheaper than recomputing the prefix elsewhere.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from helios.engine.api import GenerationRequest

BLOCK_TOKENS = 128
MAX_BLOCKS = 1024  # 128k tokens: longer prompts route by their first MAX_BLOCKS blocks
TABLE_ENTRIES = 200_000  # block hashes remembered (about 40 MB at most)
SESSIONS = 50_000
DECISIONS = ("prefix", "session", "least_loaded", "default")  # what chose a request's replica
# The routers of this process by deployment name (helios.cluster.router registers itself; the
# frontend that owns the handle reads their stats). Ray ships the router module by value, so the
# registry lives here.
ROUTERS: dict[str, Any] = {}


@dataclass(frozen=True)
class RouteKey:
    blocks: tuple[bytes, ...]  # chained hashes of whole BLOCK_TOKENS blocks, prompt order
    session: str | None = None  # the client's conversation id (prompt_cache_key, a session header)

    @property
    def anchor(self) -> bytes:
        """What rendezvous hashing places: the first block, else the session, else nothing."""
        if self.blocks:
            return self.blocks[0]
        return (self.session or "").encode("utf-8", "surrogatepass")


def route_key(request: GenerationRequest) -> RouteKey:
    ids = np.asarray(request.prompt_token_ids, dtype=np.int64)
    whole = min(len(ids) // BLOCK_TOKENS, MAX_BLOCKS)
    images = sorted((image.offset, image.digest) for image in request.images)
    blocks, previous = [], b""
    for index in range(whole):
        start, end = index * BLOCK_TOKENS, (index + 1) * BLOCK_TOKENS
        h = hashlib.blake2b(previous, digest_size=16)
        h.update(ids[start:end].tobytes())
        for offset, digest in images:
            if start <= offset < end:
                h.update(digest)
        previous = h.digest()
        blocks.append(previous)
    return RouteKey(tuple(blocks), request.session_hint)


@dataclass(frozen=True)
class Choice:
    ranks: list[list[str]]  # replica ids, most preferred rank first
    decision: str  # prefix | session | least_loaded (what picked the first rank)
    matched_blocks: int


@dataclass
class AffinityTable:
    capacity: int = 8  # requests a replica runs at once (its engine's max_concurrency)
    entries: int = TABLE_ENTRIES
    sessions_kept: int = SESSIONS
    _blocks: OrderedDict[bytes, set[str]] = field(default_factory=OrderedDict)
    _sessions: OrderedDict[str, str] = field(default_factory=OrderedDict)

    def choose(self, candidates: Sequence[str], loads: dict[str, int], key: RouteKey | None) -> Choice:
        if not candidates:
            return Choice([], "least_loaded", 0)
        key = key or RouteKey(())
        holders, depth = self._longest_run(candidates, key.blocks)
        session = self._sessions.get(key.session) if key.session else None
        least = min(loads.get(r, 0) for r in candidates)

        def by_load(group: Sequence[str]) -> list[str]:
            return sorted(group, key=lambda r: (loads.get(r, 0), -_rendezvous(key.anchor, r)))

        if depth:
            preferred, decision = (session, "session") if session in holders else (by_load(holders)[0], "prefix")
        elif session in candidates:
            preferred, decision = session, "session"
        else:
            preferred, decision = by_load(candidates)[0], "least_loaded"
        if loads.get(preferred, 0) >= self.capacity and least < self.capacity:
            preferred, decision = by_load(candidates)[0], "least_loaded"
        rest = by_load([r for r in candidates if r != preferred])
        return Choice(
            [[preferred], rest] if rest else [[preferred]], decision, depth if decision != "least_loaded" else 0
        )

    def record(self, key: RouteKey | None, replica: str) -> None:
        """The replica will hold this prompt's blocks (once its prefill runs)."""
        if key is None:
            return
        for block in key.blocks:
            holders = self._blocks.get(block)
            if holders is None:
                holders = self._blocks[block] = set()
            else:
                self._blocks.move_to_end(block)
            holders.add(replica)
        while len(self._blocks) > self.entries:
            self._blocks.popitem(last=False)
        if key.session:
            self._sessions[key.session] = replica
            self._sessions.move_to_end(key.session)
            while len(self._sessions) > self.sessions_kept:
                self._sessions.popitem(last=False)

    def forget(self, replica: str) -> None:
        """A replica left: it holds nothing any more."""
        for block in list(self._blocks):
            holders = self._blocks[block]
            holders.discard(replica)
            if not holders:
                del self._blocks[block]
        for session in [s for s, r in self._sessions.items() if r == replica]:
            del self._sessions[session]

    def _longest_run(self, candidates: Sequence[str], blocks: tuple[bytes, ...]) -> tuple[set[str], int]:
        """The candidates holding the longest leading run of blocks, and its length."""
        alive, depth = set(candidates), 0
        for block in blocks:
            holders = self._blocks.get(block)
            if not holders or not (holders & alive):
                break
            alive, depth = holders & alive, depth + 1
        return (alive, depth) if depth else (set(), 0)


def _rendezvous(anchor: bytes, replica: str) -> int:
    return int.from_bytes(hashlib.blake2b(anchor + replica.encode(), digest_size=8).digest(), "big")

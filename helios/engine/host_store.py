"""Host prefix store: prefix checkpoints kept beyond the KV pool and the process (api.md host
retention beside the checkpoint cache).

Records are chain links (helios.engine.host_records): a captured checkpoint is offered to the
store, which links it to the longest record it already holds for a prefix of the same ids and
copies out only the pages beyond it, so a conversation's turns cost one link each, not one
whole prefix each. Links live in a bounded DRAM tier and are written through to a bounded disk
tier (`nvme`) when a directory is configured; both are tied to one core by `identity` (its
digest, KV layout and dtype).

Invariants:
- Every indexed record's ancestors are indexed (in some tier): losing one drops its descendants
  (`end_of_chain`), so a lookup always finds whole chains.
- Within a tier a record is used more recently than none of its descendants (a use touches the
  leaf, then its ancestors), so least-recently-used eviction always takes a chain end
  (`end_of_chain`); a record evicted from DRAM stays on disk.
- Disk records are renamed into place whole (host_records.write_record); a record that fails a
  check on read is dropped (`io_error`) with its descendants, and its prefix recomputed. Several
  processes may share the directory: each rescans it when its mtime changes.
- A record that does not fit a tier's budget is not kept there (`oversize`). A directory that
  cannot be written leaves the DRAM tier alone, with a warning, never a failed request.

Admission (PrefixCache.fetch) restores the longest chain when it covers more than the pool's own
checkpoints and its predicted transfer (bytes over each tier's measured copy/read rate) is
cheaper than the prefill it replaces (tokens over the measured prefill rate): the three lookup
histograms of api.md record both estimates and the tokens left to prefill.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from helios.engine.host_records import (
    HostRecord,
    RecordError,
    RecordLink,
    RecordReplaced,
    read_link,
    read_record,
    write_record,
)
from helios.manifest import Manifest

log = logging.getLogger("helios.host_store")

TIERS = ("dram", "nvme")
DROP_REASONS = ("end_of_chain", "oversize", "io_error")
DEFAULT_DISK_BYTES = 16 << 30
# Unwritten records (complete DRAM copies waiting for the disk writer) may hold at most this
# much memory; a copy-out beyond it is deferred (the headroom check), not queued.
PARKED_LIMIT_BYTES = 2 << 30
# Priors until the first measurements: a conservative CPU-class prefill, a memory copy, a disk read.
PRIOR_PREFILL_NS_PER_TOKEN = 1_000_000.0
PRIOR_COPY_BYTES_PER_S = 4e9
PRIOR_DISK_BYTES_PER_S = 5e8
EWMA = 0.3  # weight of a new measurement
# Lookup histogram buckets (upper bounds): tokens, then nanoseconds.
TOKEN_BUCKETS = (0, 16, 64, 256, 1024, 4096, 16384, 65536)
NS_BUCKETS = (1e5, 1e6, 1e7, 1e8, 1e9, 1e10, 1e11)
HISTOGRAMS = {"missing_tokens": TOKEN_BUCKETS, "estimated_transfer_ns": NS_BUCKETS, "estimated_prefill_ns": NS_BUCKETS}


def default_dram_bytes() -> int:
    """A quarter of the memory available at start, at most 8 GiB."""
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        available = 4 << 30
    return min(available // 4, 8 << 30)


@dataclass
class HostStoreConfig:
    dram_bytes: int = field(default_factory=default_dram_bytes)  # 0 turns the DRAM tier off
    directory: Path | None = None  # the disk tier; None: off
    disk_bytes: int = DEFAULT_DISK_BYTES
    # "predicted": restore a chain only when its predicted transfer beats the prefill it saves;
    # "always": whenever it covers more than the pool (a tiny model's prefill is nearly free).
    restore: str = "predicted"


RESTORE_POLICIES = ("predicted", "always")


def prefix_key(ids: np.ndarray) -> bytes:
    """The digest a prefix is indexed by, in the pool's checkpoints and in host records."""
    return hashlib.blake2b(np.asarray(ids, dtype=np.int64).tobytes(), digest_size=16).digest()


def prefix_keys(token_ids: list[int], lengths: list[int]) -> Iterator[tuple[int, bytes]]:
    """(length, prefix_key(token_ids[:length])) for each of the ascending `lengths`, from one
    incremental hash over the prompt: O(prompt + lengths), not O(prompt x lengths)."""
    ids = np.asarray(token_ids[: lengths[-1]], dtype=np.int64) if lengths else np.zeros(0, np.int64)
    h = hashlib.blake2b(digest_size=16)
    prev = 0
    for length in lengths:
        h.update(ids[prev:length].tobytes())
        prev = length
        yield length, h.copy().digest()


class Histogram:
    """A Prometheus histogram's state: counts per upper bound (+Inf last) and the sum."""

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        index = next((i for i, bound in enumerate(self.bounds) if value <= bound), len(self.bounds))
        self.counts[index] += 1
        self.sum += value

    def buckets(self) -> list[tuple[str, int]]:
        """Cumulative (le, count) pairs, as prometheus_client's HistogramMetricFamily takes them."""
        out, total = [], 0
        for bound, count in zip([*map(str, self.bounds), "+Inf"], self.counts):
            total += count
            out.append((bound, total))
        return out


@dataclass
class HostStoreStats:
    hits: int = 0  # admissions whose chain admission fetched
    reused_tokens: int = 0  # prompt tokens those chains covered beyond the pool's checkpoint
    memory_records: int = 0
    disk_records: int = 0
    parked_records: int = 0  # complete DRAM copies awaiting their disk write
    bytes_out: int = 0  # copied out of the pool
    bytes_in: int = 0  # copied back into pool pages
    store_skipped: int = 0  # offers of records already held
    copyout_deferrals: int = 0  # offers deferred by the parked-bytes headroom check
    restores_declined: int = 0  # chains whose predicted transfer cost more than their prefill
    held: dict[str, int] = field(default_factory=dict)  # records stored, by tier
    dropped: dict[tuple[str, str], int] = field(default_factory=dict)  # by (tier, reason)
    histograms: dict[str, tuple[list[tuple[str, int]], float]] = field(default_factory=dict)


@dataclass
class Chain:
    """A whole chain of records, root first, covering `length` tokens of a prompt."""

    links: list[RecordLink]

    @property
    def length(self) -> int:
        return self.links[-1].length


def core_identity(manifest: Manifest, pool_dtype: str = "float32") -> str:
    """What a record must match to be served: the core's files, its KV layout and the dtype of the
    pool the K/V came from (each dtype keeps its own folder; a record's header names it too)."""
    kv = manifest.kv
    text = json.dumps(
        [
            manifest.digest or manifest.content_digest,
            kv.num_layers,
            kv.kv_heads,
            kv.head_dim,
            kv.page_tokens,
            pool_dtype,
        ]
    )
    return hashlib.sha256(text.encode()).hexdigest()


class HostStore:
    """The two tiers and their chain index. Offers, lookups and loads run on the engine thread,
    disk writes on one writer thread; the index is shared under one lock."""

    def __init__(
        self, identity: str, config: HostStoreConfig, page_tokens: int, page_bytes: int, dtype: str = "float32"
    ):
        """page_bytes: one page's K/V in the pool's `dtype`, the type records hold."""
        self.identity = identity
        self.dtype = dtype
        self.config = config
        self.page_tokens = page_tokens
        self.page_bytes = page_bytes
        self._lock = threading.RLock()
        self._links: dict[str, RecordLink] = {}  # every indexed record, either tier
        self._children: dict[str, set[str]] = {}
        self._dram: OrderedDict[str, HostRecord] = OrderedDict()  # least recently used first
        self._dram_bytes = 0
        self._parked: dict[str, HostRecord] = {}  # awaiting the writer
        self._parked_bytes = 0
        self._disk: OrderedDict[str, int] = OrderedDict()  # key -> file bytes, least recently used first
        self._disk_bytes = 0
        self.hits = self.reused_tokens = self.bytes_out = self.bytes_in = 0
        self.store_skipped = self.copyout_deferrals = self.restores_declined = 0
        self.held = dict.fromkeys(TIERS, 0)
        self.dropped = {(tier, reason): 0 for tier in TIERS for reason in DROP_REASONS}
        self.histograms = {name: Histogram(bounds) for name, bounds in HISTOGRAMS.items()}
        self.prefill_ns_per_token = PRIOR_PREFILL_NS_PER_TOKEN
        self.copy_bytes_per_s = PRIOR_COPY_BYTES_PER_S
        self.disk_bytes_per_s = PRIOR_DISK_BYTES_PER_S
        self.folder: Path | None = None
        self._folder_mtime = 0.0
        self._writer: ThreadPoolExecutor | None = None
        if config.directory is not None:
            self._open_directory(Path(config.directory) / identity[:32])

    # -- counts ----------------------------------------------------------------------------------

    def stats(self) -> HostStoreStats:
        with self._lock:
            return HostStoreStats(
                self.hits,
                self.reused_tokens,
                len(self._dram),
                len(self._disk),
                len(self._parked),
                self.bytes_out,
                self.bytes_in,
                self.store_skipped,
                self.copyout_deferrals,
                self.restores_declined,
                dict(self.held),
                dict(self.dropped),
                {name: (h.buckets(), h.sum) for name, h in self.histograms.items()},
            )

    # -- offers ----------------------------------------------------------------------------------

    def offer(self, ids: np.ndarray, read_pages: Callable[[int], np.ndarray], state: np.ndarray | None = None) -> None:
        """Keep a captured checkpoint of `ids`: a link from the longest held prefix of them, whose
        pages from `first_page` on `read_pages(first_page)` copies out of the pool."""
        ids = np.asarray(ids, dtype=np.int64)
        key = prefix_key(ids).hex()
        with self._lock:
            if key in self._links:
                self.store_skipped += 1  # a duplicate: already held
                self._touch(key)
                return
            parent = self._longest(ids.tolist(), ids.shape[0] - 1)
            start = parent.length if parent is not None else 0
            first_page = start // self.page_tokens
            pages = -(-ids.shape[0] // self.page_tokens) - first_page
            nbytes = pages * self.page_bytes + (ids.shape[0] - start) * 8 + (0 if state is None else state.nbytes)
            to_dram = 0 < nbytes <= self.config.dram_bytes
            to_disk = self._writer is not None and nbytes <= self.config.disk_bytes
            if self.config.dram_bytes > 0 and not to_dram:
                self.dropped[("dram", "oversize")] += 1
            if self._writer is not None and not to_disk:
                self.dropped[("nvme", "oversize")] += 1
            if not (to_dram or to_disk):
                return  # nowhere to keep it: no copy
            if to_disk and self._parked_bytes + nbytes > PARKED_LIMIT_BYTES:
                self.copyout_deferrals += 1  # the writer is behind: no more copies in flight
                return
        kv = read_pages(first_page)
        link = RecordLink(key, parent.links[-1].key if parent else None, start, int(ids.shape[0]), first_page, 0)
        record = HostRecord(link, ids[start:].copy(), kv, None if state is None else np.array(state, np.float32))
        link.nbytes = record.nbytes
        self.bytes_out += record.nbytes
        with self._lock:
            if link.parent is not None and link.parent not in self._links:
                return  # its parent went while the pages were copied
            self._links[key] = link
            if link.parent is not None:
                self._children.setdefault(link.parent, set()).add(key)
            if to_disk:
                self._parked[key] = record
                self._parked_bytes += record.nbytes
                assert self._writer is not None
                self._writer.submit(self._write, record)
            if to_dram:
                self._dram[key] = record
                self._dram_bytes += record.nbytes
                self.held["dram"] += 1
            self._touch(key)
            self._fit_dram()

    def close(self) -> None:
        """Finish pending disk writes."""
        if self._writer is not None:
            self._writer.shutdown(wait=True)

    # -- lookup ----------------------------------------------------------------------------------

    def find(self, token_ids: list[int], limit: int) -> Chain | None:
        """The longest whole chain whose ids prefix `token_ids`, at most `limit` tokens long."""
        with self._lock:
            self._rescan()
            return self._longest(token_ids, limit)

    def worth_restoring(self, chain: Chain | None, held: int, prompt_tokens: int, record: bool = True) -> bool:
        """Predict a chain's restore against the prefill it saves beyond the pool's own `held`-token
        checkpoint (the last prompt token is always computed); `record` enters the lookup in the
        histograms and the declined count."""
        covered = chain.length if chain is not None else 0
        if record:
            self.histograms["missing_tokens"].observe(max(0, prompt_tokens - max(covered, held)))
        if chain is None or chain.length <= held:
            return False
        saved = min(chain.length, prompt_tokens - 1) - min(held, prompt_tokens - 1)
        with self._lock:
            in_dram = sum(link.nbytes for link in chain.links if link.key in self._dram or link.key in self._parked)
        on_disk = sum(link.nbytes for link in chain.links) - in_dram
        transfer_ns = (in_dram / self.copy_bytes_per_s + on_disk / self.disk_bytes_per_s) * 1e9
        prefill_ns = saved * self.prefill_ns_per_token
        if record:
            self.histograms["estimated_transfer_ns"].observe(transfer_ns)
            self.histograms["estimated_prefill_ns"].observe(prefill_ns)
        if transfer_ns >= prefill_ns and self.config.restore != "always":
            self.restores_declined += int(record)
            return False
        return True

    def load(self, chain: Chain, token_ids: list[int]) -> list[HostRecord] | None:
        """The chain's records, root first, their ids checked against `token_ids`; None when a
        record fails a check (it and its descendants are dropped) or a record went meanwhile."""
        records = []
        for link in chain.links:
            with self._lock:
                record = self._dram.get(link.key) or self._parked.get(link.key)
            if record is None:
                record = self._read_disk(link)
                if record is None:
                    return None
                with self._lock:
                    if link.key in self._links and self._keeps_in_dram(record):
                        self._dram[link.key] = record
                        self._dram_bytes += record.nbytes
                        self.held["dram"] += 1
            if not np.array_equal(record.ids, np.asarray(token_ids[link.start : link.length], dtype=np.int64)):
                return None  # a hash collision: never served
            records.append(record)
        with self._lock:
            # A writer's disk trim may have dropped a link while it was read: the records passed
            # every check and are served, but only what is still indexed is touched.
            self._touch(chain.links[-1].key)
            self._fit_dram()
        self.bytes_in += sum(r.nbytes for r in records)
        return records

    # -- measurements (priors until then) ---------------------------------------------------------

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self.prefill_ns_per_token += EWMA * (seconds * 1e9 / tokens - self.prefill_ns_per_token)

    def observe_copy(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            self.copy_bytes_per_s += EWMA * (nbytes / seconds - self.copy_bytes_per_s)

    # -- index internals (lock held) ---------------------------------------------------------------

    def _longest(self, token_ids: list[int], limit: int) -> Chain | None:
        limit = min(limit, len(token_ids))
        by_length: dict[int, set[str]] = {}
        for key, link in self._links.items():
            if link.length <= limit:
                by_length.setdefault(link.length, set()).add(key)
        best = None
        for _, digest in prefix_keys(token_ids, sorted(by_length)):
            if digest.hex() in self._links:
                best = digest.hex()
        if best is None:
            return None
        links = [self._links[best]]
        while links[-1].parent is not None:
            links.append(self._links[links[-1].parent])
        return Chain(links[::-1])

    def _touch(self, key: str | None) -> None:
        """Mark a record used, then its ancestors (more recent than any of their descendants)."""
        while key is not None and key in self._links:
            for tier in (self._dram, self._disk):
                if key in tier:
                    tier.move_to_end(key)
            key = self._links[key].parent

    def _keeps_in_dram(self, record: HostRecord) -> bool:
        return 0 < record.nbytes <= self.config.dram_bytes

    def _fit_dram(self) -> None:
        while self._dram_bytes > self.config.dram_bytes and self._dram:
            key, record = self._dram.popitem(last=False)
            self._dram_bytes -= record.nbytes
            self.dropped[("dram", "end_of_chain")] += 1
            if key not in self._disk and key not in self._parked:
                self._forget(key)

    def _forget(self, key: str) -> None:
        """Drop a record from the index and every tier, and its descendants (`end_of_chain`)."""
        link = self._links.pop(key, None)
        if link is None:
            return
        if link.parent is not None and link.parent in self._children:
            self._children[link.parent].discard(key)
        for child in self._children.pop(key, set()):
            for tier, held in (("dram", self._dram), ("nvme", self._disk)):
                if child in held:
                    self.dropped[(tier, "end_of_chain")] += 1
            self._forget(child)
        record = self._dram.pop(key, None)
        if record is not None:
            self._dram_bytes -= record.nbytes
        parked = self._parked.pop(key, None)
        if parked is not None:  # its write still runs; _write sees the link gone and deletes the file
            self._parked_bytes -= parked.nbytes
        size = self._disk.pop(key, None)
        if size is not None:
            self._disk_bytes -= size
            self._path(link).unlink(missing_ok=True)

    # -- disk --------------------------------------------------------------------------------------

    def _open_directory(self, folder: Path) -> None:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            probe = folder / f".probe-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            log.warning("host store directory %s is not writable (%s): keeping checkpoints in memory only", folder, exc)
            return
        self.folder = folder
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="helios-host-store")
        with self._lock:
            self._rescan()

    def _path(self, link: RecordLink) -> Path:
        assert self.folder is not None
        return self.folder / f"{link.length}-{link.key}.rec"

    def _rescan(self) -> None:
        """Index record files this process has not seen (a restart, or another process sharing the
        directory), oldest first so the LRU order survives; orphans are dropped."""
        if self.folder is None:
            return
        try:
            mtime = self.folder.stat().st_mtime
            if mtime == self._folder_mtime:
                return
            self._folder_mtime = mtime
            files = sorted(((p.stat().st_mtime, p) for p in self.folder.glob("*.rec")), key=lambda item: item[0])
        except OSError:
            return
        fresh = []
        for _, path in files:
            length, _, key = path.stem.partition("-")
            if key in self._links or not length.isdigit():
                continue
            try:
                link = read_link(path, self.identity, self.dtype)
                size = path.stat().st_size
                if link.key != key or link.length != int(length) or not self._well_formed(link):
                    raise RecordError("its header does not match its name or its chain fields are inconsistent")
            except FileNotFoundError:  # another process sharing the directory evicted it
                continue
            except (OSError, RecordError) as exc:
                log.warning("host store record %s is unreadable (%s): dropped", path.name, exc)
                path.unlink(missing_ok=True)
                self.dropped[("nvme", "io_error")] += 1
                continue
            self._links[link.key] = link
            self._disk[link.key] = size
            self._disk_bytes += size
            fresh.append(link)
        for link in fresh:  # parents first (they were written first); orphans go
            if link.key not in self._links or link.parent is None:
                continue
            parent = self._links.get(link.parent)
            if parent is None or parent.length != link.start:
                self.dropped[("nvme", "end_of_chain")] += 1
                self._forget(link.key)
            else:
                self._children.setdefault(link.parent, set()).add(link.key)
        for link in fresh:
            if link.key in self._links:
                self._touch(link.key)

    def _well_formed(self, link: RecordLink) -> bool:
        """A link's own fields agree (a chain root starts at 0, a link starts inside its parent's
        last page), so walking parents always ends."""
        return (
            0 <= link.start < link.length
            and (link.parent is None) == (link.start == 0)
            and link.parent != link.key
            and link.first_page == link.start // self.page_tokens
        )

    def _write(self, record: HostRecord) -> None:
        """Writer thread: the record file, then the disk budget."""
        link = record.link
        path = self._path(link)
        try:
            size = write_record(path, record, self.identity)
        except OSError as exc:  # a full or failing disk: the record stays in memory only
            log.warning("host store write of %s failed (%s): kept in memory only", path.name, exc)
            with self._lock:
                self.dropped[("nvme", "io_error")] += 1
                self._unpark(record)
                if self._links.get(link.key) is link and link.key not in self._dram:
                    self._forget(link.key)
            return
        with self._lock:
            self._unpark(record)
            if self._links.get(link.key) is not link:  # dropped while it was written (a lost ancestor)
                if link.key not in self._links:
                    path.unlink(missing_ok=True)
                return
            self._disk_bytes += size - self._disk.get(link.key, 0)
            self._disk[link.key] = size
            self.held["nvme"] += 1
            self._touch(link.key)
            self._folder_mtime = self.folder.stat().st_mtime if self.folder else 0.0
            while self._disk_bytes > self.config.disk_bytes and self._disk:
                old_key, old_size = self._disk.popitem(last=False)
                self._disk_bytes -= old_size
                self._path(self._links[old_key]).unlink(missing_ok=True)
                self.dropped[("nvme", "end_of_chain")] += 1
                if old_key not in self._dram:
                    self._forget(old_key)

    def _unpark(self, record: HostRecord) -> None:
        if self._parked.get(record.link.key) is record:
            del self._parked[record.link.key]
            self._parked_bytes -= record.nbytes

    def _read_disk(self, link: RecordLink) -> HostRecord | None:
        with self._lock:
            known = link.key in self._disk and self.folder is not None
        if not known:
            return None
        path = self._path(link)
        started = time.perf_counter()
        try:
            record = read_record(path, self.identity, link, self.dtype)
        except FileNotFoundError:  # another process sharing the directory evicted it
            with self._lock:
                self._forget(link.key)
            return None
        except RecordReplaced:  # another process wrote the same prefix under another chain
            with self._lock:
                self._disk_bytes -= self._disk.pop(link.key, 0)  # keep its file: the next rescan indexes it
                self._forget(link.key)
                self._folder_mtime = 0.0
            return None
        except (OSError, RecordError) as exc:
            log.warning(
                "host store record %s failed its checks (%s): dropped, its prefix is recomputed", path.name, exc
            )
            with self._lock:
                self.dropped[("nvme", "io_error")] += 1
                self._forget(link.key)
            return None
        seconds = time.perf_counter() - started
        if seconds > 0:
            self.disk_bytes_per_s += EWMA * (record.nbytes / seconds - self.disk_bytes_per_s)
        return record

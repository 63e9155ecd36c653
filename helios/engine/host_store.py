"""Host prefix store: prefix checkpoints kept beyond the KV pool and the process (api.md host
retention beside the checkpoint cache).

A record is one prefix checkpoint: its token ids and the K/V of the pool pages that hold them
([layers, 2, pages, page_tokens, kv_heads, head_dim], the pool's own float32 layout), tied to one
core by `identity` (the core's digest, KV layout and dtype). When the pool captures a
checkpoint, its pages are copied out to the DRAM tier (LRU within a byte budget) and written
through to the disk tier when a directory is configured (LRU by use within its own budget; a
record dropped from DRAM stays on disk). Admission asks for the longest record whose ids prefix
a prompt; a longer one than the pool holds is copied back into pool pages (helios.engine.
prefix_cache.PrefixCache.fetch) and restored like any pool checkpoint.

Disk records live in DIR/<identity>/LENGTH-KEY.rec: a JSON header line (format, identity,
length, shape, blake2b checksum of the payload) and the payload (ids, then K/V). They are
written to a temporary file and renamed, so a reader never sees a partial record and writers of
the same record (several processes may share DIR) cannot corrupt it; a record that fails any
check (identity, shape, ids, checksum, a short read) is dropped (`io_error`) and its prefix
recomputed, never served. A directory that cannot be written degrades the store to DRAM only,
with a warning, never a failed request. Records of cores with recurrent state are not kept
(their snapshots are not part of the record format yet).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from helios.manifest import Manifest

log = logging.getLogger("helios.host_store")

FORMAT = "flare-host-record-1"
TIERS = ("dram", "nvme")
DROP_REASONS = ("end_of_chain", "oversize", "io_error")
DEFAULT_DISK_BYTES = 16 << 30


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


@dataclass
class HostRecord:
    ids: np.ndarray  # int64 [length]
    kv: np.ndarray  # float32 [layers, 2, pages, page_tokens, kv_heads, head_dim]

    @property
    def length(self) -> int:
        return int(self.ids.shape[0])

    @property
    def nbytes(self) -> int:
        return int(self.ids.nbytes + self.kv.nbytes)


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


@dataclass
class HostStoreStats:
    hits: int = 0  # admissions that fetched a record into the pool
    reused_tokens: int = 0  # prompt tokens those fetches covered
    memory_records: int = 0
    disk_records: int = 0
    bytes_out: int = 0  # copied out of the pool
    bytes_in: int = 0  # copied back into pool pages
    held: dict[str, int] = field(default_factory=dict)  # records stored, by tier
    dropped: dict[tuple[str, str], int] = field(default_factory=dict)  # by (tier, reason)


def core_identity(manifest: Manifest) -> str:
    """What a record must match to be served: the core's files and its KV layout and dtype."""
    kv = manifest.kv
    text = json.dumps([manifest.digest or manifest.content_digest, kv.num_layers, kv.kv_heads, kv.head_dim,
                       kv.page_tokens, kv.dtype])
    return hashlib.sha256(text.encode()).hexdigest()


def page_callbacks(runner: Any) -> dict[str, Any]:
    """PrefixCache's read_pages/write_pages over a runner's pool ([layers, 2, pages, ...] view)."""
    pages_view = getattr(runner, "_pages", None)
    if pages_view is None:
        return {}

    def read(pages: list[int]) -> np.ndarray:
        return pages_view[:, :, pages]  # fancy indexing: a fresh copy

    def write(pages: list[int], data: np.ndarray) -> None:
        pages_view[:, :, pages] = data

    return {"read_pages": read, "write_pages": write}


class HostStore:
    """The two tiers and their index. `put`, `lookup` and `get` run on the engine thread; disk
    writes on one writer thread."""

    def __init__(self, identity: str, config: HostStoreConfig):
        self.identity = identity
        self.config = config
        self._lock = threading.Lock()  # the disk index and counters the writer also touches
        self._dram: OrderedDict[str, HostRecord] = OrderedDict()
        self._dram_bytes = 0
        self._disk: OrderedDict[str, tuple[int, int]] = OrderedDict()  # key -> (length, file bytes)
        self._lengths: dict[str, int] = {}  # every known key (either tier) -> its length
        self.hits = 0
        self.reused_tokens = 0
        self.bytes_out = 0
        self.bytes_in = 0
        self.held = dict.fromkeys(TIERS, 0)
        self.dropped = {(tier, reason): 0 for tier in TIERS for reason in DROP_REASONS}
        self.folder: Path | None = None
        self._writer: ThreadPoolExecutor | None = None
        if config.directory is not None:
            self._open_directory(Path(config.directory) / identity[:32])

    # -- counts ----------------------------------------------------------------------------------

    @property
    def memory_records(self) -> int:
        return len(self._dram)

    @property
    def disk_records(self) -> int:
        return len(self._disk)

    def stats(self) -> HostStoreStats:
        with self._lock:
            return HostStoreStats(self.hits, self.reused_tokens, len(self._dram), len(self._disk), self.bytes_out,
                                  self.bytes_in, dict(self.held), dict(self.dropped))

    # -- store -----------------------------------------------------------------------------------

    def put(self, ids: np.ndarray, kv: np.ndarray) -> None:
        """Keep a captured checkpoint (ids and a fresh copy of its pages)."""
        key = prefix_key(ids).hex()
        if key in self._dram:
            self._dram.move_to_end(key)
            return
        record = HostRecord(np.array(ids, dtype=np.int64, copy=True), kv)
        self.bytes_out += record.nbytes
        if record.nbytes <= self.config.dram_bytes:
            self._keep_in_dram(key, record)
        elif self.folder is None:
            self.dropped[("dram", "oversize")] += 1
            return
        with self._lock:
            on_disk = key in self._disk
            self._lengths[key] = record.length
        if self._writer is not None and not on_disk:
            self._writer.submit(self._write, key, record)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.shutdown(wait=True)

    # -- lookup ----------------------------------------------------------------------------------

    def lookup(self, token_ids: list[int], limit: int) -> tuple[str, int] | None:
        """(key, length) of the longest known record whose ids prefix `token_ids` (length <= limit)."""
        with self._lock:
            lengths = sorted({n for n in self._lengths.values() if n <= min(limit, len(token_ids))})
            known = set(self._lengths)
        best = None
        for length, digest in prefix_keys(token_ids, lengths):
            if digest.hex() in known:
                best = (digest.hex(), length)
        return best

    def get(self, key: str, token_ids: list[int]) -> HostRecord | None:
        """The record, from DRAM or disk (then also kept in DRAM); None if it fails its checks."""
        record = self._dram.get(key)
        if record is not None:
            self._dram.move_to_end(key)
        else:
            record = self._read(key)
            if record is None:
                return None
            if record.nbytes <= self.config.dram_bytes:
                self._keep_in_dram(key, record)
        if not np.array_equal(record.ids, np.asarray(token_ids[: record.length], dtype=np.int64)):
            return None  # a hash collision: never served
        self.bytes_in += int(record.kv.nbytes)
        return record

    # -- DRAM ------------------------------------------------------------------------------------

    def _keep_in_dram(self, key: str, record: HostRecord) -> None:
        self._dram[key] = record
        self._dram_bytes += record.nbytes
        self.held["dram"] += 1
        while self._dram_bytes > self.config.dram_bytes and self._dram:
            old_key, old = self._dram.popitem(last=False)
            self._dram_bytes -= old.nbytes
            with self._lock:
                if old_key not in self._disk:
                    self._lengths.pop(old_key, None)

    # -- disk ------------------------------------------------------------------------------------

    def _open_directory(self, folder: Path) -> None:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            probe = folder / f".probe-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            log.warning("host store directory %s is not writable (%s): keeping checkpoints in memory only",
                        folder, exc)
            return
        self.folder = folder
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="helios-host-store")
        files = sorted(folder.glob("*.rec"), key=lambda p: p.stat().st_mtime)
        for path in files:  # oldest first: the LRU order of a restarted store
            length, _, key = path.stem.partition("-")
            if length.isdigit() and key:
                self._disk[key] = (int(length), path.stat().st_size)
                self._lengths[key] = int(length)

    def _path(self, key: str, length: int) -> Path:
        assert self.folder is not None
        return self.folder / f"{length}-{key}.rec"

    def _write(self, key: str, record: HostRecord) -> None:
        """Writer thread: header line, payload, atomic rename; then the disk budget."""
        path = self._path(key, record.length)
        payload = (record.ids.tobytes(), np.ascontiguousarray(record.kv).tobytes())
        checksum = hashlib.blake2b(payload[0], digest_size=16)
        checksum.update(payload[1])
        header = {"format": FORMAT, "identity": self.identity, "length": record.length,
                  "shape": list(record.kv.shape), "dtype": str(record.kv.dtype), "checksum": checksum.hexdigest()}
        temporary = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            with open(temporary, "wb") as out:
                out.write(json.dumps(header).encode() + b"\n")
                out.write(payload[0])
                out.write(payload[1])
            os.replace(temporary, path)
        except OSError as exc:
            temporary.unlink(missing_ok=True)
            log.warning("host store write of %s failed (%s): the record stays in memory only", path.name, exc)
            with self._lock:
                self.dropped[("nvme", "io_error")] += 1
            return
        size = path.stat().st_size
        with self._lock:
            self._disk[key] = (record.length, size)
            self._lengths[key] = record.length
            self.held["nvme"] += 1
            self._trim_disk()

    def _trim_disk(self) -> None:
        """Least recently used records go until the directory fits its budget (lock held)."""
        total = sum(size for _, size in self._disk.values())
        while total > self.config.disk_bytes and self._disk:
            key, (length, size) = self._disk.popitem(last=False)
            self._path(key, length).unlink(missing_ok=True)
            total -= size
            if key not in self._dram:
                self._lengths.pop(key, None)

    def _read(self, key: str) -> HostRecord | None:
        with self._lock:
            entry = self._disk.get(key)
            if entry is not None:
                self._disk.move_to_end(key)
        if entry is None or self.folder is None:
            return None
        path = self._path(key, entry[0])
        try:
            with open(path, "rb") as source:
                header = json.loads(source.readline())
                shape = [int(n) for n in header["shape"]]
                length = int(header["length"])
                ids = np.frombuffer(source.read(length * 8), dtype=np.int64)
                kv = np.frombuffer(source.read(int(np.prod(shape)) * 4), dtype=np.float32)
            checksum = hashlib.blake2b(ids.tobytes(), digest_size=16)
            checksum.update(kv.tobytes())
            ok = (header.get("format") == FORMAT and header.get("identity") == self.identity
                  and header.get("dtype") == "float32" and length == entry[0] and ids.shape[0] == length
                  and kv.size == int(np.prod(shape)) and checksum.hexdigest() == header.get("checksum"))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("host store record %s is unreadable (%s): dropped", path.name, exc)
            ok = False
        if not ok:
            self._drop_disk(key, path)
            return None
        return HostRecord(ids.copy(), kv.reshape(shape).copy())

    def _drop_disk(self, key: str, path: Path) -> None:
        path.unlink(missing_ok=True)
        with self._lock:
            self._disk.pop(key, None)
            if key not in self._dram:
                self._lengths.pop(key, None)
            self.dropped[("nvme", "io_error")] += 1

"""Host prefix-store records: what one chain link holds and its file format (api.md host
retention; the store itself is helios.engine.host_store).

A record is one link of a chain. It extends its parent record (the longest record already held
whose ids prefix its own, or nothing) from token `start` to `length`: it carries those token ids,
the K/V of the pool pages from `first_page` = start // page_tokens up to the page holding
length - 1 ([layers, 2, pages, page_tokens, kv_heads, head_dim] in the pool's layout and dtype; the
parent's partly filled last page is carried again, completed), and, for cores with recurrent
state, the state after `length` tokens. Restoring a chain writes its links root first, so every
page ends up holding the leaf's view of it.

File: one JSON header line, then the payload (ids int64, K/V in the pool's dtype, state float32).
The header names the format, the core identity, the K/V dtype (a record of another dtype is
refused, so recomputed, never misread), the link (key, parent, start, length, first_page), the shapes
and a blake2b checksum of the payload. `inputs` is reserved for prepared image inputs (not stored
yet): readers of this format require it empty.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from helios.kernels import kv_dtype

FORMAT = "flare-host-record-2"


class RecordError(ValueError):
    """A record file that fails a check: torn, truncated, foreign or corrupted."""


class RecordReplaced(RecordError):
    """A sound record file whose link is not the one indexed: another process sharing the
    directory wrote the same prefix as a link of another chain."""


@dataclass
class RecordLink:
    """Where a record sits in its chain; what the index keeps for every record of either tier."""

    key: str  # prefix_key(ids[:length]).hex()
    parent: str | None  # the key of ids[:start], None for a chain root (start == 0)
    start: int
    length: int
    first_page: int
    nbytes: int  # payload bytes (what a restore copies)


@dataclass
class HostRecord:
    link: RecordLink
    ids: np.ndarray  # int64 [length - start]: the tokens this link adds
    kv: np.ndarray  # the pool's dtype [layers, 2, pages, page_tokens, kv_heads, head_dim] from first_page
    state: np.ndarray | None = None  # float32 [width]: recurrent state after `length` tokens

    @property
    def nbytes(self) -> int:
        return int(self.ids.nbytes + self.kv.nbytes + (self.state.nbytes if self.state is not None else 0))


def _checksum(parts: list[bytes]) -> str:
    digest = hashlib.blake2b(digest_size=16)
    for part in parts:
        digest.update(part)
    return digest.hexdigest()


def write_record(path: Path, record: HostRecord, identity: str) -> int:
    """Write `record` to `path` atomically (a private temporary file, then a rename: readers never
    see a partial record and concurrent writers of one record each rename a whole one). Returns
    the file's size; raises OSError."""
    link = record.link
    payload = [record.ids.tobytes(), np.ascontiguousarray(record.kv).tobytes()]
    if record.state is not None:
        payload.append(np.ascontiguousarray(record.state).tobytes())
    header = {
        "format": FORMAT,
        "identity": identity,
        "key": link.key,
        "parent": link.parent,
        "start": link.start,
        "length": link.length,
        "first_page": link.first_page,
        "kv_shape": list(record.kv.shape),
        "state_shape": None if record.state is None else list(record.state.shape),
        "dtype": kv_dtype.name_of(record.kv.dtype),
        "inputs": [],
        "checksum": _checksum(payload),
    }
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(temporary, "wb") as out:
            out.write(json.dumps(header).encode() + b"\n")
            for part in payload:
                out.write(part)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    return path.stat().st_size


def read_link(path: Path, identity: str, dtype: str) -> RecordLink:
    """The header of a record file (a start-up or rescan index entry); raises RecordError/OSError."""
    with open(path, "rb") as source:
        header = _header(source.readline(), identity, dtype)
    return _link(header)


def read_record(path: Path, identity: str, link: RecordLink, dtype: str) -> HostRecord:
    """The whole record, every check passed (its K/V in `dtype`, the pool's); raises RecordError,
    or OSError when unreadable."""
    with open(path, "rb") as source:
        header = _header(source.readline(), identity, dtype)
        if _link(header) != link:
            raise RecordReplaced("its header does not match the index")
        kv_shape = [int(n) for n in header["kv_shape"]]
        state_shape = header["state_shape"]
        sizes = [(link.length - link.start) * 8, int(np.prod(kv_shape)) * kv_dtype.itemsize(dtype)]
        if state_shape is not None:
            sizes.append(int(np.prod([int(n) for n in state_shape])) * 4)
        parts = [source.read(size) for size in sizes]
        trailing = source.read(1)
    if [len(part) for part in parts] != sizes or trailing:
        raise RecordError("truncated or overlong payload")
    if _checksum(parts) != header["checksum"]:
        raise RecordError("checksum mismatch")
    ids = np.frombuffer(parts[0], dtype=np.int64)
    kv = np.frombuffer(parts[1], dtype=kv_dtype.numpy_dtype(dtype)).reshape(kv_shape)
    state = None if state_shape is None else np.frombuffer(parts[2], dtype=np.float32)
    return HostRecord(link, ids.copy(), kv.copy(), None if state is None else state.copy())


def _header(line: bytes, identity: str, dtype: str) -> dict:
    try:
        header = json.loads(line)
    except ValueError as exc:
        raise RecordError(f"unreadable header ({exc})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise RecordError(f"not a {FORMAT} record")
    if header.get("identity") != identity:
        raise RecordError("written by another core (identity mismatch)")
    if header.get("dtype") != dtype:
        raise RecordError(f"K/V of another dtype ({header.get('dtype')!r}, the pool holds {dtype})")
    if header.get("inputs") != []:
        raise RecordError("unsupported payload (prepared inputs)")
    return header


def _link(header: dict) -> RecordLink:
    try:
        kv_shape = [int(n) for n in header["kv_shape"]]
        state = header["state_shape"]
        item = kv_dtype.itemsize(header["dtype"])
        nbytes = (int(header["length"]) - int(header["start"])) * 8 + int(np.prod(kv_shape)) * item
        nbytes += 0 if state is None else int(np.prod([int(n) for n in state])) * 4
        return RecordLink(
            str(header["key"]),
            header["parent"],
            int(header["start"]),
            int(header["length"]),
            int(header["first_page"]),
            nbytes,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise RecordError(f"malformed header ({exc})") from None

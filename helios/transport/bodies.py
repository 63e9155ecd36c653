"""Request bodies: bounded reading, content decoding, strict JSON.

Both the encoded and the decoded body are bounded by max_body_bytes. The encoded bytes are
counted while they stream in (Content-Length is checked up front) under a read deadline;
decompression runs in a worker pool, stops as soon as its output would pass the bound and takes
input in slices, so neither a compression bomb nor a body of many tiny gzip members costs more
than linear work and the limit in memory.

JSON is parsed strictly, once, here, so no protocol code sees invalid text or numbers: UTF-8 only
(no lone surrogates, raw or escaped), finite numbers only, and bounded nesting and element counts
checked on the bytes before parsing, so the parsed objects stay a small multiple of the body.
"""

from __future__ import annotations

import asyncio
import io
import json
import math
import re
import zlib
from dataclasses import dataclass
from typing import Any

import brotli
import numpy as np
import zstandard
from aiohttp import web

from helios.transport.errors import ApiError, bad_request, request_timeout, too_large, unsupported_encoding

DEFAULT_MAX_BODY_BYTES = 32 << 20
DEFAULT_BODY_TIMEOUT_S = 60.0
_CHUNK = 1 << 16
_CHUNK_OUT = 1 << 20  # decompressed bytes per call: short calls, and a structure check per MiB
SUPPORTED_ENCODINGS = ("identity", "gzip", "x-gzip", "deflate", "br", "zstd")
# Concatenated gzip members are legal but rare; each one restarts the inflater.
MAX_GZIP_MEMBERS = 64
MAX_INT_DIGITS = 308  # 10**308 is about the largest double


@dataclass(frozen=True)
class JsonLimits:
    """Structure bounds of a request body, checked before parsing.

    elements counts values and keys (structural `,` `:` `[` `{` outside strings); the default
    holds several full-context token-ID prompts. depth bounds nesting (tool schemas use ~10)."""

    max_elements: int = 1 << 18
    max_depth: int = 64


def content_encodings(header: str | None) -> list[str]:
    """The encodings applied to the body, in the order they were applied; 415 if unknown."""
    if not header:
        return []
    codings = [c.strip().lower() for c in header.split(",") if c.strip()]
    for coding in codings:
        if coding not in SUPPORTED_ENCODINGS:
            raise unsupported_encoding(coding)
    return [c for c in codings if c != "identity"]


async def read_encoded(request: web.Request, max_bytes: int, timeout: float = DEFAULT_BODY_TIMEOUT_S) -> bytes:
    """The raw (still encoded) body, at most max_bytes, fully arrived within `timeout` seconds."""
    length = request.content_length
    if length is not None and length > max_bytes:
        raise too_large(max_bytes)
    buf = bytearray()
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.content.iter_chunked(_CHUNK):
                buf += chunk
                if len(buf) > max_bytes:
                    raise too_large(max_bytes)
    except TimeoutError:
        raise request_timeout(f"the request body did not arrive within {timeout:g} s") from None
    return bytes(buf)


def decode(data: bytes, encodings: list[str], max_bytes: int, limits: JsonLimits | None = None) -> bytes:
    """Undo `encodings` (last applied first), each stage bounded by max_bytes. With `limits`,
    the last stage's output (the JSON text) is checked against them as it grows, so a bomb of
    tiny elements stops after about a mebibyte instead of at the body limit."""
    stages = list(reversed(encodings))
    for index, coding in enumerate(stages):
        out = _Output(max_bytes, limits if index == len(stages) - 1 else None)
        try:
            if coding in ("gzip", "x-gzip"):
                _zlib(data, 16 + zlib.MAX_WBITS, out, max_members=MAX_GZIP_MEMBERS)
            elif coding == "deflate":
                _zlib(data, zlib.MAX_WBITS, out, max_members=1)
            elif coding == "br":
                _brotli(data, out)
            elif coding == "zstd":
                _zstd(data, out)
        except ApiError:
            raise
        except (zlib.error, brotli.error, zstandard.ZstdError, EOFError, ValueError) as exc:
            raise bad_request(f"the request body is not valid {coding} data: {exc}") from None
        if out.structure is not None:
            out.structure.finish(out.data)
        data = out.data
    return data


class _Output:
    """A decoder's output: bounded by max_bytes (413 past it) and, for JSON text, watched by
    `Structure` as it grows."""

    def __init__(self, max_bytes: int, limits: JsonLimits | None):
        self.data = bytearray()
        self.max_bytes = max_bytes
        self.structure = Structure(limits) if limits is not None else None

    @property
    def room(self) -> int:
        """What the next decompressor call may produce (one byte past the bound is the 413)."""
        return max(1, min(_CHUNK_OUT, self.max_bytes + 1 - len(self.data)))

    def add(self, chunk: bytes) -> None:
        self.data += chunk
        if len(self.data) > self.max_bytes:
            raise too_large(self.max_bytes)
        if self.structure is not None:
            self.structure.grew(self.data, len(chunk))


def _zlib(data: bytes, wbits: int, out: _Output, *, max_members: int) -> None:
    """Inflate members one after another. Input goes in _CHUNK slices, so what a finished
    member leaves unused (zlib copies it) is at most one slice: linear in the body."""
    view = memoryview(data)
    pos = 0
    members = 0
    while pos < len(view) or members == 0:
        members += 1
        if members > max_members:
            raise ValueError(f"more than {max_members} concatenated members")
        inflater = zlib.decompressobj(wbits)
        while not inflater.eof:
            if pos >= len(view):
                raise EOFError("truncated stream")
            piece = view[pos : pos + _CHUNK]
            pos += len(piece)
            # max_length bounds what one call may allocate; the rest waits in unconsumed_tail.
            out.add(inflater.decompress(piece, out.room))
            while inflater.unconsumed_tail:
                out.add(inflater.decompress(inflater.unconsumed_tail, out.room))
        pos -= len(inflater.unused_data)
        if max_members == 1 and pos < len(view):
            raise ValueError("trailing data after the stream")


def _brotli(data: bytes, out: _Output) -> None:
    d = brotli.Decompressor()
    out.add(d.process(data, output_buffer_limit=_CHUNK))
    while not d.is_finished() and not d.can_accept_more_data():
        out.add(d.process(b"", output_buffer_limit=_CHUNK))
    if not d.is_finished():
        raise EOFError("truncated stream")


def _zstd(data: bytes, out: _Output) -> None:
    reader = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data), read_across_frames=True)
    while chunk := reader.read(_CHUNK):
        out.add(chunk)


# -- strict JSON -------------------------------------------------------------------------------

# A JSON string (unterminated ones run to the end). Possessive loops never backtrack: linear.
_STRING = re.compile(rb'"[^"\\]*+(?:\\.[^"\\]*+)*+"?', re.DOTALL)
_NOT_STRUCTURAL = bytes(b for b in range(256) if b not in b",:[]{}")
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")


def _invalid(reason: str) -> ApiError:
    return bad_request(f"the request body is not valid JSON: {reason}")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _double_range_int(text: str) -> int:
    """Integers past a double's range (~1.8e308) would overflow wherever a number is read as
    one; RFC 8259 calls them non-interoperable, so they are refused like 1e999."""
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"the number {text[:40]}... is out of range (numbers must be finite)")
    return int(text)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is out of range (numbers must be finite)")
    return value


class Structure:
    """Element and depth bounds of JSON text, checked before any object is built.

    Structural bytes (`,` `:` `[` `{`) are counted as the text grows; strings may hold such
    bytes too, so only once that cheap count passes a bound is the text counted again with its
    strings removed (and then again each time it doubles: linear overall). A prefix that breaks a
    bound is conclusive: the whole text can only have more elements and at least that depth."""

    def __init__(self, limits: JsonLimits):
        self.limits = limits
        self.opens = 0  # raw `[` and `{`, strings included: an upper bound on depth
        self.elements = 0  # raw `,` `:` `[` `{`: an upper bound on elements
        self._exact_at = 0  # text length at which to count exactly next
        self._checked = -1  # text length last counted exactly

    def grew(self, text: bytes | bytearray, added: int) -> None:
        start = len(text) - added
        opens = text.count(b"[", start) + text.count(b"{", start)
        self.opens += opens
        self.elements += opens + text.count(b",", start) + text.count(b":", start)
        if self.within_raw_bounds:
            return
        if len(text) >= self._exact_at:
            self.check_exactly(text)
            self._exact_at = 2 * len(text)

    @property
    def within_raw_bounds(self) -> bool:
        return self.opens <= self.limits.max_depth and self.elements <= self.limits.max_elements

    def finish(self, text: bytes | bytearray) -> None:
        """The whole text is in: count it exactly unless the raw count already proves it fits."""
        if not self.within_raw_bounds and self._checked != len(text):
            self.check_exactly(text)

    def check_exactly(self, text: bytes | bytearray) -> None:
        limits = self.limits
        self._checked = len(text)
        structure = _STRING.sub(b"0", text).translate(None, _NOT_STRUCTURAL)
        opens = structure.count(b"[") + structure.count(b"{")
        closes = structure.count(b"]") + structure.count(b"}")
        if len(structure) - closes > limits.max_elements:
            raise _invalid(f"more than {limits.max_elements} elements")
        if closes > opens:  # no JSON text (nor prefix of one) closes more than it opened
            raise _invalid("more closing brackets than opening ones")
        # At most 2 x max_elements brackets here, one byte each: the depth costs a few MB at most.
        brackets = np.frombuffer(structure.translate(None, _NOT_BRACKET), dtype=np.uint8)
        if brackets.size:
            steps = ((brackets == ord("[")) | (brackets == ord("{"))).view(np.int8) * np.int8(2) - np.int8(1)
            if int(np.cumsum(steps, dtype=np.int32).max()) > limits.max_depth:
                raise _invalid(f"nesting deeper than {limits.max_depth} levels")


def check_structure(data: bytes | bytearray, limits: JsonLimits) -> None:
    """Refuse text with more elements or deeper nesting than `limits` (Structure, in one go)."""
    structure = Structure(limits)
    structure.grew(data, len(data))
    structure.finish(data)


def _lone_surrogate_path(value: Any, path: str = "$") -> str | None:
    """The path of the first string (or key) holding a lone UTF-16 surrogate, if any."""
    stack = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            if not item.isascii():
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError:
                    return where
        elif isinstance(item, dict):
            for key, child in item.items():
                stack.append((key, f"{where} (a key)"))
                stack.append((child, f"{where}.{key}" if key.isascii() else f"{where}[...]"))
        elif isinstance(item, list):
            stack.extend((child, f"{where}[{i}]") for i, child in enumerate(item))
    return None


def parse_json(data: bytes | bytearray, limits: JsonLimits = JsonLimits(), *, checked: bool = False) -> Any:
    """Strict JSON: UTF-8 text without lone surrogates, finite numbers, bounded structure; any
    failure is a 400 naming the problem. `checked`: the structure was checked while decoding."""
    if not checked:
        check_structure(data, limits)
    try:
        text = data.decode("utf-8")  # strict: refuses invalid bytes and encoded surrogates (ED A0 80)
    except UnicodeDecodeError as exc:
        raise _invalid(f"it is not UTF-8 ({exc.reason} at byte {exc.start})") from None
    del data
    try:
        value = json.loads(
            text.removeprefix("\ufeff"),
            parse_constant=_reject_constant,
            parse_float=_finite_float,
            parse_int=_double_range_int,
        )
    except (ValueError, RecursionError) as exc:
        raise _invalid(str(exc)) from None
    # Escaped surrogates (\ud800) parse into lone ones unless they pair up; only walk when present.
    if "\\ud" in text or "\\uD" in text:
        where = _lone_surrogate_path(value)
        if where is not None:
            raise _invalid(f"{where} holds a lone UTF-16 surrogate (text must be valid Unicode)")
    return value


def decode_json(data: bytes, encodings: list[str], max_bytes: int, limits: JsonLimits = JsonLimits()) -> Any:
    """Worker-pool half of body handling: decompress (watching the structure) then parse."""
    if not encodings:
        return parse_json(data, limits)
    return parse_json(decode(data, encodings, max_bytes, limits), limits, checked=True)

"""Request bodies: bounded reading, content decoding, strict JSON.

Both the encoded and the decoded body are bounded by max_body_bytes. The encoded bytes are
counted while they stream in (Content-Length is checked up front); decompression runs in the
frontend worker pool and stops as soon as its output would pass the bound, so a compression
bomb never allocates more than the limit (plus one decompressor chunk).
"""

from __future__ import annotations

import io
import json
import zlib
from typing import Any

import brotli
import zstandard
from aiohttp import web

from helios.server.errors import ApiError, bad_request, too_large, unsupported_encoding

DEFAULT_MAX_BODY_BYTES = 32 << 20
_CHUNK = 1 << 16
SUPPORTED_ENCODINGS = ("identity", "gzip", "x-gzip", "deflate", "br", "zstd")


def content_encodings(header: str | None) -> list[str]:
    """The encodings applied to the body, in the order they were applied; 415 if unknown."""
    if not header:
        return []
    codings = [c.strip().lower() for c in header.split(",") if c.strip()]
    for coding in codings:
        if coding not in SUPPORTED_ENCODINGS:
            raise unsupported_encoding(coding)
    return [c for c in codings if c != "identity"]


async def read_encoded(request: web.Request, max_bytes: int) -> bytes:
    """The raw (still encoded) body, at most max_bytes."""
    length = request.content_length
    if length is not None and length > max_bytes:
        raise too_large(max_bytes)
    buf = bytearray()
    async for chunk in request.content.iter_chunked(_CHUNK):
        buf += chunk
        if len(buf) > max_bytes:
            raise too_large(max_bytes)
    return bytes(buf)


def decode(data: bytes, encodings: list[str], max_bytes: int) -> bytes:
    """Undo `encodings` (last applied first), each stage bounded by max_bytes."""
    for coding in reversed(encodings):
        try:
            if coding in ("gzip", "x-gzip"):
                data = _zlib(data, 16 + zlib.MAX_WBITS, max_bytes, multi_member=True)
            elif coding == "deflate":
                data = _zlib(data, zlib.MAX_WBITS, max_bytes, multi_member=False)
            elif coding == "br":
                data = _brotli(data, max_bytes)
            elif coding == "zstd":
                data = _zstd(data, max_bytes)
        except ApiError:
            raise
        except (zlib.error, brotli.error, zstandard.ZstdError, EOFError, ValueError) as exc:
            raise bad_request(f"the request body is not valid {coding} data: {exc}") from None
    return data


def _zlib(data: bytes, wbits: int, max_bytes: int, *, multi_member: bool) -> bytes:
    out = bytearray()
    pending = data
    while pending:
        d = zlib.decompressobj(wbits)
        chunk_in = pending
        while True:
            # max_length bounds what one call may allocate; unconsumed_tail holds the rest.
            out += d.decompress(chunk_in, max_bytes + 1 - len(out))
            if len(out) > max_bytes:
                raise too_large(max_bytes)
            if d.eof or not d.unconsumed_tail:
                break
            chunk_in = d.unconsumed_tail
        if not d.eof:
            raise EOFError("truncated stream")
        pending = d.unused_data if multi_member else b""
        if not multi_member and d.unused_data:
            raise ValueError("trailing data after the stream")
    return bytes(out)


def _brotli(data: bytes, max_bytes: int) -> bytes:
    d = brotli.Decompressor()
    out = bytearray()
    out += d.process(data, output_buffer_limit=_CHUNK)
    while len(out) <= max_bytes and not d.is_finished() and not d.can_accept_more_data():
        out += d.process(b"", output_buffer_limit=_CHUNK)
    if len(out) > max_bytes:
        raise too_large(max_bytes)
    if not d.is_finished():
        raise EOFError("truncated stream")
    return bytes(out)


def _zstd(data: bytes, max_bytes: int) -> bytes:
    reader = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data), read_across_frames=True)
    out = bytearray()
    while True:
        chunk = reader.read(_CHUNK)
        if not chunk:
            break
        out += chunk
        if len(out) > max_bytes:
            raise too_large(max_bytes)
    return bytes(out)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_json(data: bytes) -> Any:
    """Strict JSON (no NaN/Infinity); any failure is a 400."""
    try:
        return json.loads(data, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from None


def decode_json(data: bytes, encodings: list[str], max_bytes: int) -> Any:
    """Worker-pool half of body handling: decompress then parse."""
    return parse_json(decode(data, encodings, max_bytes))

"""The body decoder as the one gate for text and numbers: strict UTF-8 without lone surrogates,
finite numbers, bounded structure (checked before parsing), linear multi-member gzip, and an
error renderer that cannot fail on what it echoes."""

from __future__ import annotations

import gzip
import json
import tracemalloc
import zlib

import pytest

from helios.transport import bodies
from helios.transport.bodies import JsonLimits
from helios.transport.config import ServerConfig
from helios.transport.errors import ApiError, dumps, openai_error_response


def rejected(data: bytes, limits: JsonLimits | None = None) -> str:
    with pytest.raises(ApiError) as info:
        bodies.parse_json(data, limits or JsonLimits())
    assert info.value.status == 400 and info.value.type == "invalid_request_error"
    return info.value.message


@pytest.mark.parametrize(
    "data",
    [
        b'{"content": "\\ud800"}',  # escaped high surrogate alone
        b'{"content": "x\\udc00y"}',  # escaped low surrogate alone
        b'{"content": "\\ud83d\\u0041"}',  # high surrogate followed by a non-surrogate
        b'{"a": [{"b": ["ok", "\\uDBFF"]}]}',  # upper-case hex, nested
        b'{"\\ud800zz": 1}',  # in a key (System One echoes unknown names)
    ],
)
def test_escaped_lone_surrogates_are_400s(data):
    message = rejected(data)
    assert "lone UTF-16 surrogate" in message and "$" in message


def test_raw_surrogate_bytes_and_invalid_utf8_are_400s():
    assert "not UTF-8" in rejected(b'{"content": "\xed\xa0\x80"}')  # CESU-style encoded surrogate
    assert "not UTF-8" in rejected(b'{"content": "\xff"}')


def test_valid_unicode_passes_including_escaped_pairs_and_a_bom():
    assert bodies.parse_json(b'{"e": "\\ud83d\\ude00", "k": "\xe2\x9c\x93"}') == {"e": "\U0001f600", "k": "\u2713"}
    assert bodies.parse_json(b'{"path": "C:\\\\ud800"}') == {"path": "C:\\ud800"}  # an escaped backslash, not \u
    assert bodies.parse_json("\ufeff{}".encode()) == {}


@pytest.mark.parametrize(
    "literal", [b"1e999", b"-1e400", b"1" + b"0" * 400 + b".0", b"1" + b"0" * 400, b"-" + b"9" * 309]
)
def test_non_finite_numbers_are_400s(literal):
    assert "numbers must be finite" in rejected(b'{"temperature": ' + literal + b"}")


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity"])
def test_non_standard_constants_are_400s(literal):
    assert f"{literal.decode().lstrip('-')} is not valid JSON" in rejected(b'{"x": ' + literal + b"}")


def test_large_but_finite_numbers_pass():
    value = bodies.parse_json(b'{"maximum": 18446744073709551615, "big": ' + b"9" * 308 + b', "f": 1e308}')
    assert value["maximum"] == 2**64 - 1 and value["f"] == 1e308


def test_structure_bounds():
    limits = JsonLimits(max_elements=1000, max_depth=8)
    assert "more than 1000 elements" in rejected(b"[" + b"[]," * 2000 + b"[]]", limits)
    assert "nesting deeper than 8" in rejected(b"[" * 9 + b"]" * 9, limits)
    assert bodies.parse_json(b"[" * 8 + b"]" * 8, limits) == [[[[[[[[]]]]]]]]
    # Brackets, commas and colons inside strings are text, not structure.
    text = json.dumps({"prompt": "[{,:}]" * 5000, "code": "{" * 100})
    assert bodies.parse_json(text.encode(), limits)["prompt"].startswith("[{,:}]")
    unterminated = b'{"a": "' + b'\\"' * 3000  # the string scan stays linear without a closing quote
    assert "not valid JSON" in rejected(unterminated, limits)


def test_bounds_never_refuse_a_full_context_token_prompt():
    context = 32768
    limits = ServerConfig().json_limits(context)
    prompt = list(range(100, 100 + context))
    batch = {"prompt": [prompt] * 4, "max_tokens": 1}  # four full-context prompts in one body
    assert bodies.parse_json(json.dumps(batch).encode(), limits)["prompt"][3][-1] == 100 + context - 1
    tools = [
        {
            "type": "function",
            "function": {
                "name": f"t{i}",
                "parameters": {
                    "type": "object",
                    "properties": {
                        f"p{j}": {
                            "type": "array",
                            "items": {"type": "object", "properties": {"x": {"type": "string", "enum": ["a", "b"]}}},
                        }
                        for j in range(20)
                    },
                },
            },
        }
        for i in range(300)
    ]
    assert len(bodies.parse_json(json.dumps({"tools": tools}).encode(), limits)["tools"]) == 300


def test_parsing_memory_is_a_small_multiple_of_the_body():
    limit = 8 << 20
    config = ServerConfig(max_body_bytes=limit)
    limits = config.json_limits(32768)
    bomb = gzip.compress(b"[" + b"[]," * ((limit - 2) // 3 - 1) + b"[]]")  # ~2.8 M empty arrays in ~10 KiB
    assert len(bomb) < 64 << 10
    tracemalloc.start()
    try:
        with pytest.raises(ApiError) as info:
            bodies.decode_json(bomb, ["gzip"], limit, limits)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert info.value.status == 400 and "elements" in info.value.message
    assert peak < 4 * limit
    largest = json.dumps({"prompt": list(range(1000, 1000 + limits.max_elements - 8))}).encode()
    assert len(largest) < limit
    tracemalloc.start()
    try:
        assert len(bodies.parse_json(largest, limits)["prompt"]) == limits.max_elements - 8
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * limit


def test_gzip_members_are_bounded_and_each_costs_one_slice():
    member = gzip.compress(b"")
    many = member * (bodies.MAX_GZIP_MEMBERS + 1)
    with pytest.raises(ApiError) as info:
        bodies.decode(many, ["gzip"], 1 << 20)
    assert info.value.status == 400 and f"more than {bodies.MAX_GZIP_MEMBERS}" in info.value.message
    # Within the bound, members (including empty ones) concatenate as gzip defines.
    body = b"".join(gzip.compress(piece) for piece in (b'{"a"', b"", b": [1, 2", b"]}"))
    assert bodies.decode_json(body, ["gzip"], 1 << 20) == {"a": [1, 2]}
    # A large member after many small ones: the unused input zlib copies is one slice per member.
    calls = []
    real = zlib.decompressobj

    class Counting:
        def __init__(self, wbits):
            self._d = real(wbits)

        def decompress(self, data, max_length=0):
            calls.append(len(data))
            return self._d.decompress(data, max_length)

        def __getattr__(self, name):
            return getattr(self._d, name)

    big = gzip.compress(b"x" * (4 << 20), compresslevel=1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bodies.zlib, "decompressobj", Counting)
        out = bodies.decode(member * 60 + big, ["gzip"], 8 << 20)
    assert out == b"x" * (4 << 20)
    assert max(calls) <= 1 << 16  # input never handed over in more than one slice
    # Linear: each member may re-read at most one slice that its predecessor left unused.
    assert sum(calls) <= len(member * 60 + big) + 61 * (1 << 16)


def test_deflate_refuses_trailing_data():
    with pytest.raises(ApiError) as info:
        bodies.decode(zlib.compress(b"{}") + b"junk", ["deflate"], 1 << 20)
    assert info.value.status == 400


def test_error_renderer_survives_what_it_echoes():
    error = ApiError(400, "invalid_request_error", "unknown field '\ud800zz'")
    response = openai_error_response(error)
    body = json.loads(response.body.decode("utf-8"))
    assert body["error"]["message"] == "unknown field '\ufffdzz'"
    assert json.loads(dumps({"x": float("inf"), "y": [float("nan")]})) == {"x": None, "y": [None]}

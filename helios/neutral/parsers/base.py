"""Neutral parser items and the helpers every tool syntax shares.

A parser turns the generated text of one answer into ordered items:

- `Text`: answer text (or reasoning text, once the reasoning layer relabels it),
- `Reasoning`: readable reasoning text,
- `Call`: one complete tool call (a name and a JSON-object of arguments).

Every item carries the raw offset (characters from the start of the generated text, delimiters
included) where it begins, so tokens can be attributed to what they produced: Responses gives
logprob entries only to tokens whose first text byte is answer text, and usage counts the
tokens published as reasoning.

Tool syntaxes are streaming state machines over answer text (`ToolParser`). They buffer a
possible envelope until it is decided: text that turns out not to be a call is released as
text, a complete envelope becomes a `Call`. Envelopes are never published piecemeal.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

# api.md: tool arguments are JSON objects bounded to 8 MiB.
MAX_ARGUMENT_BYTES = 8 << 20
# An envelope (tags, names, arguments) may exceed its arguments by this much before it is refused.
ENVELOPE_SLACK = 64 << 10


class ToolParseError(Exception):
    """The model's output cannot be parsed: a malformed envelope, an empty name, invalid argument
    syntax, oversize arguments, or a recognized call left incomplete at natural completion.
    The response fails (HTTP 500 buffered, a terminal error event streamed)."""


@dataclass
class Text:
    text: str
    start: int  # raw offset of text[0]


@dataclass
class Reasoning:
    text: str
    start: int


@dataclass
class Call:
    name: str
    arguments: dict[str, Any]
    start: int  # raw offset of the envelope
    end: int  # raw offset just past the envelope


Item = Text | Reasoning | Call


@dataclass
class Chunk:
    """Generated text, contiguous in the raw stream from `start`."""

    text: str
    start: int


@dataclass
class Marker:
    """A single-token reasoning delimiter generated as that token (api.md: only the token opens
    or closes reasoning). `text` is what the token spells in the released text ("" when the
    tokenizer skips it as a special token)."""

    token_id: int
    text: str
    start: int


Piece = Chunk | Marker


# -- offset-tracked pending text ---------------------------------------------------------------


class Pending:
    """Undecided text plus the raw offset of each run it came from (runs need not touch)."""

    def __init__(self) -> None:
        self.text = ""
        self._runs: list[tuple[int, int]] = []  # (index in text, raw offset) per appended run

    def __len__(self) -> int:
        return len(self.text)

    def add(self, text: str, start: int) -> None:
        if not text:
            return
        if not self._runs or self.raw(len(self.text)) != start:
            self._runs.append((len(self.text), start))
        self.text += text

    def raw(self, index: int) -> int:
        """Raw offset of text[index] (index == len: just past the last run)."""
        base_index, base_raw = 0, 0
        for i, r in self._runs:
            if i > index:
                break
            base_index, base_raw = i, r
        return base_raw + index - base_index

    def take(self, n: int) -> list[Text]:
        """Remove and return the first n characters as Text items, one per raw run."""
        n = min(n, len(self.text))
        out: list[Text] = []
        if n <= 0:
            return out
        bounds = [i for i, _ in self._runs if 0 < i < n] + [n]
        lo = 0
        for hi in bounds:
            if hi > lo:
                out.append(Text(self.text[lo:hi], self.raw(lo)))
            lo = hi
        self.drop(n)
        return out

    def drop(self, n: int) -> None:
        n = min(n, len(self.text))
        if n <= 0:
            return
        start = self.raw(n)
        kept = [(i - n, r) for i, r in self._runs if i > n]
        self.text = self.text[n:]
        self._runs = [(0, start), *kept] if self.text else []

    def take_all(self) -> list[Text]:
        return self.take(len(self.text))


def partial_suffix(text: str, needles: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `needles`."""
    best = 0
    for needle in needles:
        for k in range(min(len(needle) - 1, len(text)), best, -1):
            if text.endswith(needle[:k]):
                best = k
                break
    return best


def find_first(text: str, needles: tuple[str, ...], start: int = 0) -> tuple[int, str] | None:
    best: tuple[int, str] | None = None
    for needle in needles:
        at = text.find(needle, start)
        if at >= 0 and (best is None or at < best[0]):
            best = (at, needle)
    return best


# -- JSON helpers ------------------------------------------------------------------------------

_JSON_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"?|[{}\[\]]')


def json_end(text: str, start: int) -> int | None:
    """Index just past the JSON object/array that begins at text[start] ('{' or '['), or None
    when it is not closed yet. Brackets inside strings are ignored; validity is checked later.
    Strings are skipped by the regex engine, so long arguments cost little per call."""
    depth = 0
    for match in _JSON_TOKENS.finditer(text, start):
        token = match.group()
        if token[0] == '"':
            if len(token) < 2 or not _closed_string(token):
                return None  # an unterminated string runs to the end of the text
            continue
        if token in "{[":
            depth += 1
        else:
            depth -= 1
            if depth == 0:
                return match.end()
    return None


def _closed_string(token: str) -> bool:
    """A matched string token ends with an unescaped quote."""
    backslashes = len(token) - 1 - len(token[:-1].rstrip("\\"))
    return token.endswith('"') and backslashes % 2 == 0


def loads_strict(text: str) -> Any:
    """json.loads without NaN/Infinity (not JSON)."""

    def refuse(constant: str) -> Any:
        raise ValueError(f"{constant} is not valid JSON")

    return json.loads(text, parse_constant=refuse)


def check_arguments_size(arguments: dict[str, Any] | str) -> None:
    size = (
        len(arguments.encode("utf-8"))
        if isinstance(arguments, str)
        else len(json.dumps(arguments, ensure_ascii=False).encode("utf-8"))
    )
    if size > MAX_ARGUMENT_BYTES:
        raise ToolParseError(f"tool call arguments exceed {MAX_ARGUMENT_BYTES >> 20} MiB")


def check_envelope_size(text: str) -> None:
    """An unfinished envelope that already exceeds the argument bound can never be published."""
    if (
        len(text) > MAX_ARGUMENT_BYTES + ENVELOPE_SLACK
        and len(text.encode("utf-8")) > MAX_ARGUMENT_BYTES + ENVELOPE_SLACK
    ):
        raise ToolParseError(f"tool call arguments exceed {MAX_ARGUMENT_BYTES >> 20} MiB")


def make_call(name: Any, arguments: Any, start: int, end: int) -> Call:
    """Validate a decoded call: a nonempty string name and a JSON object of arguments (a JSON
    string holding an object is accepted, as OpenAI-style models sometimes write)."""
    if not isinstance(name, str) or not name.strip():
        raise ToolParseError("a tool call has an empty or non-string name")
    if arguments is None:
        arguments = {}
    if isinstance(arguments, str):
        try:
            arguments = loads_strict(arguments) if arguments.strip() else {}
        except ValueError:
            raise ToolParseError(f"the arguments of tool call {name!r} are not a JSON object") from None
    if not isinstance(arguments, dict):
        raise ToolParseError(f"the arguments of tool call {name!r} are not a JSON object")
    check_arguments_size(arguments)
    return Call(name.strip(), arguments, start, end)


# -- schema-guided conversion ------------------------------------------------------------------


def _types(schema: dict[str, Any] | None) -> list[str]:
    if not isinstance(schema, dict):
        return []
    kind = schema.get("type")
    if isinstance(kind, str):
        return [kind]
    if isinstance(kind, list):
        return [k for k in kind if isinstance(k, str)]
    out: list[str] = []
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or []:
            out.extend(_types(sub))
    if "enum" in schema and not out:
        out = sorted({_json_type(v) for v in schema["enum"]})
    if "const" in schema and not out:
        out = [_json_type(schema["const"])]
    return out


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def convert_value(raw: str, schema: dict[str, Any] | None) -> Any:
    """Best-effort typing of a textual parameter value by its declared schema. Without a schema
    (an undeclared tool or parameter) the value stays a string; a value that does not convert
    also stays a string (non-strict schemas do not reject invalid values)."""
    types = _types(schema)
    if not types or "string" in types:
        if "string" in types and len(types) > 1:
            # e.g. ["string", "null"]: a bare null means null, anything else is the string.
            if "null" in types and raw.strip() == "null":
                return None
        return raw
    text = raw.strip()
    for kind in types:
        if kind == "integer":
            try:
                return int(text)
            except ValueError:
                try:
                    number = float(text)
                    if number.is_integer():
                        return int(number)
                except ValueError:
                    pass
        elif kind == "number":
            try:
                number = float(text)
                if math.isfinite(number):
                    return int(text) if text.lstrip("-").isdigit() else number
            except ValueError:
                pass
        elif kind == "boolean":
            if text.lower() in ("true", "false"):
                return text.lower() == "true"
        elif kind == "null":
            if text.lower() in ("null", "none"):
                return None
        elif kind in ("object", "array"):
            try:
                value = loads_strict(text)
            except ValueError:
                continue
            if _json_type(value) == kind:
                return value
    return raw


def property_schema(schema: dict[str, Any] | None, name: str) -> dict[str, Any] | None:
    if not isinstance(schema, dict):
        return None
    props = schema.get("properties")
    if isinstance(props, dict) and isinstance(props.get(name), dict):
        return props[name]
    return None


@dataclass
class ToolSchemas:
    """Declared parameter schemas by model-facing tool name (unknown tools have none)."""

    by_name: dict[str, dict[str, Any]] = field(default_factory=dict)

    def parameter(self, tool: str, parameter: str) -> dict[str, Any] | None:
        return property_schema(self.by_name.get(tool), parameter)


class ToolParser:
    """A tool-call syntax: a streaming state machine over generated text.

    `feed` receives text contiguous with everything fed before (runs may skip delimiter
    text), `flush` marks a boundary no envelope may cross (a reasoning close delimiter), and
    `finish` ends the output: a natural end raises ToolParseError for a recognized envelope
    that is incomplete; a truncated end (the output limit) omits it.

    `answer` is False while the text is reasoning (only tagged envelopes count there) and True
    in answer content; `verbatim` (a structured-output grammar is active) stops scanning once
    ordinary answer content has begun.
    """

    def __init__(self, schemas: ToolSchemas | None = None):
        self.schemas = schemas or ToolSchemas()
        self.answer = True
        self.verbatim = False

    def begin_answer(self) -> None:
        self.answer = True

    @property
    def in_envelope(self) -> bool:
        """Inside a call region that owns all later text, reasoning delimiters included (only
        DeepSeek's syntax opens one)."""
        return False

    def feed(self, text: str, start: int) -> list[Item]:
        raise NotImplementedError

    def flush(self) -> list[Item]:
        raise NotImplementedError

    def finish(self, truncated: bool) -> list[Item]:
        raise NotImplementedError

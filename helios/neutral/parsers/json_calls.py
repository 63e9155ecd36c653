"""JSON tool-call syntaxes.

hermes (Qwen2.5 / Qwen3 instruct templates)::

    <tool_call>
    {"name": "lookup", "arguments": {"query": "alpha"}}
    </tool_call>

The call is complete when its JSON object closes; the closing tag is swallowed when present (a
model that ends right after the object still made a complete call). `<tool_call>` followed by
anything but a JSON object (or a ```json fence) is ordinary text.

qwen25_coder_json (Qwen2.5-Coder, see shared/models.md): the hermes form, plus a whole answer
that is one or more call objects, bare or in ```json fences, or a JSON array of them. A call
object may also be spelled as OpenAI's tool-call object or `{"function": NAME, "arguments": ...}`
(both written by the model in agent sessions). Such an
answer is only known to be calls when it ends, so it is held until then; an answer that turns
out to be anything else (a structured JSON answer, prose) is released unchanged as text.

llama3_json (Llama 3.1 / 3.2 / 3.3 instruct templates): the model answers a tool call with the
bare object its template asks for, `{"name": NAME, "parameters": {...}}`, which the
qwen25_coder_json reading already takes (`parameters` for `arguments`, several objects in a row);
the syntax is the same parser under the name the Llama recipes declare.

Both accept a call object in doubled braces, `{{"name": ..., "arguments": {...}}}`: the Qwen2.5
chat template's tool instructions literally show `{{"name": <function-name>, "arguments":
<args-json-object>}}`, and the models copy it (docs/conformance.md). That spelling is not JSON,
so no JSON answer is ever taken for it.
"""

from __future__ import annotations

import re
from typing import Any

from helios.neutral.parsers.base import (
    Item,
    Pending,
    ToolParseError,
    ToolSchemas,
    check_envelope_size,
    json_end,
    loads_strict,
    make_call,
)
from helios.neutral.parsers.tagged import MORE, Complete, Decision, NotACall, TaggedParser

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
CALL_KEYS = frozenset({"name", "arguments", "parameters", "id", "type"})
_FENCE_OPEN = re.compile(r"```[A-Za-z]*[ \t]*\n?")


def loads_call_value(text: str) -> Any:
    """A JSON value, or the inner object of the template's doubled-brace call spelling
    `{{...}}` (see the module docstring). Raises ValueError for anything else."""
    try:
        return loads_strict(text)
    except ValueError:
        if not (text.startswith("{") and text.endswith("}")):
            raise
        inner = text[1:-1].strip()
        if not (inner.startswith("{") and inner.endswith("}")) or json_end(inner, 0) != len(inner):
            raise
        value = loads_strict(inner)
        if not isinstance(value, dict) or "name" not in value:
            raise
        return value


def _plain_call(item: Any) -> Any:
    """Two more spellings of one call that Qwen2.5-Coder writes in agent sessions (Claude Code's
    Edit, recorded with the 1.5B: docs/conformance.md), as {"name", "arguments"}: the OpenAI
    tool-call object `{"type": "function", "function": {"name": ..., "arguments": ...}}` and
    `{"function": NAME, "arguments": {...}}`. Anything else is returned unchanged."""
    if not isinstance(item, dict) or "name" in item:
        return item
    function = item.get("function")
    if (
        isinstance(function, dict)
        and set(item) <= {"function", "type", "id"}
        and item.get("type", "function") == "function"
    ):
        return function
    if isinstance(function, str) and set(item) <= (CALL_KEYS | {"function"}) - {"name"}:
        return {"name": function, **{k: v for k, v in item.items() if k != "function"}}
    return item


def call_objects(value: Any, bare: bool = False) -> list[tuple[str, Any]] | None:
    """(name, arguments) pairs when `value` is a call object or a nonempty array of them. A bare
    object (no <tool_call> around it) must spell its arguments to count as a call."""
    items = value if isinstance(value, list) else [value]
    if not items:
        return None
    out = []
    for item in map(_plain_call, items):
        if not isinstance(item, dict) or "name" not in item or not set(item) <= CALL_KEYS:
            return None
        if bare and "arguments" not in item and "parameters" not in item:
            return None
        if "arguments" in item and "parameters" in item:
            return None
        out.append((item["name"], item.get("arguments", item.get("parameters", {}))))
    return out


class HermesParser(TaggedParser):
    openers = (OPEN,)
    trailing_closers = (CLOSE,)

    def decide(self, buf: str, final: bool) -> Decision:
        i = _skip_space(buf, len(OPEN))
        if i == len(buf):
            return MORE
        fenced = buf[i] == "`"
        if fenced:
            rest = buf[i:]
            if not rest.startswith("```"):
                return MORE if "```".startswith(rest) else NotACall(len(OPEN))
            fence = _FENCE_OPEN.match(buf, i)
            if fence is None or fence.end() == len(buf):
                return MORE
            i = _skip_space(buf, fence.end())
            if i == len(buf):
                return MORE
        if buf[i] not in "{[":
            return NotACall(len(OPEN))
        end = json_end(buf, i)
        if end is None:
            return MORE
        try:
            value = loads_call_value(buf[i:end])
        except ValueError as exc:
            raise ToolParseError(f"the model's <tool_call> holds invalid JSON: {exc}") from None
        pairs = call_objects(value)
        if pairs is None:
            raise ToolParseError('a <tool_call> must hold a JSON object with "name" and "arguments"')
        if fenced:  # the closing fence belongs to the envelope
            j = _skip_space(buf, end)
            if buf.startswith("```", j):
                end = j + 3
            elif not final and "```".startswith(buf[j:]):
                return MORE
        return Complete(pairs, end)


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


class Qwen25CoderJsonParser(HermesParser):
    """hermes, plus whole answers made of bare or fenced call objects."""

    def __init__(self, schemas: ToolSchemas | None = None):
        super().__init__(schemas)
        self._whole: Pending | None = None  # the held answer while it may be calls
        self._whole_open = False  # whole-answer detection applies to the answer still

    def begin_answer(self) -> None:
        super().begin_answer()
        self._whole_open = True
        self._whole = Pending()
        self._whole_scan = _WholeScan()

    def feed(self, text: str, start: int) -> list[Item]:
        if self.answer and self._whole is None and not self._whole_open:
            self.begin_answer()
        if self._whole is None:
            return super().feed(text, start)
        self._whole.add(text, start)
        check_envelope_size(self._whole.text)
        if self._whole_scan.advance(self._whole.text) is None:
            return []  # still possibly a whole-answer call list
        return self._give_up()

    def _give_up(self) -> list[Item]:
        """The answer is not (only) calls: scan what was held as ordinary hermes text."""
        held, self._whole = self._whole, None
        out: list[Item] = []
        for run in held.take_all():
            out += super().feed(run.text, run.start)
        return out

    def flush(self) -> list[Item]:
        if self._whole is not None:
            out = self._give_up()
            return out + super().flush()
        return super().flush()

    def finish(self, truncated: bool) -> list[Item]:
        if self._whole is None:
            return super().finish(truncated)
        held = self._whole
        text = held.text
        if not text.strip():
            self._whole = None
            return held.take_all() + super().finish(truncated)
        pairs = _whole_calls(text)
        if pairs is not None:
            self._whole = None
            start, end = held.raw(0), held.raw(len(text))
            return [make_call(name, arguments, start, end) for name, arguments in pairs]
        if _looks_like_call(text):
            if truncated:
                # Complete calls before the cut are kept; the truncated envelope is omitted.
                self._whole = None
                values, end = _leading_values(text)
                pairs = [p for v in values for p in (call_objects(v, bare=True) or [])]
                return [make_call(name, arguments, held.raw(0), held.raw(end)) for name, arguments in pairs]
            if not _complete_json_sequence(text):
                raise ToolParseError("the model left a tool call incomplete")
        out = self._give_up()
        return out + super().finish(truncated)


# Doubled braces are not a call start: only a complete, balanced `{{...}}` call is taken for one
# (the 1.5B also writes `{{"name": ..., "arguments": {...}}` with one closing brace short).
_CALL_START = re.compile(r'\s*(?:```[A-Za-z]*\s*)?\[?\s*\{\s*"(?:name|function|type)"\s*:')


def _looks_like_call(text: str) -> bool:
    return _CALL_START.match(text) is not None


class _WholeScan:
    """Incremental check that an answer can still be a sequence of call objects (whitespace,
    ```fences and JSON objects/arrays). Each character is looked at once, however the text
    arrives, so long structured answers stay linear."""

    def __init__(self) -> None:
        self.pos = 0  # next character to look at
        self.value_start = -1  # start of the JSON value being scanned, -1 between values
        self.depth = 0
        self.in_string = self.escape = False

    def advance(self, text: str) -> bool | None:
        """None while `text` may still be calls, False once it cannot."""
        n = len(text)
        while self.pos < n:
            if self.value_start >= 0:
                if not self._scan_value(text):
                    return None
                try:
                    if call_objects(loads_call_value(text[self.value_start : self.pos]), bare=True) is None:
                        return False
                except ValueError:
                    return False
                self.value_start = -1
                continue
            ch = text[self.pos]
            if ch.isspace():
                self.pos += 1
            elif ch == "`":
                rest = text[self.pos :]
                if not rest.startswith("```"):
                    return None if "```".startswith(rest) else False
                fence = _FENCE_OPEN.match(text, self.pos)
                if fence.end() == n:
                    return None if n - self.pos < 16 else False
                self.pos = fence.end()
            elif ch in "{[":
                self.value_start = self.pos
                self.depth = 0
                self.in_string = self.escape = False
            else:
                return False
        return None

    def _scan_value(self, text: str) -> bool:
        """Advance through the current value; True when it closed."""
        for i in range(self.pos, len(text)):
            ch = text[i]
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.pos = i + 1
                    return True
        self.pos = len(text)
        return False


def _leading_values(text: str) -> tuple[list[Any], int]:
    """The complete JSON values at the start of a whitespace/fence-separated sequence, and where
    they end (len(text) when the whole text is such a sequence)."""
    values: list[Any] = []
    i, n = 0, len(text)
    done = 0
    while True:
        while i < n and text[i].isspace():
            i += 1
        if i == n:
            return values, n
        if text.startswith("```", i):
            fence = _FENCE_OPEN.match(text, i)
            i = fence.end() if fence else i + 3
            continue
        if text[i] not in "{[":
            return values, done
        end = json_end(text, i)
        if end is None:
            return values, done
        try:
            values.append(loads_call_value(text[i:end]))
        except ValueError:
            return values, done
        i = done = end


def _split_values(text: str) -> list[Any] | None:
    """The JSON values of a whitespace/fence-separated sequence, or None if it is not one."""
    values, end = _leading_values(text)
    return values if end == len(text) else None


def _whole_calls(text: str) -> list[tuple[str, Any]] | None:
    values = _split_values(text)
    if not values:
        return None
    pairs: list[tuple[str, Any]] = []
    for value in values:
        found = call_objects(value, bare=True)
        if found is None:
            return None
        pairs.extend(found)
    for name, arguments in pairs:
        if not isinstance(name, str) or not (isinstance(arguments, dict) or isinstance(arguments, str)):
            return None
    return pairs


def _complete_json_sequence(text: str) -> bool:
    return _split_values(text) is not None


class KimiK2Parser(TaggedParser):
    """kimi_k2 (Kimi K2 / K2.5 / K3 templates): special-token sections of JSON-argument calls::

        <|tool_calls_section_begin|><|tool_call_begin|>functions.lookup:0<|tool_call_argument_begin|>
        {"query": "alpha"}<|tool_call_end|><|tool_calls_section_end|>

    The section opener is a control token, so it always starts calls. Call ids have the form
    `functions.NAME:INDEX` (a bare `NAME:INDEX` is accepted too); the section end completes the
    envelope."""

    SECTION_OPEN, SECTION_CLOSE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
    CALL_OPEN, ARGS, CALL_CLOSE = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
    openers = (SECTION_OPEN,)

    def decide(self, buf: str, final: bool) -> Decision:
        pos = len(self.SECTION_OPEN)
        calls: list[tuple[str, dict]] = []
        while True:
            pos = _skip_space(buf, pos)
            rest = buf[pos:]
            if rest.startswith(self.SECTION_CLOSE):
                return Complete(calls, pos + len(self.SECTION_CLOSE))
            if not rest.startswith(self.CALL_OPEN):
                if not rest or self.SECTION_CLOSE.startswith(rest) or self.CALL_OPEN.startswith(rest):
                    return MORE
                raise ToolParseError("a Kimi tool-call section holds text outside <|tool_call_begin|> entries")
            head = pos + len(self.CALL_OPEN)
            args_at = buf.find(self.ARGS, head)
            if args_at < 0:
                return MORE
            call_id = buf[head:args_at].strip()
            name = call_id.removeprefix("functions.").rsplit(":", 1)[0].strip()
            end_at = buf.find(self.CALL_CLOSE, args_at)
            if end_at < 0:
                return MORE
            try:
                arguments = loads_strict(buf[args_at + len(self.ARGS) : end_at].strip())
            except ValueError as exc:
                raise ToolParseError(f"a Kimi tool call holds invalid JSON arguments: {exc}") from None
            if not name or not isinstance(arguments, dict):
                raise ToolParseError("a Kimi tool call needs a function name and a JSON object of arguments")
            calls.append((name, arguments))
            pos = end_at + len(self.CALL_CLOSE)


class MistralParser(TaggedParser):
    """mistral (Mistral 7B v0.3, Ministral, Mistral Small/Nemo templates): calls after the
    `[TOOL_CALLS]` control token, with no closing tag (the turn ends with the calls)::

        [TOOL_CALLS] [{"name": "lookup", "arguments": {"query": "alpha"}}]      (v3 tokenizers)
        [TOOL_CALLS]lookup[ARGS]{"query": "alpha"}                            (v11 and later)

    A JSON array (or one object) of calls completes when it closes; the named form when its
    arguments object does, and each further call has its own [TOOL_CALLS]."""

    OPEN, ARGS = "[TOOL_CALLS]", "[ARGS]"
    openers = (OPEN,)

    def decide(self, buf: str, final: bool) -> Decision:
        i = _skip_space(buf, len(self.OPEN))
        if i == len(buf):
            return MORE
        if buf[i] in "[{":
            end = json_end(buf, i)
            if end is None:
                return MORE
            try:
                pairs = call_objects(loads_strict(buf[i:end]))
            except ValueError as exc:
                raise ToolParseError(f"the model's [TOOL_CALLS] holds invalid JSON: {exc}") from None
            if pairs is None:
                raise ToolParseError('[TOOL_CALLS] must hold call objects with "name" and "arguments"')
            return Complete(pairs, end)
        args_at = buf.find(self.ARGS, i)
        if args_at < 0:
            return MORE
        name, j = buf[i:args_at].strip(), _skip_space(buf, args_at + len(self.ARGS))
        if j == len(buf):
            return MORE
        if buf[j] != "{":
            raise ToolParseError(f"[TOOL_CALLS]{name}[ARGS] must be followed by a JSON object")
        end = json_end(buf, j)
        if end is None:
            return MORE
        try:
            arguments = loads_strict(buf[j:end])
        except ValueError as exc:
            raise ToolParseError(f"the model's [ARGS] holds invalid JSON: {exc}") from None
        return Complete([(name, arguments)], end)

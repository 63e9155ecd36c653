"""Tag-structured tool syntaxes whose parameter values are text.

qwen3_xml (Qwen function tags, Qwen3-Coder / Qwen3.5 templates)::

    <tool_call>
    <function=lookup>
    <parameter=query>
    alpha
    </parameter>
    </function>
    </tool_call>

A `<tool_call>` or `<function=` tag starts a call only when followed by a `<function=NAME>`
header and then a `<parameter=` or `</function>` tag (api.md); other mentions are text. The call
completes at `</function>`, so the outer tags may be omitted. A missing `</parameter>` is closed
by the next parameter or function boundary. One leading and one trailing wrapping newline are
removed from each value; declared schemas guide best-effort type conversion.

glm45 (GLM-4.5 and later)::

    <tool_call>lookup
    <arg_key>query</arg_key>
    <arg_value>alpha</arg_value>
    </tool_call>

`<tool_call>` starts a call only when followed by a function name and an `<arg_key>` or
`</tool_call>` tag.

mimo (MiMo-V2): the same tags as qwen3_xml, but parameter values are kept verbatim (no
newline unwrapping): `<parameter=code>    x = 1\n</parameter>` is "    x = 1\n".

minimax (MiniMax-M2 family): the namespace-prefixed opener always starts a call::

    <minimax:tool_call>
    <invoke name="lookup">
    <parameter name="query">alpha</parameter>
    </invoke>
    </minimax:tool_call>
"""

from __future__ import annotations

import re

from helios.neutral.parsers.base import ToolParseError, convert_value, partial_suffix
from helios.neutral.parsers.tagged import MORE, Complete, Decision, NotACall, TaggedParser

MAX_NAME = 256


def _is_partial(rest: str, tags: tuple[str, ...]) -> bool:
    """`rest` is a proper prefix of one of `tags` (so the next text decides)."""
    return any(t.startswith(rest) and t != rest for t in tags)


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def _unwrap(value: str) -> str:
    """Qwen: one leading and one trailing wrapping newline belong to the tags."""
    if value.startswith("\r\n"):
        value = value[2:]
    elif value.startswith("\n"):
        value = value[1:]
    if value.endswith("\r\n"):
        value = value[:-2]
    elif value.endswith("\n"):
        value = value[:-1]
    return value


class QwenFunctionTagParser(TaggedParser):
    TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
    FUNC_OPEN, FUNC_CLOSE = "<function=", "</function>"
    PARAM_OPEN, PARAM_CLOSE = "<parameter=", "</parameter>"
    openers = (TOOL_OPEN, FUNC_OPEN)
    trailing_closers = (TOOL_CLOSE,)
    unwrap_values = True  # Qwen: one wrapping newline on each side belongs to the tags

    def decide(self, buf: str, final: bool) -> Decision:
        tool = buf.startswith(self.TOOL_OPEN)
        not_a_call = NotACall(len(self.TOOL_OPEN) if tool else len(self.FUNC_OPEN))
        i = 0
        if tool:
            i = _skip_space(buf, len(self.TOOL_OPEN))
            rest = buf[i:]
            if not rest.startswith(self.FUNC_OPEN):
                return MORE if not rest or _is_partial(rest, (self.FUNC_OPEN,)) else not_a_call
        # The header: <function=NAME>
        name_start = i + len(self.FUNC_OPEN)
        gt = buf.find(">", name_start)
        if gt < 0:
            partial = buf[name_start:]
            if "<" in partial or "\n" in partial or len(partial) > MAX_NAME:
                return not_a_call
            return MORE
        name = buf[name_start:gt]
        if not name.strip() or "<" in name or "\n" in name:
            return not_a_call
        j = _skip_space(buf, gt + 1)
        rest = buf[j:]
        if not (rest.startswith(self.PARAM_OPEN) or rest.startswith(self.FUNC_CLOSE)):
            return MORE if not rest or _is_partial(rest, (self.PARAM_OPEN, self.FUNC_CLOSE)) else not_a_call
        # A recognized call: read parameters up to </function>.
        arguments: dict[str, object] = {}
        pos = gt + 1
        while True:
            pos = _skip_space(buf, pos)
            if buf.startswith(self.FUNC_CLOSE, pos):
                return Complete([(name.strip(), arguments)], pos + len(self.FUNC_CLOSE))
            if buf.startswith(self.PARAM_OPEN, pos):
                key_start = pos + len(self.PARAM_OPEN)
                key_end = buf.find(">", key_start)
                if key_end < 0:
                    return MORE
                key = buf[key_start:key_end].strip()
                if not key:
                    raise ToolParseError(f"tool call {name.strip()!r} has a parameter without a name")
                value_start = key_end + 1
                boundary = _first(buf, (self.PARAM_CLOSE, self.PARAM_OPEN, self.FUNC_CLOSE), value_start)
                if boundary is None:
                    return MORE
                at, tag = boundary
                raw = buf[value_start:at]
                raw = _unwrap(raw) if self.unwrap_values else raw
                arguments[key] = convert_value(raw, self.schemas.parameter(name.strip(), key))
                pos = at + len(tag) if tag == self.PARAM_CLOSE else at
                continue
            # Stray text between parameters: skip to the next tag.
            nxt = _first(buf, (self.PARAM_OPEN, self.FUNC_CLOSE), pos)
            if nxt is None:
                return MORE
            pos = nxt[0]


class MiMoFunctionTagParser(QwenFunctionTagParser):
    """MiMo-V2 (mimo): Qwen's function tags written compactly; values are kept verbatim,
    indentation and newlines included (api.md)."""

    unwrap_values = False


def _first(text: str, tags: tuple[str, ...], start: int) -> tuple[int, str] | None:
    best = None
    for tag in tags:
        at = text.find(tag, start)
        if at >= 0 and (best is None or at < best[0]):
            best = (at, tag)
    return best


class GlmParser(TaggedParser):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    KEY_OPEN, KEY_CLOSE = "<arg_key>", "</arg_key>"
    VALUE_OPEN, VALUE_CLOSE = "<arg_value>", "</arg_value>"
    openers = (OPEN,)

    def decide(self, buf: str, final: bool) -> Decision:
        lt = buf.find("<", len(self.OPEN))
        if lt < 0:
            head = buf[len(self.OPEN) :].lstrip()
            # A name is one line and short; anything more is prose that mentions the tag.
            newline = head.find("\n")
            if (newline >= 0 and head[newline:].strip()) or len(head) > MAX_NAME:
                return NotACall(len(self.OPEN))
            return MORE
        name = buf[len(self.OPEN) : lt].strip()
        if not name or "\n" in name:
            return NotACall(len(self.OPEN))
        rest = buf[lt:]
        if not (rest.startswith(self.KEY_OPEN) or rest.startswith(self.CLOSE)):
            return MORE if _is_partial(rest, (self.KEY_OPEN, self.CLOSE)) else NotACall(len(self.OPEN))
        arguments: dict[str, object] = {}
        pos = lt
        while True:
            pos = _skip_space(buf, pos)
            if buf.startswith(self.CLOSE, pos):
                return Complete([(name, arguments)], pos + len(self.CLOSE))
            if pos >= len(buf) or _is_partial(buf[pos:], (self.CLOSE, self.KEY_OPEN)):
                return MORE
            if not buf.startswith(self.KEY_OPEN, pos):
                raise ToolParseError(f"tool call {name!r} has text where <arg_key> was expected")
            key_end = buf.find(self.KEY_CLOSE, pos)
            if key_end < 0:
                return MORE
            key = buf[pos + len(self.KEY_OPEN) : key_end].strip()
            if not key:
                raise ToolParseError(f"tool call {name!r} has an empty <arg_key>")
            pos = _skip_space(buf, key_end + len(self.KEY_CLOSE))
            if pos >= len(buf) or _is_partial(buf[pos:], (self.VALUE_OPEN,)):
                return MORE
            if not buf.startswith(self.VALUE_OPEN, pos):
                raise ToolParseError(f"tool call {name!r} has no <arg_value> for {key!r}")
            value_end = buf.find(self.VALUE_CLOSE, pos)
            if value_end < 0:
                return MORE
            raw = buf[pos + len(self.VALUE_OPEN) : value_end]
            arguments[key] = convert_value(raw, self.schemas.parameter(name, key))
            pos = value_end + len(self.VALUE_CLOSE)


_INVOKE = re.compile(r'<invoke\s+name\s*=\s*"([^"]*)"\s*>')
_PARAMETER = re.compile(r'<parameter\s+name\s*=\s*"([^"]*)"\s*>')


class MiniMaxParser(TaggedParser):
    OPEN, CLOSE = "<minimax:tool_call>", "</minimax:tool_call>"
    openers = (OPEN,)

    def decide(self, buf: str, final: bool) -> Decision:
        end = buf.find(self.CLOSE)
        if end < 0:
            return MORE
        body = buf[len(self.OPEN) : end]
        calls = []
        pos = 0
        while True:
            invoke = _INVOKE.search(body, pos)
            if invoke is None:
                if body[pos:].strip():
                    raise ToolParseError("a <minimax:tool_call> block holds text outside <invoke> elements")
                break
            if body[pos : invoke.start()].strip():
                raise ToolParseError("a <minimax:tool_call> block holds text outside <invoke> elements")
            close = body.find("</invoke>", invoke.end())
            if close < 0:
                raise ToolParseError("an <invoke> element is not closed")
            name = invoke.group(1).strip()
            inner = body[invoke.end() : close]
            arguments: dict[str, object] = {}
            ppos = 0
            while (param := _PARAMETER.search(inner, ppos)) is not None:
                value_end = inner.find("</parameter>", param.end())
                if value_end < 0:
                    raise ToolParseError(f"a parameter of tool call {name!r} is not closed")
                key = param.group(1).strip()
                if not key:
                    raise ToolParseError(f"tool call {name!r} has a parameter without a name")
                raw = _unwrap(inner[param.end() : value_end])
                arguments[key] = convert_value(raw, self.schemas.parameter(name, key))
                ppos = value_end + len("</parameter>")
            calls.append((name, arguments))
            pos = close + len("</invoke>")
        if not calls:
            raise ToolParseError("a <minimax:tool_call> block holds no <invoke> element")
        return Complete(calls, end + len(self.CLOSE))


__all__ = ["QwenFunctionTagParser", "GlmParser", "MiniMaxParser", "partial_suffix"]

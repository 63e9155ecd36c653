"""Gemma 4 tool calls: the `<|tool_call>` opener always starts a call::

    <|tool_call>call:lookup{query:<|"|>alpha<|"|>,limit:3}<tool_call|>

Keys are bare, strings are delimited by `<|"|>`, other scalars are bare JSON-like literals, and
objects/arrays nest with braces and brackets. Several calls are concatenated without separators.
"""

from __future__ import annotations

from typing import Any

from helios.neutral.parsers.base import ToolParseError, loads_strict
from helios.neutral.parsers.tagged import MORE, Complete, Decision, TaggedParser

OPEN, CLOSE, QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'


class Gemma4Parser(TaggedParser):
    openers = (OPEN,)

    def decide(self, buf: str, final: bool) -> Decision:
        end = buf.find(CLOSE, len(OPEN))
        if end < 0:
            return MORE
        body = buf[len(OPEN) : end].strip()
        if not body.startswith("call:"):
            raise ToolParseError("a Gemma tool call must start with call:NAME")
        brace = body.find("{")
        name = (body[5:brace] if brace >= 0 else body[5:]).strip()
        if brace < 0:
            arguments: dict[str, Any] = {}
        else:
            reader = _Reader(body, brace)
            value = reader.value()
            if body[reader.pos :].strip():
                raise ToolParseError(f"tool call {name!r} has text after its arguments")
            if not isinstance(value, dict):
                raise ToolParseError(f"the arguments of tool call {name!r} are not an object")
            arguments = value
        return Complete([(name, arguments)], end + len(CLOSE))


class _Reader:
    def __init__(self, text: str, pos: int):
        self.text, self.pos = text, pos

    def _space(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos].isspace():
            self.pos += 1

    def value(self) -> Any:
        self._space()
        t = self.text
        if t.startswith(QUOTE, self.pos):
            end = t.find(QUOTE, self.pos + len(QUOTE))
            if end < 0:
                raise ToolParseError("an unterminated string in Gemma tool arguments")
            value = t[self.pos + len(QUOTE) : end]
            self.pos = end + len(QUOTE)
            return value
        if self.pos >= len(t):
            raise ToolParseError("Gemma tool arguments end early")
        if t[self.pos] == "{":
            return self._object()
        if t[self.pos] == "[":
            return self._array()
        start = self.pos
        while self.pos < len(t) and t[self.pos] not in ",}]":
            self.pos += 1
        raw = t[start : self.pos].strip()
        try:
            return loads_strict(raw)
        except ValueError:
            return raw  # a bare word: keep it as text

    def _object(self) -> dict[str, Any]:
        self.pos += 1
        out: dict[str, Any] = {}
        while True:
            self._space()
            if self.text.startswith("}", self.pos):
                self.pos += 1
                return out
            if self.text.startswith(QUOTE, self.pos):
                key = self.value()
            else:
                colon = self.text.find(":", self.pos)
                if colon < 0:
                    raise ToolParseError("a Gemma tool argument has no value")
                key = self.text[self.pos : colon].strip()
                self.pos = colon
            self._space()
            if not self.text.startswith(":", self.pos) or not key:
                raise ToolParseError("malformed Gemma tool arguments")
            self.pos += 1
            out[key] = self.value()
            self._space()
            if self.text.startswith(",", self.pos):
                self.pos += 1
            elif not self.text.startswith("}", self.pos):
                raise ToolParseError("malformed Gemma tool arguments")

    def _array(self) -> list[Any]:
        self.pos += 1
        out: list[Any] = []
        while True:
            self._space()
            if self.text.startswith("]", self.pos):
                self.pos += 1
                return out
            out.append(self.value())
            self._space()
            if self.text.startswith(",", self.pos):
                self.pos += 1
            elif not self.text.startswith("]", self.pos):
                raise ToolParseError("malformed Gemma tool arguments")

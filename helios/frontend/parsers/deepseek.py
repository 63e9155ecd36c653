"""DeepSeek markup tool calls (DSML, and the XTML spelling of the same structure)::

    <｜DSML｜function_calls>
    <｜DSML｜invoke name="lookup">
    <｜DSML｜parameter name="query" string="true">alpha</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜function_calls>

The outer opener always starts a call block. Each call is published when its invoke closes;
names must be nonempty and argument names nonempty and unique. string="true" values are text,
other values are JSON. Closing the outer block ends parsed output: later text is discarded.

api.md pins DeepSeek's official deepseek-recipe state machine for these syntaxes; it is not
available to this runtime, so this is a faithful reimplementation of the documented markup
(both the fullwidth ｜ and an ASCII | bar are accepted, as the models write either).
"""

from __future__ import annotations

import re

from helios.frontend.parsers.base import ToolParseError, loads_strict
from helios.frontend.parsers.tagged import MORE, Complete, Decision, TaggedParser, ToolSchemas


BARS = ("\uff5c", "|")  # the fullwidth bar DeepSeek's encoder writes first; ASCII accepted too


class DeepSeekMarkupParser(TaggedParser):
    @staticmethod
    def block_tags(word: str) -> tuple[str, str]:
        """The function_calls block's opening and closing tags as the encoder writes them."""
        return f"<{BARS[0]}{word}{BARS[0]}function_calls>", f"</{BARS[0]}{word}{BARS[0]}function_calls>"

    def __init__(self, word: str, schemas: ToolSchemas | None = None):
        super().__init__(schemas)
        self.word = word
        bars = BARS
        self._block_open = tuple(f"<{b}{word}{b}function_calls>" for b in bars)
        self._block_close = tuple(f"</{b}{word}{b}function_calls>" for b in bars)
        self._invoke_open = tuple(f"<{b}{word}{b}invoke" for b in bars)
        bar = "[\uff5c|]"
        self._invoke = re.compile(rf'<{bar}{word}{bar}invoke\s+name\s*=\s*"([^"]*)"\s*>')
        self._invoke_close = re.compile(rf"</{bar}{word}{bar}invoke>")
        self._parameter = re.compile(
            rf'<{bar}{word}{bar}parameter\s+name\s*=\s*"([^"]*)"(?:\s+string\s*=\s*"(true|false)")?\s*>')
        self._parameter_close = re.compile(rf"</{bar}{word}{bar}parameter>")
        self._inside = False
        self.openers = self._block_open

    def decide(self, buf: str, final: bool) -> Decision:
        if buf.startswith(self._block_open):
            opener = next(o for o in self._block_open if buf.startswith(o))
            self._inside = True
            self.openers = (*self._invoke_open, *self._block_close)
            return Complete([], len(opener))
        if buf.startswith(self._block_close):
            return Complete([], len(buf), stop=True)
        header = self._invoke.match(buf)
        if header is None:
            if ">" in buf:
                raise ToolParseError(f"a malformed {self.word} invoke tag")
            return MORE
        close = self._invoke_close.search(buf, header.end())
        if close is None:
            return MORE
        name = header.group(1).strip()
        body = buf[header.end():close.start()]
        arguments: dict[str, object] = {}
        pos = 0
        while (param := self._parameter.search(body, pos)) is not None:
            if body[pos:param.start()].strip():
                raise ToolParseError(f"tool call {name!r} has text outside its parameters")
            end = self._parameter_close.search(body, param.end())
            if end is None:
                raise ToolParseError(f"a parameter of tool call {name!r} is not closed")
            key = param.group(1).strip()
            if not key:
                raise ToolParseError(f"tool call {name!r} has a parameter without a name")
            if key in arguments:
                raise ToolParseError(f"tool call {name!r} repeats the parameter {key!r}")
            raw = body[param.end():end.start()]
            if param.group(2) == "true":
                arguments[key] = raw
            else:
                try:
                    arguments[key] = loads_strict(raw)
                except ValueError:
                    if param.group(2) == "false":
                        raise ToolParseError(f"parameter {key!r} of tool call {name!r} is not valid JSON") from None
                    arguments[key] = raw
            pos = end.end()
        if body[pos:].strip():
            raise ToolParseError(f"tool call {name!r} has text outside its parameters")
        return Complete([(name, arguments)], close.end())

"""DeepSeek markup tool calls (DSML, and XTML: the same markup with the token spelled ｜XTML｜).

The official encoders write (deepseek-recipe 0.2.0 `DeepseekV4Encoding`; V4.1 writes the
tag names ` calls`, ` invoke` and ` parameter` with a leading space)::

    text\\n\\n<｜DSML｜tool_calls>
    <｜DSML｜invoke name="lookup">
    <｜DSML｜parameter name="query" string="true">alpha</｜DSML｜parameter>
    <｜DSML｜parameter name="limit" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

api.md pins DeepSeek's official deepseek-recipe state machine, which owns recognition. It is
not a dependency of this runtime, so this parser reproduces its observable behaviour, proven
against the official package by tests/unit/test_deepseek_parser.py:

- `<` + the token (`<｜DSML｜`) anywhere in content or reasoning starts the tool region,
  whatever tag follows; newlines right before it are dropped. Only the fullwidth bar counts.
- Between invokes only `<｜DSML｜invoke name="N" ...>` (optional space before `invoke`) and the
  region's close, `</｜DSML｜tool_calls>` or `</｜DSML｜ calls>` (or `function_calls` as helios' fallback
  templates write the block), matter; after the close all
  output is discarded. Other text and tags are ignored.
- In an invoke, `<｜DSML｜parameter name="K" string="true|false">` opens a value that runs to
  the next closing DSML tag, whichever; any other closing DSML tag closes the invoke and
  publishes the call (an omitted `</｜DSML｜parameter>` or `</｜DSML｜invoke>` is tolerated so).
- `</think>` in answer content is dropped, as the official parser drops it.

Helios' own layer (api.md) then validates what the official parser would pass on as broken or
ambiguous arguments: names are nonempty, argument names nonempty, whitespace-free and unique,
string="false" values are JSON, parameter tags carry exactly the string attribute, and a call
still open at a natural end is an error (a truncated one is omitted).
"""

from __future__ import annotations

import re
from typing import Any

from helios.neutral.parsers.base import (
    Item,
    Pending,
    Text,
    ToolParseError,
    ToolParser,
    ToolSchemas,
    check_envelope_size,
    loads_strict,
    make_call,
    partial_suffix,
)

BAR = "\uff5c"  # the fullwidth bar of DeepSeek's special tokens; an ASCII bar is plain text
THINK_CLOSE = "</think>"  # dropped from answer content, as the official parser does

TEXT, REGION, INVOKE, PARAM, DONE = "text", "region", "invoke", "param", "done"


class DeepSeekMarkupParser(ToolParser):
    trailing_closers: tuple[str, ...] = ()  # OutputParser may extend it; the region swallows all

    @staticmethod
    def region_tags(word: str) -> tuple[str, tuple[str, ...]]:
        """What the output grammar keeps open: any DSML tag opens the region (as the official
        parser reads it) and one of the block closes ends it: V4's `tool_calls`, V4.1's
        ` calls`, or `function_calls` as helios' Jinja fallback templates spell the block."""
        token = f"{BAR}{word}{BAR}"
        return f"<{token}", (f"</{token}tool_calls>", f"</{token} calls>", f"</{token}function_calls>")

    def __init__(self, word: str, schemas: ToolSchemas | None = None):
        super().__init__(schemas)
        token = f"{BAR}{word}{BAR}"
        self.word = word
        self._open = f"<{token}"
        self._close = f"</{token}"
        self._region_ends = self.region_tags(word)[1]  # the grammar's closers too
        self._invoke_prefixes = (f'<{token}invoke name="', f'<{token} invoke name="')
        self._param_prefixes = (f"<{token}parameter", f"<{token} parameter")
        self._invoke = re.compile(rf'<{token} ?invoke name="([^"]*)"([^>]*)(>?)')
        self._param = re.compile(rf"<{token} ?parameter([^>]*)(>?)")
        self._param_attrs = re.compile(r' name="([^"]*)"\s+string="(true|false)"')
        self.pending = Pending()
        self.mode = TEXT
        self._passthrough = False  # verbatim answer content has begun
        self._name = ""
        self._arguments: dict[str, Any] = {}
        self._call_start = 0
        self._key = ""
        self._is_string = True
        self._seen = 0  # value characters already searched for a closing tag

    @property
    def in_envelope(self) -> bool:
        """In the call region, which reasoning.py leaves whole to this parser (`</think>` too)."""
        return self.mode != TEXT

    # -- ToolParser ---------------------------------------------------------------------------

    def feed(self, text: str, start: int) -> list[Item]:
        if self.mode == DONE:
            return []
        self.pending.add(text, start)
        return self._scan(final=False)

    def flush(self) -> list[Item]:
        """The reasoning close: held text is released; an open region continues past it."""
        out = self._scan(final=False)
        if self.mode == TEXT:
            out += self._release(len(self.pending.text))
        return out

    def finish(self, truncated: bool) -> list[Item]:
        out = self._scan(final=True)
        if self.mode in (INVOKE, PARAM) and not truncated:
            raise ToolParseError("the model left a tool call incomplete")
        self.pending.drop(len(self.pending.text))  # a partial tag, or a truncated call: omitted
        return out

    # -- scanning -----------------------------------------------------------------------------

    def _scan(self, final: bool) -> list[Item]:
        out: list[Item] = []
        step = {TEXT: self._text, REGION: self._region, INVOKE: self._invoke_body, PARAM: self._value}
        while self.pending.text and self.mode != DONE:
            progressed, items = step[self.mode](final)
            out += items
            if not progressed:
                break
        if self.mode == DONE:
            self.pending.drop(len(self.pending.text))
        return out

    def _text(self, final: bool) -> tuple[bool, list[Item]]:
        buf = self.pending.text
        if self._passthrough:
            return False, self._release(len(buf))
        at = buf.find(self._open)
        think = buf.find(THINK_CLOSE) if self.answer else -1
        if think >= 0 and (at < 0 or think < at):
            items = self._release(think)
            self.pending.drop(len(THINK_CLOSE))
            return True, items
        if at >= 0:
            kept = len(buf[:at].rstrip("\n"))  # the encoder's separator before the block
            items = self._release(kept)
            self.pending.drop(at - kept)
            self.mode = REGION
            return True, items
        if final:
            return False, self._release(len(buf))
        hold = len(buf) - partial_suffix(buf, (self._open, THINK_CLOSE) if self.answer else (self._open,))
        while hold > 0 and buf[hold - 1] == "\n":
            hold -= 1  # newlines are dropped if the block follows them
        return False, self._release(hold)

    def _skip_to_tag(self, final: bool) -> str | None:
        """Drop the ignored text before the next DSML tag; the buffer from that tag, or None
        while none has begun (the possible start of one is kept unless the output ended)."""
        buf = self.pending.text
        at = self._next_tag(buf)
        if at < 0:
            self.pending.drop(len(buf) - (0 if final else partial_suffix(buf, (self._open, self._close))))
            return None
        self.pending.drop(at)
        return self.pending.text

    def _region(self, final: bool) -> tuple[bool, list[Item]]:
        """Between invokes: wait for an invoke header or the region's close; ignore the rest."""
        buf = self._skip_to_tag(final)
        if buf is None:
            return False, []
        if self._settle(buf, self._region_ends, final) is None:
            return False, []
        if buf.startswith(self._region_ends):
            self.mode = DONE
            return True, []
        is_invoke = self._settle(buf, self._invoke_prefixes, final) if buf.startswith(self._open) else False
        if is_invoke is None:
            return False, []
        if is_invoke:
            header = self._invoke.match(buf)
            if header is not None and header.group(3):
                self._name, self._arguments = header.group(1), {}
                self._call_start = self.pending.raw(0)
                self.pending.drop(header.end())
                self.mode = INVOKE
                return True, []
            if header is None or header.end() == len(buf):  # the header is still being written
                if not final:  # at the end a partial header is no call (official)
                    check_envelope_size(buf)
                return False, []
        self.pending.drop(1)  # not a tag this machine reads: ignored
        return True, []

    def _invoke_body(self, final: bool) -> tuple[bool, list[Item]]:
        """Inside an invoke: parameter tags open values; any closing DSML tag closes the invoke
        (the region close too, which then leaves the region open: official)."""
        buf = self._skip_to_tag(final)
        if buf is None:
            return False, []
        if buf.startswith(self._close):
            return True, self._publish(len(self._close))
        is_param = self._settle(buf, self._param_prefixes, final)
        if is_param is None:
            return False, []
        if is_param:
            return self._parameter_header(buf, final)
        self.pending.drop(1)  # another opening tag (a nested invoke too): ignored
        return True, []

    def _parameter_header(self, buf: str, final: bool) -> tuple[bool, list[Item]]:
        tag = self._param.match(buf)
        if tag is None or not tag.group(2):
            if not final:  # at the end the call stays open: finish decides
                check_envelope_size(buf)
            return False, []
        attrs = self._param_attrs.fullmatch(tag.group(1))
        if attrs is None:  # the official parser corrupts or drops such a parameter
            raise ToolParseError(f'a parameter tag of tool call {self._name!r} is not name="K" string="true|false"')
        key, kind = attrs.group(1), attrs.group(2)
        if not key or key != "".join(key.split()):
            raise ToolParseError(f"tool call {self._name!r} has a parameter with an empty or spaced name")
        if key in self._arguments:
            raise ToolParseError(f"tool call {self._name!r} repeats the parameter {key!r}")
        self._key, self._is_string = key, kind == "true"
        self.pending.drop(tag.end())
        self.mode, self._seen = PARAM, 0
        return True, []

    def _value(self, final: bool) -> tuple[bool, list[Item]]:
        """A value runs to the next closing DSML tag, whichever it is (`</｜DSML｜invoke>` too)."""
        buf = self.pending.text
        at = buf.find(self._close, self._seen)
        if at < 0:
            check_envelope_size(buf)
            self._seen = max(0, len(buf) - len(self._close) + 1)  # rescan only what may hold a tag
            return False, []
        raw = buf[:at]
        if self._is_string:
            self._arguments[self._key] = raw
        else:
            try:
                self._arguments[self._key] = loads_strict(raw)
            except ValueError:
                raise ToolParseError(f"parameter {self._key!r} of tool call {self._name!r} is not valid JSON") from None
        self.pending.drop(at + len(self._close))  # whichever tag it is, it ends the value only
        self.mode = INVOKE
        return True, []

    # -- helpers ------------------------------------------------------------------------------

    def _next_tag(self, buf: str) -> int:
        found = [i for i in (buf.find(self._open), buf.find(self._close)) if i >= 0]
        return min(found) if found else -1

    @staticmethod
    def _settle(buf: str, needles: tuple[str, ...], final: bool) -> bool | None:
        """Whether `buf` starts with one of `needles`; None while it may still become one."""
        if buf.startswith(needles):
            return True
        if not final and any(n.startswith(buf) for n in needles):
            return None
        return False

    def _publish(self, consumed: int) -> list[Item]:
        call = make_call(self._name, self._arguments, self._call_start, self.pending.raw(consumed))
        self.pending.drop(consumed)
        self.mode = REGION
        return [call]

    def _release(self, n: int) -> list[Text]:
        items = self.pending.take(n)
        if self.verbatim and self.answer and any(t.text.strip() for t in items):
            self._passthrough = True
        return items

"""Engine events of one choice -> parser pieces -> ordered items with token attribution.

The engine releases text per event (after UTF-8 completion and stop-string holds) together with
the event's token ids and logprob entries. This driver keeps the raw released text, turns
single-token reasoning delimiters into `Marker`s at the place their text appears (or at the
event's position when the tokenizer skips them as special tokens), feeds the parser, and gives
each logprob entry to the item that holds its token's first text byte: answer text keeps its
entries (Responses `output_text.logprobs`), entries of reasoning, tool envelopes and delimiters
are dropped there. It also counts the tokens published as reasoning (usage reasoning_tokens).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from helios.neutral.parsers.base import Call, Chunk, Item, Marker, Piece, Reasoning, Text
from helios.neutral.parsers.reasoning import OutputParser


@dataclass
class TextOut:
    text: str
    logprobs: list[Any] = field(default_factory=list)


@dataclass
class ReasoningOut:
    text: str


@dataclass
class CallOut:
    name: str
    arguments: dict[str, Any]


Out = TextOut | ReasoningOut | CallOut


class OutputStream:
    def __init__(self, parser: OutputParser, markers: dict[int, str] | None = None):
        self.parser = parser
        self.markers = markers or {}
        self.raw_len = 0  # characters of released text so far
        self._buffer = ""  # released text not yet handed to the parser
        self._base = 0  # raw offset of _buffer[0]
        self._pending: list[tuple[int, str, int]] = []  # (token id, text, earliest offset)
        self._entries: deque[tuple[int, Any]] = deque()  # (raw offset, logprob entry)
        self.reasoning_tokens = 0

    def feed(self, token_ids: list[int], text: str, entries: list[Any] | None = None) -> list[Out]:
        at = self.raw_len
        for entry in entries or []:
            self._entries.append((at, entry))
        delimiters = 0
        for token in token_ids:
            if token in self.markers:
                self._pending.append((token, self.markers[token], at))
                delimiters += 1
        self.raw_len += len(text)
        self._buffer += text
        out = self._attribute(self.parser.feed(self._drain(final=False)))
        if self.parser.in_reasoning:
            self.reasoning_tokens += len(token_ids) - delimiters
        return out

    def finish(self, truncated: bool) -> list[Out]:
        items = self.parser.feed(self._drain(final=True))
        items += self.parser.finish(truncated)
        out = self._attribute(items)
        self._entries.clear()
        return out

    # -- markers --------------------------------------------------------------------------

    def _drain(self, final: bool) -> list[Piece]:
        pieces: list[Piece] = []
        while self._pending:
            token, text, earliest = self._pending[0]
            if not text:  # skipped by the detokenizer: a zero-width marker at its event
                at = max(earliest, self._base)
                if at > self._base + len(self._buffer):
                    break
                self._cut(pieces, at - self._base)
                pieces.append(Marker(token, "", at))
            else:
                found = self._buffer.find(text, max(0, earliest - self._base))
                if found < 0:
                    if not final:
                        break  # its text is still held back (a possible stop string)
                    self._pending.pop(0)  # clipped by a stop string: it never appeared
                    continue
                self._cut(pieces, found)
                pieces.append(Marker(token, text, self._base))
                self._buffer = self._buffer[len(text) :]
                self._base += len(text)
            self._pending.pop(0)
        if not self._pending and self._buffer:
            self._cut(pieces, len(self._buffer))
        return pieces

    def _cut(self, pieces: list[Piece], n: int) -> None:
        if n > 0:
            pieces.append(Chunk(self._buffer[:n], self._base))
            self._buffer = self._buffer[n:]
            self._base += n

    # -- attribution ----------------------------------------------------------------------

    def _attribute(self, items: list[Item]) -> list[Out]:
        out: list[Out] = []
        for item in items:
            if isinstance(item, Text):
                lo, hi = item.start, item.start + len(item.text)
                self._skip(lo)
                taken = []
                while self._entries and self._entries[0][0] < hi:
                    taken.append(self._entries.popleft()[1])
                out.append(TextOut(item.text, taken))
            elif isinstance(item, Reasoning):
                self._skip(item.start + len(item.text))
                out.append(ReasoningOut(item.text))
            elif isinstance(item, Call):
                self._skip(item.end)
                out.append(CallOut(item.name, item.arguments))
        return out

    def _skip(self, offset: int) -> None:
        while self._entries and self._entries[0][0] < offset:
            self._entries.popleft()

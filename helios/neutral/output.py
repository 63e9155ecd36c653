"""The ordered output of one generated answer, as neutral semantic events.

Protocol encoders (Chat, Messages, Responses) never look at engine events directly: they read the
blocks this accumulator opens, extends and closes, so a buffered response and its SSE stream
are built from the same sequence and cannot disagree. The output parsers
(helios.neutral.parsers) and the tool policy (helios.neutral.tools) sit in front: answer text
becomes `text` blocks, readable reasoning `reasoning` blocks, and each validated call one
`tool_call` block that opens, receives its whole arguments and closes at once (envelopes are
buffered until complete, so there are no partial calls).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from helios.engine.api import TokenLogprob
from helios.neutral.tools import EmittedCall

BlockKind = Literal["text", "reasoning", "tool_call"]


@dataclass
class Block:
    index: int  # position among this answer's blocks (stable once opened)
    kind: BlockKind
    text: str = ""  # text, reasoning, or the call's arguments JSON
    logprobs: list[TokenLogprob] = field(default_factory=list)  # entries of answer-text tokens
    closed: bool = False
    call: EmittedCall | None = None


@dataclass
class BlockOpened:
    block: Block


@dataclass
class BlockDelta:
    block: Block
    text: str
    logprobs: list[TokenLogprob]


@dataclass
class BlockClosed:
    block: Block


OutputEvent = BlockOpened | BlockDelta | BlockClosed


class OutputAccumulator:
    """Text, reasoning and calls in, ordered block events out."""

    def __init__(self) -> None:
        self.blocks: list[Block] = []
        self._open: Block | None = None

    def feed(self, text: str, logprobs: list[TokenLogprob] | None = None) -> list[OutputEvent]:
        """Answer text (with the logprob entries of the tokens whose first byte it holds)."""
        return self._append("text", text, list(logprobs or []))

    def reasoning(self, text: str) -> list[OutputEvent]:
        return self._append("reasoning", text, [])

    def call(self, call: EmittedCall) -> list[OutputEvent]:
        events = self._close()
        block = Block(len(self.blocks), "tool_call", call=call)
        self.blocks.append(block)
        block.text = call.custom_input if call.custom_input is not None else call.arguments_json
        block.closed = True
        return events + [BlockOpened(block), BlockDelta(block, block.text, []), BlockClosed(block)]

    def finish(self) -> list[OutputEvent]:
        """The answer ended: close what is open."""
        return self._close()

    def _append(self, kind: BlockKind, text: str, entries: list[TokenLogprob]) -> list[OutputEvent]:
        if not text and not entries:
            return []
        events: list[OutputEvent] = []
        if self._open is not None and self._open.kind != kind:
            events += self._close()
        if self._open is None:
            # A block opens on its first text (or first logprob entry whose text the
            # detokenizer still holds), so an answer without output has no empty block.
            self._open = Block(len(self.blocks), kind)
            self.blocks.append(self._open)
            events.append(BlockOpened(self._open))
        self._open.text += text
        self._open.logprobs.extend(entries)
        events.append(BlockDelta(self._open, text, entries))
        return events

    def _close(self) -> list[OutputEvent]:
        if self._open is None:
            return []
        block, self._open = self._open, None
        block.closed = True
        return [BlockClosed(block)]

    def text(self, kind: BlockKind = "text") -> str:
        return "".join(b.text for b in self.blocks if b.kind == kind)

    @property
    def calls(self) -> list[EmittedCall]:
        return [b.call for b in self.blocks if b.call is not None]

"""The ordered output of one generated answer, as neutral semantic events.

Protocol encoders (Messages, Responses) never look at engine events directly: they read the
blocks this accumulator opens, extends and closes, so a buffered response and its SSE stream
are built from the same sequence and cannot disagree. Today every generated text is one text
block; the reasoning and tool-call parsers (tools issue) sit in front of `feed` and open
`reasoning` / `tool_call` blocks in the same order-preserving list.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Union

from helios.engine.api import TokenLogprob

BlockKind = Literal["text", "reasoning", "tool_call"]


@dataclass
class Block:
    index: int  # position among this answer's blocks (stable once opened)
    kind: BlockKind
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    closed: bool = False


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


OutputEvent = Union[BlockOpened, BlockDelta, BlockClosed]


class OutputAccumulator:
    """Text and logprob entries in, ordered block events out."""

    def __init__(self) -> None:
        self.blocks: list[Block] = []
        self._open: Block | None = None

    def feed(self, text: str, logprobs: list[TokenLogprob] | None = None) -> list[OutputEvent]:
        entries = list(logprobs or [])
        if not text and not entries:
            return []
        events: list[OutputEvent] = []
        if self._open is None:
            # A block opens on its first text (or first logprob entry whose text the
            # detokenizer still holds), so an answer without output has no empty block.
            self._open = Block(len(self.blocks), "text")
            self.blocks.append(self._open)
            events.append(BlockOpened(self._open))
        self._open.text += text
        self._open.logprobs.extend(entries)
        events.append(BlockDelta(self._open, text, entries))
        return events

    def finish(self) -> list[OutputEvent]:
        """The answer ended: close what is open."""
        if self._open is None:
            return []
        block, self._open = self._open, None
        block.closed = True
        return [BlockClosed(block)]

    def text(self, kind: BlockKind = "text") -> str:
        return "".join(b.text for b in self.blocks if b.kind == kind)

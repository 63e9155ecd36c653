"""The scanning machine shared by tagged tool syntaxes.

Text is released as soon as it cannot be the start of an envelope opener; from an opener on,
the syntax's `decide` looks at the buffered envelope and says whether it needs more text, is not
a call after all (release some text), or is complete (calls, and how much text they consumed).
After a call, whitespace and the syntax's outer closing tag are swallowed.
"""

from __future__ import annotations

from dataclasses import dataclass

from helios.neutral.parsers.base import (
    Call,
    Item,
    Pending,
    Text,
    ToolParseError,
    ToolParser,
    ToolSchemas,
    check_envelope_size,
    find_first,
    make_call,
    partial_suffix,
)


@dataclass
class More:
    """The envelope is undecided or incomplete: wait for more text."""


@dataclass
class NotACall:
    """The opener is ordinary text: release `length` characters and keep scanning."""

    length: int


@dataclass
class Complete:
    calls: list[tuple[str, dict]]  # (name, arguments) in order
    consumed: int  # characters of the buffer the envelope used
    stop: bool = False  # nothing after this envelope is parsed output (DeepSeek outer close)


Decision = More | NotACall | Complete

MORE = More()


class TaggedParser(ToolParser):
    openers: tuple[str, ...] = ()
    # Closing tags that may follow a completed call (an outer block end), swallowed with whitespace.
    trailing_closers: tuple[str, ...] = ()

    def __init__(self, schemas: ToolSchemas | None = None):
        super().__init__(schemas)
        self.pending = Pending()
        self._after_call = False
        self._passthrough = False  # verbatim answer content has begun
        self._discard = False  # the output ended for parsing purposes (DeepSeek)

    # -- syntax hook ------------------------------------------------------------------------

    def decide(self, buf: str, final: bool) -> Decision:
        """`buf` starts with one of `openers`. `final`: no more text will come."""
        raise NotImplementedError

    # -- ToolParser ---------------------------------------------------------------------------

    def feed(self, text: str, start: int) -> list[Item]:
        if self._discard:
            return []
        self.pending.add(text, start)
        return self._scan(final=False)

    def flush(self) -> list[Item]:
        """A boundary no envelope crosses: undecided text becomes text."""
        out = self._scan(final=False)
        if self.pending.text and not self._discard:
            out += self.pending.take_all()
        self._after_call = False
        return out

    def finish(self, truncated: bool) -> list[Item]:
        if self._discard:
            return []
        out = self._scan(final=True)
        buf = self.pending.text
        if buf:
            if any(buf.startswith(o) for o in self.openers):
                if not truncated:
                    raise ToolParseError("the model left a tool call incomplete")
                self.pending.drop(len(buf))  # a truncated envelope is omitted
            elif self._after_call and not buf.strip():
                self.pending.drop(len(buf))
            else:
                out += self.pending.take_all()
        return out

    # -- scanning -----------------------------------------------------------------------------

    def _scan(self, final: bool) -> list[Item]:
        out: list[Item] = []
        p = self.pending
        while p.text and not self._discard:
            buf = p.text
            if self._after_call:
                stripped = buf.lstrip()
                skipped = len(buf) - len(stripped)
                closer = next((c for c in self.trailing_closers if stripped.startswith(c)), None)
                if closer is not None:
                    p.drop(skipped + len(closer))
                    continue
                if not stripped or (not final and partial_suffix(stripped, self.trailing_closers) == len(stripped)):
                    break  # whitespace or a partial closer: wait
                p.drop(skipped)
                self._after_call = False
                continue
            if self._passthrough:
                out += p.take_all()
                break
            if any(buf.startswith(o) for o in self.openers):
                check_envelope_size(buf)
                decision = self.decide(buf, final)
                if isinstance(decision, More):
                    break
                if isinstance(decision, NotACall):
                    out += self._release(max(1, decision.length))
                    continue
                start, end = p.raw(0), p.raw(decision.consumed)
                for name, arguments in decision.calls:
                    out.append(make_call(name, arguments, start, end))
                p.drop(decision.consumed)
                self._after_call = True
                if decision.stop:
                    self._discard = True
                    p.drop(len(p.text))
                continue
            found = find_first(buf, self.openers)
            if found is not None:
                out += self._release(found[0])
                continue
            hold = 0 if final else partial_suffix(buf, self.openers)
            out += self._release(len(buf) - hold)
            break
        return out

    def _release(self, n: int) -> list[Text]:
        items = self.pending.take(n)
        if self.verbatim and self.answer and any(t.text.strip() for t in items):
            self._passthrough = True
        return items


def calls_only(items: list[Item]) -> list[Call]:
    return [i for i in items if isinstance(i, Call)]

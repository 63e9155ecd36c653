"""Reasoning syntaxes and the top-level output parser (reasoning around a tool syntax).

A delimiter the tokenizer encodes as one token (`<think>`, `</think>`, Gemma 4's `<channel|>`)
opens or closes reasoning only when the model generates that token: the stream driver turns such
tokens into `Marker`s, and the same text written in ordinary pieces stays text. Delimiters that
span several tokens (Gemma 4's `<|channel>thought`) and syntaxes declared text-only (DeepSeek)
are matched as text.

Output begins in one of three states: `reasoning` (the prompt opened reasoning, e.g. Qwen's
`<think>\\n` generation prompt), `start` (the model may open reasoning before any answer text)
or `answer`. Reasoning text is published without its wrapping whitespace; answer text right
after a closed reasoning block loses its leading whitespace (the template's separator).

Qwen and DeepSeek treat a tool call as an implicit end of reasoning: with `tool_ends_reasoning`,
tagged envelopes are parsed inside reasoning too, and a complete call ends it (DeepSeek's parser
leaves reasoning at any DSML tag; parsers/deepseek.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from helios.neutral.parsers.base import (
    Call,
    Item,
    Marker,
    Pending,
    Piece,
    Reasoning,
    Text,
    ToolParser,
    partial_suffix,
)


@dataclass(frozen=True)
class ReasoningSyntax:
    name: str
    open: str
    close: str
    tool_ends_reasoning: bool = False  # a complete tool call implicitly closes reasoning (Qwen, DeepSeek)
    text_only: bool = False  # delimiters are always matched as text (DeepSeek's own parser)
    # Characters trimmed around reasoning and before the answer (None: all whitespace). DeepSeek's
    # official parser trims newlines only, and keeps an unclosed reasoning's trailing newlines.
    strip: str | None = None
    # Only the prompt opens reasoning (DeepSeek: it ends in `<think>` or `</think>`); output that
    # does not start in reasoning is answer, a `<think>` in it included (official parser).
    prompt_opens: bool = False


REASONING_SYNTAXES: dict[str, ReasoningSyntax] = {
    s.name: s
    for s in (
        ReasoningSyntax("qwen3", "<think>", "</think>", tool_ends_reasoning=True),
        ReasoningSyntax("think", "<think>", "</think>"),
        ReasoningSyntax("glm45", "<think>", "</think>"),
        ReasoningSyntax("minimax", "<think>", "</think>"),
        ReasoningSyntax("mimo", "<think>", "</think>"),
        ReasoningSyntax("kimi", "<think>", "</think>"),
        # Any DSML tag ends DeepSeek reasoning (official deepseek-recipe parser).
        ReasoningSyntax(
            "deepseek", "<think>", "</think>", tool_ends_reasoning=True, text_only=True, strip="\n", prompt_opens=True
        ),
        ReasoningSyntax("gemma4", "<|channel>thought", "<channel|>"),
    )
}


@dataclass(frozen=True)
class ResolvedReasoning:
    """A reasoning syntax against the loaded tokenizer: single-token delimiters have ids."""

    syntax: ReasoningSyntax
    open_id: int | None
    close_id: int | None

    @property
    def markers(self) -> dict[int, str]:
        out = {}
        if self.open_id is not None:
            out[self.open_id] = self.syntax.open
        if self.close_id is not None:
            out[self.close_id] = self.syntax.close
        return out


START, REASONING, ANSWER = "start", "reasoning", "answer"


class OutputParser:
    """Pieces of generated text in; ordered Text, Reasoning and Call items out."""

    def __init__(self, tools: ToolParser | None, reasoning: ResolvedReasoning | None, start_state: str = ANSWER):
        self.tools = tools
        self.reasoning = reasoning
        self.state = start_state if reasoning is not None else ANSWER
        if reasoning is not None and reasoning.syntax.prompt_opens and self.state == START:
            self.state = ANSWER
        self._held = Pending()  # START: leading whitespace (and a partial text opener)
        self._close_hold = Pending()  # REASONING with a text close: a partial close delimiter
        self._ws = Pending()  # REASONING: trailing whitespace, published only if more follows
        self._reasoning_begun = False
        self._strip_answer = False  # the next answer text follows a reasoning block
        # After DeepSeek's prompt (ending in `</think>` without reasoning) the answer loses its
        # leading newlines too, as in the official parser.
        self._edge_strip = reasoning is not None and reasoning.syntax.strip is not None
        if self.state == ANSWER:
            self._strip_answer = self._edge_strip
        self._implicit_close = False  # reasoning ended by a tool call, not by its delimiter
        if tools is not None:
            tools.answer = self.state == ANSWER
            if reasoning is not None and reasoning.syntax.tool_ends_reasoning and reasoning.close_id is None:
                # After a call ended reasoning, the model's own (text) close is swallowed with
                # the envelope's trailing tags.
                tools.trailing_closers = (*tools.trailing_closers, reasoning.syntax.close)

    @property
    def in_reasoning(self) -> bool:
        return self.state == REASONING

    # -- input ----------------------------------------------------------------------------

    def feed(self, pieces: list[Piece]) -> list[Item]:
        out: list[Item] = []
        for piece in pieces:
            if isinstance(piece, Marker):
                out += self._marker(piece)
            elif piece.text:
                out += self._chunk(piece.text, piece.start)
        return out

    def finish(self, truncated: bool) -> list[Item]:
        out: list[Item] = []
        if self.state == START:
            held = self._held.take_all()
            self._enter_answer(strip=self._edge_strip)
            for run in held:
                out += self._answer(run.text, run.start)
        if self.state == REASONING and self._close_hold.text:
            for run in self._close_hold.take_all():
                out += self._reasoning_text(run.text, run.start)
        if self.tools is not None:
            out += self._label(self.tools.finish(truncated))
        if self.state == REASONING and self.reasoning is not None and self.reasoning.syntax.strip is not None:
            out += [Reasoning(run.text, run.start) for run in self._ws.take_all()]
        return out

    def _marker(self, marker: Marker) -> list[Item]:
        r = self.reasoning
        assert r is not None  # markers exist only for a reasoning syntax
        if self.state == START and marker.token_id == r.open_id:
            self._held = Pending()
            self._begin_reasoning()
            return []
        if self.state == START and marker.token_id == r.close_id:
            self._held = Pending()
            self._enter_answer(strip=True)
            return []
        if self.state == REASONING and marker.token_id == r.close_id:
            return self._close()
        if self.state == ANSWER and marker.token_id == r.close_id and self._implicit_close and self._strip_answer:
            return []  # the model's own close after a tool call already ended reasoning
        return self._chunk(marker.text, marker.start) if marker.text else []

    def _chunk(self, text: str, start: int) -> list[Item]:
        if self.state == START:
            return self._start(text, start)
        if self.state == REASONING:
            return self._reasoning(text, start)
        return self._answer(text, start)

    # -- states ---------------------------------------------------------------------------

    def _start(self, text: str, start: int) -> list[Item]:
        r = self.reasoning
        assert r is not None
        self._held.add(text, start)
        body = self._held.text.lstrip()
        lead = len(self._held.text) - len(body)
        if r.open_id is None:  # a text opener
            opener = r.syntax.open
            if body.startswith(opener):
                after = lead + len(opener)
                rest = self._held.text[after:]
                rest_start = self._held.raw(after)
                self._held = Pending()
                self._begin_reasoning()
                return self._reasoning(rest, rest_start) if rest else []
            if not body or opener.startswith(body):
                return []
        elif not body:
            return []
        held = self._held.take_all()
        self._enter_answer(strip=self._edge_strip)
        out: list[Item] = []
        for run in held:
            out += self._answer(run.text, run.start)
        return out

    def _begin_reasoning(self) -> None:
        self.state = REASONING
        if self.tools is not None:
            self.tools.answer = False

    def _enter_answer(self, strip: bool) -> None:
        self.state = ANSWER
        self._strip_answer = strip
        if self.tools is not None:
            self.tools.begin_answer()

    def _reasoning(self, text: str, start: int) -> list[Item]:
        r = self.reasoning
        assert r is not None
        if r.close_id is not None:
            return self._reasoning_text(text, start)
        close = r.syntax.close
        self._close_hold.add(text, start)
        if self._in_envelope():
            return self._hand_over()
        buf = self._close_hold.text
        at = buf.find(close)
        if at >= 0:
            out: list[Item] = []
            for run in self._close_hold.take(at):
                out += self._reasoning_text(run.text, run.start)
            if self._in_envelope():
                return out + self._hand_over()
            self._close_hold.drop(len(close))
            rest = self._close_hold.take_all()
            out += self._close()
            for run in rest:
                out += self._chunk(run.text, run.start)
            return out
        keep = partial_suffix(buf, (close,))
        out = []
        for run in self._close_hold.take(len(buf) - keep):
            out += self._reasoning_text(run.text, run.start)
        return out

    def _in_envelope(self) -> bool:
        # DeepSeek's call region (begun in reasoning) owns all later text, `</think>` included.
        return self.tools is not None and self.tools.in_envelope

    def _hand_over(self) -> list[Item]:
        out: list[Item] = []
        for run in self._close_hold.take_all():
            out += self._reasoning_text(run.text, run.start)
        return out

    def _reasoning_text(self, text: str, start: int) -> list[Item]:
        """Reasoning content (the close delimiter already removed)."""
        if self.state != REASONING:
            return self._answer(text, start)
        if self.tools is not None and self.reasoning is not None and self.reasoning.syntax.tool_ends_reasoning:
            return self._label(self.tools.feed(text, start))
        return self._publish_reasoning(text, start)

    def _close(self) -> list[Item]:
        """The reasoning close delimiter: undecided envelope text stays reasoning."""
        out: list[Item] = []
        if self.tools is not None and self.reasoning is not None and self.reasoning.syntax.tool_ends_reasoning:
            out += self._label(self.tools.flush())
        self._ws = Pending()  # trailing whitespace of reasoning is the delimiter's
        self._enter_answer(strip=True)
        return out

    def _answer(self, text: str, start: int) -> list[Item]:
        if self.tools is None:
            return self._answer_direct(Text(text, start)) if self._strip_answer else [Text(text, start)]
        # Leading whitespace is stripped from the tool parser's text output (_label), after it
        # swallowed what belongs to a preceding envelope.
        return self._label(self.tools.feed(text, start))

    def _publish_reasoning(self, text: str, start: int) -> list[Item]:
        chars = self.reasoning.syntax.strip if self.reasoning is not None else None
        if not self._reasoning_begun:
            stripped = text.lstrip(chars)
            if not stripped:
                return []
            start += len(text) - len(stripped)
            text = stripped
            self._reasoning_begun = True
        body = text.rstrip(chars)
        out: list[Item] = []
        if body:
            for run in self._ws.take_all():
                out.append(Reasoning(run.text, run.start))
            out.append(Reasoning(body, start))
        self._ws.add(text[len(body) :], start + len(body))
        return out

    def _label(self, items: list[Item]) -> list[Item]:
        """Tool parser output: text is reasoning while reasoning is open; a call ends it."""
        out: list[Item] = []
        for item in items:
            if isinstance(item, Call):
                if self.state == REASONING:
                    self._ws = Pending()
                    self._implicit_close = True
                    self.state = ANSWER
                    self._strip_answer = True
                    if self.tools is not None:
                        self.tools.begin_answer()
                out.append(item)
            elif isinstance(item, Text):
                if self.state == REASONING:
                    out += self._publish_reasoning(item.text, item.start)
                elif self._strip_answer:
                    out += self._answer_direct(item)
                else:
                    out.append(item)
            else:
                out.append(item)
        return out

    def _answer_direct(self, item: Text) -> list[Item]:
        stripped = item.text.lstrip(self.reasoning.syntax.strip if self.reasoning is not None else None)
        if not stripped:
            return []
        self._strip_answer = False
        return [Text(stripped, item.start + len(item.text) - len(stripped))]

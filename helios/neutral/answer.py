"""One generated choice followed from engine events to accounting and neutral output blocks.

`ChoiceState` accumulates what the engine generated for one choice (text, ids, logprob entries
with their text offsets, prompt scores, counts, the terminal cause). `Answer` adds what a
conversational choice needs on top: the core's output parsers, the request's tool contract and the
ordered blocks of `OutputAccumulator`. Protocol encoders read both; neither knows about HTTP.
"""

from __future__ import annotations

import codecs
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from helios.engine.api import FinishReason, GenerationEvent, PromptLogprob, TokenLogprob
from helios.neutral.errors import OutputFailure
from helios.neutral.output import OutputAccumulator, OutputEvent
from helios.neutral.parsers import CallOut, Out, ReasoningOut, TextOut, ToolParseError, build_stream
from helios.neutral.request import OutputPlan
from helios.neutral.tokenizer import Tokenizer
from helios.neutral.tools import OutputError, ToolPolicy

log = logging.getLogger("helios.output")


@dataclass
class Delta:
    """What one engine event adds to a choice."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    offsets: list[int]  # text_offset of each logprob entry (characters from completion start)
    timestamps_ns: list[int]
    prompt_logprobs: list[PromptLogprob | None] = field(default_factory=list)  # scored prompt positions


@dataclass
class ChoiceState:
    """Everything generated so far for one choice (one engine request)."""

    index: int
    tokenizer: Tokenizer
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    timestamps_ns: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprob | None] = field(default_factory=list)
    finished: bool = False
    finish_reason: FinishReason | None = None
    stop_reason: str | int | list[int] | None = None
    cached_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    _chars: int = 0
    _decoder: Any = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace"))

    def apply(self, event: GenerationEvent) -> Delta:
        stamp = time.time_ns()
        # The engine already omits entries for a terminating EOS / token-id stop (api.md).
        entries = list(event.logprobs or [])
        offsets = []
        for entry in entries:
            offsets.append(self._chars)
            if not self.tokenizer.is_special(entry.token_id):  # released text skips specials
                self._chars += len(self._decoder.decode(self.tokenizer.token_bytes(entry.token_id)))
        self.text.append(event.text)
        self.token_ids.extend(event.token_ids)
        stamps = [stamp] * len(event.token_ids)
        self.timestamps_ns.extend(stamps)
        self.logprobs.extend(entries)
        self.offsets.extend(offsets)
        self.prompt_logprobs.extend(event.prompt_logprobs or [])
        self.cached_tokens = max(self.cached_tokens, event.cached_tokens)
        self.completion_tokens = max(self.completion_tokens, event.completion_tokens)
        if event.finished:
            self.finished = True
            self.finish_reason = event.finish_reason
            self.stop_reason = event.stop_reason
            self.error = event.error
        return Delta(event.text, list(event.token_ids), entries, offsets, stamps, list(event.prompt_logprobs or []))

    @property
    def full_text(self) -> str:
        return "".join(self.text)


class Answer:
    """One conversational choice: usage counts (ChoiceState), then output parsing
    (frontend.parsers), the tool contract (frontend.tools) and ordered blocks (frontend.output).

    `apply` raises OutputFailure when the output breaks its contract: a malformed or incomplete
    tool envelope, a call the tool choice forbids, a second call with parallel calls disabled,
    a custom tool input outside its grammar, or a required call that never came."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_tokens: int,
        plan: OutputPlan | None = None,
        index: int = 0,
        call_prefix: str = "call_",
    ):
        self.prompt_tokens = prompt_tokens
        self.state = ChoiceState(index, tokenizer)
        self.output = OutputAccumulator()
        plan = plan or OutputPlan()
        self.stream = build_stream(plan.spec)
        self.policy = ToolPolicy(plan.tools, plan.choice)
        self.call_prefix = call_prefix

    def apply(self, event: GenerationEvent) -> list[OutputEvent]:
        delta = self.state.apply(event)
        failed = event.finished and event.finish_reason in (FinishReason.ERROR, FinishReason.ABORT)
        try:
            outs = self.stream.feed(delta.token_ids, delta.text, delta.logprobs)
            if event.finished and not failed:
                outs += self.stream.finish(truncated=event.finish_reason == FinishReason.LENGTH)
            events = self._route(outs)
            if event.finished and not failed:
                self.policy.finish()
        except (ToolParseError, OutputError) as exc:
            message = (
                f"the model's tool call could not be parsed: {exc}" if isinstance(exc, ToolParseError) else str(exc)
            )
            log.warning("%s; generated text: %r", message, self.state.full_text[-2000:])
            raise OutputFailure(message) from None
        if event.finished:
            # The raw model output, for conformance write-ups (scripts/conformance.sh logs it).
            log.debug(
                "finished (%s, last token %s); generated text: %r",
                event.finish_reason,
                self.state.token_ids[-1:],
                self.state.full_text,
            )
            events += self.output.finish()
        return events

    def _route(self, outs: list[Out]) -> list[OutputEvent]:
        events: list[OutputEvent] = []
        for out in outs:
            if isinstance(out, TextOut):
                if not self.policy.omit_text:
                    events += self.output.feed(out.text, out.logprobs)
            elif isinstance(out, ReasoningOut):
                events += self.output.reasoning(out.text)
            elif isinstance(out, CallOut):
                call_id = f"{self.call_prefix}{uuid.uuid4().hex[:24]}"
                events += self.output.call(self.policy.check(out.name, out.arguments, call_id))
        return events

    @property
    def cached_tokens(self) -> int:
        # The engine's admission count of reused prompt tokens.
        return self.state.cached_tokens

    @property
    def completion_tokens(self) -> int:
        return self.state.completion_tokens

    @property
    def reasoning_tokens(self) -> int:
        return self.stream.reasoning_tokens

    @property
    def hit_limit(self) -> bool:
        return self.state.finish_reason == FinishReason.LENGTH

    @property
    def cause(self) -> str:
        """The terminal cause: "length", "tool_calls" (parsed calls completed an answer the user
        did not stop), "stop_sequence" (a matched string stop) or "stop" (EOS, token stop)."""
        if self.hit_limit:
            return "length"
        if isinstance(self.state.stop_reason, str):
            return "stop_sequence"
        if self.state.stop_reason is None and self.output.calls:
            return "tool_calls"
        return "stop"

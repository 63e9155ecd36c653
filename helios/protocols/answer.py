"""One generated answer followed from engine events to neutral output blocks.

Every conversational choice (Chat Completions per choice, Messages, Responses) is read through
`Answer`: token accounting in `common.ChoiceState`, then the core's output parsers, the request's
tool contract and the ordered blocks of `frontend.output.OutputAccumulator`. Messages and
Responses generate exactly one choice; they share the request lifecycle (`handle`) and consume
the engine through `follow`, which keeps an SSE connection alive while the model waits. Their own
modules only decode and encode.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

from aiohttp import web

from helios.engine.api import FinishReason, GenerationEvent, GenerationRequest
from helios.frontend.output import OutputAccumulator, OutputEvent
from helios.frontend.parsers import CallOut, Out, ReasoningOut, TextOut, ToolParseError, build_stream
from helios.frontend.request import OutputPlan
from helios.frontend.tokenizer import Tokenizer
from helios.frontend.tools import OutputError, ToolPolicy
from helios.protocols import common
from helios.server.admission import GenerationGroup
from helios.server.context import ServerContext
from helios.server.errors import server_error
from helios.server.sse import KEEPALIVE_SECONDS

log = logging.getLogger("helios.output")


class SinglePlan(Protocol):
    request: GenerationRequest
    stream: bool


Planner = Callable[[ServerContext, dict[str, Any], str], Any]
EncodeFn = Callable[..., Awaitable[web.StreamResponse]]


async def handle(request: web.Request, ctx: ServerContext, plan: Planner, id_prefix: str,
                 buffered: EncodeFn, stream: EncodeFn) -> web.StreamResponse:
    """Body -> plan (frontend pool) -> one admission slot and submit -> buffered or SSE encoder.
    The group is closed on every exit, which aborts the request if the client left."""
    body = await ctx.read_json_object(request)
    response_id = f"{id_prefix}_{uuid.uuid4().hex}"
    p: SinglePlan = await ctx.in_frontend(plan, ctx, body, response_id)
    group, headers = ctx.launch(request, [p.request], response_id)
    try:
        if p.stream:
            return await stream(request, ctx, p, group, headers)
        return await buffered(ctx, p, group, headers)
    finally:
        group.close()


class Answer:
    """One choice: usage counts (common.ChoiceState), then output parsing (frontend.parsers),
    the tool contract (frontend.tools) and ordered blocks (frontend.output), per engine event.

    `apply` raises ApiError (500) when the output breaks its contract: a malformed or incomplete
    tool envelope, a call the tool choice forbids, a second call with parallel calls disabled,
    a custom tool input outside its grammar, or a required call that never came."""

    def __init__(self, tokenizer: Tokenizer, prompt_tokens: int, plan: OutputPlan | None = None,
                 index: int = 0, call_prefix: str = "call_", stats: Any = None):
        self.prompt_tokens = prompt_tokens
        self.stats = stats  # server HttpStats: output failures count as failed requests
        self.state = common.ChoiceState(index, tokenizer)
        self.output = OutputAccumulator()
        plan = plan or OutputPlan()
        self.stream = build_stream(plan.spec)
        self.policy = ToolPolicy(plan.tools, plan.choice)
        self.call_prefix = call_prefix

    def apply(self, event: GenerationEvent) -> list[OutputEvent]:
        delta = self.state.apply(event)
        try:
            outs = self.stream.feed(delta.token_ids, delta.text, delta.logprobs)
            failed = event.finished and event.finish_reason in (FinishReason.ERROR, FinishReason.ABORT)
            if event.finished and not failed:
                outs += self.stream.finish(truncated=event.finish_reason == FinishReason.LENGTH)
            events = self._route(outs)
            if event.finished and not failed:
                self.policy.finish()
        except (ToolParseError, OutputError) as exc:
            if self.stats is not None:
                self.stats.output_failures += 1
            message = _failure_message(exc)
            log.warning("%s; generated text: %r", message, self.state.full_text[-2000:])
            raise server_error(message) from None
        if event.finished:
            # The raw model output, for conformance write-ups (scripts/conformance.sh logs it).
            log.debug("finished (%s, last token %s); generated text: %r", event.finish_reason,
                      self.state.token_ids[-1:], self.state.full_text)
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


def _failure_message(exc: Exception) -> str:
    if isinstance(exc, ToolParseError):
        return f"the model's tool call could not be parsed: {exc}"
    return str(exc)


async def follow(group: GenerationGroup,
                 keepalive: Callable[[], Awaitable[None]] | None = None) -> AsyncIterator[GenerationEvent]:
    """Every event of a one-child group until its final one. With `keepalive`, it is awaited
    after each quiet KEEPALIVE_SECONDS (an SSE comment) so proxies keep the stream open."""
    while True:
        item = await group.next(KEEPALIVE_SECONDS if keepalive else None)
        if item is None:
            assert keepalive is not None
            await keepalive()
            continue
        _, event = item
        yield event
        if event.finished:
            return

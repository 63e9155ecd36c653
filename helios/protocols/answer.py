"""One generated answer followed from engine events to neutral output blocks.

Messages and Responses generate exactly one choice. They share the request lifecycle (`handle`),
read the answer through `Answer` (token accounting in `common.ChoiceState`, ordered blocks in
`frontend.output.OutputAccumulator`) and consume the engine through `follow`, which keeps an SSE
connection alive while the model waits. Their own modules only decode and encode.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

from aiohttp import web

from helios.engine.api import FinishReason, GenerationEvent, GenerationRequest
from helios.frontend.output import OutputAccumulator, OutputEvent
from helios.frontend.tokenizer import Tokenizer
from helios.protocols import common
from helios.server.admission import GenerationGroup
from helios.server.context import ServerContext
from helios.server.sse import KEEPALIVE_SECONDS


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
    """Usage counts and ordered output blocks of one choice, updated per engine event."""

    def __init__(self, tokenizer: Tokenizer, prompt_tokens: int):
        self.prompt_tokens = prompt_tokens
        self.state = common.ChoiceState(0, tokenizer)
        self.output = OutputAccumulator()

    def apply(self, event: GenerationEvent) -> list[OutputEvent]:
        delta = self.state.apply(event)
        events = self.output.feed(delta.text, delta.logprobs)
        if event.finished:
            events += self.output.finish()
        return events

    @property
    def cached_tokens(self) -> int:
        # The engine's admission count of reused prompt tokens (zero until prefix caching).
        return self.state.cached_tokens

    @property
    def completion_tokens(self) -> int:
        return self.state.completion_tokens

    @property
    def hit_limit(self) -> bool:
        return self.state.finish_reason == FinishReason.LENGTH


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

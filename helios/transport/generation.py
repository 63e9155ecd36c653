"""The one lifecycle of a generation request, shared by every generating protocol.

body -> the protocol's plan (frontend pool) -> admission slots -> engine group -> buffered or SSE
delivery -> the group is closed on every exit (which aborts unfinished work if the client left).
Protocols plug in as a `Codec`: a planner (JSON -> engine requests) and an `Encoder` (neutral
events -> that protocol's JSON object or SSE frames). Everything else lives here once:
admission, x-request-id, keep-alive comments, cancellation, and error framing (an output
contract failure or a failed engine request becomes an error in the protocol's own shape).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from aiohttp import web

from helios.engine.api import GenerationEvent, GenerationRequest
from helios.neutral.errors import OutputFailure
from helios.transport.admission import GenerationGroup, terminal_failure
from helios.transport.context import ServerContext, response_headers
from helios.transport.errors import ApiError, json_response, server_error
from helios.transport.logs import mark_client_left
from helios.transport.sse import KEEPALIVE_SECONDS, SSEWriter

log = logging.getLogger("helios.server")

SESSION_HEADERS = ("x-claude-code-session-id", "session_id", "session-id", "x-session-id")
Frame = tuple[Any, str | None]  # one SSE event: its data and its event name (None: unnamed)


class Plan(Protocol):
    """A validated request: its engine requests (empty: answered without the model)."""

    requests: list[GenerationRequest]
    stream: bool
    cache_key: str | None  # the client's conversation id from the body (prompt_cache_key), if any


class Encoder(Protocol):
    """Neutral engine events in, one protocol's JSON out. `apply` may raise OutputFailure."""

    done_sentinel: bool  # the stream ends with OpenAI's `data: [DONE]`

    def start(self) -> list[Frame]: ...
    def apply(self, index: int, event: GenerationEvent) -> list[Frame]: ...
    def end(self) -> list[Frame]: ...
    def body(self) -> Any: ...
    def failure(self, error: ApiError) -> list[Frame]: ...


@dataclass(frozen=True)
class Codec:
    """What one generating protocol adds to the lifecycle."""

    name: str  # for logs
    id_prefix: str  # response ids: id_prefix + 32 hex digits
    plan: Callable[[ServerContext, dict[str, Any], str], Plan]  # runs in the frontend pool
    encoder: Callable[[ServerContext, Any], Encoder]
    check_headers: Callable[[web.Request], None] | None = None  # before the body is read

    def new_id(self) -> str:
        return f"{self.id_prefix}{uuid.uuid4().hex}"


async def serve(request: web.Request, ctx: ServerContext, codec: Codec) -> web.StreamResponse:
    if codec.check_headers is not None:
        codec.check_headers(request)
    body = await ctx.read_json_object(request)
    response_id = codec.new_id()
    headers = response_headers(request, response_id)  # binds the request id before planning logs anything
    plan = await ctx.in_frontend(codec.plan, ctx, body, response_id)
    hint = session_hint(request.headers, plan.cache_key)
    for child in plan.requests:
        child.session_hint = hint
    encoder = codec.encoder(ctx, plan)
    if not plan.requests:  # answered from the prompt alone: it never reached the model
        return await _stream(request, ctx, codec, encoder, None, {}) if plan.stream else json_response(encoder.body())
    group = ctx.start_group(plan.requests, ctx.reserve(len(plan.requests)))
    # Links the request id (on this record and the access line) to the engine's request ids.
    log.debug("%s: %d engine request(s) %s-N", codec.name, len(plan.requests), response_id)
    try:
        if plan.stream:
            return await _stream(request, ctx, codec, encoder, group, headers)
        return await _buffered(ctx, encoder, group, headers)
    finally:
        group.close()  # aborts unfinished children on disconnect or failure


def session_hint(headers: Any, cache_key: str | None) -> str | None:
    """The client's conversation id, if it sent one: OpenAI's prompt_cache_key (decoded by the
    protocol), else a session header (Claude Code, Codex and generic forms). Only a routing hint:
    never trusted for access."""
    if cache_key is not None:
        return f"key:{cache_key}"
    for name in SESSION_HEADERS:
        value = headers.get(name)
        if value and len(value) <= 256:
            return f"session:{value}"
    return None


async def follow(
    group: GenerationGroup, keepalive: Callable[[], Awaitable[None]] | None = None
) -> AsyncIterator[tuple[int, GenerationEvent]]:
    """Every (child index, event) of a group until each child's final event. With `keepalive`,
    it is awaited after each quiet KEEPALIVE_SECONDS (an SSE comment) so proxies keep the stream."""
    remaining = len(group.requests)
    while remaining:
        item = await group.next(KEEPALIVE_SECONDS if keepalive else None)
        if item is None:
            assert keepalive is not None
            await keepalive()
            continue
        yield item
        if item[1].finished:
            remaining -= 1


def _output_failure(ctx: ServerContext, exc: OutputFailure) -> ApiError:
    ctx.http.output_failures += 1  # output contract failures count as failed requests
    return server_error(str(exc))


async def _buffered(
    ctx: ServerContext, encoder: Encoder, group: GenerationGroup, headers: dict[str, str]
) -> web.Response:
    async for index, event in follow(group):
        if event.finished and (failure := terminal_failure(event)) is not None:
            raise failure.with_headers(headers)
        try:
            encoder.apply(index, event)
        except OutputFailure as exc:
            raise _output_failure(ctx, exc).with_headers(headers) from None
    return json_response(encoder.body(), headers=headers)


async def _stream(
    request: web.Request,
    ctx: ServerContext,
    codec: Codec,
    encoder: Encoder,
    group: GenerationGroup | None,
    headers: dict[str, str],
) -> web.StreamResponse:
    writer = await SSEWriter.start(request, headers)

    async def send(frames: list[Frame]) -> None:
        for data, event in frames:
            await writer.send(data, event=event)

    try:
        await send(encoder.start())
        if group is not None:
            async for index, event in follow(group, writer.comment):
                if event.finished and (failure := terminal_failure(event)) is not None:
                    await _fail(writer, encoder, failure)
                    return writer.response
                await send(encoder.apply(index, event))
        await send(encoder.end())
        await (writer.done() if encoder.done_sentinel else writer.close())
    except ConnectionError:
        mark_client_left(request)  # serve's finally aborts what is still running
    except OutputFailure as exc:
        await _fail(writer, encoder, _output_failure(ctx, exc))
    except ApiError as exc:
        await _fail(writer, encoder, exc)
    except Exception:
        log.exception("%s stream failed", codec.name)
        await _fail(writer, encoder, server_error("the stream failed"))
    return writer.response


async def _fail(writer: SSEWriter, encoder: Encoder, error: ApiError) -> None:
    """The protocol's terminal error event(s), then end of body: no [DONE] or stop event follows."""
    try:
        for data, event in encoder.failure(error):
            await writer.send(data, event=event)
        await writer.close()
    except Exception:  # the connection is gone too
        pass

"""POST /v1/messages and /v1/messages/count_tokens: Anthropic Messages over the neutral conversation.

decode (system + content blocks -> Conversation) -> render through the chat template -> one
engine request -> encode the ordered output blocks as a message object or named SSE events
(message_start, content_block_start/delta/stop, message_delta with the final usage, message_stop).

Usage reports reused prompt tokens in cache_read_input_tokens and the rest in input_tokens, so
their sum is what count_tokens returns for the same request; cache writes are not accounted
separately (cache_creation_input_tokens is always 0).
"""

from __future__ import annotations

import dataclasses
import datetime
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from helios.engine.api import GenerationEvent, GenerationRequest
from helios.neutral.answer import Answer
from helios.neutral.output import Block, BlockClosed, BlockDelta, BlockOpened, OutputEvent
from helios.neutral.request import Lowered, OutputPlan, lower
from helios.neutral.sampling import resolve_max_tokens
from helios.protocols.messages_request import (
    Decoded,
    MessagesRequest,
    decode,
    decode_request,
    thinking_signature,
)
from helios.transport.context import ServerContext
from helios.transport.errors import ApiError, bad_request, json_response, messages_error_body
from helios.transport.generation import Codec, Frame

ANTHROPIC_VERSION = "2023-06-01"


@dataclass
class MessagesPlan:
    response_id: str
    prompt_ids: list[int]
    requests: list[GenerationRequest]
    stream: bool
    output: OutputPlan
    cache_key: str | None = None  # a routing hint


def require_version(request: web.Request) -> None:
    """The header is required. This server speaks the 2023-06-01 wire format; later dated versions
    are accepted because current SDKs send their own newer date for that same format (the pinned
    anthropic SDK sends 2026-10-21), while malformed or older versions are refused."""
    version = request.headers.get("anthropic-version")
    if version is None:
        raise bad_request(f"the anthropic-version header is required (anthropic-version: {ANTHROPIC_VERSION})")
    version = version.strip()
    try:
        dated = datetime.date.fromisoformat(version) if len(version) == 10 else None
    except ValueError:
        dated = None
    if dated is None or version < ANTHROPIC_VERSION:
        raise bad_request(f"unsupported anthropic-version {version!r}; this server implements {ANTHROPIC_VERSION}")


def _lower(ctx: ServerContext, decoded: Decoded, prepare: bool = True) -> Lowered:
    return lower(
        decoded.conversation,
        decoded.options,
        manifest=ctx.manifest,
        template=ctx.template,
        tokenizer=ctx.tokenizer,
        default_budget=ctx.config.thinking_token_budget,
        prepare=prepare,
    )


def _prompt(ctx: ServerContext, decoded: Decoded) -> list[int]:
    return _lower(ctx, decoded, prepare=False).prompt_ids


def count(ctx: ServerContext, body: dict[str, Any]) -> int:
    """The exact prepared input token count of the request /v1/messages would submit."""
    return len(_prompt(ctx, decode(ctx, body)))


def build(ctx: ServerContext, request: MessagesRequest, response_id: str) -> MessagesPlan:
    """Render the conversation and make its engine request."""
    lowered = _lower(ctx, request.decoded)
    max_tokens = resolve_max_tokens(request.max_tokens, len(lowered.prompt_ids), ctx.manifest.limits)
    requests = lowered.requests(response_id, dataclasses.replace(request.sampling, max_tokens=max_tokens))
    return MessagesPlan(response_id, lowered.prompt_ids, requests, request.stream, lowered.output, request.cache_key)


def plan(ctx: ServerContext, body: dict[str, Any], response_id: str) -> MessagesPlan:
    """Decode (messages_request.py), then build (runs in the frontend pool)."""
    return build(ctx, decode_request(ctx, body), response_id)


# -- encoding --------------------------------------------------------------------------------------


def usage(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt_tokens - cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached_tokens,
        "output_tokens": output_tokens,
    }


STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use", "stop_sequence": "stop_sequence", "stop": "end_turn"}


def stop_reason(answer: Answer) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence): the limit wins only when it was the terminal cause; calls
    that complete an answer the user did not stop are tool_use; EOS and token stops end_turn."""
    reason = STOP_REASONS[answer.cause]
    return reason, answer.state.stop_reason if reason == "stop_sequence" else None


def content_block(block: Block) -> dict[str, Any]:
    if block.kind == "reasoning":
        return {"type": "thinking", "thinking": block.text, "signature": thinking_signature(block.text)}
    if block.kind == "tool_call":
        call = block.call
        assert call is not None
        return {"type": "tool_use", "id": call.id, "name": call.name, "input": call.arguments}
    return {"type": "text", "text": block.text}


def message_object(
    ctx: ServerContext,
    p: MessagesPlan,
    content: list[dict[str, Any]],
    reason: str | None,
    sequence: str | None,
    usage_: dict[str, Any],
) -> dict[str, Any]:
    return {
        "id": p.response_id,
        "type": "message",
        "role": "assistant",
        "model": ctx.model_id,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage_,
    }


class MessagesEncoder:
    """One Answer; a message object, or the named SSE events of its ordered blocks."""

    done_sentinel = False

    def __init__(self, ctx: ServerContext, p: MessagesPlan):
        self.ctx, self.p = ctx, p
        self.answer = Answer(ctx.tokenizer, len(p.prompt_ids), p.output, call_prefix="toolu_")

    def usage(self) -> dict[str, Any]:
        a = self.answer
        return usage(a.prompt_tokens, a.cached_tokens, a.completion_tokens)

    def start(self) -> list[Frame]:
        # The full prompt with zero cache reads; message_delta carries the final counts (api.md).
        start = message_object(self.ctx, self.p, [], None, None, usage(self.answer.prompt_tokens, 0, 0))
        return [_named({"type": "message_start", "message": start})]

    def apply(self, index: int, event: GenerationEvent) -> list[Frame]:
        items = self.answer.apply(event)
        return [_named(frame) for item in items for frame in _frames(item)] if self.p.stream else []

    def end(self) -> list[Frame]:
        reason, sequence = stop_reason(self.answer)
        return [
            _named(
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": reason, "stop_sequence": sequence},
                    "usage": self.usage(),
                }
            ),
            _named({"type": "message_stop"}),
        ]

    def failure(self, error: ApiError) -> list[Frame]:
        return [(messages_error_body(error), "error")]  # no message_stop follows

    def body(self) -> dict[str, Any]:
        reason, sequence = stop_reason(self.answer)
        content = [content_block(b) for b in self.answer.output.blocks]
        return message_object(self.ctx, self.p, content, reason, sequence, self.usage())


def _named(data: dict[str, Any]) -> Frame:
    return data, data["type"]  # the SDK dispatches on the event name


def _frames(item: OutputEvent) -> list[dict[str, Any]]:
    block = item.block
    index = block.index
    if isinstance(item, BlockOpened):
        if block.kind == "reasoning":
            opened: dict[str, Any] = {"type": "thinking", "thinking": "", "signature": ""}
        elif block.kind == "tool_call":
            opened = {**content_block(block), "input": {}}
        else:
            opened = {"type": "text", "text": ""}
        return [{"type": "content_block_start", "index": index, "content_block": opened}]
    if isinstance(item, BlockDelta):
        if not item.text:
            return []
        if block.kind == "reasoning":
            delta = {"type": "thinking_delta", "thinking": item.text}
        elif block.kind == "tool_call":
            assert block.call is not None
            delta = {"type": "input_json_delta", "partial_json": block.call.arguments_json}
        else:
            delta = {"type": "text_delta", "text": item.text}
        return [{"type": "content_block_delta", "index": index, "delta": delta}]
    if isinstance(item, BlockClosed):
        frames = []
        if block.kind == "reasoning":  # the block's marker, once its text is complete
            frames.append(
                {
                    "type": "content_block_delta",
                    "index": index,
                    "delta": {"type": "signature_delta", "signature": thinking_signature(block.text)},
                }
            )
        return frames + [{"type": "content_block_stop", "index": index}]
    return []


async def handle_count(request: web.Request, ctx: ServerContext) -> web.Response:
    require_version(request)
    body = await ctx.read_json_object(request)
    return json_response({"input_tokens": await ctx.in_frontend(count, ctx, body)})


CODEC = Codec("messages", "msg_", plan, MessagesEncoder, check_headers=require_version)

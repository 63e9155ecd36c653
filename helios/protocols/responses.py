"""POST /v1/responses: stateless OpenAI Responses over the neutral conversation (decoding:
responses_request.py).

Requests carry the whole conversation (input items plus instructions); nothing is stored, so
store: true, previous_response_id, conversation, background and truncation: "auto" are 400s.
Output items come from the ordered output blocks, keep their order and ids for the whole
response, and stream as named lifecycle events with increasing sequence_number, ending in
response.completed, response.incomplete (max_output_tokens) or response.failed, never [DONE].
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass
from typing import Any

from helios.engine.api import GenerationEvent, GenerationRequest, SamplingParams
from helios.neutral.answer import Answer
from helios.neutral.output import Block, BlockDelta, BlockOpened, OutputEvent
from helios.neutral.request import OutputPlan, lower
from helios.neutral.sampling import resolve_max_tokens
from helios.protocols import common
from helios.protocols.responses_request import ResponsesRequest, decode
from helios.transport.context import ServerContext
from helios.transport.errors import ApiError
from helios.transport.generation import Codec, Frame

ITEM_PREFIXES = {"text": "msg", "reasoning": "rs", "tool_call": "fc"}


@dataclass
class ResponsesPlan:
    response_id: str
    prompt_ids: list[int]
    requests: list[GenerationRequest]
    stream: bool
    logprobs: int | None  # natural alternatives per output_text entry; None: not included
    as_token_ids: bool
    echo: dict[str, Any]  # request settings repeated in every response object
    sampling: SamplingParams
    output: OutputPlan
    cache_key: str | None = None  # prompt_cache_key: a routing hint


def build(ctx: ServerContext, request: ResponsesRequest, response_id: str) -> ResponsesPlan:
    """Render the conversation and make its engine request."""
    lowered = lower(
        request.conversation,
        request.options,
        manifest=ctx.manifest,
        template=ctx.template,
        tokenizer=ctx.tokenizer,
        default_budget=ctx.config.thinking_token_budget,
    )
    prompt_ids = lowered.prompt_ids
    max_tokens = resolve_max_tokens(
        request.max_output_tokens, len(prompt_ids), ctx.manifest.limits, name="max_output_tokens"
    )
    sampling = dataclasses.replace(request.sampling, max_tokens=max_tokens)
    return ResponsesPlan(
        response_id=response_id,
        prompt_ids=prompt_ids,
        requests=lowered.requests(response_id, sampling),
        stream=request.stream,
        logprobs=request.top_logprobs,
        as_token_ids=request.as_token_ids,
        echo=dict(request.echo),
        sampling=sampling,
        output=lowered.output,
        cache_key=request.cache_key,
    )


def plan(ctx: ServerContext, body: dict[str, Any], response_id: str) -> ResponsesPlan:
    """Decode (responses_request.py), then build (runs in the frontend pool)."""
    return build(ctx, decode(ctx, body), response_id)


# -- encoding --------------------------------------------------------------------------------------


class ResponsesEncoder:
    """Output items and response objects from one Answer; item ids are fixed when a block opens.
    Streams are named lifecycle events with one increasing sequence_number."""

    done_sentinel = False

    def __init__(self, ctx: ServerContext, plan: ResponsesPlan):
        self.ctx, self.plan = ctx, plan
        self.answer = Answer(ctx.tokenizer, len(plan.prompt_ids), plan.output)
        self.created_at = common.now()
        self.item_ids: dict[int, str] = {}
        self.sequence = 0

    def event(self, kind: str, **fields: Any) -> Frame:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return data, kind

    def start(self) -> list[Frame]:
        return [
            self.event("response.created", response=self.response("in_progress")),
            self.event("response.in_progress", response=self.response("in_progress")),
        ]

    def apply(self, index: int, event: GenerationEvent) -> list[Frame]:
        items = self.answer.apply(event)
        if not self.plan.stream:
            return []
        return [
            frame
            for item in items
            for frame in (_call_events(self, item) if item.block.kind == "tool_call" else _output_events(self, item))
        ]

    def end(self) -> list[Frame]:
        status = self.final_status()
        return [self.event(f"response.{status}", response=self.response(status))]

    def failure(self, error: ApiError) -> list[Frame]:
        """response.failed is the terminal event of a generation failure; nothing follows it."""
        return [self.event("response.failed", response=self.response("failed", error))]

    def body(self) -> dict[str, Any]:
        return self.response(self.final_status())

    def item_id(self, block: Block) -> str:
        if block.index not in self.item_ids:
            prefix = ITEM_PREFIXES[block.kind]
            if block.call is not None and block.call.custom_input is not None:
                prefix = "ctc"
            self.item_ids[block.index] = f"{prefix}_{uuid.uuid4().hex}"
        return self.item_ids[block.index]

    def entries(self, logprobs: list) -> list[dict[str, Any]]:
        if self.plan.logprobs is None:
            return []
        return common.chat_logprob_entries(self.ctx.tokenizer, logprobs, self.plan.logprobs, self.plan.as_token_ids)

    def part(self, block: Block) -> dict[str, Any]:
        return {"type": "output_text", "text": block.text, "annotations": [], "logprobs": self.entries(block.logprobs)}

    def item(self, block: Block) -> dict[str, Any]:
        if not block.closed:
            status = "in_progress"
        else:
            status = "incomplete" if self.answer.hit_limit and block.kind != "tool_call" else "completed"
        if block.kind == "reasoning":
            # Readable reasoning: reasoning_text content, an empty summary, no encrypted state.
            return {
                "id": self.item_id(block),
                "type": "reasoning",
                "summary": [],
                "status": status,
                "content": [{"type": "reasoning_text", "text": block.text}],
            }
        if block.kind == "tool_call":
            call = block.call
            assert call is not None
            if call.custom_input is not None:
                item: dict[str, Any] = {
                    "id": self.item_id(block),
                    "type": "custom_tool_call",
                    "call_id": call.id,
                    "name": call.name,
                    "input": call.custom_input,
                }
            else:
                item = {
                    "id": self.item_id(block),
                    "type": "function_call",
                    "call_id": call.id,
                    "name": call.name,
                    "arguments": call.arguments_json,
                    "status": status,
                }
            if call.namespace is not None:
                item["namespace"] = call.namespace
            return item
        return {
            "id": self.item_id(block),
            "type": "message",
            "status": status,
            "role": "assistant",
            "content": [self.part(block)],
        }

    def usage(self) -> dict[str, Any]:
        a = self.answer
        return {
            "input_tokens": a.prompt_tokens,
            "input_tokens_details": {"cached_tokens": a.cached_tokens},
            "output_tokens": a.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": a.reasoning_tokens},
            "total_tokens": a.prompt_tokens + a.completion_tokens,
        }

    def response(self, status: str, error: ApiError | None = None) -> dict[str, Any]:
        final = status in ("completed", "incomplete", "failed")
        s = self.plan.sampling
        return {
            "id": self.plan.response_id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": {"code": error.code or error.type, "message": error.message} if error else None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "model": self.ctx.model_id,
            "output": [self.item(b) for b in self.answer.output.blocks],
            "temperature": s.temperature,
            "top_p": s.top_p,
            "usage": self.usage() if final and status != "failed" else None,
            **self.plan.echo,
        }

    def final_status(self) -> str:
        return "incomplete" if self.answer.hit_limit else "completed"


def _output_events(encoder: ResponsesEncoder, item: OutputEvent) -> list[Frame]:
    block = item.block
    where = {"item_id": encoder.item_id(block), "output_index": block.index}
    reasoning = block.kind == "reasoning"
    kind = "reasoning_text" if reasoning else "output_text"
    emit = encoder.event
    if isinstance(item, BlockOpened):
        opened = {**encoder.item(block), "content": []}
        part = (
            {"type": "reasoning_text", "text": ""}
            if reasoning
            else {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        )
        return [
            emit("response.output_item.added", output_index=block.index, item=opened),
            emit("response.content_part.added", **where, content_index=0, part=part),
        ]
    if isinstance(item, BlockDelta):
        if reasoning:
            return [emit("response.reasoning_text.delta", **where, content_index=0, delta=item.text)]
        return [
            emit(
                "response.output_text.delta",
                **where,
                content_index=0,
                delta=item.text,
                logprobs=encoder.entries(item.logprobs),
            )
        ]
    done = encoder.item(block)
    part = done["content"][0]
    extra = {} if reasoning else {"logprobs": part["logprobs"]}
    return [
        emit(f"response.{kind}.done", **where, content_index=0, text=block.text, **extra),
        emit("response.content_part.done", **where, content_index=0, part=part),
        emit("response.output_item.done", output_index=block.index, item=done),
    ]


def _call_events(encoder: ResponsesEncoder, item: OutputEvent) -> list[Frame]:
    """A call arrives complete: added, its whole arguments (or custom input) as one delta, done."""
    block = item.block
    call = block.call
    assert call is not None
    where = {"item_id": encoder.item_id(block), "output_index": block.index}
    custom = call.custom_input is not None
    emit = encoder.event
    if isinstance(item, BlockOpened):
        opened = encoder.item(block)
        opened.update({"input": ""} if custom else {"arguments": "", "status": "in_progress"})
        return [emit("response.output_item.added", output_index=block.index, item=opened)]
    if isinstance(item, BlockDelta):
        kind = "custom_tool_call_input" if custom else "function_call_arguments"
        return [emit(f"response.{kind}.delta", **where, delta=block.text)]
    done = (
        emit("response.custom_tool_call_input.done", **where, input=block.text)
        if custom
        else emit("response.function_call_arguments.done", **where, arguments=block.text, name=call.name)
    )
    return [done, emit("response.output_item.done", output_index=block.index, item=encoder.item(block))]


CODEC = Codec("responses", "resp_", plan, ResponsesEncoder)

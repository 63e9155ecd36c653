"""POST /v1/chat/completions: OpenAI Chat Completions over the neutral conversation.

decode (JSON -> Conversation + options) -> frontend lowering (template, tools, grammar, one engine
request per choice) -> encode events as a chat.completion object or chat.completion.chunk SSE.
The request lifecycle around both is helios.transport.generation's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from helios.engine.api import GenerationEvent, GenerationRequest, SamplingParams
from helios.neutral.answer import Answer
from helios.neutral.conversation import (
    Conversation,
    ImagePart,
    Message,
    Part,
    ReasoningPart,
    TextPart,
    ToolCallPart,
    ToolResultPart,
    ToolSpec,
)
from helios.neutral.errors import RequestError
from helios.neutral.grammar import OutputFormat
from helios.neutral.images import decode_data_url
from helios.neutral.output import BlockDelta, BlockOpened, OutputEvent
from helios.neutral.request import ChatOptions, Lowered, OutputPlan, lower
from helios.neutral.sampling import check_top_logprobs, requested_max_tokens, resolve_max_tokens
from helios.neutral.thinking import Budget, check_budget, check_effort, template_kwargs
from helios.neutral.tools import EmittedCall, ToolChoice, unique_names
from helios.protocols import common
from helios.protocols.fields import choice_count, opt_bool, opt_object
from helios.transport.context import ServerContext
from helios.transport.generation import Codec, Frame

ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass
class ChatPlan:
    """A validated chat request, ready to submit."""

    response_id: str
    prompt_ids: list[int]
    requests: list[GenerationRequest]
    stream: bool
    options: common.StreamOptions
    logprobs: int | None  # natural alternatives per entry, None when logprobs are off
    as_token_ids: bool
    return_token_ids: bool
    return_timestamps: bool
    base: SamplingParams
    output: OutputPlan
    prompt_logprobs: int | None = None  # alternatives of the top-level prompt_logprobs; None: omitted
    cache_key: str | None = None  # prompt_cache_key: a routing hint


# -- decoding --------------------------------------------------------------------------------------


def decode_messages(value: Any) -> list[Message]:
    if not isinstance(value, list) or not value:
        raise RequestError("messages must be a nonempty array", param="messages")
    return [_decode_message(m, i) for i, m in enumerate(value)]


def _decode_message(raw: Any, index: int) -> Message:
    where = f"messages[{index}]"
    if not isinstance(raw, dict):
        raise RequestError(f"{where} must be an object", param="messages")
    role = raw.get("role")
    if role not in ROLES:
        raise RequestError(f"{where}.role must be one of {', '.join(ROLES)}", param="messages")
    name = raw.get("name")
    if name is not None and not isinstance(name, str):
        raise RequestError(f"{where}.name must be a string", param="messages")
    parts = _decode_content(raw.get("content"), where, role)
    if role == "assistant":
        reasoning = raw.get("reasoning_content", raw.get("reasoning"))
        if reasoning is not None:
            if not isinstance(reasoning, str):
                raise RequestError(f"{where}.reasoning_content must be a string", param="messages")
            if reasoning:
                parts.insert(0, ReasoningPart(reasoning))
        parts.extend(_decode_tool_calls(raw.get("tool_calls"), where))
    if role == "tool":
        call_id = raw.get("tool_call_id")
        if call_id is not None and not isinstance(call_id, str):
            raise RequestError(f"{where}.tool_call_id must be a string", param="messages")
        content = [p for p in parts if isinstance(p, (TextPart, ImagePart))]
        parts = [ToolResultPart(call_id or "", content)]
    return Message(role, parts, name=name)


def _decode_content(content: Any, where: str, role: str) -> list[Part]:
    if content is None:
        return []
    if isinstance(content, str):
        return [TextPart(content)]
    if not isinstance(content, list):
        raise RequestError(f"{where}.content must be a string or an array of content parts", param="messages")
    parts: list[Part] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append(TextPart(part["text"]))
        elif kind == "refusal" and role == "assistant" and isinstance(part.get("refusal"), str):
            parts.append(TextPart(part["refusal"]))
        elif kind == "image_url" and role in ("user", "tool"):
            image = part.get("image_url")
            url = image.get("url") if isinstance(image, dict) else image
            if not isinstance(url, str):
                raise RequestError(f"{where}.content[{j}].image_url.url must be a string", param="messages")
            parts.append(ImagePart(*decode_data_url(url, "messages")))
        else:
            raise RequestError(f"{where}.content[{j}] has an unsupported content part type {kind!r}", param="messages")
    return parts


def _decode_tool_calls(value: Any, where: str) -> list[ToolCallPart]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise RequestError(f"{where}.tool_calls must be an array", param="messages")
    calls = []
    for j, call in enumerate(value):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RequestError(f"{where}.tool_calls[{j}] needs function.name", param="messages")
        arguments = fn.get("arguments", "{}")
        if not isinstance(arguments, (str, dict)):
            raise RequestError(f"{where}.tool_calls[{j}].function.arguments must be a JSON string", param="messages")
        call_id = call.get("id") or ""
        if not isinstance(call_id, str):
            raise RequestError(f"{where}.tool_calls[{j}].id must be a string", param="messages")
        calls.append(ToolCallPart(call_id, fn["name"], arguments))
    return calls


def decode_tools(body: dict[str, Any]) -> tuple[list[ToolSpec], ToolChoice]:
    tools = body.get("tools")
    if tools is None:
        tools = []
    if not isinstance(tools, list):
        raise RequestError("tools must be an array", param="tools")
    specs = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise RequestError(f"tools[{i}] must be a function tool with a name", param="tools")
        if fn.get("strict") is True:
            raise RequestError("strict function schemas (strict: true) are not supported", param="tools")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise RequestError(f"tools[{i}].function.parameters must be an object", param="tools")
        description = fn.get("description")
        if description is not None and not isinstance(description, str):
            raise RequestError(f"tools[{i}].function.description must be a string", param="tools")
        specs.append(ToolSpec(fn["name"], description, params))
    unique_names(specs)
    choice = body.get("tool_choice")
    parallel = opt_bool(body, "parallel_tool_calls", True)
    if choice is None or choice in ("auto", "none", "required"):
        return specs, ToolChoice(choice or "auto", parallel=parallel)
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise RequestError('tool_choice must be "auto", "none", "required" or a named function', param="tool_choice")
    return specs, ToolChoice("named", fn["name"], parallel)


def decode_output_format(body: dict[str, Any]) -> tuple[OutputFormat | None, str]:
    fmt = common.decode_format(body.get("response_format"), "response_format", nested=True)
    guided, param = common.decode_guided(body)
    if fmt is not None and guided is not None:
        raise RequestError("response_format cannot be combined with guided decoding", param=param)
    return (fmt, "response_format") if fmt is not None else (guided, param)


@dataclass(frozen=True)
class ChatRequest:
    """A Chat Completions body decoded once: every field validated (against the core where the
    core bounds it); build() reads only this."""

    conversation: Conversation
    tools: list[ToolSpec]
    tool_choice: ToolChoice
    output_format: OutputFormat | None
    output_format_param: str
    thinking_budget: int | None
    template_kwargs: dict[str, Any]  # chat_template_kwargs, the thinking variables filled in
    n: int
    stream: bool
    stream_options: common.StreamOptions
    top_logprobs: int | None  # natural alternatives per entry; None: logprobs off
    prompt_logprobs: int | None
    add_generation_prompt: bool
    continue_final: bool
    sampling: SamplingParams  # without max_tokens, which needs the rendered prompt
    max_tokens: int | None  # max_completion_tokens, else max_tokens (bounded by the prompt in build)
    max_tokens_param: str
    as_token_ids: bool
    return_token_ids: bool
    return_timestamps: bool
    cache_key: str | None


def decode(ctx: ServerContext, body: dict[str, Any]) -> ChatRequest:
    """The body's fields, checked in the order their errors are reported."""
    m = ctx.manifest
    messages = decode_messages(body.get("messages"))
    tools, choice = decode_tools(body)
    if body.get("chat_template") is not None:
        raise RequestError("custom chat templates are not accepted; the core's template is used", param="chat_template")
    fmt, fmt_param = decode_output_format(body)
    budget = check_budget(body.get("thinking_token_budget"))
    effort = check_effort(body.get("reasoning_effort"), "reasoning_effort", m.template.numeric_effort)
    common.reject_unsupported_extensions(body, structured=True, biased=True)
    n = choice_count(body)
    if n > ctx.admission.slots:
        raise RequestError(f"n={n} needs more admission slots than this server has ({ctx.admission.slots})", param="n")
    stream = opt_bool(body, "stream", False)
    options = common.stream_options(body)

    logprobs_on = opt_bool(body, "logprobs", False)
    top = common.opt_logprob_count(body, "top_logprobs")
    if top and not logprobs_on:
        raise RequestError("top_logprobs requires logprobs: true", param="top_logprobs")
    k = check_top_logprobs(top or 0, "top_logprobs", m.logprobs) if logprobs_on else None
    explicit = common.logprob_token_ids(body, logprobs_on, m)
    prompt_k = common.prompt_logprobs_count(body.get("prompt_logprobs"), streaming=stream, manifest=m)

    add_generation_prompt = opt_bool(body, "add_generation_prompt", True)
    continue_final = opt_bool(body, "continue_final_message", False)
    kwargs = opt_object(body, "chat_template_kwargs") or {}
    kwargs = template_kwargs(
        kwargs,
        enabled=common.reasoning_switch(body, kwargs),
        effort=effort,
        template_source=ctx.template.source if ctx.template else None,
    )
    sampling = common.request_sampling(body, m, logprobs=k, biased=True)
    sampling.logprob_token_ids = explicit
    max_tokens_param = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = requested_max_tokens(body.get(max_tokens_param), max_tokens_param, allow_zero=False)
    return ChatRequest(
        conversation=Conversation(messages),
        tools=tools,
        tool_choice=choice,
        output_format=fmt,
        output_format_param=fmt_param,
        thinking_budget=budget,
        template_kwargs=kwargs,
        n=n,
        stream=stream,
        stream_options=options,
        top_logprobs=k,
        prompt_logprobs=prompt_k,
        add_generation_prompt=add_generation_prompt,
        continue_final=continue_final,
        sampling=sampling,
        max_tokens=max_tokens,
        max_tokens_param=max_tokens_param,
        as_token_ids=opt_bool(body, "return_tokens_as_token_ids", False),
        return_token_ids=opt_bool(body, "return_token_ids", False),
        return_timestamps=opt_bool(body, "return_token_timestamps", False),
        cache_key=common.prompt_cache_key(body),
    )


def render(ctx: ServerContext, request: ChatRequest, prepare: bool = True) -> Lowered:
    """The conversation lowered through the core's template (`prepare` False: the prompt only,
    as /tokenize counts it)."""
    chat_options = ChatOptions(
        tools=request.tools,
        choice=request.tool_choice,
        output_format=request.output_format,
        output_format_param=request.output_format_param,
        template_kwargs=request.template_kwargs,
        add_generation_prompt=request.add_generation_prompt,
        continue_final=request.continue_final,
        budget=Budget(request.thinking_budget, explicit=request.thinking_budget is not None),
        user_stops=request.sampling.has_user_stops,
        ignore_eos=request.sampling.ignore_eos,
    )
    return lower(
        request.conversation,
        chat_options,
        manifest=ctx.manifest,
        template=ctx.template,
        tokenizer=ctx.tokenizer,
        default_budget=ctx.config.thinking_token_budget,
        prepare=prepare,
    )


def build(ctx: ServerContext, request: ChatRequest, response_id: str) -> ChatPlan:
    """Render the conversation and make one engine request per choice."""
    lowered = render(ctx, request)
    max_tokens = resolve_max_tokens(
        request.max_tokens,
        len(lowered.prompt_ids),
        ctx.manifest.limits,
        name=request.max_tokens_param,
    )
    base = dataclasses.replace(request.sampling, max_tokens=max_tokens)
    return ChatPlan(
        response_id=response_id,
        prompt_ids=lowered.prompt_ids,
        # The top-level prompt_logprobs field reports one scoring of the shared prompt.
        requests=lowered.requests(response_id, base, choices=request.n, prompt_logprobs=request.prompt_logprobs),
        stream=request.stream,
        options=request.stream_options,
        logprobs=request.top_logprobs,
        as_token_ids=request.as_token_ids,
        return_token_ids=request.return_token_ids,
        return_timestamps=request.return_timestamps,
        base=base,
        output=lowered.output,
        prompt_logprobs=request.prompt_logprobs,
        cache_key=request.cache_key,
    )


def plan(ctx: ServerContext, body: dict[str, Any], response_id: str) -> ChatPlan:
    """Decode, then build (runs in the frontend pool)."""
    return build(ctx, decode(ctx, body), response_id)


# -- encoding --------------------------------------------------------------------------------------


def finish_reason(answer: Answer) -> str:
    """length, tool_calls (parsed calls completed an answer the user did not stop) or stop."""
    cause = answer.cause
    return cause if cause in ("length", "tool_calls") else "stop"


def _tool_call(call: EmittedCall, index: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments_json},
    }
    return out if index is None else {"index": index, **out}


def _delta(events: list[OutputEvent], calls_before: int) -> dict[str, Any]:
    """One chunk's delta from the block events of one engine event."""
    delta: dict[str, Any] = {}
    content = "".join(e.text for e in events if isinstance(e, BlockDelta) and e.block.kind == "text")
    reasoning = "".join(e.text for e in events if isinstance(e, BlockDelta) and e.block.kind == "reasoning")
    calls = [e.block.call for e in events if isinstance(e, BlockOpened) and e.block.call is not None]
    if reasoning:
        delta["reasoning_content"] = reasoning
    if content:
        delta["content"] = content
    if calls:
        delta["tool_calls"] = [_tool_call(c, calls_before + k) for k, c in enumerate(calls)]
    return delta


class ChatEncoder(common.OpenAIStream):
    """One Answer per choice; a chat.completion object, or chat.completion.chunk frames."""

    def __init__(self, ctx: ServerContext, p: ChatPlan):
        self.ctx, self.p, self.options = ctx, p, p.options
        self.answers = [Answer(ctx.tokenizer, len(p.prompt_ids), p.output, index=i) for i in range(len(p.requests))]
        self.created = common.now()
        self.role_sent = [False] * len(self.answers)
        self.calls_sent = [0] * len(self.answers)

    def usage(self) -> dict[str, Any]:
        return common.usage(
            len(self.p.prompt_ids),
            sum(a.completion_tokens for a in self.answers),
            self.answers[0].cached_tokens,  # the first choice's admission count (prompt counted once)
            reasoning_tokens=sum(a.reasoning_tokens for a in self.answers),
            image_tokens=sum(image.tokens for image in self.p.requests[0].images) if self.p.requests else 0,
        )

    def chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        out = {
            "id": self.p.response_id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.ctx.model_id,
            "choices": choices,
        }
        if self.p.options.continuous_usage:
            out["usage"] = self.usage()  # cumulative counts on every chunk
        return out

    def start(self) -> list[Frame]:
        return []

    def apply(self, index: int, event: GenerationEvent) -> list[Frame]:
        p, answer = self.p, self.answers[index]
        state = answer.state
        before = len(state.logprobs), len(state.token_ids), len(state.timestamps_ns)
        events = answer.apply(event)
        if not p.stream:
            return []
        frames: list[Frame] = []
        if not self.role_sent[index] and (event.token_ids or event.finished):
            # The role delta waits for the first generated token (api.md).
            self.role_sent[index] = True
            frames.append(
                (
                    self.chunk(
                        [
                            {
                                "index": index,
                                "delta": {"role": "assistant", "content": ""},
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ]
                    ),
                    None,
                )
            )
        entries = state.logprobs[before[0] :] if p.logprobs is not None else []
        ids = state.token_ids[before[1] :] if p.return_token_ids else []
        delta = _delta(events, self.calls_sent[index])
        self.calls_sent[index] += len(delta.get("tool_calls", []))
        if not (delta or entries or ids or event.finished):
            return frames
        if not delta and (entries or ids):
            delta = {"content": ""}
        choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
        if entries:
            choice["logprobs"] = {
                "content": common.chat_logprob_entries(self.ctx.tokenizer, entries, p.logprobs or 0, p.as_token_ids)
            }
        if p.return_token_ids:
            choice["token_ids"] = ids
        if p.return_timestamps:
            choice["token_timestamps_ns"] = state.timestamps_ns[before[2] :]
        if event.finished:
            choice["finish_reason"] = finish_reason(answer)
            choice["stop_reason"] = state.stop_reason
        out = self.chunk([choice])
        if event.finished and (p.return_token_ids or p.return_timestamps):
            out["reused_prompt_tokens"] = self.answers[0].cached_tokens
        last = all(a.state.finished for a in self.answers)
        if last and p.return_token_ids and not p.options.include_usage:
            out["usage"] = self.usage()
        return frames + [(out, None)]

    def body(self) -> dict[str, Any]:
        p, tokenizer = self.p, self.ctx.tokenizer
        choices = []
        for a in self.answers:
            s = a.state
            text, reasoning, calls = a.output.text("text"), a.output.text("reasoning"), a.output.calls
            choice: dict[str, Any] = {
                "index": s.index,
                "message": {
                    "role": "assistant",
                    "content": text if text or not calls else None,
                    "refusal": None,
                    "tool_calls": [_tool_call(c) for c in calls],
                    "reasoning_content": reasoning or None,
                },
                "logprobs": None,
                "finish_reason": finish_reason(a),
                "stop_reason": s.stop_reason,
            }
            if p.logprobs is not None:
                choice["logprobs"] = {
                    "content": common.chat_logprob_entries(tokenizer, s.logprobs, p.logprobs, p.as_token_ids)
                }
            if p.return_token_ids:
                choice["token_ids"] = s.token_ids
            if p.return_timestamps:
                choice["token_timestamps_ns"] = s.timestamps_ns
            choices.append(choice)
        first = self.answers[0]
        out: dict[str, Any] = {
            "id": p.response_id,
            "object": "chat.completion",
            "created": common.now(),
            "model": self.ctx.model_id,
            "choices": choices,
            "usage": self.usage(),
            "system_fingerprint": None,
            "prompt_logprobs": (
                common.prompt_logprobs_field(tokenizer, first.state.prompt_logprobs, p.prompt_logprobs)
                if p.prompt_logprobs is not None
                else None
            ),
        }
        if p.return_token_ids:
            out["prompt_token_ids"] = p.prompt_ids
        if p.return_token_ids or p.return_timestamps:
            out["reused_prompt_tokens"] = first.cached_tokens
        return out


CODEC = Codec("chat", "chatcmpl-", plan, ChatEncoder)

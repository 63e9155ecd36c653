"""POST /v1/chat/completions: OpenAI Chat Completions over the neutral conversation.

decode (JSON -> Conversation + options) -> render through the chat template -> one engine
request per choice -> encode events as a chat.completion object or chat.completion.chunk SSE.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from helios.engine.api import GenerationRequest, SamplingParams
from helios.frontend.conversation import (
    Conversation,
    ImagePart,
    Message,
    Part,
    ReasoningPart,
    TextPart,
    ToolCallPart,
    ToolResultPart,
    ToolSpec,
    render_prompt,
)
from helios.frontend.errors import RequestError
from helios.frontend.sampling import (
    DISTRIBUTION_FIELDS,
    SamplingFields,
    check_top_logprobs,
    child_seed,
    require_int,
    resolve_max_tokens,
    resolve_sampling,
)
from helios.protocols import common
from helios.server.admission import GenerationGroup, terminal_failure
from helios.server.context import ServerContext, new_response_id, response_headers
from helios.server.errors import ApiError, json_response, server_error
from helios.server.sse import KEEPALIVE_SECONDS, SSEWriter

log = logging.getLogger("helios.chat")

ROLES = ("system", "developer", "user", "assistant", "tool")
_INT32_MAX = (1 << 31) - 1


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
        elif kind == "image_url":
            # Text-only cores advertise input_modalities ["text"]; the vision issue decodes these.
            raise RequestError("this model core does not accept image input", param="messages")
        else:
            raise RequestError(f"{where}.content[{j}] has an unsupported content part type {kind!r}",
                               param="messages")
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
            raise RequestError(f"{where}.tool_calls[{j}].function.arguments must be a JSON string",
                               param="messages")
        call_id = call.get("id") or ""
        if not isinstance(call_id, str):
            raise RequestError(f"{where}.tool_calls[{j}].id must be a string", param="messages")
        calls.append(ToolCallPart(call_id, fn["name"], arguments))
    return calls


def decode_tools(body: dict[str, Any], supports_tools: bool) -> list[ToolSpec]:
    tools = body.get("tools")
    choice = body.get("tool_choice")
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
    if choice is not None and choice not in ("auto", "none", "required") and not isinstance(choice, dict):
        raise RequestError('tool_choice must be "auto", "none", "required" or a named function', param="tool_choice")
    if choice == "required" and not specs:
        raise RequestError('tool_choice "required" needs at least one tool', param="tool_choice")
    if choice == "required" or isinstance(choice, dict):
        # Needs the tool-call parser and output validator (tools issue).
        raise RequestError("required and named tool_choice are not supported yet", param="tool_choice")
    if specs and not supports_tools:
        raise RequestError("this model core's chat template does not support tools", param="tools")
    if choice == "none":
        return []  # the model is told about no tools it must not call
    return specs


def plan(ctx: ServerContext, body: dict[str, Any], response_id: str) -> ChatPlan:
    """Validate everything and build every child request (runs in the frontend pool)."""
    m = ctx.manifest
    messages = decode_messages(body.get("messages"))
    tools = decode_tools(body, m.template.supports_tools)
    if body.get("chat_template") is not None:
        raise RequestError("custom chat templates are not accepted; the core's template is used",
                           param="chat_template")
    fmt = common.opt_object(body, "response_format")
    if fmt is not None and fmt.get("type") != "text":
        raise RequestError("response_format other than text is not supported yet", param="response_format")
    if body.get("thinking_token_budget") is not None:
        budget = require_int(body["thinking_token_budget"], "thinking_token_budget")
        if not 1 <= budget <= _INT32_MAX:
            raise RequestError("thinking_token_budget must be a positive 32-bit integer",
                               param="thinking_token_budget")
        if not m.parsers.reasoning:
            raise RequestError("thinking_token_budget needs a model core with reasoning syntax",
                               param="thinking_token_budget")
        raise RequestError("thinking_token_budget is not supported yet", param="thinking_token_budget")
    common.reject_unsupported_extensions(body)
    n = common.choice_count(body)
    if n > ctx.admission.slots:
        raise RequestError(f"n={n} needs more admission slots than this server has ({ctx.admission.slots})",
                           param="n")
    stream = common.opt_bool(body, "stream", False)
    options = common.stream_options(body)

    logprobs_on = common.opt_bool(body, "logprobs", False)
    top = common.opt_int(body, "top_logprobs", None)
    if top is not None and not 0 <= top <= 20:
        raise RequestError("top_logprobs must be between 0 and 20", param="top_logprobs")
    if top and not logprobs_on:
        raise RequestError("top_logprobs requires logprobs: true", param="top_logprobs")
    k = check_top_logprobs(top or 0, "top_logprobs", m.logprobs) if logprobs_on else None
    common.check_logprob_token_ids(body, logprobs_on)
    common.check_prompt_logprobs(body.get("prompt_logprobs"), streaming=stream,
                                 core_has_prompt_logprobs=m.logprobs.prompt_logprobs)

    add_generation_prompt = common.opt_bool(body, "add_generation_prompt", True)
    continue_final = common.opt_bool(body, "continue_final_message", False)
    kwargs = common.opt_object(body, "chat_template_kwargs") or {}
    base = resolve_sampling(
        SamplingFields(
            values={name: body.get(name) for name in DISTRIBUTION_FIELDS},
            seed=body.get("seed"),
            stop=body.get("stop"),
            stop_token_ids=body.get("stop_token_ids"),
            ignore_eos=body.get("ignore_eos"),
            include_stop_str_in_output=body.get("include_stop_str_in_output"),
            logprobs=k,
        ),
        m.sampling,
        m.architecture.vocab_size,
    )
    prompt_ids = render_prompt(
        Conversation(messages, tools),
        ctx.template,
        ctx.tokenizer,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final,
        template_kwargs=kwargs,
    )
    requested = body.get("max_completion_tokens")
    name = "max_completion_tokens"
    if requested is None:
        requested, name = body.get("max_tokens"), "max_tokens"
    max_tokens = resolve_max_tokens(requested, len(prompt_ids), m.limits, name=name, allow_zero=False)
    base = dataclasses.replace(base, max_tokens=max_tokens)
    requests = [
        GenerationRequest(
            request_id=f"{response_id}-{i}",
            prompt_token_ids=prompt_ids,
            sampling=dataclasses.replace(base, seed=child_seed(base.seed, i)),
        )
        for i in range(n)
    ]
    return ChatPlan(
        response_id=response_id,
        prompt_ids=prompt_ids,
        requests=requests,
        stream=stream,
        options=options,
        logprobs=k,
        as_token_ids=common.opt_bool(body, "return_tokens_as_token_ids", False),
        return_token_ids=common.opt_bool(body, "return_token_ids", False),
        return_timestamps=common.opt_bool(body, "return_token_timestamps", False),
        base=base,
    )


# -- handler ---------------------------------------------------------------------------------------

async def handle(request: web.Request, ctx: ServerContext) -> web.StreamResponse:
    body = await ctx.read_json_object(request)
    response_id = new_response_id("chatcmpl")
    p = await ctx.in_frontend(plan, ctx, body, response_id)
    reservation = ctx.reserve(len(p.requests))
    group = ctx.start_group(p.requests, reservation)
    headers = response_headers(request, response_id)
    try:
        if p.stream:
            return await _stream(request, ctx, p, group, headers)
        return await _buffered(ctx, p, group, headers)
    finally:
        group.close()  # aborts unfinished children on disconnect or failure


def _states(ctx: ServerContext, p: ChatPlan) -> list[common.ChoiceState]:
    return [common.ChoiceState(i, ctx.tokenizer) for i in range(len(p.requests))]


def _usage(p: ChatPlan, states: list[common.ChoiceState]) -> dict[str, Any]:
    return common.usage(
        len(p.prompt_ids),
        sum(s.completion_tokens for s in states),
        states[0].cached_tokens,  # the first choice's admission count (prompt counted once)
        reasoning_tokens=0,  # no reasoning parser yet: nothing is published as reasoning
    )


async def _buffered(ctx: ServerContext, p: ChatPlan, group: GenerationGroup,
                    headers: dict[str, str]) -> web.Response:
    states = _states(ctx, p)
    while not all(s.finished for s in states):
        item = await group.next()
        assert item is not None
        index, event = item
        states[index].apply(event)
        if event.finished and (failure := terminal_failure(event)) is not None:
            raise failure.with_headers(headers)
    choices = []
    for s in states:
        choice: dict[str, Any] = {
            "index": s.index,
            "message": {"role": "assistant", "content": s.full_text, "refusal": None, "tool_calls": [],
                        "reasoning_content": None},
            "logprobs": None,
            "finish_reason": common.finish_reason_name(s.finish_reason),
            "stop_reason": s.stop_reason,
        }
        if p.logprobs is not None:
            choice["logprobs"] = {
                "content": common.chat_logprob_entries(ctx.tokenizer, s.logprobs, p.logprobs, p.as_token_ids)
            }
        if p.return_token_ids:
            choice["token_ids"] = s.token_ids
        if p.return_timestamps:
            choice["token_timestamps_ns"] = s.timestamps_ns
        choices.append(choice)
    out: dict[str, Any] = {
        "id": p.response_id,
        "object": "chat.completion",
        "created": common.now(),
        "model": ctx.model_id,
        "choices": choices,
        "usage": _usage(p, states),
        "system_fingerprint": None,
        "prompt_logprobs": None,
    }
    if p.return_token_ids:
        out["prompt_token_ids"] = p.prompt_ids
    if p.return_token_ids or p.return_timestamps:
        out["reused_prompt_tokens"] = states[0].cached_tokens
    return json_response(out, headers=headers)


async def _stream(request: web.Request, ctx: ServerContext, p: ChatPlan, group: GenerationGroup,
                  headers: dict[str, str]) -> web.StreamResponse:
    writer = await SSEWriter.start(request, headers)
    states = _states(ctx, p)
    created = common.now()
    role_sent = [False] * len(states)

    def chunk(choices: list[dict[str, Any]]) -> dict[str, Any]:
        out = {"id": p.response_id, "object": "chat.completion.chunk", "created": created,
               "model": ctx.model_id, "choices": choices}
        if p.options.continuous_usage:
            out["usage"] = _usage(p, states)  # cumulative counts on every chunk
        return out

    try:
        while not all(s.finished for s in states):
            item = await group.next(KEEPALIVE_SECONDS)
            if item is None:
                await writer.comment()
                continue
            index, event = item
            state = states[index]
            delta = state.apply(event)
            if event.finished and (failure := terminal_failure(event)) is not None:
                await writer.send(common.stream_error(failure))
                await writer.close()
                return writer.response
            if not role_sent[index] and (event.token_ids or event.finished):
                # The role delta waits for the first generated token (api.md).
                role_sent[index] = True
                await writer.send(chunk([{"index": index, "delta": {"role": "assistant", "content": ""},
                                          "logprobs": None, "finish_reason": None}]))
            entries = delta.logprobs if p.logprobs is not None else []
            ids = delta.token_ids if p.return_token_ids else []
            if not (delta.text or entries or ids or event.finished):
                continue
            choice: dict[str, Any] = {
                "index": index,
                "delta": {"content": delta.text} if (delta.text or entries or ids) else {},
                "logprobs": None,
                "finish_reason": None,
            }
            if entries:
                choice["logprobs"] = {
                    "content": common.chat_logprob_entries(ctx.tokenizer, entries, p.logprobs or 0, p.as_token_ids)
                }
            if p.return_token_ids:
                choice["token_ids"] = ids
            if p.return_timestamps:
                choice["token_timestamps_ns"] = delta.timestamps_ns
            if event.finished:
                choice["finish_reason"] = common.finish_reason_name(state.finish_reason)
                choice["stop_reason"] = state.stop_reason
            out = chunk([choice])
            if event.finished and (p.return_token_ids or p.return_timestamps):
                out["reused_prompt_tokens"] = states[0].cached_tokens
            last = all(s.finished for s in states)
            if last and p.return_token_ids and not p.options.include_usage:
                out["usage"] = _usage(p, states)
            await writer.send(out)
        if p.options.include_usage:
            await writer.send({**chunk([]), "usage": _usage(p, states)})
        await writer.done()
    except (ConnectionResetError, ConnectionError):
        pass  # the client left; the handler's finally aborts what is still running
    except ApiError as exc:
        await _try_send_error(writer, exc)
    except Exception:
        log.exception("chat stream failed")
        await _try_send_error(writer, server_error("the stream failed"))
    return writer.response


async def _try_send_error(writer: SSEWriter, error: ApiError) -> None:
    try:
        await writer.send(common.stream_error(error))
        await writer.close()
    except Exception:  # the connection is gone too
        pass

"""POST /v1/responses, decoding: a Responses body -> a typed ResponsesRequest (input items and
instructions as the neutral conversation, tools, controls, sampling), every field checked once.
Stateless: store, previous_response_id, conversation, background and truncation "auto" are 400s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from helios.engine.api import SamplingParams
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
from helios.neutral.grammar import Compiler, OutputFormat, compiler_for
from helios.neutral.images import decode_data_url
from helios.neutral.request import ChatOptions
from helios.neutral.sampling import check_top_logprobs, requested_max_tokens
from helios.neutral.thinking import Budget, check_budget, check_effort, template_kwargs
from helios.neutral.tools import (
    CUSTOM_PARAMETERS,
    NAMESPACE_SEPARATOR,
    ToolChoice,
    custom_description,
    namespaced,
    unique_names,
)
from helios.protocols import common
from helios.protocols.fields import opt_bool, opt_object
from helios.transport.context import ServerContext

LOGPROBS_INCLUDE = "message.output_text.logprobs"
MESSAGE_ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text", "text", "refusal")


def _bad(message: str, param: str = "input") -> RequestError:
    return RequestError(message, param=param)


def _string(value: Any, where: str, param: str = "input") -> str:
    if not isinstance(value, str):
        raise _bad(f"{where} must be a string", param)
    return value


def _content_parts(content: Any, where: str) -> list[Part]:
    if isinstance(content, str):
        return [TextPart(content)]
    if not isinstance(content, list):
        raise _bad(f"{where}.content must be a string or an array of content parts")
    parts: list[Part] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in TEXT_PARTS:
            key = "refusal" if kind == "refusal" else "text"
            parts.append(TextPart(_string(part.get(key), f"{where}.content[{j}].{key}")))
        elif kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str):
                raise _bad(f"{where}.content[{j}].image_url must be a data URL string (file ids are not supported)")
            parts.append(ImagePart(*decode_data_url(url, "input")))
        elif kind in ("input_file", "input_audio"):
            raise _bad(f"{kind} content is not supported")
        else:
            raise _bad(f"{where}.content[{j}] has an unsupported content part type {kind!r}")
    return parts


def _reasoning(item: dict[str, Any], where: str) -> ReasoningPart | None:
    texts = [c.get("text") for c in item.get("content") or [] if isinstance(c, dict)]
    if not texts:
        texts = [s.get("text") for s in item.get("summary") or [] if isinstance(s, dict)]
    if not all(isinstance(t, str) for t in texts):
        raise _bad(f"{where}: reasoning text must be strings")
    text = "".join(texts)
    if not text:
        if item.get("encrypted_content"):
            raise _bad(f"{where}: opaque encrypted-only reasoning cannot be replayed; send reasoning_text content")
        return None
    return ReasoningPart(text)


def decode_input(value: Any, instructions: Any) -> list[Message]:
    messages: list[Message] = []
    if instructions is not None:
        text = _string(instructions, "instructions", "instructions")
        if text:
            # Instructions are developer text: with them, every system and developer section is
            # merged into one leading system message in request order (api.md).
            messages.append(Message("developer", [TextPart(text)]))
    if isinstance(value, str):
        messages.append(Message("user", [TextPart(value)]))
        return messages
    if not isinstance(value, list) or not value:
        raise _bad("input must be a string or a nonempty array of input items")

    def assistant(parts: list[Part]) -> None:
        # Reasoning, the answer and its calls are one assistant turn however they were split.
        if messages and messages[-1].role == "assistant":
            messages[-1].parts.extend(parts)
        else:
            messages.append(Message("assistant", parts))

    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise _bad(f"{where} must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in MESSAGE_ROLES:
                raise _bad(f"{where}.role must be one of {', '.join(MESSAGE_ROLES)}")
            parts = _content_parts(item.get("content"), where)
            if role == "assistant":
                assistant(parts)
            else:
                messages.append(Message(role, parts))
        elif kind == "reasoning":
            part = _reasoning(item, where)
            if part is not None:
                assistant([part])
        elif kind in ("function_call", "custom_tool_call"):
            call_id, name = item.get("call_id"), item.get("name")
            if not isinstance(call_id, str) or not isinstance(name, str) or not name:
                raise _bad(f"{where}: {kind} needs a string call_id and a nonempty name")
            namespace = item.get("namespace")
            if namespace is not None:
                name = namespaced(_string(namespace, f"{where}.namespace"), name)
            if kind == "function_call":
                arguments: dict[str, Any] | str = _string(item.get("arguments", "{}"), f"{where}.arguments")
            else:
                arguments = {"input": _string(item.get("input", ""), f"{where}.input")}
            assistant([ToolCallPart(call_id, name, arguments)])
        elif kind in ("function_call_output", "custom_tool_call_output"):
            call_id = _string(item.get("call_id"), f"{where}.call_id")
            output = item.get("output")
            content = (
                [p for p in _content_parts(output, where) if isinstance(p, (TextPart, ImagePart))] if output else []
            )
            messages.append(Message("tool", [ToolResultPart(call_id, list(content))]))
        elif kind == "item_reference":
            raise _bad(f"{where}: item references need stored responses; this server is stateless")
        else:
            raise _bad(f"{where} has an unsupported item type {kind!r}")
    return messages


def decode_tools(body: dict[str, Any], compiler: Compiler) -> tuple[list[ToolSpec], ToolChoice]:
    """Function, custom (text or Lark/regex grammar) and namespace tools, and the tool choice."""
    tools = body.get("tools")
    if tools is None:
        tools = []
    if not isinstance(tools, list):
        raise _bad("tools must be an array", "tools")
    specs: list[ToolSpec] = []
    for i, tool in enumerate(tools):
        if isinstance(tool, dict) and tool.get("type") == "namespace":
            namespace = tool.get("name")
            if not isinstance(namespace, str) or not namespace:
                raise _bad(f"tools[{i}].name must be a nonempty string", "tools")
            inner = tool.get("tools")
            if not isinstance(inner, list) or not inner:
                raise _bad(f"tools[{i}].tools must be a nonempty array", "tools")
            about = tool.get("description") if isinstance(tool.get("description"), str) else None
            specs += [_tool(t, f"tools[{i}].tools[{j}]", compiler, namespace, about) for j, t in enumerate(inner)]
        else:
            specs.append(_tool(tool, f"tools[{i}]", compiler))
    unique_names(specs)
    return specs, _tool_choice(body, specs)


def _tool(
    tool: Any, where: str, compiler: Compiler, namespace: str | None = None, namespace_description: str | None = None
) -> ToolSpec:
    kind = tool.get("type") if isinstance(tool, dict) else None
    if kind not in ("function", "custom"):
        raise _bad(f"{where}: hosted tools ({kind!r}) are not supported; declare function or custom tools", "tools")
    name, description = tool.get("name"), tool.get("description")
    if not isinstance(name, str) or not name:
        raise _bad(f"{where}.name must be a nonempty string", "tools")
    if NAMESPACE_SEPARATOR in name and namespace is not None:
        raise _bad(f"{where}.name must not contain {NAMESPACE_SEPARATOR!r} inside a namespace", "tools")
    if description is not None and not isinstance(description, str):
        raise _bad(f"{where}.description must be a string", "tools")
    if namespace_description:
        description = f"{namespace_description}\n\n{description}" if description else namespace_description
    model_name = namespaced(namespace, name) if namespace else name
    client = name if namespace else None
    if kind == "custom":
        fmt = tool.get("format")
        grammar, syntax, definition = None, None, None
        if fmt is not None:
            if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "grammar"):
                raise _bad(f'{where}.format.type must be "text" or "grammar"', "tools")
            if fmt["type"] == "grammar":
                syntax, definition = fmt.get("syntax"), fmt.get("definition")
                grammar = compiler.tool_grammar(syntax, definition, "tools")
        return ToolSpec(
            model_name,
            custom_description(description, syntax, definition),
            CUSTOM_PARAMETERS,
            client_name=client,
            namespace=namespace,
            custom=True,
            grammar=grammar,
        )
    if tool.get("strict") is True:
        raise _bad("strict function schemas (strict: true) are not supported", "tools")
    params = tool.get("parameters")
    if params is None:
        params = {"type": "object", "properties": {}}
    if not isinstance(params, dict):
        raise _bad(f"{where}.parameters must be an object", "tools")
    return ToolSpec(model_name, description, params, client_name=client, namespace=namespace)


def _tool_choice(body: dict[str, Any], specs: list[ToolSpec]) -> ToolChoice:
    choice = body.get("tool_choice")
    parallel = opt_bool(body, "parallel_tool_calls", True)
    if choice is None or choice in ("auto", "none", "required"):
        return ToolChoice(choice or "auto", parallel=parallel)
    if not isinstance(choice, dict) or choice.get("type") not in ("function", "custom"):
        raise _bad('tool_choice must be "auto", "none", "required" or a named function or custom tool', "tool_choice")
    name = choice.get("name")
    if isinstance(name, str) and isinstance(choice.get("namespace"), str):
        name = namespaced(choice["namespace"], name)
    spec = next((s for s in specs if s.name == name), None)
    # The selected tool must be declared, and its type must match.
    if spec is None or spec.custom != (choice["type"] == "custom"):
        raise _bad("tool_choice names a tool that is not declared in tools", "tool_choice")
    return ToolChoice("named", spec.name, parallel)


def _reject_stateful(body: dict[str, Any]) -> None:
    if body.get("store") is True:
        raise _bad("store: true is not supported; this server keeps no responses (send store: false)", "store")
    for name in ("previous_response_id", "conversation", "prompt"):
        if body.get(name) is not None:
            raise _bad(f"{name} is not supported: requests must carry the complete conversation", name)
    if body.get("background") is True:
        raise _bad("background responses are not supported", "background")
    truncation = body.get("truncation")
    if truncation not in (None, "disabled"):
        raise _bad('truncation must be "disabled": automatic truncation is not supported', "truncation")
    if body.get("prompt_logprobs") is not None:
        raise _bad("prompt_logprobs is not supported by /v1/responses", "prompt_logprobs")


def _logprobs(body: dict[str, Any], ctx: ServerContext) -> tuple[int | None, list[int] | None]:
    """(natural alternatives per output_text entry or None when not included, explicit ids)."""
    include = body.get("include") or []
    if not isinstance(include, list) or not all(isinstance(i, str) for i in include):
        raise _bad("include must be an array of strings", "include")
    top = common.opt_logprob_count(body, "top_logprobs")
    enabled = LOGPROBS_INCLUDE in include  # other include values are ignored (api.md)
    if top and not enabled:
        raise _bad(f'top_logprobs requires include: ["{LOGPROBS_INCLUDE}"]', "top_logprobs")
    explicit = common.logprob_token_ids(body, enabled, ctx.manifest)
    k = check_top_logprobs(top or 0, "top_logprobs", ctx.manifest.logprobs) if enabled else None
    return k, explicit


@dataclass
class Controls:
    echo: dict[str, Any]  # request settings repeated in every response object
    output_format: OutputFormat | None
    effort: str | None
    budget: int | None


def _check_controls(body: dict[str, Any]) -> Controls:
    """Validate the non-sampling settings."""
    text = opt_object(body, "text") or {}
    fmt = common.decode_format(text.get("format"), "text.format", nested=False)
    reasoning = opt_object(body, "reasoning") or {}
    effort = check_effort(reasoning.get("effort"), "reasoning.effort")
    budget = check_budget(body.get("thinking_token_budget"))
    common.reject_unsupported_extensions(body)
    parallel = opt_bool(body, "parallel_tool_calls", True)
    metadata = opt_object(body, "metadata") or {}
    echoed_format = text.get("format") if fmt is not None else {"type": "text"}
    echo = {
        "instructions": body.get("instructions"),
        "metadata": metadata,
        "parallel_tool_calls": parallel,
        "reasoning": {"effort": effort, "summary": reasoning.get("summary")},
        "text": {"format": echoed_format, **({"verbosity": text["verbosity"]} if "verbosity" in text else {})},
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": body.get("tools") or [],
        "truncation": "disabled",
        "store": False,
        "background": False,
        "previous_response_id": None,
        "user": body.get("user"),
        "top_logprobs": body.get("top_logprobs"),
    }
    return Controls(echo, fmt, effort, budget)


@dataclass(frozen=True)
class ResponsesRequest:
    """A Responses body decoded once; build() reads only this."""

    conversation: Conversation
    options: ChatOptions
    sampling: SamplingParams  # without max_tokens, which needs the rendered prompt
    max_output_tokens: int | None
    top_logprobs: int | None  # natural alternatives per output_text entry; None: not included
    stream: bool
    as_token_ids: bool
    echo: dict[str, Any]  # request settings repeated in every response object
    cache_key: str | None  # prompt_cache_key: a routing hint


def decode(ctx: ServerContext, body: dict[str, Any]) -> ResponsesRequest:
    """The body's fields, checked in the order their errors are reported."""
    m = ctx.manifest
    _reject_stateful(body)
    controls = _check_controls(body)
    k, explicit = _logprobs(body, ctx)
    if "input" not in body:
        raise _bad("input is required")
    messages = decode_input(body["input"], body.get("instructions"))
    tools, choice = decode_tools(body, compiler_for(ctx.tokenizer, m))
    kwargs = opt_object(body, "chat_template_kwargs") or {}
    kwargs = template_kwargs(
        kwargs,
        enabled=common.reasoning_switch(body, kwargs),
        effort=controls.effort,
        template_source=ctx.template.source if ctx.template else None,
    )
    sampling = common.request_sampling(body, m, logprobs=k)
    sampling.logprob_token_ids = explicit
    options = ChatOptions(
        tools=tools,
        choice=choice,
        output_format=controls.output_format,
        output_format_param="text",
        template_kwargs=kwargs,
        budget=Budget(controls.budget, explicit=controls.budget is not None),
        user_stops=sampling.has_user_stops,
        ignore_eos=sampling.ignore_eos,
    )
    return ResponsesRequest(
        conversation=Conversation(messages),
        options=options,
        sampling=sampling,
        max_output_tokens=requested_max_tokens(body.get("max_output_tokens"), "max_output_tokens", allow_zero=False),
        top_logprobs=k,
        stream=opt_bool(body, "stream", False),
        as_token_ids=opt_bool(body, "return_tokens_as_token_ids", False),
        echo={**controls.echo, "max_output_tokens": body.get("max_output_tokens")},
        cache_key=common.prompt_cache_key(body),
    )

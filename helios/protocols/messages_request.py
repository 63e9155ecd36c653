"""POST /v1/messages and /v1/messages/count_tokens, decoding: a Messages body -> the neutral
conversation and its generation options (Decoded, shared by generation and counting), then the
generation fields (MessagesRequest), every field checked once.
"""

from __future__ import annotations

import hashlib
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
from helios.neutral.grammar import OutputFormat
from helios.neutral.images import decode_base64
from helios.neutral.request import ChatOptions
from helios.neutral.sampling import requested_max_tokens
from helios.neutral.thinking import INT32_MAX, Budget, check_budget, check_effort, effort_from_budget, template_kwargs
from helios.neutral.tools import ToolChoice, unique_names
from helios.protocols import common
from helios.protocols.fields import opt_bool, opt_int, opt_object
from helios.transport.context import ServerContext

THINKING_MARKER = "flare-thinking-v1:"
MAX_CACHE_HINTS = 4  # api.md: the first four cache_control blocks are checkpoint candidates
# Logprobs exist on the OpenAI-shaped protocols only; Messages refuses rather than ignores them.
LOGPROB_FIELDS = ("logprobs", "top_logprobs", "return_tokens_as_token_ids", "logprob_token_ids", "prompt_logprobs")
# Server-side features a local runtime does not have.
HOSTED_FIELDS = ("mcp_servers", "container")


def thinking_signature(text: str) -> str:
    """The local round-trip marker of a thinking block: a consistency check, not authentication."""
    return THINKING_MARKER + hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass
class Decoded:
    """A Messages request lowered to the neutral conversation (shared by generation and counting)."""

    conversation: Conversation
    options: ChatOptions  # tools, choice, output format, thinking, continuation, cache hints

    @property
    def continue_final(self) -> bool:
        """The history ends with an assistant prefill."""
        return self.options.continue_final

    @property
    def cache_hints(self) -> list[Part]:
        """Parts whose end is a candidate prefix-checkpoint boundary (cache_control blocks)."""
        return self.options.cache_hints


def _text_of(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise RequestError(f"{where} must be a string", param="messages")
    return value


def image_block(block: dict[str, Any], at: str) -> ImagePart:
    """An image block with a base64 source (URL and file sources are refused)."""
    source = block.get("source")
    if not isinstance(source, dict) or source.get("type") != "base64":
        kind = source.get("type") if isinstance(source, dict) else None
        raise RequestError(
            f"{at}.source must be a base64 image source (got {kind!r}); remote image URLs and files are not supported",
            param="messages",
        )
    data, media = source.get("data"), source.get("media_type")
    if not isinstance(data, str) or not isinstance(media, str):
        raise RequestError(f"{at}.source needs string data and media_type", param="messages")
    return ImagePart(decode_base64(data, media.lower(), "messages"), media.lower())


def _text_blocks(value: Any, where: str, hints: list[Part] | None, images: bool = False) -> list[TextPart | ImagePart]:
    """A string or an array of text blocks (system prompts), also image blocks (tool_result content)."""
    if isinstance(value, str):
        return [TextPart(value)] if value else []
    if not isinstance(value, list):
        raise RequestError(f"{where} must be a string or an array of text blocks", param=where)
    parts: list[TextPart | ImagePart] = []
    for j, block in enumerate(value):
        if images and isinstance(block, dict) and block.get("type") == "image":
            parts.append(image_block(block, f"{where}[{j}]"))
            continue
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "image":
                raise RequestError(f"{where}[{j}]: image blocks are not accepted here", param=where)
            raise RequestError(f"{where}[{j}] must be a text block", param=where)
        part = TextPart(_text_of(block.get("text"), f"{where}[{j}].text"))
        parts.append(part)
        if hints is not None and block.get("cache_control") is not None:
            hints.append(part)
    return parts


def decode_system(value: Any) -> list[Message]:
    if value is None:
        return []
    parts = _text_blocks(value, "system", None)
    return [Message("system", parts)] if parts else []


def decode_messages(value: Any, hints: list[Part]) -> list[Message]:
    if not isinstance(value, list) or not value:
        raise RequestError("messages must be a nonempty array", param="messages")
    out: list[Message] = []
    for i, raw in enumerate(value):
        out.extend(_decode_message(raw, f"messages[{i}]", hints))
    return out


def _decode_message(raw: Any, where: str, hints: list[Part]) -> list[Message]:
    """One Anthropic message -> neutral messages. A user turn's tool_result blocks become tool
    messages at their positions; message-level metadata (output_config, ...) is ignored."""
    if not isinstance(raw, dict):
        raise RequestError(f"{where} must be an object", param="messages")
    role = raw.get("role")
    if role not in ("user", "assistant", "system"):
        raise RequestError(f"{where}.role must be user, assistant or system", param="messages")
    content = raw.get("content")
    if role == "system":
        # Inline system text; an empty one produces no prompt text (api.md).
        parts = _text_blocks(content, f"{where}.content", None)
        return [Message("system", parts)] if parts else []
    if isinstance(content, str):
        return [Message(role, [TextPart(content)])]
    if not isinstance(content, list):
        raise RequestError(f"{where}.content must be a string or an array of content blocks", param="messages")
    messages: list[Message] = []
    current: list[Part] = []

    def flush() -> None:
        if current:
            messages.append(Message(role, list(current)))
            current.clear()

    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        hinted = role == "user" and isinstance(block, dict) and block.get("cache_control") is not None
        if kind == "text":
            part: Part = TextPart(_text_of(block.get("text"), f"{at}.text"))
            current.append(part)
            if hinted:
                hints.append(part)
        elif kind == "image" and role == "user":
            part = image_block(block, at)
            current.append(part)
            if hinted:
                hints.append(part)
        elif kind == "tool_use" and role == "assistant":
            current.append(_tool_use(block, at))
        elif kind == "thinking" and role == "assistant":
            current.append(_thinking(block, at))
        elif kind == "redacted_thinking":
            raise RequestError(
                f"{at}: redacted (encrypted-only) thinking cannot be replayed to this model", param="messages"
            )
        elif kind == "tool_result" and role == "user":
            flush()
            result = _tool_result(block, at)
            messages.append(Message("tool", [result]))
            if hinted:
                hints.append(result)
        else:
            raise RequestError(f"{at} has an unsupported content block type {kind!r} for role {role}", param="messages")
    flush()
    return messages


def _tool_use(block: dict[str, Any], at: str) -> ToolCallPart:
    call_id, name, arguments = block.get("id"), block.get("name"), block.get("input", {})
    if not isinstance(call_id, str) or not isinstance(name, str) or not name:
        raise RequestError(f"{at}: tool_use needs a string id and a nonempty name", param="messages")
    if not isinstance(arguments, dict):
        raise RequestError(f"{at}.input must be an object", param="messages")
    return ToolCallPart(call_id, name, arguments)


def _thinking(block: dict[str, Any], at: str) -> ReasoningPart:
    text = _text_of(block.get("thinking"), f"{at}.thinking")
    signature = block.get("signature")
    if signature is not None and not isinstance(signature, str):
        raise RequestError(f"{at}.signature must be a string", param="messages")
    # Our own markers must match their text; readable thinking from other providers is replayed.
    if signature and signature.startswith(THINKING_MARKER) and signature != thinking_signature(text):
        raise RequestError(f"{at}: the thinking text does not match its flare-thinking-v1 signature", param="messages")
    return ReasoningPart(text)


def _tool_result(block: dict[str, Any], at: str) -> ToolResultPart:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise RequestError(f"{at}.tool_use_id must be a nonempty string", param="messages")
    is_error = block.get("is_error", False)
    if not isinstance(is_error, bool):
        raise RequestError(f"{at}.is_error must be a boolean", param="messages")
    content = _text_blocks(block.get("content", ""), f"{at}.content", None, images=True)
    return ToolResultPart(call_id, content, is_error=is_error)


def decode_tools(body: dict[str, Any]) -> tuple[list[ToolSpec], ToolChoice]:
    tools = body.get("tools")
    if tools is None:
        tools = []
    if not isinstance(tools, list):
        raise RequestError("tools must be an array", param="tools")
    specs = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise RequestError(f"tools[{i}] must be an object", param="tools")
        kind = tool.get("type", "custom")
        if kind != "custom":
            raise RequestError(
                f"tools[{i}]: server tools ({kind!r}) are not supported; declare client tools "
                "with name and input_schema",
                param="tools",
            )
        name, schema, description = tool.get("name"), tool.get("input_schema"), tool.get("description")
        if not isinstance(name, str) or not name:
            raise RequestError(f"tools[{i}].name must be a nonempty string", param="tools")
        if not isinstance(schema, dict):
            raise RequestError(f"tools[{i}].input_schema must be an object", param="tools")
        if description is not None and not isinstance(description, str):
            raise RequestError(f"tools[{i}].description must be a string", param="tools")
        if tool.get("strict") is True:
            raise RequestError("strict tool schemas (strict: true) are not supported", param="tools")
        specs.append(ToolSpec(name, description, schema))
    unique_names(specs)
    choice = body.get("tool_choice")
    if choice is None:
        return specs, ToolChoice("auto")
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise RequestError('tool_choice.type must be "auto", "any", "tool" or "none"', param="tool_choice")
    disable = choice.get("disable_parallel_tool_use")
    if disable is not None and not isinstance(disable, bool):
        raise RequestError("tool_choice.disable_parallel_tool_use must be a boolean", param="tool_choice")
    parallel = not disable
    if kind == "any":
        if not specs:
            raise RequestError('tool_choice "any" needs at least one tool', param="tool_choice")
        return specs, ToolChoice("required", parallel=parallel)
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str) or name not in {s.name for s in specs}:
            raise RequestError("tool_choice names a tool that is not declared in tools", param="tool_choice")
        return specs, ToolChoice("named", name, parallel)
    return specs, ToolChoice(kind, parallel=parallel)


def _check_controls(body: dict[str, Any]) -> None:
    for name in LOGPROB_FIELDS:
        if name in body and body[name] is not None:
            raise RequestError(f"{name} is not supported by /v1/messages; use /v1/chat/completions", param=name)
    for name in HOSTED_FIELDS:
        if body.get(name):
            raise RequestError(f"{name} is not supported: Flare runs no hosted tools", param=name)
    management = opt_object(body, "context_management")
    if management is not None:
        edits = management.get("edits") or []
        if not isinstance(edits, list):
            raise RequestError("context_management.edits must be an array", param="context_management")
        for edit in edits:
            # Preserving every thinking block is a no-op here; active edits would rewrite history.
            if not (
                isinstance(edit, dict) and edit.get("type") == "clear_thinking_20251015" and edit.get("keep") == "all"
            ):
                raise RequestError(
                    'context_management edits are not supported (only clear_thinking_20251015 with keep: "all")',
                    param="context_management",
                )
    common.reject_unsupported_extensions(body)


def _thinking_controls(body: dict[str, Any]) -> tuple[bool | None, str | None, Budget]:
    """thinking (enabled/adaptive/disabled, budget_tokens), thinking_token_budget and
    output_config.effort -> (enable_thinking, effort, budget)."""
    thinking = opt_object(body, "thinking")
    enabled: bool | None = None
    requested: int | None = None
    if thinking is not None:
        kind = thinking.get("type")
        if kind not in ("enabled", "disabled", "adaptive"):
            raise RequestError('thinking.type must be "enabled", "disabled" or "adaptive"', param="thinking")
        enabled = kind != "disabled"
        if thinking.get("budget_tokens") is not None:
            requested = opt_int(thinking, "budget_tokens", None)
            if requested is None or requested < 1:
                raise RequestError("thinking.budget_tokens must be a positive integer", param="thinking")
    explicit = check_budget(body.get("thinking_token_budget"))
    if explicit is not None and requested is not None and explicit != requested:
        raise RequestError(
            "thinking_token_budget and thinking.budget_tokens must match when both are given",
            param="thinking_token_budget",
        )
    output_config = opt_object(body, "output_config") or {}
    effort = check_effort(output_config.get("effort"), "output_config.effort")
    if effort is None and requested is not None and enabled:
        effort = effort_from_budget(requested)
    if explicit is not None:
        budget = Budget(explicit, explicit=True)
    elif requested is not None and enabled:
        # A hard cap where the format allows one, an effort hint elsewhere; budgets beyond the
        # 32-bit output limit can never be reached, so they never cut.
        budget = Budget(requested if requested <= INT32_MAX else None, explicit=True, advisory=True)
    else:
        budget = Budget()
    return enabled, effort, budget


def _output_format(body: dict[str, Any]) -> tuple[OutputFormat | None, str]:
    output_config = opt_object(body, "output_config") or {}
    fmt = common.decode_format(output_config.get("format"), "output_config.format", nested=False)
    legacy = common.decode_format(body.get("output_format"), "output_format", nested=False)
    if fmt is not None and legacy is not None:
        raise RequestError("give output_config.format or output_format, not both", param="output_format")
    return (fmt, "output_config") if fmt is not None else (legacy, "output_format")


def decode(ctx: ServerContext, body: dict[str, Any]) -> Decoded:
    """Everything generation and counting share: the conversation and its generation options."""
    _check_controls(body)
    hints: list[Part] = []
    messages = decode_system(body.get("system")) + decode_messages(body.get("messages"), hints)
    tools, choice = decode_tools(body)
    continue_final = messages[-1].role == "assistant" if messages else False
    if continue_final and not any(isinstance(p, TextPart) and p.text for p in messages[-1].parts):
        raise RequestError("a final assistant message (prefill) must contain text to continue", param="messages")
    enabled, effort, budget = _thinking_controls(body)
    kwargs = opt_object(body, "chat_template_kwargs") or {}
    if enabled is None:
        enabled = common.reasoning_switch(body, kwargs)
    kwargs = template_kwargs(
        kwargs, enabled=enabled, effort=effort, template_source=ctx.template.source if ctx.template else None
    )
    fmt, fmt_param = _output_format(body)
    options = ChatOptions(
        tools=tools,
        choice=choice,
        output_format=fmt,
        output_format_param=fmt_param,
        template_kwargs=kwargs,
        add_generation_prompt=not continue_final,
        continue_final=continue_final,
        budget=budget,
        # Read from the body (count_tokens shares this decoder without resolving sampling); the
        # same fields as SamplingParams.has_user_stops.
        user_stops=any(body.get(name) for name in ("stop_sequences", "stop_token_ids", "stop_token_sequences")),
        ignore_eos=body.get("ignore_eos") is True,
        cache_hints=hints[:MAX_CACHE_HINTS],
    )
    return Decoded(Conversation(messages), options)


@dataclass(frozen=True)
class MessagesRequest:
    """A Messages body decoded once for generation; build() reads only this."""

    decoded: Decoded
    stream: bool
    sampling: SamplingParams  # without max_tokens, which needs the rendered prompt
    max_tokens: int | None
    cache_key: str | None  # prompt_cache_key, accepted on every generation route: a routing hint


def decode_request(ctx: ServerContext, body: dict[str, Any]) -> MessagesRequest:
    """decode(), then the fields only generation reads, in the order their errors are reported."""
    decoded = decode(ctx, body)
    stream = opt_bool(body, "stream", False)
    sampling = common.request_sampling(body, ctx.manifest, stop_name="stop_sequences")
    max_tokens = requested_max_tokens(body.get("max_tokens"), allow_zero=False)
    return MessagesRequest(decoded, stream, sampling, max_tokens, common.prompt_cache_key(body))

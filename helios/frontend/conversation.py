"""The one neutral request model every protocol decoder produces.

A protocol decoder (chat, messages, responses, ...) turns its JSON into a `Conversation`, or,
for raw completions, `RawPrompt`s; `render_prompt` lowers a conversation through the prepared
chat template into token ids. No endpoint translates through another endpoint's JSON: they
meet here.

Part types for images, reasoning, tool calls and tool results are declared now so later
decoders fill them in; lowering handles the ones a text template can show today.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal, Union

from helios.frontend.errors import RequestError
from helios.frontend.template import ChatTemplate
from helios.frontend.tokenizer import Tokenizer

Role = Literal["system", "developer", "user", "assistant", "tool"]


@dataclass
class TextPart:
    text: str


@dataclass
class ImagePart:
    data: bytes  # decoded PNG/JPEG/WebP bytes (decoders check the media type)
    media_type: str


@dataclass
class ReasoningPart:
    text: str


@dataclass
class ToolCallPart:
    id: str
    name: str
    arguments: dict[str, Any] | str  # a JSON object, or the raw string a client sent back


@dataclass
class ToolResultPart:
    call_id: str
    content: list[Union[TextPart, ImagePart]] = field(default_factory=list)
    is_error: bool = False


Part = Union[TextPart, ImagePart, ReasoningPart, ToolCallPart, ToolResultPart]


@dataclass
class Message:
    role: Role
    parts: list[Part] = field(default_factory=list)
    name: str | None = None

    def text(self, separator: str = "\n") -> str:
        return separator.join(p.text for p in self.parts if isinstance(p, TextPart))


@dataclass
class ToolSpec:
    """A client-executed function tool, as the template's `tools` variable presents it."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})


@dataclass
class Conversation:
    messages: list[Message]
    tools: list[ToolSpec] = field(default_factory=list)


@dataclass
class RawPrompt:
    """A raw completion prompt: text (tokenized with the raw-prompt policy) or explicit ids."""

    text: str | None = None
    token_ids: list[int] | None = None


# Text parts inside one message are joined the way vLLM flattens OpenAI content arrays for
# string-content templates; instruction sections merged into one system message are separated
# by a blank line (api.md "Conversation and tool semantics").
PART_SEPARATOR = "\n"
SECTION_SEPARATOR = "\n\n"


def merge_instructions(messages: list[Message]) -> list[Message]:
    """Apply the system/developer rules before templating.

    With developer messages present, every system and developer message becomes one leading
    system message, sections in request order; other messages keep their relative order.
    Without developer messages the template's own system-role rules apply unchanged.
    TODO(conversation issue): probe the template for inline system support and rewrite
    noninitial system messages into <system>...</system> user turns where it lacks one.
    """
    if not any(m.role == "developer" for m in messages):
        return list(messages)
    sections = [m.text(PART_SEPARATOR) for m in messages if m.role in ("system", "developer")]
    rest = [m for m in messages if m.role not in ("system", "developer")]
    merged = Message("system", [TextPart(SECTION_SEPARATOR.join(s for s in sections if s))])
    return [merged, *rest]


def to_template_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """Plain dicts in the shape Hugging Face chat templates read."""
    out: list[dict[str, Any]] = []
    for message in messages:
        if any(isinstance(p, ImagePart) for p in message.parts):
            raise RequestError("this model core does not accept image input", param="messages")
        if message.role == "tool":
            results = [p for p in message.parts if isinstance(p, ToolResultPart)]
            if results:
                for result in results:
                    text = PART_SEPARATOR.join(p.text for p in result.content if isinstance(p, TextPart))
                    if any(isinstance(p, ImagePart) for p in result.content):
                        raise RequestError("this model core does not accept image input", param="messages")
                    out.append({"role": "tool", "tool_call_id": result.call_id, "content": text})
                continue
            out.append({"role": "tool", "content": message.text(PART_SEPARATOR)})
            continue
        entry: dict[str, Any] = {"role": message.role, "content": message.text(PART_SEPARATOR)}
        if message.name:
            entry["name"] = message.name
        reasoning = "".join(p.text for p in message.parts if isinstance(p, ReasoningPart))
        if reasoning:
            entry["reasoning_content"] = reasoning
        calls = [p for p in message.parts if isinstance(p, ToolCallPart)]
        if calls:
            entry["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": _arguments(c.arguments)}}
                for c in calls
            ]
        out.append(entry)
    return out


def _arguments(arguments: dict[str, Any] | str) -> Any:
    # Templates index and tojson the arguments object (vLLM parses client strings likewise).
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


def template_tools(tools: list[ToolSpec]) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    return [
        {"type": "function", "function": {
            "name": t.name,
            **({"description": t.description} if t.description is not None else {}),
            "parameters": t.parameters,
        }}
        for t in tools
    ]


def render_text(
    conversation: Conversation,
    template: ChatTemplate | None,
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    if template is None:
        raise RequestError("this model core has no chat template; use /v1/completions")
    messages = to_template_messages(merge_instructions(conversation.messages))
    return template.render(
        messages,
        tools=template_tools(conversation.tools),
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        template_kwargs=template_kwargs,
    )


def render_prompt(
    conversation: Conversation,
    template: ChatTemplate | None,
    tokenizer: Tokenizer,
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """Lower a conversation to prompt token ids through the prepared template."""
    text = render_text(
        conversation,
        template,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        template_kwargs=template_kwargs,
    )
    # The template writes its own BOS/control tokens (HF and vLLM encode without extras).
    return tokenizer.encode(text, add_bos=False)

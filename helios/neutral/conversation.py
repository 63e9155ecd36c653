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
import weakref
from dataclasses import dataclass, field
from typing import Any, Literal

from helios.neutral.errors import RequestError
from helios.neutral.template import ChatTemplate
from helios.neutral.tokenizer import Tokenizer

Role = Literal["system", "developer", "user", "assistant", "tool"]


@dataclass
class TextPart:
    text: str


@dataclass
class ImagePart:
    data: bytes  # encoded PNG/JPEG/WebP bytes (decoders check the media type)
    media_type: str
    # The text the template sees for this image: the core's vision placeholder, set by lowering
    # on a core with a vision graph (None: image input is a 400).
    placeholder: str | None = None


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
    content: list[TextPart | ImagePart] = field(default_factory=list)
    is_error: bool = False


Part = TextPart | ImagePart | ReasoningPart | ToolCallPart | ToolResultPart


@dataclass
class Message:
    role: Role
    parts: list[Part] = field(default_factory=list)
    name: str | None = None

    def text(self, separator: str = "\n") -> str:
        return separator.join(p.text for p in self.parts if isinstance(p, TextPart))


@dataclass
class ToolSpec:
    """A client-executed function tool, as the template's `tools` variable presents it.

    `name` is what the model sees; the other fields let an encoder restore what the client
    declared (Responses namespaces become namespace__name, custom tools a function taking
    {"input": string} whose completed input is checked against `grammar`)."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})
    client_name: str | None = None  # the declared name when it differs from `name`
    namespace: str | None = None
    custom: bool = False
    grammar: Any = None  # helios.neutral.grammar.TextGrammar for a grammar-constrained custom tool


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
    system message whose sections keep their role labels (<system>...</system>,
    <developer>...</developer>) in request order; other messages keep their relative order.
    Without developer messages the template's own system-role rules apply unchanged.
    """
    if not any(m.role == "developer" for m in messages):
        return list(messages)
    sections = []
    for m in messages:
        if m.role in ("system", "developer"):
            text = m.text(PART_SEPARATOR)
            if text:
                sections.append(f"<{m.role}>\n{text}\n</{m.role}>")
    rest = [m for m in messages if m.role not in ("system", "developer")]
    merged = Message("system", [TextPart(SECTION_SEPARATOR.join(sections))])
    return [merged, *rest]


def with_instruction(conversation: Conversation, text: str) -> Conversation:
    """The conversation with `text` appended to its leading system instructions (a new leading
    system message when there is none). Used for the required-tool and JSON-only instructions."""
    messages = list(conversation.messages)
    if messages and messages[0].role == "system":
        first = messages[0]
        messages[0] = Message("system", [*first.parts, TextPart("\n" + text)], name=first.name)
    else:
        messages.insert(0, Message("system", [TextPart(text)]))
    return Conversation(messages, conversation.tools)


_INLINE_PROBE = "\ue001flare-inline-system\ue001"
_INLINE_SUPPORT: weakref.WeakKeyDictionary[ChatTemplate, bool] = weakref.WeakKeyDictionary()


def supports_inline_system(template: ChatTemplate) -> bool:
    """Probe the template once: does a system message after the first turn render its text?"""
    known = _INLINE_SUPPORT.get(template)
    if known is None:
        probe = [
            {"role": "user", "content": "x"},
            {"role": "system", "content": _INLINE_PROBE},
            {"role": "user", "content": "y"},
        ]
        try:
            known = _INLINE_PROBE in template.render(probe, add_generation_prompt=True)
        except RequestError:
            known = False
        _INLINE_SUPPORT[template] = known
    return known


def inline_system_fallback(messages: list[Message], template: ChatTemplate) -> list[Message]:
    """Noninitial system messages become <system>...</system> user messages at the same
    positions when the template rejects or omits inline system text."""
    if not any(m.role == "system" for m in messages[1:]) or supports_inline_system(template):
        return messages
    out = messages[:1]
    for m in messages[1:]:
        if m.role == "system":
            text = SECTION_SEPARATOR.join(p.text for p in m.parts if isinstance(p, TextPart))
            out.append(Message("user", [TextPart(f"<system>{text}</system>")]))
        else:
            out.append(m)
    return out


def reorder_tool_results(messages: list[Message]) -> list[Message]:
    """Parallel tool results are put in the order of the preceding assistant's calls.

    Only when the results between that assistant message and the next one answer its calls
    exactly (unique ids, none missing or unknown); other messages keep their positions and
    results never cross an assistant message."""
    out = list(messages)
    i = 0
    while i < len(out):
        calls = [p.id for p in out[i].parts if isinstance(p, ToolCallPart)] if out[i].role == "assistant" else []
        if not calls:
            i += 1
            continue
        j = i + 1
        slots: list[int] = []
        while j < len(out) and out[j].role != "assistant":
            if out[j].role == "tool":
                slots.append(j)
            j += 1
        results = [[p for p in out[k].parts if isinstance(p, ToolResultPart)] for k in slots]
        ids = [r[0].call_id for r in results if len(r) == 1]
        if (
            len(ids) == len(slots) == len(calls)
            and len(set(calls)) == len(calls)
            and len(set(ids)) == len(ids)
            and set(ids) == set(calls)
        ):
            order = {call_id: n for n, call_id in enumerate(calls)}
            ranked = sorted(zip(ids, (out[k] for k in slots)), key=lambda pair: order[pair[0]])
            for k, (_, message) in zip(slots, ranked):
                out[k] = message
        i = j
    return out


def content_text(parts: list[Any]) -> str:
    """A message's text parts joined by PART_SEPARATOR, each image's placeholder in its place (as
    Qwen-style templates write an image item: directly beside the text around it)."""
    out = ""
    previous_text = False
    for part in parts:
        if isinstance(part, TextPart):
            out += (PART_SEPARATOR if previous_text else "") + part.text
            previous_text = True
        elif isinstance(part, ImagePart):
            if part.placeholder is None:
                raise RequestError("this model core does not accept image input", param="messages")
            out += part.placeholder
            previous_text = False
    return out


def image_parts(messages: list[Message]) -> list[ImagePart]:
    """Every image of the messages, in the order to_template_messages writes them."""
    found: list[ImagePart] = []
    for message in messages:
        for part in message.parts:
            if isinstance(part, ImagePart):
                found.append(part)
            elif isinstance(part, ToolResultPart):
                found.extend(p for p in part.content if isinstance(p, ImagePart))
    return found


def to_template_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """Plain dicts in the shape Hugging Face chat templates read."""
    out: list[dict[str, Any]] = []
    for message in messages:
        if message.role == "tool":
            results = [p for p in message.parts if isinstance(p, ToolResultPart)]
            if results:
                for result in results:
                    out.append(
                        {"role": "tool", "tool_call_id": result.call_id, "content": content_text(result.content)}
                    )
                continue
            out.append({"role": "tool", "content": content_text(message.parts)})
            continue
        entry: dict[str, Any] = {"role": message.role, "content": content_text(message.parts)}
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
        {
            "type": "function",
            "function": {
                "name": t.name,
                **({"description": t.description} if t.description is not None else {}),
                "parameters": t.parameters,
            },
        }
        for t in tools
    ]


def template_order(conversation: Conversation, template: ChatTemplate) -> list[Message]:
    """The messages as the template receives them (instruction, tool-result and system rules)."""
    return inline_system_fallback(reorder_tool_results(merge_instructions(conversation.messages)), template)


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
    messages = to_template_messages(template_order(conversation, template))
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

"""Tool choice and output validation, shared by Chat Completions, Messages and Responses.

Protocol decoders produce `ToolSpec`s (model-facing names; custom and namespaced tools carry
what their protocol needs to restore them) and a neutral `ToolChoice`:

- auto: the declared tools are presented; parseable calls, also to undeclared tools, are returned.
- none: no tools are presented and nothing is parsed as a call.
- required (Anthropic "any"): at least one declared tool; an instruction to call a tool is added
  to the prompt, and the response fails unless a complete call to a declared tool was made.
- named: only the selected tool is presented (no instruction, no decoding constraint); answer
  text is omitted; every call must target it and at least one complete call is required.
- parallel False (parallel_tool_calls: false, disable_parallel_tool_use): a second call fails
  the response before it is emitted.

Validation failures are `OutputError`s: HTTP 500 buffered, a terminal error event streamed.
Sampling is never changed and nothing is retried or fabricated.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from helios.neutral.conversation import Conversation, ToolSpec, with_instruction
from helios.neutral.errors import RequestError

REQUIRED_INSTRUCTION = "You must respond by calling at least one of the provided tools."
REQUIRED_NOT_SATISFIED = "required tool choice was not satisfied"
NAMESPACE_SEPARATOR = "__"
CUSTOM_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {"input": {"type": "string", "description": "The complete input text for this tool."}},
    "required": ["input"],
}


class OutputError(Exception):
    """Generated output that fails its request's contract (the response fails with 500)."""


@dataclass
class ToolChoice:
    mode: str = "auto"  # auto | none | required | named
    name: str | None = None  # model-facing name of the selected tool (named)
    parallel: bool = True

    @property
    def validates(self) -> bool:
        return self.mode in ("required", "named")


def require_tools(choice: ToolChoice, tools: list[ToolSpec], param: str = "tool_choice") -> None:
    if choice.mode == "required" and not tools:
        raise RequestError('tool_choice "required" needs at least one tool', param=param)
    if choice.mode == "named":
        spec = next((t for t in tools if t.name == choice.name), None)
        if spec is None:
            raise RequestError("tool_choice names a tool that is not declared in tools", param=param)


def presented(tools: list[ToolSpec], choice: ToolChoice) -> list[ToolSpec]:
    """The tool definitions the model sees."""
    if choice.mode == "none":
        return []
    if choice.mode == "named":
        return [t for t in tools if t.name == choice.name]
    return list(tools)


def unique_names(tools: list[ToolSpec], param: str = "tools") -> None:
    seen: set[str] = set()
    for tool in tools:
        if tool.name in seen:
            raise RequestError(f"tool name {tool.name!r} is declared more than once (ambiguous)", param=param)
        seen.add(tool.name)


def namespaced(namespace: str, name: str) -> str:
    return f"{namespace}{NAMESPACE_SEPARATOR}{name}"


def custom_description(description: str | None, syntax: str | None, definition: str | None) -> str:
    """A custom tool's description for the model, with its grammar contract."""
    text = description or ""
    if syntax and definition:
        kind = "Lark grammar" if syntax == "lark" else "regular expression"
        contract = f"The input must match this {kind} exactly:\n{definition}"
        text = f"{text}\n\n{contract}" if text else contract
    return text


def with_required_instruction(conversation: Conversation, choice: ToolChoice) -> Conversation:
    if choice.mode != "required":
        return conversation
    return with_instruction(conversation, REQUIRED_INSTRUCTION)


@dataclass
class EmittedCall:
    """A validated call, ready for a protocol encoder."""

    id: str
    name: str  # the client's name (namespace and custom mapping restored)
    arguments: dict[str, Any]
    namespace: str | None = None
    custom_input: str | None = None  # Responses custom tools: the raw input text

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


class ToolPolicy:
    """Checks each parsed call against the request's tool contract, in output order."""

    def __init__(self, tools: list[ToolSpec], choice: ToolChoice):
        self.tools = {t.name: t for t in tools}
        self.choice = choice
        self.calls = 0
        self.declared_calls = 0

    @property
    def omit_text(self) -> bool:
        return self.choice.mode == "named"

    def check(self, name: str, arguments: dict[str, Any], call_id: str) -> EmittedCall:
        if self.choice.mode == "named" and name != self.choice.name:
            raise OutputError(f"the model called tool {name!r}, but tool_choice requires {self.choice.name!r}")
        if self.calls >= 1 and not self.choice.parallel:
            raise OutputError("the model made more than one tool call, but parallel tool calls are disabled")
        spec = self.tools.get(name)
        emitted = EmittedCall(call_id, name, arguments)
        if spec is not None:
            emitted.name = spec.client_name or spec.name
            emitted.namespace = spec.namespace
            if spec.custom:
                text = arguments.get("input")
                if not isinstance(text, str) or set(arguments) - {"input"}:
                    raise OutputError(f"the model's call to custom tool {emitted.name!r} has no string input")
                if spec.grammar is not None and not spec.grammar.matches(text):
                    raise OutputError(f"the input of custom tool {emitted.name!r} does not match its grammar")
                emitted.custom_input = text
            self.declared_calls += 1
        self.calls += 1
        return emitted

    def finish(self) -> None:
        """The output ended: required and named modes need a complete declared call."""
        if self.choice.validates and self.declared_calls == 0:
            raise OutputError(f"{REQUIRED_NOT_SATISFIED}: the model made no complete call to a declared tool")

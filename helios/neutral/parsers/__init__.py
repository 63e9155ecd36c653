"""Model output parsers: streaming state machines from generated text to neutral items.

The core's manifest names its syntaxes (`parsers.tool`, `parsers.reasoning`, set by the recipe);
they are looked up here by that name, never guessed from the model's name.

    tool syntaxes       hermes, qwen25_coder_json, llama3_json, qwen3_xml, mimo, glm45, minimax,
                        gemma4, deepseek_dsml, deepseek_xtml, kimi_k2, mistral
    reasoning syntaxes  see parsers.reasoning.REASONING_SYNTAXES
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from helios.neutral.parsers.base import ToolParseError, ToolParser, ToolSchemas
from helios.neutral.parsers.deepseek import DeepSeekMarkupParser
from helios.neutral.parsers.gemma import CLOSE as GEMMA_CLOSE
from helios.neutral.parsers.gemma import OPEN as GEMMA_OPEN
from helios.neutral.parsers.gemma import QUOTE as GEMMA_QUOTE
from helios.neutral.parsers.gemma import Gemma4Parser
from helios.neutral.parsers.json_calls import HermesParser, KimiK2Parser, MistralParser, Qwen25CoderJsonParser
from helios.neutral.parsers.reasoning import (
    ANSWER,
    REASONING,
    REASONING_SYNTAXES,
    START,
    OutputParser,
    ReasoningSyntax,
    ResolvedReasoning,
)
from helios.neutral.parsers.stream import CallOut, Out, OutputStream, ReasoningOut, TextOut
from helios.neutral.parsers.xml_calls import GlmParser, MiMoFunctionTagParser, MiniMaxParser, QwenFunctionTagParser

TOOL_SYNTAXES: dict[str, Callable[[ToolSchemas], ToolParser]] = {
    "hermes": HermesParser,
    "qwen25_coder_json": Qwen25CoderJsonParser,
    "llama3_json": Qwen25CoderJsonParser,  # bare {"name", "parameters"} answers (json_calls.py)
    "qwen3_xml": QwenFunctionTagParser,
    "qwen3_coder": QwenFunctionTagParser,
    "mimo": MiMoFunctionTagParser,
    "glm45": GlmParser,
    "minimax": MiniMaxParser,
    "gemma4": Gemma4Parser,
    "deepseek_dsml": lambda schemas: DeepSeekMarkupParser("DSML", schemas),
    "deepseek_xtml": lambda schemas: DeepSeekMarkupParser("XTML", schemas),
    "kimi_k2": KimiK2Parser,
    "mistral": MistralParser,
}


@dataclass(frozen=True)
class ToolEnvelope:
    """A whole tool-call block of one syntax: it runs from `opener` to the first of `closers`
    (none: the block is a JSON array, JSON_ARRAY_SYNTAXES); `inner` are the tags inside it (a
    tokenizer may hold any of these as one special token)."""

    opener: str
    closers: tuple[str, ...]
    inner: tuple[str, ...] = ()


_FUNCTION_TAGS = (
    QwenFunctionTagParser.FUNC_OPEN,
    QwenFunctionTagParser.FUNC_CLOSE,
    QwenFunctionTagParser.PARAM_OPEN,
    QwenFunctionTagParser.PARAM_CLOSE,
)
_QWEN_BLOCKS = (  # Qwen's parser also reads a bare function block without <tool_call>
    ToolEnvelope(QwenFunctionTagParser.TOOL_OPEN, (QwenFunctionTagParser.TOOL_CLOSE,), _FUNCTION_TAGS),
    ToolEnvelope(QwenFunctionTagParser.FUNC_OPEN, (QwenFunctionTagParser.FUNC_CLOSE,), _FUNCTION_TAGS[2:]),
)
# Under an output constraint the grammar keeps each syntax's block forms open
# (helios.neutral.grammar); JSON syntaxes also constrain the call object inside them.
TOOL_ENVELOPES: dict[str, tuple[ToolEnvelope, ...]] = {
    "hermes": (ToolEnvelope(HermesParser.openers[0], HermesParser.trailing_closers),),
    "qwen25_coder_json": (ToolEnvelope(HermesParser.openers[0], HermesParser.trailing_closers),),
    "llama3_json": (ToolEnvelope(HermesParser.openers[0], HermesParser.trailing_closers),),
    "qwen3_xml": _QWEN_BLOCKS,
    "qwen3_coder": _QWEN_BLOCKS,
    "mimo": _QWEN_BLOCKS,
    "glm45": (
        ToolEnvelope(
            GlmParser.OPEN,
            (GlmParser.CLOSE,),
            (GlmParser.KEY_OPEN, GlmParser.KEY_CLOSE, GlmParser.VALUE_OPEN, GlmParser.VALUE_CLOSE),
        ),
    ),
    "minimax": (ToolEnvelope(MiniMaxParser.OPEN, (MiniMaxParser.CLOSE,)),),
    "gemma4": (ToolEnvelope(GEMMA_OPEN, (GEMMA_CLOSE,), (GEMMA_QUOTE,)),),
    "deepseek_dsml": (ToolEnvelope(*DeepSeekMarkupParser.region_tags("DSML")),),
    "deepseek_xtml": (ToolEnvelope(*DeepSeekMarkupParser.region_tags("XTML")),),
    "mistral": (ToolEnvelope(MistralParser.OPEN, ()),),
    "kimi_k2": (
        ToolEnvelope(
            KimiK2Parser.SECTION_OPEN,
            (KimiK2Parser.SECTION_CLOSE,),
            (KimiK2Parser.CALL_OPEN, KimiK2Parser.ARGS, KimiK2Parser.CALL_CLOSE),
        ),
    ),
}
JSON_CALL_SYNTAXES = frozenset({"hermes", "qwen25_coder_json", "llama3_json"})  # one JSON call object per envelope
BARE_CALL_SYNTAXES = frozenset({"qwen25_coder_json", "llama3_json"})  # whole answers of bare call objects
JSON_ARRAY_SYNTAXES = frozenset({"mistral"})  # the opener, then a JSON array of calls (no closer)

# Single-token tool openers that end reasoning for the engine's budget (Qwen's implicit close).
TOOL_OPENER_TEXT: dict[str, tuple[str, ...]] = {
    "hermes": ("<tool_call>",),
    "qwen25_coder_json": ("<tool_call>",),
    "qwen3_xml": ("<tool_call>", "<function="),
    "qwen3_coder": ("<tool_call>", "<function="),
    "mimo": ("<tool_call>", "<function="),
}


class UnknownSyntax(ValueError):
    pass


def tool_syntax_known(name: str | None) -> bool:
    return not name or name in TOOL_SYNTAXES


def reasoning_syntax(name: str | None) -> ReasoningSyntax | None:
    if not name:
        return None
    try:
        return REASONING_SYNTAXES[name]
    except KeyError:
        raise UnknownSyntax(
            f"unknown reasoning syntax {name!r} (known: {', '.join(sorted(REASONING_SYNTAXES))})"
        ) from None


def single_token(tokenizer: Any, text: str) -> int | None:
    """The id of `text` when the tokenizer writes it as exactly one token."""
    ids = tokenizer.encode(text, add_bos=False)
    if len(ids) == 1 and tokenizer.token_bytes(ids[0]) == text.encode("utf-8"):
        return ids[0]
    return None


def resolve_reasoning(name: str | None, tokenizer: Any) -> ResolvedReasoning | None:
    syntax = reasoning_syntax(name)
    if syntax is None:
        return None
    if syntax.text_only:
        return ResolvedReasoning(syntax, None, None)
    return ResolvedReasoning(syntax, single_token(tokenizer, syntax.open), single_token(tokenizer, syntax.close))


def start_state(reasoning: ResolvedReasoning | None, prompt_text: str) -> str:
    """Where output begins: inside reasoning when the prompt ends with an open delimiter (the
    template opened it), otherwise where the model may still open it."""
    if reasoning is None:
        return ANSWER
    tail = prompt_text.rstrip()
    if tail.endswith(reasoning.syntax.open):
        return REASONING
    return START


@dataclass
class OutputSpec:
    """How one request's output is parsed (plain data built at plan time)."""

    tool_syntax: str | None = None  # None: no tools presented, answers are text
    schemas: dict[str, dict[str, Any]] = field(default_factory=dict)  # model-facing name -> parameters
    reasoning: ResolvedReasoning | None = None
    start: str = ANSWER
    verbatim: bool = False  # a structured-output grammar constrains the answer


def build_stream(spec: OutputSpec) -> OutputStream:
    tools: ToolParser | None = None
    if spec.tool_syntax:
        factory = TOOL_SYNTAXES.get(spec.tool_syntax)
        if factory is None:
            raise UnknownSyntax(f"unknown tool syntax {spec.tool_syntax!r}")
        tools = factory(ToolSchemas(dict(spec.schemas)))
        tools.verbatim = spec.verbatim
    parser = OutputParser(tools, spec.reasoning, spec.start)
    return OutputStream(parser, spec.reasoning.markers if spec.reasoning else {})


__all__ = [
    "ANSWER",
    "REASONING",
    "START",
    "CallOut",
    "OutputSpec",
    "OutputStream",
    "Out",
    "ReasoningOut",
    "TextOut",
    "ToolParseError",
    "UnknownSyntax",
    "build_stream",
    "reasoning_syntax",
    "resolve_reasoning",
    "single_token",
    "start_state",
    "tool_syntax_known",
]

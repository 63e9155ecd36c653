"""Structured output and custom-tool grammars, compiled by llguidance before admission.

Request formats (JSON schema, any JSON object, Lark, regex, choice) become an llguidance grammar
named `answer`. The grammar the engine enforces is `answer`, or `answer` or the model's tool-call
envelopes when tools are presented (every tool syntax, helios.neutral.parsers.TOOL_ENVELOPES), so
"constrain the final answer while the tool-call envelopes stay free" holds: the engine applies the
mask once reasoning has ended (reasoning is never constrained). Tool arguments follow their own
tool's parameter schema (JSON call syntaxes) or the syntax's parser (markup syntaxes), never the
answer's.

Compilation is bounded: sources above MAX_SOURCE_BYTES and grammars beyond llguidance's parser
limits are refused with HTTP 400 naming the grammar. Custom tool grammars (Responses) use the
same compiler and validate a completed input's exact bytes.
"""

from __future__ import annotations

import json
import re
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import llguidance
import numpy as np

from helios.engine.constraints import first_line, llg_tokenizer, parser_limits
from helios.neutral.errors import RequestError
from helios.neutral.parsers import (
    BARE_CALL_SYNTAXES,
    JSON_ARRAY_SYNTAXES,
    JSON_CALL_SYNTAXES,
    TOOL_ENVELOPES,
    ToolEnvelope,
)

MAX_SOURCE_BYTES = 1 << 20
# The admission probe: this many tokens deep, along at most this many paths.
PROBE_STEPS = 3
PROBE_WIDTH = 4
# Compact JSON (one space after ':' and ','): no runaway whitespace, and the spelling models use.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_OBJECT: dict[str, Any] = {"type": "object"}


class GrammarError(RequestError):
    """A grammar or schema llguidance cannot compile (HTTP 400)."""


@dataclass
class OutputFormat:
    """What the final answer must be."""

    kind: str  # "json_schema" | "json_object" | "lark" | "regex" | "choice"
    source: Any  # schema dict, Lark text, regex text, or list of strings
    name: str | None = None  # the schema's name (json_schema)

    @property
    def is_json(self) -> bool:
        return self.kind in ("json_schema", "json_object")

    def instruction(self, with_tools: bool) -> str | None:
        """The JSON-only formatting instruction added to the system prompt (conversational JSON)."""
        if not self.is_json:
            return None
        lead = "When you answer (rather than call a tool), reply" if with_tools else "Reply"
        if self.kind == "json_object":
            return f"{lead} with only a JSON object and no other text."
        schema = json.dumps(self.source, ensure_ascii=False)
        return f"{lead} with only a JSON value that conforms to this JSON schema, and no other text:\n{schema}"


def _source_size(value: Any) -> int:
    return len((value if isinstance(value, str) else json.dumps(value)).encode("utf-8"))


def _check_size(value: Any, what: str, param: str) -> None:
    if _source_size(value) > MAX_SOURCE_BYTES:
        raise GrammarError(f"the {what} grammar source exceeds {MAX_SOURCE_BYTES >> 20} MiB", param=param)


def _styled(schema: dict[str, Any]) -> dict[str, Any]:
    styled = dict(schema)
    guidance = dict(styled.get("x-guidance") or {})
    for key, value in JSON_STYLE.items():
        guidance.setdefault(key, value)
    guidance.setdefault("lenient", True)
    styled["x-guidance"] = guidance
    return styled


def answer_entry(fmt: OutputFormat) -> dict[str, Any]:
    """The llguidance grammar entry for a format, named `answer`."""
    if fmt.kind == "json_schema":
        return {"name": "answer", "json_schema": _styled(fmt.source)}
    if fmt.kind == "json_object":
        return {"name": "answer", "json_schema": _styled(ANY_OBJECT)}
    if fmt.kind == "lark":
        return {"name": "answer", "lark_grammar": fmt.source}
    if fmt.kind == "regex":
        return {"name": "answer", "lark_grammar": "start: " + _lark_regex(fmt.source)}
    if fmt.kind == "choice":
        return {"name": "answer", "lark_grammar": "start: " + " | ".join(json.dumps(c) for c in fmt.source)}
    raise GrammarError(f"unknown output format {fmt.kind!r}")


def _lark_regex(pattern: str) -> str:
    # A Lark regex literal: /.../ with slashes escaped.
    return "/" + pattern.replace("/", "\\/") + "/"


@dataclass
class Envelope:
    """How the model writes a block of tool calls, for the grammar's `calls` alternative, over one
    tokenizer: `special` maps the syntax's tags that are single special tokens there to their
    ids (referenced as tokens: they are never bytes of a text lexeme)."""

    forms: tuple[ToolEnvelope, ...]  # the block forms the syntax's parser reads
    special: dict[str, int]
    json_calls: bool  # one JSON call object inside, its arguments checked by the tool's schema
    bare: bool  # the whole answer may be bare or ```json-fenced call objects (qwen25_coder_json)
    json_array: bool = False  # the opener, then a JSON array of call objects, no closer (Mistral)

    def ref(self, text: str) -> str:
        return f"<[{self.special[text]}]>" if text in self.special else json.dumps(text)

    def block_rules(self) -> list[str]:
        """Markup blocks, one rule set per form; blocks may follow each other directly (Gemma 4
        concatenates its calls) or after a newline."""
        rules = [
            "tagged: " + " | ".join(f"tagged{i}" for i in range(len(self.forms))),
            'calls: tagged ("\\n"? tagged)*',
        ]
        for i, form in enumerate(self.forms):
            rules += self._form_rules(form, i)
        return rules

    def _form_rules(self, form: ToolEnvelope, i: int) -> list[str]:
        """One block form: its opener, then text and the syntax's special inner tags, then a
        closer. Text that ends in a text closer is one lexeme (LAST), because llguidance's lexer
        does not give back bytes a greedy text lexeme took; text before a special tag (MID) may
        not contain a text closer."""
        text_closers = [c for c in form.closers if c not in self.special]
        token_closers = " | ".join(self.ref(c) for c in form.closers if c in self.special)
        inner = " | ".join(self.ref(t) for t in form.inner if t in self.special and t not in form.closers)
        rules = [f"tagged{i}: {self.ref(form.opener)} body{i}"]
        if not text_closers:
            items = f"TEXT{i}" + (f" | {inner}" if inner else "")
            return rules + [f"body{i}: ({items})* ({token_closers})", f"TEXT{i}: /(?s:.+)/"]
        closer = "(?:" + "|".join(_literal(c) for c in text_closers) + ")"
        ends = [f"LAST{i}"] + ([f"MID{i}? ({token_closers})"] if token_closers else [])
        loop = f"(MID{i}? ({inner}))* " if inner else ""
        return rules + [
            f"body{i}: {loop}({' | '.join(ends)})",
            f"MID{i}: /(?s:.+)/ & ~/(?s:.*{closer}.*)/",
            f"LAST{i}: /(?s:.*{closer})/ & ~/(?s:.*{closer}.+)/",
        ]


def _literal(text: str) -> str:
    return re.escape(text).replace("/", "\\/")


def envelope_for(tool_syntax: str | None, special_id: Callable[[str], int | None]) -> Envelope | None:
    """The tool-call envelope of a declared tool syntax over one tokenizer (None without one)."""
    forms = TOOL_ENVELOPES.get(tool_syntax or "")
    if forms is None:
        return None
    tags = {tag for form in forms for tag in (form.opener, *form.closers, *form.inner)}
    special = {tag: token for tag in tags if (token := special_id(tag)) is not None}
    return Envelope(
        forms,
        special,
        tool_syntax in JSON_CALL_SYNTAXES,
        tool_syntax in BARE_CALL_SYNTAXES,
        tool_syntax in JSON_ARRAY_SYNTAXES,
    )


def call_schema(tools: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A call object of one of the presented tools, its arguments checked by that tool's own
    parameter schema (never the answer's)."""

    def one(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
        usable = isinstance(parameters, dict) and parameters and '"$ref"' not in json.dumps(parameters)
        arguments = parameters if usable else ANY_OBJECT  # references only resolve at a schema's root
        return {
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": arguments},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }

    options = [one(name, parameters) for name, parameters in tools.items()]
    return options[0] if len(options) == 1 else {"anyOf": options}


def structured_grammar(
    fmt: OutputFormat, envelope: Envelope | None, tools: dict[str, dict[str, Any]], bare_calls: bool = True
) -> str:
    """The llguidance grammar (JSON text) the engine enforces for this request.

    A bare call object (qwen25_coder_json) and a JSON answer both start with "{": once the
    conversation ends in tool results, `bare_calls` is False and only the template's tagged
    envelope remains for further calls, so a bare object is the answer. (Qwen2.5-Coder otherwise
    repeats its call with the result merged into the arguments instead of answering; see
    shared/models.md and docs/conformance.md.)

    The ```json fence is part of that syntax too (Qwen2.5-Coder's usual way to write a call), so
    where bare calls are allowed a fence holds one or more call objects; a fence never holds the
    answer, which is the bare JSON value the format asks for. So does the template's doubled-brace
    spelling `{{...}}` of a call object (helios.neutral.parsers.json_calls), which no JSON answer
    can start with."""
    answer = answer_entry(fmt)
    if envelope is None or not tools:
        top = "start: @answer"
        return json.dumps({"grammars": [{"lark_grammar": top}, answer]})
    if envelope.json_array:  # nothing closes the block: the array's end is the block's
        array = json.dumps(_styled({"type": "array", "items": call_schema(tools), "minItems": 1}))
        opener = envelope.ref(envelope.forms[0].opener)
        rules = [f'tagged: {opener} " "? %json {array}', 'calls: tagged ("\\n"? tagged)*']
    elif envelope.json_calls:
        call = json.dumps(_styled(call_schema(tools)))
        form = envelope.forms[0]
        opener, closer = envelope.ref(form.opener), envelope.ref(form.closers[0])
        rules = [f'tagged: {opener} "\\n" %json {call} "\\n" {closer}', 'calls: tagged ("\\n" tagged)*']
    else:
        rules = envelope.block_rules()
    bare = envelope.bare and bare_calls
    alternatives = ["@answer", "calls"]
    if bare:
        alternatives += ["@bare", "fenced", "doubled"]
        rules.append('fenced: "```json\\n" @bare ("\\n" @bare)* "\\n```"')
        rules.append('doubled: "{" @bare "}"')
    top = "start: " + " | ".join(alternatives) + "\n" + "\n".join(rules)
    grammars = [{"lark_grammar": top}, answer]
    if bare:
        grammars.append({"name": "bare", "json_schema": _styled(call_schema(tools))})
    return json.dumps({"grammars": grammars})


class Compiler:
    """Validates grammars against the loaded tokenizer (shared LLTokenizer)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int]):
        self._args = (tokenizer_json, vocab_size, list(eos_token_ids))
        self._special: dict[str, int | None] = {}
        self._llg: Any = None

    @property
    def llg(self) -> Any:
        if self._llg is None:
            self._llg = llg_tokenizer(*self._args)
        return self._llg

    def special_id(self, text: str) -> int | None:
        """The id of `text` when the grammar tokenizer holds it as one special token."""
        if text not in self._special:
            tok = self.llg
            ids = tok.tokenize_str(text, parse_special=True)
            self._special[text] = ids[0] if len(ids) == 1 and tok.is_special_token(ids[0]) else None
        return self._special[text]

    def validate(self, grammar: str, what: str, param: str) -> str:
        """Compile `grammar`, then prove it usable: a grammar can compile and still fail on its
        first tokens (a lexer blow-up like a{1000000}, a row past llguidance's item limit, a rule
        with no terminating derivation). Each of those fails every time, so it is a 400 here
        rather than an engine failure after admission."""
        try:
            error = llguidance.LLMatcher.validate_grammar(grammar, self.llg, limits=parser_limits())
        except Exception as exc:  # malformed grammar JSON from our side, or a limit
            error = str(exc)
        if error and not error.startswith("WARNING"):
            raise GrammarError(f"the {what} grammar does not compile: {first_line(error)}", param=param)
        problem = self._probe(grammar)
        if problem:
            raise GrammarError(f"the {what} grammar cannot generate: {problem}", param=param)
        return grammar

    def _probe(self, grammar: str) -> str | None:
        """Walk the first PROBE_STEPS tokens of a few paths (tokens spread over each mask);
        the first error found, or None."""
        words = (self.llg.vocab_size + 31) // 32
        bits = np.zeros(words, dtype=np.int32)
        frontier = [llguidance.LLMatcher(self.llg, grammar, log_level=0, limits=parser_limits())]
        for _ in range(PROBE_STEPS):
            following = []
            for matcher in frontier:
                if not matcher.is_error():
                    matcher.unsafe_compute_mask_ptr(bits.ctypes.data, bits.size * 4)
                if matcher.is_error():
                    error = first_line(matcher.get_error())
                    return "it admits no complete output" if error == "NoExtensionBias" else error
                if matcher.is_stopped():
                    continue
                allowed = np.flatnonzero(np.unpackbits(bits.view(np.uint8), bitorder="little"))
                if allowed.size == 0:
                    return "no token can follow" if not matcher.is_accepting() else None
                picks = allowed[np.linspace(0, allowed.size - 1, min(PROBE_WIDTH, allowed.size)).astype(int)]
                for token in dict.fromkeys(int(t) for t in picks):
                    branch = matcher.deep_copy()
                    branch.consume_token(token)
                    if branch.is_error():
                        return first_line(branch.get_error())
                    following.append(branch)
            frontier = following[:PROBE_WIDTH]
        return None

    def output_grammar(
        self,
        fmt: OutputFormat,
        tool_syntax: str | None,
        tools: dict[str, dict[str, Any]],
        param: str,
        bare_calls: bool = True,
    ) -> str:
        """`tools`: the presented tools' parameter schemas by model-facing name."""
        _check_size(fmt.source, "output", param)
        envelope = envelope_for(tool_syntax, self.special_id)
        if envelope is not None and tools:  # a usable call path must not hide an unusable answer
            self.validate(structured_grammar(fmt, None, {}), "output", param)
        return self.validate(structured_grammar(fmt, envelope, tools, bare_calls), "output", param)

    def tool_grammar(self, syntax: str, definition: str, param: str) -> TextGrammar:
        """A Responses custom tool's Lark or regex grammar."""
        if not isinstance(definition, str) or not definition:
            raise GrammarError("a custom tool grammar needs a nonempty definition", param=param)
        _check_size(definition, "custom tool", param)
        if syntax == "lark":
            grammar = llguidance.LLMatcher.grammar_from_lark(definition)
        elif syntax == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(definition)
        else:
            raise GrammarError(f'custom tool grammar syntax must be "lark" or "regex", not {syntax!r}', param=param)
        return TextGrammar(self, self.validate(grammar, "custom tool", param))


class TextGrammar:
    """A compiled grammar that checks complete texts (custom tool inputs)."""

    def __init__(self, compiler: Compiler, grammar: str):
        self.compiler = compiler
        self.grammar = grammar

    def matches(self, text: str) -> bool:
        tok = self.compiler.llg
        matcher = llguidance.LLMatcher(tok, self.grammar, log_level=0, limits=parser_limits())
        ids = tok.tokenize_str(text) if text else []
        return matcher.consume_tokens(ids) and matcher.is_accepting()


_COMPILERS: weakref.WeakKeyDictionary[Any, Compiler] = weakref.WeakKeyDictionary()


def compiler_for(tokenizer: Any, manifest: Any) -> Compiler:
    """The compiler of a loaded core (its tokenizer JSON, vocabulary and end tokens), one per
    tokenizer object."""
    compiler = _COMPILERS.get(tokenizer)
    if compiler is None:
        compiler = Compiler(
            tokenizer.to_json(), manifest.architecture.vocab_size, list(manifest.tokenizer.eos_token_ids)
        )
        _COMPILERS[tokenizer] = compiler
    return compiler

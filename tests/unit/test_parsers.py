"""Output parsers on recorded token streams: the real Qwen tokenizer splits each text into the
tokens a model would generate, the engine's incremental detokenizer releases them one event at a
time, and the stream driver feeds the parsers, exactly as a served request does.

A Qwen3-style tokenizer (the real one with <think> and </think> as added tokens, like Qwen3's)
covers the single-token reasoning rules."""

from __future__ import annotations

import json
from functools import cache

import llguidance
import pytest

from helios.engine.constraints import parser_limits
from helios.engine.detokenizer import IncrementalDetokenizer
from helios.manifest import TokenizerSpec
from helios.neutral.grammar import Compiler, OutputFormat
from helios.neutral.parsers import (
    ANSWER,
    JSON_CALL_SYNTAXES,
    REASONING,
    START,
    TOOL_SYNTAXES,
    CallOut,
    OutputSpec,
    ReasoningOut,
    TextOut,
    ToolParseError,
    build_stream,
    resolve_reasoning,
    single_token,
    start_state,
)
from helios.neutral.parsers.base import MAX_ARGUMENT_BYTES, convert_value
from helios.neutral.tokenizer import Tokenizer
from tests.conftest import add_think_tokens
from tests.unit.tiny_checkpoints import qwen_tokenizer_bundle

THINK, END_THINK = 151667, 151668  # Qwen3's ids for <think> and </think>


@cache
def qwen_tokenizer(thinking: bool = False) -> Tokenizer:
    bundle = qwen_tokenizer_bundle()
    text = add_think_tokens(bundle["tokenizer_json"]) if thinking else bundle["tokenizer_json"]
    spec = TokenizerSpec(
        file="tokenizer.json",
        bos_token_id=None,
        eos_token_ids=bundle["eos_token_ids"],
        pad_token_id=bundle["pad_token_id"],
        add_bos=False,
        special_tokens=bundle["special_tokens"],
    )
    return Tokenizer(text, spec, 151936)


def run(
    pieces, spec: OutputSpec, *, tokenizer: Tokenizer | None = None, truncated: bool = False, entries: bool = False
) -> list:
    """Generate `pieces` (text, or a list mixing text and token ids) one token per event."""
    tok = tokenizer or qwen_tokenizer()
    ids: list[int] = []
    for piece in pieces if isinstance(pieces, list) else [pieces]:
        ids += [piece] if isinstance(piece, int) else tok.encode(piece, add_bos=False)
    detok = IncrementalDetokenizer(tok, [])
    stream = build_stream(spec)
    out = []
    for t in ids:
        out += stream.feed([t], detok.push(t), [t] if entries else None)
    out += stream.feed([], detok.flush())
    out += stream.finish(truncated)
    run.stream = stream
    return out


def merged(outs: list) -> list:
    """Adjacent text (and reasoning) items joined, calls as (name, arguments)."""
    result: list = []
    for o in outs:
        if isinstance(o, CallOut):
            result.append(("call", o.name, o.arguments))
            continue
        kind = "text" if isinstance(o, TextOut) else "reasoning"
        if result and result[-1][0] == kind:
            result[-1] = (kind, result[-1][1] + o.text)
        else:
            result.append((kind, o.text))
    return result


def spec(tool: str | None = None, **kw) -> OutputSpec:
    return OutputSpec(tool_syntax=tool, **kw)


CALL = '{"name": "lookup", "arguments": {"query": "alpha"}}'
LOOKUP = ("call", "lookup", {"query": "alpha"})


# -- JSON syntaxes ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        CALL,
        "```json\n" + json.dumps(json.loads(CALL), indent=2) + "\n```",
        "\n" + CALL + "\n",
        "<tool_call>\n" + CALL + "\n</tool_call>",
    ],
)
def test_qwen25_coder_answers_made_of_one_call(text):
    assert merged(run(text, spec("qwen25_coder_json"))) == [LOOKUP]


def test_qwen25_coder_several_calls_and_arrays():
    two = [CALL, '{"name": "lookup", "arguments": {"query": "beta"}}']
    expected = [LOOKUP, ("call", "lookup", {"query": "beta"})]
    assert merged(run("\n".join(two), spec("qwen25_coder_json"))) == expected
    assert merged(run("[" + ", ".join(two) + "]", spec("qwen25_coder_json"))) == expected
    assert (
        merged(run("```json\n" + two[0] + "\n```\n```json\n" + two[1] + "\n```", spec("qwen25_coder_json"))) == expected
    )


def test_llama3_json_answers_are_calls_and_prose_stays_text():
    """Llama 3.1+ answer a tool call with the bare object their template asks for (`parameters`
    for the arguments), streamed token by token; prose and other JSON answers stay text."""
    llama = '{"name": "lookup", "parameters": {"query": "alpha"}}'
    assert merged(run(llama, spec("llama3_json"))) == [LOOKUP]
    second = '{"name": "lookup", "parameters": {"query": "beta"}}'
    assert merged(run(llama + "\n" + second, spec("llama3_json"))) == [LOOKUP, ("call", "lookup", {"query": "beta"})]
    for text in ("The answer is 42.", '{"value": 7391}'):
        assert merged(run(text, spec("llama3_json"))) == [("text", text)]


def test_mistral_tool_calls_in_both_spellings():
    """[TOOL_CALLS] then a JSON array of calls (v3 tokenizers), or NAME[ARGS]{...} per call
    (v11), streamed token by token; text before the calls stays text."""
    beta = ("call", "lookup", {"query": "beta"})
    two = "[TOOL_CALLS] [" + CALL + ', {"name": "lookup", "arguments": {"query": "beta"}}]'
    assert merged(run(two, spec("mistral"))) == [LOOKUP, beta]
    named = '[TOOL_CALLS]lookup[ARGS]{"query": "alpha"}[TOOL_CALLS]lookup[ARGS]{"query": "beta"}'
    assert merged(run("Checking. " + named, spec("mistral"))) == [("text", "Checking. "), LOOKUP, beta]
    with pytest.raises(ToolParseError):
        run("[TOOL_CALLS] [{]", spec("mistral"))


def test_qwen25_coder_template_doubled_braces():
    # Recorded from Qwen2.5-Coder-1.5B under tool_choice "required" (docs/conformance.md): the
    # template's instructions show `{{"name": <function-name>, ...}}` and the model copies it.
    doubled = '{{"name": "lookup", "arguments": {"query": "alpha"}}}'
    assert merged(run(doubled, spec("qwen25_coder_json"))) == [LOOKUP]
    assert merged(run("<tool_call>\n" + doubled + "\n</tool_call>", spec("qwen25_coder_json"))) == [LOOKUP]
    assert merged(run("<tool_call>\n" + doubled + "\n</tool_call>", spec("hermes"))) == [LOOKUP]
    assert merged(
        run('```json\n{{\n  "name": "lookup",\n  "arguments": {"query": "alpha"}\n}}\n```', spec("qwen25_coder_json"))
    ) == [LOOKUP]
    # Doubled braces around anything but a whole call object stay text, as does an unbalanced
    # doubled call (also recorded from the 1.5B, after a tool result).
    for text in (
        '{{"value": 7391}}',
        '{{"name": "lookup"}} and more',
        "{{x}}",
        '{{"name": "record", "arguments": {"input": "ID-42"}}',
        '{{"response": "Recorded successfully."}}',
    ):
        assert merged(run(text, spec("qwen25_coder_json"))) == [("text", text)]


def test_qwen25_coder_function_wrapped_calls():
    # Recorded from Qwen2.5-Coder-1.5B as Claude Code's agent (docs/conformance.md): the call as
    # OpenAI's tool-call object, fenced, and as {"function": NAME, "arguments": {...}}.
    wrapped = '```json\n{\n  "function": {\n    "name": "lookup",\n    "arguments": {"query": "alpha"}\n  }\n}\n```'
    assert merged(run(wrapped, spec("qwen25_coder_json"))) == [LOOKUP]
    typed = '{"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": "{\\"query\\": \\"alpha\\"}"}}'
    assert merged(run(typed, spec("qwen25_coder_json"))) == [LOOKUP]
    named = '{"function": "lookup", "arguments": {"query": "alpha"}}'
    assert merged(run(named, spec("qwen25_coder_json"))) == [LOOKUP]
    assert merged(run("<tool_call>\n" + named + "\n</tool_call>", spec("hermes"))) == [LOOKUP]
    # Other objects with a "function" or "type" key stay answers.
    for text in (
        '{"function": "lookup"}',
        '{"type": "function", "function": {"name": "lookup"}, "extra": 1}',
        '{"type": "object", "properties": {}}',
        '{"function": {"name": "f", "arguments": {}}, "type": "tool"}',
    ):
        assert merged(run(text, spec("qwen25_coder_json"))) == [("text", text)]


def test_qwen25_coder_json_answers_and_prose_stay_text():
    for text in ('{"value": 7391}', '{"name": "Ada"}', "OK", "The call is " + CALL, CALL + " and more"):
        assert merged(run(text, spec("qwen25_coder_json"))) == [("text", text)]
    # Prose is released as it is generated, not held to the end.
    stream = build_stream(spec("qwen25_coder_json"))
    tok = qwen_tokenizer()
    early = []
    for t in tok.encode("Hello there, how can I help?", add_bos=False):
        early += stream.feed([t], tok.decode([t]))
    assert "".join(o.text for o in early).startswith("Hello there")


def test_qwen25_coder_truncation_and_incomplete_calls():
    assert run('{"name": "lookup", "argu', spec("qwen25_coder_json"), truncated=True) == []  # omitted
    kept = run(CALL + "\n" + CALL[:25], spec("qwen25_coder_json"), truncated=True)
    assert merged(kept) == [LOOKUP]  # complete calls before the cut are kept
    with pytest.raises(ToolParseError):
        run('{"name": "lookup", "argu', spec("qwen25_coder_json"))  # recognized, incomplete at EOS
    assert merged(run('{"value": 73', spec("qwen25_coder_json"), truncated=True)) == [("text", '{"value": 73')]


def test_hermes_tags():
    text = "Let me check.\n<tool_call>\n" + CALL + "\n</tool_call>\n<tool_call>\n" + CALL + "\n</tool_call>"
    assert merged(run(text, spec("hermes"))) == [("text", "Let me check.\n"), LOOKUP, LOOKUP]
    assert merged(run("<tool_call>\n" + CALL, spec("hermes"))) == [LOOKUP]  # the model ended after the object
    assert merged(run("Write <tool_call> tags around calls.", spec("hermes"))) == [
        ("text", "Write <tool_call> tags around calls.")
    ]
    for bad in (
        '<tool_call>\n{"name": "lookup", "arguments": }\n</tool_call>',
        '<tool_call>\n{"arguments": {}}\n</tool_call>',
        '<tool_call>\n{"name": "", "arguments": {}}\n</tool_call>',
        '<tool_call>\n{"name": "lookup", "arguments": [1]}\n</tool_call>',
        '<tool_call>\n{"name": "lookup"',
    ):
        with pytest.raises(ToolParseError):
            run(bad, spec("hermes"))
    assert run('<tool_call>\n{"name": "lookup"', spec("hermes"), truncated=True) == []


def test_arguments_are_bounded():
    big = (
        '<tool_call>\n{"name": "write", "arguments": {"text": "' + "x" * (MAX_ARGUMENT_BYTES + 10) + '"}}\n</tool_call>'
    )
    stream = build_stream(spec("hermes"))
    with pytest.raises(ToolParseError, match="8 MiB"):
        for i in range(0, len(big), 1 << 20):
            stream.feed([], big[i : i + (1 << 20)])
        stream.finish(False)


# -- tag syntaxes ----------------------------------------------------------------------------------

QWEN_XML = "<tool_call>\n<function=lookup>\n<parameter=query>\nalpha\n</parameter>\n<parameter=limit>\n3\n</parameter>\n</function>\n</tool_call>"
SCHEMAS = {
    "lookup": {
        "type": "object",
        "properties": {
            "query": {"type": "string"},
            "limit": {"type": "integer"},
            "exact": {"type": "boolean"},
            "tags": {"type": "array"},
        },
    }
}


def test_qwen_function_tags():
    xml = spec("qwen3_xml", schemas=SCHEMAS)
    assert merged(run("Checking.\n" + QWEN_XML, xml)) == [
        ("text", "Checking.\n"),
        ("call", "lookup", {"query": "alpha", "limit": 3}),
    ]
    # Outer tags omitted; a missing </parameter> closed by the next boundary; conversion by schema.
    bare = "<function=lookup>\n<parameter=query>\n  indented\n\n<parameter=exact>\ntrue\n<parameter=tags>\n[1, 2]\n</function>"
    assert merged(run(bare, xml)) == [("call", "lookup", {"query": "  indented\n", "exact": True, "tags": [1, 2]})]
    # Undeclared tools keep text values; invalid values stay text (non-strict schemas).
    assert merged(run("<function=other>\n<parameter=n>\n3\n</parameter>\n</function>", xml)) == [
        ("call", "other", {"n": "3"})
    ]
    assert merged(run("<function=lookup>\n<parameter=limit>\nmany\n</parameter>\n</function>", xml)) == [
        ("call", "lookup", {"limit": "many"})
    ]


def test_qwen_function_tag_header_rule():
    xml = spec("qwen3_xml", schemas=SCHEMAS)
    for prose in (
        "Use the <tool_call> tag to call.",
        "Write <function=name> then parameters.",
        "<tool_call> is how calls start.",
        "<function=lookup> is the header.",
    ):
        assert merged(run(prose, xml)) == [("text", prose)]
    with pytest.raises(ToolParseError):
        run("<tool_call>\n<function=lookup>\n<parameter=query>\nal", xml)  # undecided at the end
    assert run("<tool_call>\n<function=lookup>\n<parameter=query>\nal", xml, truncated=True) == []


def test_glm_minimax_gemma_deepseek():
    glm = "<tool_call>lookup\n<arg_key>query</arg_key>\n<arg_value>alpha</arg_value>\n<arg_key>limit</arg_key>\n<arg_value>3</arg_value>\n</tool_call>"
    assert merged(run(glm, spec("glm45", schemas=SCHEMAS))) == [("call", "lookup", {"query": "alpha", "limit": 3})]
    assert merged(run("<tool_call> is a tag.\nMore prose.", spec("glm45"))) == [
        ("text", "<tool_call> is a tag.\nMore prose.")
    ]
    mini = (
        'Sure.<minimax:tool_call>\n<invoke name="lookup">\n<parameter name="query">alpha</parameter>\n</invoke>\n'
        '<invoke name="lookup">\n<parameter name="limit">3</parameter>\n</invoke>\n</minimax:tool_call>'
    )
    assert merged(run(mini, spec("minimax", schemas=SCHEMAS))) == [
        ("text", "Sure."),
        LOOKUP,
        ("call", "lookup", {"limit": 3}),
    ]
    gemma = '<|tool_call>call:lookup{query:<|"|>alpha<|"|>,limit:3,opts:{deep:true,tags:[<|"|>a<|"|>]}}<tool_call|>'
    assert merged(run(gemma, spec("gemma4"))) == [
        ("call", "lookup", {"query": "alpha", "limit": 3, "opts": {"deep": True, "tags": ["a"]}})
    ]
    dsml = (
        '<｜DSML｜function_calls>\n<｜DSML｜invoke name="lookup">\n'
        '<｜DSML｜parameter name="query" string="true">alpha</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="limit" string="false">3</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
        "</｜DSML｜function_calls>\nignored trailing text"
    )
    assert merged(run(dsml, spec("deepseek_dsml"))) == [("call", "lookup", {"query": "alpha", "limit": 3})]
    xtml = dsml.replace("DSML", "XTML")
    assert merged(run(xtml, spec("deepseek_xtml"))) == [("call", "lookup", {"query": "alpha", "limit": 3})]
    with pytest.raises(ToolParseError):  # argument names are unique
        run(dsml.replace('"limit"', '"query"'), spec("deepseek_dsml"))
    with pytest.raises(ToolParseError):  # string="false" values are JSON
        run(dsml.replace(">3<", ">three<"), spec("deepseek_dsml"))


def test_schema_guided_conversion():
    assert convert_value("3", {"type": "integer"}) == 3
    assert convert_value("3.5", {"type": "number"}) == 3.5
    assert convert_value("yes", {"type": "boolean"}) == "yes"
    assert convert_value("null", {"type": ["string", "null"]}) is None
    assert convert_value('{"a": 1}', {"type": "object"}) == {"a": 1}
    assert convert_value("3", {"anyOf": [{"type": "integer"}, {"type": "string"}]}) == "3"
    assert convert_value("3", None) == "3"


# -- reasoning -------------------------------------------------------------------------------------


def thinking(tool: str | None = "hermes", start: str = START) -> OutputSpec:
    tok = qwen_tokenizer(True)
    return OutputSpec(tool_syntax=tool, reasoning=resolve_reasoning("qwen3", tok), start=start)


def test_single_token_delimiters():
    tok = qwen_tokenizer(True)
    r = resolve_reasoning("qwen3", tok)
    assert (r.open_id, r.close_id) == (THINK, END_THINK) and single_token(tok, "</think>") == END_THINK
    assert resolve_reasoning("qwen3", qwen_tokenizer()).close_id is None  # Qwen2.5 spells it in pieces
    out = run([THINK, "\nThe user wants OK.\n", END_THINK, "\n\nOK"], thinking(), tokenizer=tok)
    assert merged(out) == [("reasoning", "The user wants OK."), ("text", "OK")]
    assert run.stream.reasoning_tokens > 0
    # The same text written in ordinary pieces is not a delimiter: it stays where it is.
    pieces = ["<th", "ink>", "not reasoning", "</th", "ink>"]
    assert merged(run(pieces, thinking(), tokenizer=tok)) == [("text", "<think>not reasoning</think>")]
    started = run(
        ["Still thinking", "</th", "ink>", " more", END_THINK, "Done"], thinking(start=REASONING), tokenizer=tok
    )
    assert merged(started) == [("reasoning", "Still thinking</think> more"), ("text", "Done")]
    # An answer may contain the delimiter token: once the answer began it is text.
    assert merged(run(["OK ", THINK, "x"], thinking(), tokenizer=tok)) == [("text", "OK <think>x")]


def test_tool_call_ends_qwen_reasoning():
    tok = qwen_tokenizer(True)
    stream = ["I need lookup.\n<tool_call>\n" + CALL + "\n</tool_call>", END_THINK, "\n"]
    assert merged(run(stream, thinking(start=REASONING), tokenizer=tok)) == [("reasoning", "I need lookup."), LOOKUP]
    # A quoted tag that never becomes a call stays reasoning.
    quoted = ["Calls look like <tool_call> tags.", END_THINK, "Fine"]
    assert merged(run(quoted, thinking(start=REASONING), tokenizer=tok)) == [
        ("reasoning", "Calls look like <tool_call> tags."),
        ("text", "Fine"),
    ]


def test_text_delimiters_and_start_state():
    tok = qwen_tokenizer()
    deep = OutputSpec(reasoning=resolve_reasoning("deepseek", tok), start=REASONING)
    assert merged(run("Hmm.</think>\n\nAnswer", deep, tokenizer=tok)) == [("reasoning", "Hmm."), ("text", "Answer")]
    r = resolve_reasoning("qwen3", tok)
    assert start_state(r, "<|im_start|>assistant\n<think>\n") == REASONING
    assert start_state(r, "<|im_start|>assistant\n<think>\n\n</think>\n\n") == START
    assert start_state(None, "anything") == ANSWER


def test_logprob_entries_follow_answer_text():
    tok = qwen_tokenizer(True)
    out = run([THINK, "why", END_THINK, "OK"], thinking(tool=None), tokenizer=tok, entries=True)
    text = [o for o in out if isinstance(o, TextOut)]
    assert [o.text for o in text] == ["OK"] and [e for o in text for e in o.logprobs] == tok.encode("OK", add_bos=False)
    assert all(not isinstance(o, ReasoningOut) or o.text == "why" for o in out)
    calls = run("Sure " + "<tool_call>\n" + CALL + "\n</tool_call>", spec("hermes"), entries=True)
    assert [e for o in calls if isinstance(o, TextOut) for e in o.logprobs] == tok.encode("Sure ", add_bos=False)


def test_markers_whose_text_is_held_or_skipped():
    tok = qwen_tokenizer(True)
    # A stop-string hold releases the delimiter's text one event later: it is found there.
    stream = build_stream(thinking(tool=None, start=REASONING))
    out = stream.feed([tok.encode("a", add_bos=False)[0]], "a")
    out += stream.feed([END_THINK], "")
    out += stream.feed([tok.encode("b", add_bos=False)[0]], "</think>b")
    out += stream.finish(False)
    assert merged(out) == [("reasoning", "a"), ("text", "b")]
    # A special (skipped) delimiter has no text: a zero-width marker at its event.
    stream = build_stream(thinking(tool=None, start=REASONING))
    stream.markers = {END_THINK: ""}
    out = stream.feed([1], "x") + stream.feed([END_THINK], "") + stream.feed([2], "y") + stream.finish(False)
    assert merged(out) == [("reasoning", "x"), ("text", "y")]


# -- tools under an output constraint --------------------------------------------------------------

CALL_BLOCKS = {
    "hermes": "<tool_call>\n" + CALL + "\n</tool_call>",
    "qwen25_coder_json": "<tool_call>\n" + CALL + "\n</tool_call>",
    "llama3_json": "<tool_call>\n" + CALL + "\n</tool_call>",
    "mistral": "[TOOL_CALLS] [" + CALL + "]",
    "qwen3_xml": QWEN_XML.replace("<parameter=limit>\n3\n</parameter>\n", ""),
    "qwen3_coder": QWEN_XML.replace("<parameter=limit>\n3\n</parameter>\n", ""),
    "mimo": "<tool_call>\n<function=lookup>\n<parameter=query>alpha</parameter>\n</function>\n</tool_call>",
    "glm45": "<tool_call>lookup\n<arg_key>query</arg_key>\n<arg_value>alpha</arg_value>\n</tool_call>",
    "minimax": (
        '<minimax:tool_call>\n<invoke name="lookup">\n<parameter name="query">alpha</parameter>\n'
        "</invoke>\n</minimax:tool_call>"
    ),
    "gemma4": '<|tool_call>call:lookup{query:<|"|>alpha<|"|>}<tool_call|>',
    "deepseek_dsml": (
        '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="lookup">\n'  # V4's official block
        '<｜DSML｜parameter name="query" string="true">alpha</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
        "</｜DSML｜tool_calls>"
    ),
    "kimi_k2": (
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.lookup:0<|tool_call_argument_begin|>"
        '{"query": "alpha"}<|tool_call_end|><|tool_calls_section_end|>'
    ),
}
CALL_BLOCKS["deepseek_xtml"] = CALL_BLOCKS["deepseek_dsml"].replace("DSML", "XTML")


@pytest.mark.parametrize("syntax", sorted(TOOL_SYNTAXES))
def test_every_tool_syntax_keeps_its_calls_under_an_output_constraint(syntax: str):
    """api.md: a JSON answer format constrains the answer while the tool-call envelopes stay
    open. For each declared syntax the enforced grammar accepts the answer, a call block its own
    parser reads as the call, and two blocks; text after a block, or a block left open, is refused."""
    bundle = qwen_tokenizer_bundle()
    compiler = Compiler(bundle["tokenizer_json"], 151936, bundle["eos_token_ids"])
    answer = {"type": "object", "properties": {"value": {"type": "integer"}}, "required": ["value"]}
    grammar = compiler.output_grammar(OutputFormat("json_schema", answer), syntax, SCHEMAS, "response_format")
    block = CALL_BLOCKS[syntax]
    assert merged(run(block, spec(syntax, schemas=SCHEMAS))) == [LOOKUP]

    def accepts(text: str) -> bool:
        matcher = llguidance.LLMatcher(compiler.llg, grammar, log_level=0, limits=parser_limits())
        return matcher.consume_tokens(compiler.llg.tokenize_str(text, parse_special=True)) and matcher.is_accepting()

    assert accepts('{"value": 7}') and accepts(block) and accepts(block + "\n" + block)
    assert not accepts(block + " and more") and not accepts(block[:-3]) and not accepts("plain prose")
    if syntax not in JSON_CALL_SYNTAXES:  # Gemma 4 writes its calls back to back
        assert accepts(block + block)
    if block.startswith("<tool_call>\n<function="):  # Qwen's parser also reads the bare function block
        bare = block.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>")
        assert merged(run(bare, spec(syntax, schemas=SCHEMAS))) == [LOOKUP] and accepts(bare)

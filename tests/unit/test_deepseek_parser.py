"""DeepSeek DSML/XTML tool calls and reasoning against DeepSeek's official deepseek-recipe.

api.md pins the official deepseek-recipe state machine. DeepSeek publishes it on PyPI
(`deepseek-recipe`, MIT, Rust with Python bindings; https://github.com/deepseek-ai/deepseek-recipe),
but it is not a dependency of Flare, so helios runs its own parser (parsers/deepseek.py) and these
fixtures prove it agrees. Each fixture is an assistant turn as the model generates it after the
official prompt (`...<｜Assistant｜><think>` in thinking mode, `...<｜Assistant｜></think>`
without), and what the official parser makes of it.

Sources (cited per fixture):
- ENC_V4 / ENC_V41: the assistant-turn layout that deepseek-recipe 0.2.0 `DeepseekV4Encoding` /
  `DeepseekV41Encoding.render_conversation` writes: `{reasoning}</think>{content}\\n\\n<block>`,
  one tag per line. The same layout as the V4 / V4.1 release reference encoders
  (`encoding/encoding_dsv4.py` in the Hugging Face deepseek-ai/DeepSeek-V4-* repos, as adapted
  in github.com/sgl-project/sglang python/sglang/srt/entrypoints/openai/encoding_dsv4.py and
  encoding_dsv41.py: `tool_calls_template`, `tool_calls_block_name` "tool_calls" / " calls").
- PARSER: deepseek-recipe 0.2.0 `StreamProcessor` (Chat Completions generator) output for that
  text, with `ParsingOptions.thinking_initial_stage = ThinkingInitialStage.ReasoningStart`
  ("discarding leading newlines", deepseek_recipe/_native.pyi) in thinking mode.
- API: api.md's validation on top of the official parser: nonempty tool names, JSON-object
  arguments with nonempty, unique names. Where the official parser passes on arguments that are
  not such an object (it splices values into the JSON text verbatim), helios fails the response.

test_official_parser_agrees replays every fixture through the official parser itself
(deepseek-recipe is pinned in the test extra).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import deepseek_recipe
import pytest

from helios.neutral.parsers import REASONING, ToolParseError, build_stream, resolve_reasoning, start_state
from tests.unit.test_parsers import merged, qwen_tokenizer, run, spec

ENC_V4 = "deepseek-recipe 0.2.0 DeepseekV4Encoding (encoding_dsv4.py layout)"
ENC_V41 = "deepseek-recipe 0.2.0 DeepseekV41Encoding (encoding_dsv41.py layout)"
PARSER = "deepseek-recipe 0.2.0 StreamProcessor"
API = "api.md validation (official parser passes on non-object arguments)"

D = "｜DSML｜"


def param(name: str, value: str, string: str = "true", sp: str = "") -> str:
    return f'<{D}{sp}parameter name="{name}" string="{string}">{value}</{D}{sp}parameter>'


def invoke(name: str, *params: str, sp: str = "") -> str:
    body = "\n".join(params)
    return f'<{D}{sp}invoke name="{name}">\n{body}\n</{D}{sp}invoke>'


def block(*invokes: str, name: str = "tool_calls") -> str:
    """A call block as the encoders write it: one tag per line, no trailing newline."""
    return f"<{D}{name}>\n" + "\n".join(invokes) + f"\n</{D}{name}>"


def v41(*invokes: str) -> str:
    return block(*invokes, name=" calls")


LOOKUP = invoke("lookup", param("query", "alpha"), param("limit", "3", "false"))


@dataclass(frozen=True)
class Fixture:
    id: str
    source: str
    text: str  # the generated assistant turn (EOS excluded)
    content: str = ""
    reasoning: str = ""
    calls: tuple[tuple[str, dict[str, Any]], ...] = ()
    error: bool = False  # helios fails the response (API)
    thinking: bool = True
    word: str = "DSML"
    official: tuple[tuple[str, Any], ...] | None = None  # the official calls where they differ


FIXTURES = [
    # -- the encoders' own layout ---------------------------------------------------------------
    Fixture(
        "v4_text_then_call",
        ENC_V4 + "; " + PARSER,
        "I need lookup.</think>Let me check.\n\n" + block(LOOKUP),
        "Let me check.",
        "I need lookup.",
        (("lookup", {"query": "alpha", "limit": 3}),),
    ),
    Fixture(
        "v4_two_invokes_empty_args",
        ENC_V4 + "; " + PARSER,
        "Two calls.</think>\n\n" + block(LOOKUP, f'<{D}invoke name="other">\n</{D}invoke>'),
        "",
        "Two calls.",
        (("lookup", {"query": "alpha", "limit": 3}), ("other", {})),
    ),
    Fixture(
        "v4_json_values",
        ENC_V4 + ' (string="false": JSON of non-strings); ' + PARSER,
        "r</think>\n\n"
        + block(
            invoke(
                "f",
                param("opts", '{"deep": true, "tags": ["a"], "n": null}', "false"),
                param("ok", "false", "false"),
                param("none", "null", "false"),
                param("x", "-1.5", "false"),
                param("list", '[1, "two", [3]]', "false"),
            )
        ),
        "",
        "r",
        (
            (
                "f",
                {
                    "opts": {"deep": True, "tags": ["a"], "n": None},
                    "ok": False,
                    "none": None,
                    "x": -1.5,
                    "list": [1, "two", [3]],
                },
            ),
        ),
    ),
    Fixture(
        "v4_strings_stay_strings",
        ENC_V4 + ' (string="true": the text as is); ' + PARSER,
        "r</think>\n\n"
        + block(invoke("f", param("n", "3"), param("obj", '{"a": 1}'), param("pad", " x "), param("empty", ""))),
        "",
        "r",
        (("f", {"n": "3", "obj": '{"a": 1}', "pad": " x ", "empty": ""}),),
    ),
    Fixture(
        "v4_multiline_code",
        ENC_V4 + "; " + PARSER,
        "r</think>\n\n" + block(invoke("write", param("code", "def f(a, b):\n    return a < b > 0\n"))),
        "",
        "r",
        (("write", {"code": "def f(a, b):\n    return a < b > 0\n"}),),
    ),
    Fixture(
        "v4_unicode",
        ENC_V4 + " (to_json ensure_ascii=False); " + PARSER,
        "查询。</think>好的。\n\n" + block(invoke("天气", param("城市", "北京"), param("天数", '["今天"]', "false"))),
        "好的。",
        "查询。",
        (("天气", {"城市": "北京", "天数": ["今天"]}),),
    ),
    Fixture(
        "v4_non_thinking",
        ENC_V4 + " (chat mode: prompt ends </think>); " + PARSER,
        "\n\nSure.\n\n" + block(LOOKUP),
        "Sure.",
        "",
        (("lookup", {"query": "alpha", "limit": 3}),),
        thinking=False,
    ),
    Fixture(
        "v41_spaced_tags",
        ENC_V41 + " (' calls', ' invoke', ' parameter'); " + PARSER,
        "r</think>Sure.\n\n"
        + v41(
            invoke("lookup", param("query", "alpha", sp=" "), param("limit", "3", "false", sp=" "), sp=" "),
            f'<{D} invoke name="other">\n\n</{D} invoke>',
        ),
        "Sure.",
        "r",
        (("lookup", {"query": "alpha", "limit": 3}), ("other", {})),
    ),
    Fixture(
        "v32_function_calls_block",
        "DeepSeek-V3.2 encoding (function_calls), helios' Jinja fallback; " + PARSER,
        "r</think>\n\n" + block(LOOKUP, name="function_calls"),
        "",
        "r",
        (("lookup", {"query": "alpha", "limit": 3}),),
    ),
    Fixture(
        "xtml_spelling",
        PARSER + " with SpecialTokens(dsml='｜XTML｜')",
        "r</think>ok\n\n" + block(LOOKUP).replace("DSML", "XTML"),
        "ok",
        "r",
        (("lookup", {"query": "alpha", "limit": 3}),),
        word="XTML",
    ),
    # -- reasoning and content edges ------------------------------------------------------------
    Fixture(
        "answer_newlines",
        PARSER + " (newlines trimmed at reasoning/answer edges only)",
        "\nthink\n</think>\n\nThe answer.\n",
        "The answer.\n",
        "think",
    ),
    Fixture("spaces_are_kept", PARSER, "  x </think> y", " y", "  x "),
    Fixture(
        "reasoning_left_open",
        PARSER + " (no </think>: all reasoning)",
        "\n\nonly thinking\n\n",
        "",
        "only thinking\n\n",
    ),
    Fixture(
        "calls_end_reasoning",
        PARSER + " (a DSML tag ends reasoning)",
        "I need it.\n\n" + block(LOOKUP) + "</think>after",
        "",
        "I need it.",
        (("lookup", {"query": "alpha", "limit": 3}),),
    ),
    Fixture("think_close_dropped_from_content", PARSER, "r</think>a</think>b<think>c", "ab<think>c", "r"),
    Fixture(
        "value_in_reasoning_keeps_think_close",
        PARSER + " (the call region owns `</think>`)",
        "I need it.\n\n" + block(invoke("f", param("a", "x</think>y"))),
        "",
        "I need it.",
        (("f", {"a": "x</think>y"}),),
    ),
    Fixture(
        "non_thinking_think_tag_is_text",
        PARSER + " (only the prompt opens reasoning)",
        "<think>x</think>y",
        "<think>xy",
        "",
        thinking=False,
    ),
    Fixture(
        "trailing_text_discarded",
        PARSER + " (the block close ends the output)",
        "r</think>\n\n" + block(LOOKUP) + "\nmore\n\n" + block(invoke("g")),
        "",
        "r",
        (("lookup", {"query": "alpha", "limit": 3}),),
    ),
    Fixture(
        "dsml_mention_swallows_rest",
        PARSER + " (any <｜DSML｜ opens the call region)",
        "r</think>Use <｜DSML｜tool_calls> to call.",
        "Use ",
        "r",
    ),
    Fixture(
        "ascii_bar_is_text",
        PARSER + " (only the fullwidth token counts)",
        "r</think>x\n\n" + block(LOOKUP).replace("｜", "|"),
        "x\n\n" + block(LOOKUP).replace("｜", "|"),
        "r",
    ),
    # -- the official parser's tolerance ------------------------------------------------------------
    Fixture(
        "no_newlines_between_tags",
        PARSER,
        f'r</think><{D}tool_calls><{D}invoke name="f">{param("a", "1")}</{D}invoke></{D}tool_calls>',
        "",
        "r",
        (("f", {"a": "1"}),),
    ),
    Fixture(
        "invoke_without_block",
        PARSER,
        "r</think>\n\n" + invoke("f", param("a", "1")) + "\n" + invoke("g"),
        "",
        "r",
        (("f", {"a": "1"}), ("g", {})),
    ),
    Fixture(
        "junk_between_tags_ignored",
        PARSER,
        "r</think>\n\n" + block(invoke("f", "junk", param("a", "1") + "more" + param("b", "2")), "stray"),
        "",
        "r",
        (("f", {"a": "1", "b": "2"}),),
    ),
    Fixture(
        "omitted_invoke_close",
        PARSER,
        f'r</think>\n\n<{D}tool_calls>\n<{D}invoke name="f">\n{param("a", "1")}\n</{D}tool_calls>',
        "",
        "r",
        (("f", {"a": "1"}),),
    ),
    Fixture(
        "omitted_block_close",
        PARSER,
        "r</think>\n\n" + f"<{D}tool_calls>\n" + invoke("f", param("a", "1")),
        "",
        "r",
        (("f", {"a": "1"}),),
    ),
    Fixture(
        "omitted_parameter_close",
        PARSER + " (a value runs to the next closing DSML tag)",
        f'r</think>\n\n<{D}tool_calls>\n<{D}invoke name="f">\n<{D}parameter name="a" string="true">1\n'
        f"</{D}invoke>\n</{D}tool_calls>",
        "",
        "r",
        (("f", {"a": "1\n"}),),
    ),
    Fixture(
        "block_close_in_invoke_closes_invoke",
        PARSER + " (any closing DSML tag ends an invoke)",
        f'r</think>\n\n<{D}tool_calls>\n<{D}invoke name="f">\n</{D}tool_calls>\n' + invoke("g"),
        "",
        "r",
        (("f", {}), ("g", {})),
    ),
    Fixture(
        "invoke_close_in_value_ends_value",
        PARSER + " (the next closing tag then closes the invoke)",
        f'r</think>\n\n<{D}tool_calls>\n<{D}invoke name="f">\n<{D}parameter name="a" string="true">1'
        f"</{D}invoke>\n" + invoke("g") + f"\n</{D}tool_calls>",
        "",
        "r",
        (("f", {"a": "1"}),),
    ),
    Fixture(
        "stray_parameter_close_ends_invoke",
        PARSER,
        f'r</think>\n\n<{D}tool_calls>\n<{D}invoke name="f">\n</{D}parameter>\n{param("a", "1")}\n</{D}invoke>',
        "",
        "r",
        (("f", {}),),
    ),
    Fixture(
        "value_keeps_open_tags",
        PARSER,
        "r</think>\n\n" + block(invoke("f", param("a", f"x <{D}parameter y</think>z"))),
        "",
        "r",
        (("f", {"a": f"x <{D}parameter y</think>z"}),),
    ),
    Fixture(
        "unknown_invoke_attribute",
        PARSER,
        f'r</think>\n\n<{D}tool_calls>\n<{D}invoke name="f" id="1">\n{param("a", "1")}\n</{D}invoke>\n</{D}tool_calls>',
        "",
        "r",
        (("f", {"a": "1"}),),
    ),
    Fixture(
        "unread_invoke_spelling",
        PARSER + " (invoke  name: not an invoke tag)",
        "r</think>\n\n" + block(invoke("f", param("a", "1")).replace("invoke name", "invoke  name", 1)),
        "",
        "r",
    ),
    Fixture("partial_header_at_end", PARSER, f'r</think>\n\n<{D}tool_calls>\n<{D}invoke name="f', "", "r"),
    # -- malformed: the official parser passes on non-object arguments, helios fails (API) ------
    Fixture(
        "false_value_not_json",
        API,
        "r</think>\n\n" + block(invoke("f", param("n", "three", "false"))),
        reasoning="r",
        error=True,
    ),
    Fixture(
        "missing_string_attribute",
        API,
        "r</think>\n\n" + block(invoke("f", f'<{D}parameter name="n">3</{D}parameter>')),
        reasoning="r",
        error=True,
    ),
    Fixture(
        "other_string_attribute",
        API,
        "r</think>\n\n" + block(invoke("f", param("n", "3", "yes"))),
        reasoning="r",
        error=True,
    ),
    Fixture(
        "duplicate_parameter",
        API,
        "r</think>\n\n" + block(invoke("f", param("a", "1"), param("a", "2"))),
        reasoning="r",
        error=True,
    ),
    Fixture("empty_tool_name", API, "r</think>\n\n" + block(invoke("", param("a", "1"))), reasoning="r", error=True),
    Fixture(
        "empty_parameter_name", API, "r</think>\n\n" + block(invoke("f", param("", "1"))), reasoning="r", error=True
    ),
    Fixture(
        "spaced_parameter_name", API, "r</think>\n\n" + block(invoke("f", param("a b", "1"))), reasoning="r", error=True
    ),
    Fixture(
        "parameter_open_at_block_close",
        API,
        f'r</think>\n\n<{D}tool_calls>\n<{D}invoke name="f">\n<{D}parameter name="a" string="true">1</{D}tool_calls>',
        reasoning="r",
        error=True,
    ),
    Fixture(
        "invoke_open_at_end",
        API + "; api.md: incomplete calls at natural completion are errors",
        f'r</think>\n\n<{D}tool_calls>\n<{D}invoke name="f">\n{param("a", "1")}\n',
        reasoning="r",
        error=True,
    ),
    # The official parser silently drops a parameter whose tag it cannot read; helios refuses.
    Fixture(
        "parameter_tag_spacing",
        API,
        "r</think>\n\n" + block(invoke("f", f'<{D}parameter  name = "a"  string = "true" >1</{D}parameter>')),
        reasoning="r",
        error=True,
        official=(("f", {}),),
    ),
]


def helios_output(fx: Fixture, pieces: Any = None, truncated: bool = False) -> tuple[str, str, list]:
    tok = qwen_tokenizer()
    reasoning = resolve_reasoning("deepseek", tok)
    start = REASONING if fx.thinking else start_state(reasoning, "<｜Assistant｜></think>")
    out = merged(
        run(
            fx.text if pieces is None else pieces,
            spec(f"deepseek_{fx.word.lower()}", reasoning=reasoning, start=start),
            tokenizer=tok,
            truncated=truncated,
        )
    )
    text = "".join(o[1] for o in out if o[0] == "text")
    thought = "".join(o[1] for o in out if o[0] == "reasoning")
    return text, thought, [(o[1], o[2]) for o in out if o[0] == "call"]


@pytest.mark.parametrize("fx", FIXTURES, ids=[f.id for f in FIXTURES])
def test_fixture(fx: Fixture):
    if fx.error:
        with pytest.raises(ToolParseError):
            helios_output(fx)
        return
    assert helios_output(fx) == (fx.content, fx.reasoning, list(fx.calls))


@pytest.mark.parametrize("fx", [f for f in FIXTURES if not f.error], ids=[f.id for f in FIXTURES if not f.error])
def test_fixture_streamed_by_character(fx: Fixture):
    """Any split of the text parses alike (the official processor is a stream parser too)."""
    tok = qwen_tokenizer()
    reasoning = resolve_reasoning("deepseek", tok)
    start = REASONING if fx.thinking else start_state(reasoning, "<｜Assistant｜></think>")
    stream = build_stream(spec(f"deepseek_{fx.word.lower()}", reasoning=reasoning, start=start))
    out = []
    for ch in fx.text:
        out += stream.feed([], ch)
    out += stream.finish(False)
    got = merged(out)
    assert "".join(o[1] for o in got if o[0] == "text") == fx.content
    assert "".join(o[1] for o in got if o[0] == "reasoning") == fx.reasoning
    assert [(o[1], o[2]) for o in got if o[0] == "call"] == list(fx.calls)


def test_truncated_call_is_omitted_and_finished_calls_kept():
    fx = Fixture(
        "cut",
        PARSER,
        "r</think>\n\n"
        + f"<{D}tool_calls>\n"
        + LOOKUP
        + f'\n<{D}invoke name="g">\n'
        + f'<{D}parameter name="a" string="true">par',
    )
    assert helios_output(fx, truncated=True) == ("", "r", [("lookup", {"query": "alpha", "limit": 3})])


def test_calls_publish_when_their_invoke_closes():
    """api.md: each call is published when its arguments complete, before the block ends."""
    stream = build_stream(spec("deepseek_dsml"))
    out = stream.feed([], "\n\n" + f"<{D}tool_calls>\n" + LOOKUP)
    assert [o.name for o in out if hasattr(o, "arguments")] == ["lookup"]


# -- the official parser itself, when installed ----------------------------------------------------


def official_output(dr: Any, fx: Fixture) -> tuple[str, str, list]:
    conversation = dr.Conversation([dr.UserMessage("hi")], thinking_mode=fx.thinking)
    request = dr.ConversationRequest(conversation, dr.ModelVersion.DeepseekV4Pro)
    options = request.parsing_options
    options.thinking_initial_stage = dr.ThinkingInitialStage.ReasoningStart if fx.thinking else None
    if fx.word != "DSML":
        options.special_tokens = dr.SpecialTokens(dsml=f"｜{fx.word}｜")
    processor = dr.StreamProcessor(dr.ChatCompletionRequest.chunk_generator(request, "id", "m"), options)
    chunks = processor.push(dr.InferenceChunk.ready()) + processor.push(dr.InferenceChunk.text(fx.text, 1))
    chunks += processor.push(dr.InferenceChunk.finish(dr.InferenceFinishReason.Stop)) + processor.finish()
    response = dr.ChatCompletionResponse("id", "m", 0, 1, 0)
    for chunk in chunks:
        response.accumulate(chunk)
    message = json.loads(response.to_json())["choices"][0]["message"]
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []]
    return message.get("content") or "", message.get("reasoning_content") or "", calls


def valid_arguments(arguments: str) -> dict | None:
    """The arguments as helios would accept them: a JSON object with unique nonempty names."""

    def unique(pairs: list) -> dict:
        keys = [k for k, _ in pairs]
        if len(set(keys)) != len(keys) or not all(keys):
            raise ValueError("repeated or empty name")
        return dict(pairs)

    try:
        value = json.loads(arguments, object_pairs_hook=unique)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


@pytest.mark.parametrize("fx", FIXTURES, ids=[f.id for f in FIXTURES])
def test_official_parser_agrees(fx: Fixture):
    content, thought, calls = official_output(deepseek_recipe, fx)
    parsed = [(name, valid_arguments(arguments)) for name, arguments in calls]
    if fx.official is not None:
        assert parsed == list(fx.official)
    elif fx.error:  # the official output is no valid set of calls
        assert any(not name or args is None for name, args in parsed)
    else:
        assert (content, thought, parsed) == (fx.content, fx.reasoning, list(fx.calls))

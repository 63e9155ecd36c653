"""Tool calls, tool choice, reasoning output and conversation lowering across Chat Completions,
Messages and Responses, on the real application over a scripted engine (tests/unit/scripted.py):
the model "says" a chosen continuation, so every rule is checked deterministically, buffered and
streamed, through the same parsers and encoders a served model uses."""

from __future__ import annotations

import json

import httpx
import pytest
from anthropic import Anthropic
from openai import OpenAI

from helios.neutral.conversation import (
    Conversation,
    Message,
    TextPart,
    ToolCallPart,
    ToolResultPart,
    render_text,
    reorder_tool_results,
    supports_inline_system,
)
from helios.neutral.template import ChatTemplate
from helios.neutral.thinking import effort_from_budget, resolve_effort, template_kwargs, template_levels
from helios.neutral.tools import REQUIRED_INSTRUCTION
from helios.protocols.messages import thinking_signature
from tests.unit.live import ANTHROPIC, USER, sse
from tests.unit.scripted import ScriptedServer

FUNCTION = {
    "name": "lookup",
    "description": "Look up a value.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
}
CHAT_TOOLS = [{"type": "function", "function": FUNCTION}]
MESSAGES_TOOLS = [{"name": "lookup", "description": "Look up a value.", "input_schema": FUNCTION["parameters"]}]
RESPONSES_TOOLS = [{"type": "function", **FUNCTION}]
CALL = '{"name": "lookup", "arguments": {"query": "alpha"}}'
OTHER = '{"name": "search", "arguments": {"q": "x"}}'
THINK, END_THINK = 151667, 151668


@pytest.fixture(scope="module")
def server(tiny_core):
    s = ScriptedServer(tiny_core)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def think(tiny_think_core):
    s = ScriptedServer(tiny_think_core)
    yield s
    s.stop()


def client(s: ScriptedServer) -> httpx.Client:
    return httpx.Client(base_url=s.url, headers=ANTHROPIC, timeout=60)


def post(s: ScriptedServer, path: str, body: dict) -> httpx.Response:
    with client(s) as http:
        return http.post(path, json=body)


def frames(s: ScriptedServer, path: str, body: dict) -> list:
    response = post(s, path, {**body, "stream": True})
    assert response.status_code == 200, response.text
    return sse(response.text)


# -- Chat Completions ----------------------------------------------------------------------------------


def test_chat_tool_calls_buffered_and_streamed(server):
    server.say(CALL)
    body = {"messages": USER, "tools": CHAT_TOOLS, "max_tokens": 64}
    choice = post(server, "/v1/chat/completions", body).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["id"].startswith("call_") and call["function"] == {"name": "lookup", "arguments": '{"query": "alpha"}'}
    chunks = [data for _, data in frames(server, "/v1/chat/completions", body) if data != "[DONE]"]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    calls = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert calls == [
        [
            {
                "index": 0,
                "id": calls[0][0]["id"],
                "type": "function",
                "function": {"name": "lookup", "arguments": '{"query": "alpha"}'},
            }
        ]
    ]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # The template saw the tool; an undeclared tool's call is still returned under auto.
    assert "lookup" in server.engine.prompt
    server.say(OTHER)
    other = post(server, "/v1/chat/completions", body).json()["choices"][0]
    assert other["message"]["tool_calls"][0]["function"]["name"] == "search"


def test_chat_finish_reasons_from_the_terminal_cause(server):
    server.say("<tool_call>\n" + CALL[:20])  # truncated envelope: omitted, length
    cut = post(server, "/v1/chat/completions", {"messages": USER, "tools": CHAT_TOOLS, "max_tokens": 6}).json()
    assert cut["choices"][0]["finish_reason"] == "length" and cut["choices"][0]["message"]["tool_calls"] == []
    server.say(CALL, " trailing")  # a user string stop after a call: stop, not tool_calls
    stopped = post(
        server, "/v1/chat/completions", {"messages": USER, "tools": CHAT_TOOLS, "max_tokens": 64, "stop": ["trailing"]}
    ).json()
    assert stopped["choices"][0]["finish_reason"] == "stop"
    server.say('<tool_call>\n{"name": "lookup", "arguments": {')  # incomplete at EOS: an error
    broken = post(server, "/v1/chat/completions", {"messages": USER, "tools": CHAT_TOOLS, "max_tokens": 64})
    assert broken.status_code == 500 and "could not be parsed" in broken.json()["error"]["message"]
    server.say(CALL)  # tool_choice none: no tools presented, nothing parsed
    none = post(server, "/v1/chat/completions", {"messages": USER, "tools": CHAT_TOOLS, "tool_choice": "none"})
    assert none.json()["choices"][0]["message"]["content"] == CALL and "lookup" not in server.engine.prompt


def test_required_and_named_tool_choice(server):
    body = {"messages": USER, "tools": CHAT_TOOLS, "tool_choice": "required", "max_tokens": 64}
    server.say(CALL)
    ok = post(server, "/v1/chat/completions", body).json()
    assert ok["choices"][0]["finish_reason"] == "tool_calls" and REQUIRED_INSTRUCTION in server.engine.prompt
    server.say("OK")
    missing = post(server, "/v1/chat/completions", body)
    assert missing.status_code == 500 and "required tool choice was not satisfied" in missing.json()["error"]["message"]
    streamed = frames(server, "/v1/chat/completions", body)
    assert "[DONE]" not in [d for _, d in streamed] and "required tool choice" in streamed[-1][1]["error"]["message"]
    assert not any(c.get("finish_reason") for _, d in streamed if isinstance(d, dict) for c in d.get("choices", []))
    server.say(OTHER)  # a call to an undeclared tool does not satisfy required
    assert post(server, "/v1/chat/completions", body).status_code == 500
    assert (
        post(server, "/v1/chat/completions", {**body, "tools": []})
        .json()["error"]["message"]
        .endswith("needs at least one tool")
    )
    # Named: only that tool is shown, answer text is omitted, other tools fail before emission.
    search = {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}
    named = {
        "messages": USER,
        "tools": CHAT_TOOLS + [search],
        "max_tokens": 64,
        "tool_choice": {"type": "function", "function": {"name": "lookup"}},
    }
    server.say("Sure.\n<tool_call>\n", CALL, "\n</tool_call>")
    message = post(server, "/v1/chat/completions", named).json()["choices"][0]["message"]
    assert message["content"] is None and message["tool_calls"][0]["function"]["name"] == "lookup"
    assert '"search"' not in server.engine.prompt and REQUIRED_INSTRUCTION not in server.engine.prompt
    server.say(OTHER)
    wrong = post(server, "/v1/chat/completions", named)
    assert wrong.status_code == 500 and "requires 'lookup'" in wrong.json()["error"]["message"]
    undeclared = {**named, "tool_choice": {"type": "function", "function": {"name": "nope"}}}
    assert post(server, "/v1/chat/completions", undeclared).status_code == 400
    strict = [{"type": "function", "function": {**FUNCTION, "strict": True}}]
    assert post(server, "/v1/chat/completions", {"messages": USER, "tools": strict}).status_code == 400


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/v1/responses"])
def test_parallel_calls_disabled(server, path):
    server.say(CALL, "\n", CALL.replace("alpha", "beta"))
    if path == "/v1/messages":
        body = {
            "messages": USER,
            "tools": MESSAGES_TOOLS,
            "max_tokens": 64,
            "tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
        }
        allowed = {**body, "tool_choice": {"type": "auto"}}
    else:
        body = (
            {"input": USER, "tools": RESPONSES_TOOLS}
            if path == "/v1/responses"
            else {"messages": USER, "tools": CHAT_TOOLS}
        )
        body["parallel_tool_calls"] = False
        allowed = {**body, "parallel_tool_calls": True}
    assert post(server, path, allowed).status_code == 200
    failed = post(server, path, body)
    assert failed.status_code == 500 and "more than one tool call" in failed.text
    streamed = frames(server, path, body)
    names = [n for n, _ in streamed]
    assert (
        "message_stop" not in names and "response.completed" not in names and "[DONE]" not in [d for _, d in streamed]
    )
    last = streamed[-1][1]
    error = last["response"]["error"] if path == "/v1/responses" else last["error"]
    assert "more than one tool call" in error["message"]


# -- Messages ------------------------------------------------------------------------------------------


def test_messages_tool_use_and_counting(server):
    sdk = Anthropic(base_url=server.url, api_key="x", max_retries=0)
    server.say(CALL)
    message = sdk.messages.create(model="m", messages=USER, tools=MESSAGES_TOOLS, max_tokens=64)
    assert message.stop_reason == "tool_use"
    (use,) = message.content
    assert use.type == "tool_use" and use.id.startswith("toolu_") and use.input == {"query": "alpha"}
    with sdk.messages.stream(model="m", messages=USER, tools=MESSAGES_TOOLS, max_tokens=64) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert final.content[0].input == {"query": "alpha"} and final.stop_reason == "tool_use"
    assert any(e.type == "input_json" for e in events)
    kwargs = {"model": "m", "messages": USER, "tools": MESSAGES_TOOLS, "tool_choice": {"type": "any"}}
    counted = sdk.messages.count_tokens(**kwargs)
    required = sdk.messages.create(max_tokens=64, **kwargs)
    assert counted.input_tokens == required.usage.input_tokens + required.usage.cache_read_input_tokens
    # History round trip: tool_use and tool_result blocks render through the template.
    history = USER + [
        {"role": "assistant", "content": [b.model_dump() for b in message.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "42"}]},
    ]
    server.say("It is 42.")
    answer = sdk.messages.create(model="m", messages=history, tools=MESSAGES_TOOLS, max_tokens=64)
    assert answer.content[0].text == "It is 42." and "<tool_response>\n42" in server.engine.prompt


def test_messages_named_tool_and_strict(server):
    server.say(CALL)
    body = {
        "messages": USER,
        "tools": MESSAGES_TOOLS,
        "max_tokens": 64,
        "tool_choice": {"type": "tool", "name": "lookup"},
    }
    assert post(server, "/v1/messages", body).json()["stop_reason"] == "tool_use"
    server.say("no call")
    assert post(server, "/v1/messages", body).json()["type"] == "error"
    strict = [{**MESSAGES_TOOLS[0], "strict": True}]
    assert post(server, "/v1/messages", {"messages": USER, "tools": strict, "max_tokens": 4}).status_code == 400


# -- Responses -----------------------------------------------------------------------------------------


def test_responses_function_calls_and_history(server):
    sdk = OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    server.say(CALL)
    with sdk.responses.stream(
        model="m", input=USER, tools=RESPONSES_TOOLS, tool_choice="required", parallel_tool_calls=False
    ) as stream:
        events = list(stream)
        result = stream.get_final_response()
    (call,) = result.output
    assert call.type == "function_call" and call.name == "lookup" and json.loads(call.arguments) == {"query": "alpha"}
    assert result.tool_choice == "required" and result.parallel_tool_calls is False
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    history = USER + [item.model_dump(exclude_none=True) for item in result.output]
    history += [{"type": "function_call_output", "call_id": call.call_id, "output": "42"}]
    server.say("It is 42.")
    assert sdk.responses.create(model="m", input=history, tools=RESPONSES_TOOLS).output_text == "It is 42."


def test_responses_custom_tools_and_namespaces(server):
    sdk = OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    custom = [
        {
            "type": "custom",
            "name": "record",
            "description": "Record an id.",
            "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "ID-" /[0-9]+/'},
        }
    ]
    server.say('{"name": "record", "arguments": {"input": "ID-42"}}')
    with sdk.responses.stream(model="m", input=USER, tools=custom) as stream:
        events = list(stream)
        result = stream.get_final_response()
    (call,) = result.output
    assert call.type == "custom_tool_call" and call.input == "ID-42" and call.name == "record"
    assert "response.custom_tool_call_input.done" in [e.type for e in events]
    assert "Lark grammar" in server.engine.prompt and '"input"' in server.engine.prompt
    server.say('{"name": "record", "arguments": {"input": "forty-two"}}')
    invalid = post(server, "/v1/responses", {"input": USER, "tools": custom})
    assert invalid.status_code == 500 and "grammar" in invalid.json()["error"]["message"]
    regex = [{**custom[0], "format": {"type": "grammar", "syntax": "regex", "definition": r"ID-\d+"}}]
    server.say('{"name": "record", "arguments": {"input": "ID-7"}}')
    assert post(server, "/v1/responses", {"input": USER, "tools": regex}).json()["output"][0]["input"] == "ID-7"
    broken = [{**custom[0], "format": {"type": "grammar", "syntax": "lark", "definition": "start: missing_rule"}}]
    refused = post(server, "/v1/responses", {"input": "x", "tools": broken})
    assert refused.status_code == 400 and "grammar" in refused.json()["error"]["message"]
    history = USER + [
        {"type": "custom_tool_call", "call_id": "c1", "name": "record", "input": "ID-42"},
        {"type": "custom_tool_call_output", "call_id": "c1", "output": "done"},
    ]
    server.say("Recorded.")
    assert post(server, "/v1/responses", {"input": history, "tools": custom}).json()["output"][0]["type"] == "message"
    # Namespaces: namespace__name for the model, restored on output; ambiguous names refused.
    spaced = [
        {"type": "namespace", "name": "crm", "description": "CRM tools.", "tools": [{"type": "function", **FUNCTION}]}
    ]
    server.say('{"name": "crm__lookup", "arguments": {"query": "a"}}')
    item = post(server, "/v1/responses", {"input": USER, "tools": spaced}).json()["output"][0]
    assert item["name"] == "lookup" and item["namespace"] == "crm" and "crm__lookup" in server.engine.prompt
    ambiguous = spaced + [{"type": "function", "name": "crm__lookup", "parameters": {}}]
    assert post(server, "/v1/responses", {"input": USER, "tools": ambiguous}).status_code == 400
    choice = {"type": "function", "name": "crm__lookup"}
    assert post(server, "/v1/responses", {"input": USER, "tools": spaced, "tool_choice": choice}).status_code == 200
    mismatch = {"type": "custom", "name": "crm__lookup"}
    assert post(server, "/v1/responses", {"input": USER, "tools": spaced, "tool_choice": mismatch}).status_code == 400


# -- reasoning output -------------------------------------------------------------------------------


def test_reasoning_on_every_protocol(think):
    think.say("The user wants OK.\n", END_THINK, "\n\nOK")
    chat = post(think, "/v1/chat/completions", {"messages": USER, "max_tokens": 64}).json()
    message = chat["choices"][0]["message"]
    assert message["reasoning_content"] == "The user wants OK." and message["content"] == "OK"
    assert chat["usage"]["completion_tokens_details"]["reasoning_tokens"] > 0
    assert think.engine.prompt.endswith("<think>\n")  # the template opened reasoning
    off = post(think, "/v1/chat/completions", {"messages": USER, "chat_template_kwargs": {"enable_thinking": False}})
    assert think.engine.prompt.endswith("</think>\n\n") and off.status_code == 200
    sdk = Anthropic(base_url=think.url, api_key="x", max_retries=0)
    with sdk.messages.stream(
        model="m", messages=USER, max_tokens=64, thinking={"type": "enabled", "budget_tokens": 2048}
    ) as stream:
        list(stream)
        final = stream.get_final_message()
    thinking, text = final.content
    assert thinking.type == "thinking" and thinking.thinking == "The user wants OK." and text.text == "OK"
    assert thinking.signature == thinking_signature(thinking.thinking)
    buffered = post(think, "/v1/messages", {"messages": USER, "max_tokens": 64}).json()
    assert buffered["content"][0] == {
        "type": "thinking",
        "thinking": "The user wants OK.",
        "signature": thinking_signature("The user wants OK."),
    }
    openai = OpenAI(base_url=think.url + "/v1", api_key="x", max_retries=0)
    with openai.responses.stream(model="m", input=USER) as stream:
        events = list(stream)
        result = stream.get_final_response()
    reasoning = result.output[0]
    assert (
        reasoning.type == "reasoning" and reasoning.summary == [] and reasoning.content[0].text == "The user wants OK."
    )
    assert result.output_text == "OK" and result.usage.output_tokens_details.reasoning_tokens > 0
    assert "response.reasoning_text.delta" in [e.type for e in events]
    # Replayed reasoning items and thinking blocks render through the template.
    history = (
        USER + [item.model_dump(exclude_none=True) for item in result.output] + [{"role": "user", "content": "Again."}]
    )
    assert post(think, "/v1/responses", {"input": history}).status_code == 200
    assert "<think>\nThe user wants OK.\n</think>" in think.engine.prompt


def test_reasoning_tool_call_and_limits(think):
    think.say("I will look it up.\n<tool_call>\n" + CALL + "\n</tool_call>", END_THINK)
    body = {"messages": USER, "tools": CHAT_TOOLS, "max_tokens": 64}
    message = post(think, "/v1/chat/completions", body).json()["choices"][0]
    assert message["finish_reason"] == "tool_calls" and message["message"]["reasoning_content"] == "I will look it up."
    think.say("Thinking for a long time about it")
    cut = post(think, "/v1/responses", {"input": USER, "max_output_tokens": 4}).json()
    assert cut["status"] == "incomplete" and cut["output"][0]["type"] == "reasoning"
    messages_cut = post(think, "/v1/messages", {"messages": USER, "max_tokens": 4}).json()
    assert messages_cut["stop_reason"] == "max_tokens" and messages_cut["content"][0]["type"] == "thinking"


def test_thinking_budget_rules(server, think):
    budget = {"messages": USER, "max_tokens": 8, "thinking_token_budget": 16}
    assert post(server, "/v1/chat/completions", budget).status_code == 400  # no reasoning syntax
    assert "thinking_token_budget" in post(server, "/v1/responses", {"input": USER, "thinking_token_budget": 5}).text
    # Messages budgets are advisory where no cap is possible; explicit mismatches are refused.
    assert (
        post(
            server,
            "/v1/messages",
            {"messages": USER, "max_tokens": 4, "thinking": {"type": "enabled", "budget_tokens": 1024}},
        ).status_code
        == 200
    )
    mismatch = {
        "messages": USER,
        "max_tokens": 4,
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "thinking_token_budget": 2048,
    }
    assert post(think, "/v1/messages", mismatch).status_code == 400
    think.say("OK")
    assert post(think, "/v1/chat/completions", budget).status_code == 200
    assert think.engine.requests[-1].reasoning.budget == 16 and think.engine.requests[-1].reasoning.starts_open
    huge = {"messages": USER, "max_tokens": 4, "thinking": {"type": "enabled", "budget_tokens": 1 << 40}}
    assert post(think, "/v1/messages", huge).status_code == 200 and think.engine.requests[-1].reasoning.budget is None
    effort = {"messages": USER, "max_tokens": 4, "thinking": {"type": "enabled", "budget_tokens": 30000}}
    assert post(think, "/v1/messages", effort).status_code == 200
    assert think.engine.requests[-1].reasoning.budget == 30000
    off = {
        "messages": USER,
        "max_tokens": 4,
        "chat_template_kwargs": {"enable_thinking": False},
        "thinking_token_budget": 3,
    }
    assert post(think, "/v1/chat/completions", off).status_code == 200  # starts in content: no cut
    assert think.engine.requests[-1].reasoning.budget is None
    for bad in (0, -1, 1 << 31, 1.5, "8"):
        assert post(think, "/v1/chat/completions", {**budget, "thinking_token_budget": bad}).status_code == 400


def test_effort_levels_follow_the_template():
    qwen = "{% if reasoning_effort == 'low' %}{% elif reasoning_effort in ['medium', 'xhigh'] %}{% endif %}"
    assert template_levels(qwen) == ["low", "medium", "xhigh"] and template_levels("{{ x }}") == []
    assert [resolve_effort(level, ["low", "medium", "xhigh"]) for level in ("minimal", "high", "max")] == [
        "low",
        "xhigh",
        "xhigh",
    ]
    assert [effort_from_budget(b) for b in (1024, 5000, 5001, 20000, 20001)] == ["low"] * 2 + ["high"] * 2 + ["max"]
    kwargs = template_kwargs({"enable_thinking": True}, enabled=False, effort="high", template_source=qwen)
    assert kwargs == {"enable_thinking": True, "reasoning_effort": "xhigh"}  # the client's own value wins
    assert template_kwargs({}, enabled=None, effort="none", template_source=qwen) == {"enable_thinking": False}


# -- conversation lowering -----------------------------------------------------------------------------


def test_inline_system_probe_and_fallback():
    native = ChatTemplate("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}")
    first_only = ChatTemplate(
        "{% for m in messages %}{% if m.role != 'system' or loop.first %}"
        "[{{ m.role }}]{{ m.content }}{% endif %}{% endfor %}"
    )
    refusing = ChatTemplate(
        "{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
        "{{ raise_exception('no') }}{% endif %}[{{ m.role }}]{{ m.content }}{% endfor %}"
    )
    assert supports_inline_system(native) and not supports_inline_system(first_only)
    assert not supports_inline_system(refusing)
    conv = Conversation(
        [
            Message("system", [TextPart("S")]),
            Message("user", [TextPart("u")]),
            Message("system", [TextPart("A"), TextPart("B")]),
            Message("user", [TextPart("v")]),
        ]
    )
    assert render_text(conv, native, add_generation_prompt=False) == "[system]S[user]u[system]A\nB[user]v"
    expected = "[system]S[user]u[user]<system>A\n\nB</system>[user]v"
    assert render_text(conv, first_only, add_generation_prompt=False) == expected
    assert render_text(conv, refusing, add_generation_prompt=False) == expected


def test_parallel_tool_results_follow_call_order():
    calls = Message("assistant", [ToolCallPart("a", "f", {}), ToolCallPart("b", "f", {})])

    def result(call_id: str) -> Message:
        return Message("tool", [ToolResultPart(call_id, [TextPart(call_id)])])

    note = Message("user", [TextPart("note")])
    ordered = reorder_tool_results([calls, result("b"), note, result("a")])
    assert [m.parts[0].call_id if m.role == "tool" else m.role for m in ordered] == ["assistant", "a", "user", "b"]
    for group in ([calls, result("b"), result("b")], [calls, result("b")], [calls, result("c"), result("a")]):
        assert reorder_tool_results(group) == group  # duplicate, missing or unknown ids
    later = Message("assistant", [TextPart("x")])
    split = [calls, result("b"), later, result("a")]
    assert reorder_tool_results(split) == split  # never across another assistant message

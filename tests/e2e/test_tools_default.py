"""End to end on the real default core (Qwen2.5-Coder-0.5B): the model's own tool calls are
parsed on every protocol, a structured answer follows a tool result, and a Responses custom tool
input is checked against its grammar. Greedy (temperature 0 clamps to the recipe's minimum)."""

from __future__ import annotations

import json

import httpx
import pytest

pytestmark = pytest.mark.e2e

FUNCTION = {
    "name": "lookup",
    "description": "Look up a value in the local database.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
}
ASK = [{"role": "user", "content": "Use lookup to look up the value for the query 'alpha'."}]
GREEDY = {"temperature": 0, "top_k": 1}  # temperature 0 alone is clamped to 0.01, which samples


@pytest.fixture(scope="module")
def http(default_server):
    with httpx.Client(base_url=default_server.url, timeout=300, headers={"anthropic-version": "2023-06-01"}) as client:
        yield client


def test_model_calls_lookup_on_every_protocol(http):
    chat = http.post(
        "/v1/chat/completions",
        json={"messages": ASK, "max_tokens": 64, **GREEDY, "tools": [{"type": "function", "function": FUNCTION}]},
    ).json()
    choice = chat["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {"query": "alpha"}
    message = http.post(
        "/v1/messages",
        json={
            "messages": ASK,
            "max_tokens": 64,
            **GREEDY,
            "tools": [
                {"name": "lookup", "description": FUNCTION["description"], "input_schema": FUNCTION["parameters"]}
            ],
        },
    ).json()
    assert message["stop_reason"] == "tool_use" and message["content"][-1]["input"] == {"query": "alpha"}
    response = http.post(
        "/v1/responses",
        json={"input": ASK, "max_output_tokens": 64, **GREEDY, "tools": [{"type": "function", **FUNCTION}]},
    ).json()
    assert [item["type"] for item in response["output"]] == ["function_call"]


def test_structured_answer_after_a_tool_result(http):
    schema = {
        "type": "object",
        "properties": {"value": {"type": "integer"}},
        "required": ["value"],
        "additionalProperties": False,
    }
    history = [
        {
            "role": "user",
            "content": 'Call lookup with exactly {"query":"alpha"} to retrieve the stored '
            'integer. Then return JSON with "value" set to that integer.',
        }
    ]
    body = {
        "tools": [{"type": "function", "function": FUNCTION}],
        "max_tokens": 128,
        **GREEDY,
        "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
    }
    first = http.post("/v1/chat/completions", json={"messages": history, **body}).json()["choices"][0]["message"]
    (call,) = first["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"query": "alpha"}
    history += [first, {"role": "tool", "tool_call_id": call["id"], "content": '{"value":7391}'}]
    final = http.post("/v1/chat/completions", json={"messages": history, **body}).json()["choices"][0]
    assert final["finish_reason"] == "stop" and json.loads(final["message"]["content"]) == {"value": 7391}


def test_custom_tool_input_checked_by_its_grammar(http):
    tools = [
        {
            "type": "custom",
            "name": "record",
            "description": "Record the requested identifier as a plain string.",
            "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "ID-" /[0-9]+/'},
        }
    ]
    response = http.post(
        "/v1/responses",
        json={
            "input": [{"role": "user", "content": "Use record to record exactly ID-42."}],
            "tools": tools,
            "max_output_tokens": 64,
            **GREEDY,
        },
    ).json()
    assert response["status"] == "completed"
    assert [(item["type"], item["input"]) for item in response["output"]] == [("custom_tool_call", "ID-42")]

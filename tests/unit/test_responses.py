"""POST /v1/responses (stateless) on a live tiny server, driven by the openai SDK and httpx:
input items, ordered output items with stable ids, the SSE lifecycle, terminal statuses, usage,
output_text logprobs and the 400 rejections."""

from __future__ import annotations

import httpx
import pytest
from openai import OpenAI

from tests.unit.live import USER, metrics, second_token, sse


@pytest.fixture(scope="module")
def http(tiny_server):
    with httpx.Client(base_url=tiny_server.url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def sdk(tiny_server):
    with OpenAI(base_url=tiny_server.url + "/v1", api_key="unused", timeout=120, max_retries=0) as client:
        yield client


def test_buffered_incomplete_at_the_output_limit(sdk: OpenAI, http: httpx.Client):
    response = sdk.responses.create(
        model="any", input=USER, max_output_tokens=4, extra_body={"ignore_eos": True, "seed": 2}
    )
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.error is None and response.store is False and response.truncation == "disabled"
    [item] = response.output
    assert item.type == "message" and item.role == "assistant" and item.status == "incomplete"
    assert item.content[0].type == "output_text" and response.output_text == item.content[0].text
    usage = response.usage
    assert usage.output_tokens == 4 and usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert 0 <= usage.input_tokens_details.cached_tokens < usage.input_tokens  # earlier tests may warm it
    assert usage.output_tokens_details.reasoning_tokens == 0
    chat = http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 1}).json()
    assert usage.input_tokens == chat["usage"]["prompt_tokens"]  # one template, one prompt


def test_stream_lifecycle_ids_and_sequence_numbers(http: httpx.Client):
    body = {"input": USER, "max_output_tokens": 5, "ignore_eos": True, "seed": 8}
    buffered = http.post("/v1/responses", json=body).json()
    response = http.post("/v1/responses", json={**body, "stream": True})
    assert response.status_code == 200 and response.headers.get("x-request-id")
    assert "[DONE]" not in response.text
    frames = sse(response.text)
    assert all(name == data["type"] for name, data in frames)
    kinds = [name for name, _ in frames]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [d["sequence_number"] for _, d in frames] == list(range(len(frames)))
    created = frames[0][1]["response"]
    assert created["status"] == "in_progress" and created["output"] == [] and created["usage"] is None
    final = frames[-1][1]["response"]
    ids = {d["item_id"] for _, d in frames if "item_id" in d}
    assert ids == {frames[2][1]["item"]["id"]} == {final["output"][0]["id"]}  # stable item id
    assert {d["response"]["id"] for _, d in frames if "response" in d} == {final["id"]}
    text = "".join(d["delta"] for n, d in frames if n == "response.output_text.delta")
    assert text == final["output"][0]["content"][0]["text"] == buffered["output"][0]["content"][0]["text"]
    assert final["usage"] == buffered["usage"] and final["status"] == "incomplete"


def test_sdk_stream_completes_on_a_natural_stop(sdk: OpenAI, http: httpx.Client):
    stop = second_token(http, seed=31)
    extra = {"seed": 31, "stop_token_ids": [stop]}
    with sdk.responses.stream(model="x", input=USER, max_output_tokens=16, extra_body=extra) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert events[-1].type == "response.completed" and final.status == "completed"
    assert final.incomplete_details is None and final.output[0].status == "completed"
    buffered = sdk.responses.create(model="x", input=USER, max_output_tokens=16, extra_body=extra)
    assert buffered.output_text == final.output_text and buffered.status == "completed"


def test_input_items_instructions_and_tool_history(http: httpx.Client):
    def tokens(**body) -> int:
        response = http.post("/v1/responses", json={"max_output_tokens": 1, **body})
        assert response.status_code == 200, response.text
        return response.json()["usage"]["input_tokens"]

    plain = tokens(input="Reply with exactly OK.")
    assert tokens(input=USER) == plain
    assert tokens(input=USER, instructions="Be brief. " * 30) > plain  # replaces the default system prompt
    assert (
        tokens(
            input=[
                {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "Reply with exactly OK."}],
                }
            ]
        )
        == plain
    )
    tools = [
        {
            "type": "function",
            "name": "lookup",
            "description": "Look up a value.",
            "strict": False,
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        }
    ]
    history = USER + [
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Call it."}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "lookup", "arguments": '{"q": "a"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "The result is 42."},
        {
            "type": "message",
            "role": "assistant",
            "id": "msg_1",
            "status": "completed",
            "content": [{"type": "output_text", "text": "It is 42.", "annotations": []}],
        },
        {"role": "developer", "content": "Answer in one word."},
        {"role": "user", "content": "And again?"},
    ]
    assert tokens(input=history, tools=tools) > tokens(input=history) > plain


@pytest.mark.parametrize(
    "extra",
    [
        {"store": True},
        {"previous_response_id": "resp_1"},
        {"conversation": "conv_1"},
        {"background": True},
        {"truncation": "auto"},
        {"prompt": {"id": "pmpt_1"}},
        {"prompt_logprobs": 1},
        {"tool_choice": {"type": "function", "name": "lookup"}},
        {"tools": [{"type": "function", "name": "lookup", "parameters": {}, "strict": True}]},
        {"tools": [{"type": "web_search"}]},
        {
            "tools": [
                {
                    "type": "custom",
                    "name": "record",
                    "format": {"type": "grammar", "syntax": "lark", "definition": "start: missing_rule"},
                }
            ]
        },
        {"text": {"format": {"type": "json_schema", "name": "a", "schema": 5}}},
        {"tools": [{"type": "function", "name": "a"}, {"type": "function", "name": "a"}]},
        {"reasoning": {"effort": 80}},
        {"top_logprobs": 1},
        {"top_logprobs": 21, "include": ["message.output_text.logprobs"]},
        {"include": "message.output_text.logprobs"},
        {"max_output_tokens": 0},
        {"temperature": "warm"},
        {"input": []},
        {"input": 5},
        {"input": [{"type": "item_reference", "id": "msg_1"}]},
        {"input": [{"type": "reasoning", "summary": [], "encrypted_content": "opaque"}]},
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:"}]}]},
        {"input": [{"role": "robot", "content": "x"}]},
        {"instructions": ["not", "a", "string"]},
    ],
)
def test_rejections_are_400_in_openai_shape(http: httpx.Client, extra):
    before = metrics(http)["flare_requests_admitted_total"]
    response = http.post("/v1/responses", json={"input": "x", **extra})
    assert response.status_code == 400, (extra, response.text)
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and set(error) == {"type", "message", "param", "code"}
    assert metrics(http)["flare_requests_admitted_total"] == before


def test_required_choice_without_tools_and_accepted_settings(http: httpx.Client):
    response = http.post("/v1/responses", json={"input": USER, "tools": [], "tool_choice": "required"})
    assert response.status_code == 400 and "needs at least one tool" in response.json()["error"]["message"]
    accepted = {
        "input": USER,
        "max_output_tokens": 1,
        "store": False,
        "background": False,
        "truncation": "disabled",
        "include": ["reasoning.encrypted_content"],
        "metadata": {"k": "v"},
        "parallel_tool_calls": False,
        "reasoning": {"effort": "low"},
        "text": {"format": {"type": "text"}},
        "tool_choice": "none",
    }
    ok = http.post("/v1/responses", json=accepted)
    assert ok.status_code == 200, ok.text
    body = ok.json()
    assert body["parallel_tool_calls"] is False and body["metadata"] == {"k": "v"} and body["tool_choice"] == "none"
    assert body["max_output_tokens"] == 1 and body["temperature"] > 0


@pytest.mark.parametrize("streaming", [False, True])
def test_output_text_logprobs(http: httpx.Client, streaming):
    body = {
        "input": USER,
        "max_output_tokens": 4,
        "ignore_eos": True,
        "seed": 4,
        "stream": streaming,
        "include": ["message.output_text.logprobs"],
        "top_logprobs": 2,
        "return_tokens_as_token_ids": True,
    }
    response = http.post("/v1/responses", json=body)
    assert response.status_code == 200, response.text
    if streaming:
        frames = [d for _, d in sse(response.text)]
        deltas = [e for d in frames if d["type"] == "response.output_text.delta" for e in d["logprobs"]]
        final = frames[-1]["response"]
    else:
        final, deltas = response.json(), None
    entries = [e for item in final["output"] for part in item["content"] for e in part["logprobs"]]
    assert len(entries) == 4
    for entry in entries:
        assert entry["token"].startswith("token_id:") and entry["logprob"] <= 0
        assert len(entry["top_logprobs"]) == 2 and all(0 <= b < 256 for b in entry["bytes"])
    if streaming:
        assert deltas == entries


@pytest.mark.parametrize("temperature", [0.0, -0.0])
def test_zero_temperature_is_clamped(http: httpx.Client, temperature):
    response = http.post("/v1/responses", json={"input": USER, "max_output_tokens": 2, "temperature": temperature})
    assert response.status_code == 200, response.text

"""POST /v1/messages and /v1/messages/count_tokens on a live tiny server (real engine), driven by
the anthropic SDK and httpx. The tiny model has random weights: these tests check structure,
accounting, stop reasons and rejections, never the text itself."""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import pytest
from anthropic import Anthropic, BadRequestError

from helios.engine.api import CheckpointRole
from helios.manifest import Manifest
from helios.neutral.conversation import render_text
from helios.neutral.hints import boundary_positions
from helios.neutral.template import ChatTemplate
from helios.neutral.tokenizer import Tokenizer
from helios.protocols import messages, messages_request
from helios.transport.config import ServerConfig
from tests.unit.live import ANTHROPIC, USER, metrics, second_token, sse


@pytest.fixture(scope="module")
def http(tiny_server):
    with httpx.Client(base_url=tiny_server.url, headers=ANTHROPIC, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def sdk(tiny_server):
    with Anthropic(base_url=tiny_server.url, api_key="unused", timeout=120, max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def frontend(tiny_core):
    """What the Messages decoder needs of the server context, from the real tiny core."""
    manifest = Manifest.load(tiny_core, verify_files=False)
    tokenizer = Tokenizer.from_core(tiny_core, manifest)
    template = ChatTemplate.from_core(tiny_core, manifest, bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token)
    return SimpleNamespace(
        manifest=manifest, tokenizer=tokenizer, template=template, model_id=manifest.model_id, config=ServerConfig()
    )


def _count(http: httpx.Client, **body) -> int:
    response = http.post("/v1/messages/count_tokens", json=body)
    assert response.status_code == 200, response.text
    return response.json()["input_tokens"]


# -- buffered and streamed -------------------------------------------------------------------------


def test_buffered_message_shape_and_usage(sdk: Anthropic, http: httpx.Client, frontend):
    message = sdk.messages.create(
        model="whatever", messages=USER, max_tokens=4, extra_body={"ignore_eos": True, "seed": 3}
    )
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert message.model == frontend.model_id
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    assert [b.type for b in message.content] == ["text"] * len(message.content)
    usage = message.usage
    assert usage.output_tokens == 4
    # Cache reads are whatever earlier requests on the shared server checkpointed (an anchor at least).
    assert usage.cache_creation_input_tokens == 0 and usage.input_tokens >= 1  # the last prompt token is computed
    assert usage.input_tokens + usage.cache_read_input_tokens == _count(http, messages=USER)
    raw = http.post("/v1/messages", json={"messages": USER, "max_tokens": 2})
    assert raw.headers.get("x-request-id")


def test_stream_event_sequence_matches_buffered(http: httpx.Client):
    body = {"messages": USER, "max_tokens": 5, "ignore_eos": True, "seed": 11}
    buffered = http.post("/v1/messages", json=body).json()
    response = http.post("/v1/messages", json={**body, "stream": True})
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    assert response.headers.get("x-request-id")
    frames = sse(response.text)
    assert all(name == data["type"] for name, data in frames)  # named events
    kinds = [name for name, _ in frames]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert "[DONE]" not in response.text
    start = frames[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    # message_start reports the whole prompt with zero cache reads; message_delta the final counts.
    assert start["usage"]["input_tokens"] == _count(http, messages=USER)
    assert start["usage"]["cache_read_input_tokens"] == 0 and start["usage"]["output_tokens"] == 0
    delta = frames[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"] == buffered["usage"]
    text = "".join(d["delta"]["text"] for n, d in frames if n == "content_block_delta")
    assert [{"type": "text", "text": text}] == buffered["content"]  # same seed, same tokens
    middle = [n for n in kinds[1:-2]]
    assert middle[0] == "content_block_start" and middle[-1] == "content_block_stop"
    assert set(middle[1:-1]) == {"content_block_delta"}


def test_sdk_stream_end_turn_on_a_token_stop(sdk: Anthropic, http: httpx.Client):
    stop = second_token(http, seed=21)
    extra = {"seed": 21, "stop_token_ids": [stop]}
    with sdk.messages.stream(model="x", messages=USER, max_tokens=16, extra_body=extra) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.stop_reason == "end_turn" and final.stop_sequence is None  # an explicit token stop
    assert "".join(b.text for b in final.content) == text
    assert 1 <= final.usage.output_tokens <= 2
    buffered = sdk.messages.create(model="x", messages=USER, max_tokens=16, extra_body=extra)
    assert [b.model_dump(exclude_none=True) for b in buffered.content] == [
        b.model_dump(exclude_none=True) for b in final.content
    ]
    assert buffered.usage.input_tokens == final.usage.input_tokens


def test_stop_sequence_reports_the_matched_string(sdk: Anthropic):
    extra = {"seed": 5, "ignore_eos": True}
    free = sdk.messages.create(model="x", messages=USER, max_tokens=12, extra_body=extra)
    text = free.content[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), text
    result = sdk.messages.create(
        model="x", messages=USER, max_tokens=12, stop_sequences=["\x00never", stop], extra_body=extra
    )
    assert result.stop_reason == "stop_sequence" and result.stop_sequence == stop
    assert "".join(b.text for b in result.content) == text[: text.find(stop)]


# -- conversation decoding -------------------------------------------------------------------------


def test_system_blocks_inline_system_and_empty_controls(http: httpx.Client, frontend):
    base = _count(http, messages=USER)  # the template's default system prompt
    system = "Be brief. " * 30
    assert _count(http, messages=USER, system=system) > base
    assert _count(
        http, messages=USER, system=[{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}]
    ) == _count(http, messages=USER, system=system)
    assert _count(http, messages=USER, system="") == base and _count(http, messages=USER, system=[]) == base
    inline = [
        {"role": "user", "content": "Hello"},
        {
            "role": "system",
            "content": [{"type": "text", "text": "Reply with exactly OK."}],
            "output_config": {"effort": "xhigh"},
        },
    ]
    controls = {"role": "system", "content": [], "output_config": {"effort": "high"}}
    assert _count(http, messages=inline) == _count(http, messages=inline + [controls])
    decoded = messages_request.decode(frontend, {"messages": inline})
    text = render_text(decoded.conversation, frontend.template)
    assert text.index("Hello") < text.index("Reply with exactly OK.")  # kept at its position


def test_tool_history_and_thinking_replay(http: httpx.Client, frontend):
    tools = [
        {
            "name": "lookup",
            "description": "Look up a value.",
            "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}},
        }
    ]
    history = [
        {"role": "user", "content": "Find alpha."},
        {
            "role": "assistant",
            "content": [
                {
                    "type": "thinking",
                    "thinking": "I should call lookup.",
                    "signature": messages_request.thinking_signature("I should call lookup."),
                },
                {"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {"q": "alpha"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "The result is 42."},
                {"type": "text", "text": "Thanks."},
            ],
        },
    ]
    decoded = messages_request.decode(frontend, {"messages": history, "tools": tools})
    assert [m.role for m in decoded.conversation.messages] == ["user", "assistant", "tool", "user"]
    text = render_text(decoded.conversation, frontend.template)
    assert '"q": "alpha"' in text and "The result is 42." in text and "lookup" in text
    assert text.index("The result is 42.") < text.index("Thanks.")
    assert _count(http, messages=history, tools=tools) > _count(http, messages=history)
    foreign = [dict(history[1], content=[{"type": "thinking", "thinking": "x", "signature": "sig-from-elsewhere"}])]
    assert _count(http, messages=history[:1] + foreign + history[2:]) > 0
    for block in (
        {"type": "thinking", "thinking": "tampered", "signature": messages_request.thinking_signature("x")},
        {"type": "redacted_thinking", "data": "opaque"},
    ):
        bad = history[:1] + [{"role": "assistant", "content": [block]}] + history[2:]
        response = http.post("/v1/messages/count_tokens", json={"messages": bad})
        assert response.status_code == 400 and response.json()["type"] == "error"


def test_assistant_prefill_continues_the_final_message(http: httpx.Client, frontend):
    prefill = USER + [{"role": "assistant", "content": "Sure:"}]
    decoded = messages_request.decode(frontend, {"messages": prefill})
    assert decoded.continue_final
    prompt = messages._prompt(frontend, decoded)
    assert frontend.tokenizer.decode(prompt).endswith("Sure:")
    result = http.post("/v1/messages", json={"messages": prefill, "max_tokens": 2, "ignore_eos": True})
    usage = result.json()["usage"] if result.status_code == 200 else {}
    assert usage.get("input_tokens", -1) + usage.get("cache_read_input_tokens", 0) == len(prompt)
    empty = USER + [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]
    assert http.post("/v1/messages/count_tokens", json={"messages": empty}).status_code == 400


def test_cache_control_blocks_become_checkpoint_hints(frontend):
    block = {"type": "text", "text": "A long shared history. " * 10, "cache_control": {"type": "ephemeral"}}
    body = {"messages": [{"role": "user", "content": [block, {"type": "text", "text": "Now act."}]}]}
    decoded = messages_request.decode(frontend, body)
    assert len(decoded.cache_hints) == 1
    prompt = messages._prompt(frontend, decoded)
    positions = [c.position for c in messages._lower(frontend, decoded).checkpoints if c.role == CheckpointRole.HINT]
    assert len(positions) == 1
    assert frontend.tokenizer.decode(prompt[: positions[0]]).endswith(block["text"].rstrip())
    many = {"messages": [{"role": "user", "content": [dict(block, text=f"part {i}") for i in range(6)]}]}
    assert len(messages_request.decode(frontend, many).cache_hints) == messages_request.MAX_CACHE_HINTS
    unhinted = messages_request.decode(frontend, {"messages": USER, "system": [block]})  # system: ignored
    assert unhinted.cache_hints == []
    assert boundary_positions(decoded.conversation, [], frontend.template, frontend.tokenizer, prompt) == []


# -- rejections ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "version,status", [(None, 400), ("2023-06-01", 200), ("2026-10-21", 200), ("2022-01-01", 400), ("latest", 400)]
)
def test_anthropic_version_header(tiny_server, version, status):
    headers = {} if version is None else {"anthropic-version": version}
    for path in ("/v1/messages/count_tokens", "/v1/messages"):
        response = httpx.post(tiny_server.url + path, json={"messages": USER, "max_tokens": 1}, headers=headers)
        assert response.status_code == status, response.text
        if status == 400:
            assert response.json()["type"] == "error" and "anthropic-version" in response.json()["error"]["message"]


@pytest.mark.parametrize("field", messages_request.LOGPROB_FIELDS)
def test_logprob_fields_are_rejected(http: httpx.Client, field):
    value = (
        True if field in ("logprobs", "return_tokens_as_token_ids") else ([1] if field == "logprob_token_ids" else 0)
    )
    before = metrics(http)["flare_requests_admitted_total"]
    response = http.post("/v1/messages", json={"messages": USER, "max_tokens": 1, field: value})
    assert response.status_code == 400
    body = response.json()
    assert (
        body["type"] == "error"
        and body["error"]["type"] == "invalid_request_error"
        and field in body["error"]["message"]
    )
    assert metrics(http)["flare_requests_admitted_total"] == before


@pytest.mark.parametrize(
    "body",
    [
        {"messages": []},
        {"messages": "hi"},
        {"messages": [{"role": "tool", "content": "x"}]},
        {"messages": [{"role": "user", "content": 5}]},
        {"messages": [{"role": "user", "content": [{"type": "video"}]}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]},
        {"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": ""}}]}]},
        {"messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]},
        {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": ""}]}]},
        {"messages": USER, "system": 3},
        {"messages": USER, "temperature": "hot"},
        {"messages": USER, "top_k": 1.5},
        {"messages": USER, "max_tokens": 0},
        {"messages": USER, "max_tokens": "8"},
        {"messages": USER, "stop_sequences": ["a", "b", "c", "d", "e"]},
        {"messages": USER, "stop_sequences": [""]},
        {"messages": USER, "stop_sequences": "x", "stop_token_ids": [1]},
        {"messages": USER, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
        {"messages": USER, "tools": [{"name": "f", "input_schema": {}, "strict": True}]},
        {"messages": USER, "tools": [{"name": "f"}]},
        {"messages": USER, "tool_choice": {"type": "tool", "name": "missing"}},
        {"messages": USER, "tool_choice": "auto"},
        {"messages": USER, "mcp_servers": [{"url": "http://x"}]},
        {"messages": USER, "thinking": {"type": "sometimes"}},
        {"messages": USER, "thinking_token_budget": 100},
        {"messages": USER, "output_config": {"format": {"type": "json_schema"}}},
        {"messages": USER, "output_config": {"format": {"type": "json_schema", "schema": {}}}, "stop_sequences": ["x"]},
        {"messages": USER, "context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}},
        {"messages": [{"role": "user", "content": "alpha beta gamma delta " * 8500}]},  # over the 32,768-token context
    ],
)
def test_bad_requests_are_400_in_messages_shape(http: httpx.Client, body):
    response = http.post("/v1/messages", json={"max_tokens": 2, **body})
    assert response.status_code == 400, (body, response.text)
    error = response.json()
    assert error["type"] == "error" and set(error["error"]) == {"type", "message"}
    assert error["error"]["type"] == "invalid_request_error" and error["error"]["message"]


def test_required_choice_without_tools_and_sdk_errors(sdk: Anthropic, http: httpx.Client):
    response = http.post(
        "/v1/messages", json={"messages": USER, "max_tokens": 1, "tools": [], "tool_choice": {"type": "any"}}
    )
    assert response.status_code == 400 and "needs at least one tool" in response.json()["error"]["message"]
    with pytest.raises(BadRequestError):
        sdk.messages.create(model="x", messages=[], max_tokens=4)
    for raw in (b"{", b"[1]", b'{"messages": NaN}'):
        bad = http.post("/v1/messages", content=raw)
        assert bad.status_code == 400 and bad.json()["type"] == "error"
    accepted = {
        "messages": USER,
        "max_tokens": 1,
        "thinking": {"type": "enabled", "budget_tokens": 2048},
        "metadata": {"user_id": "u"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    }
    assert http.post("/v1/messages", json=accepted).status_code == 200


@pytest.mark.parametrize("temperature", [0.0, -0.0])
def test_zero_temperature_is_clamped(http: httpx.Client, temperature):
    response = http.post("/v1/messages", json={"messages": USER, "max_tokens": 2, "temperature": temperature})
    assert response.status_code == 200, response.text

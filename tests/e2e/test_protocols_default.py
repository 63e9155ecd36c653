"""End to end on the real default core: the Messages, Responses and Ollama discovery protocols
answer correctly, driven by the anthropic and openai SDKs and httpx.

Answers are checked greedily (top_k 1; temperature 0 alone is clamped to the recipe's 0.01
minimum, which still samples): at the model's prepared temperature this small model may answer
"OK." instead of "OK".
"""

from __future__ import annotations

import gzip
import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from anthropic import Anthropic
from openai import OpenAI

pytestmark = pytest.mark.e2e

OK = [{"role": "user", "content": "Reply with exactly OK."}]
GREEDY = {"temperature": 0, "top_k": 1}  # temperature 0 alone is clamped to 0.01, which samples; sent as extra_body
ANTHROPIC = {"anthropic-version": "2023-06-01"}


@pytest.fixture(scope="module")
def clients(default_server):
    with (
        OpenAI(base_url=default_server.url + "/v1", api_key="local", timeout=120, max_retries=0) as openai,
        Anthropic(base_url=default_server.url, api_key="local", timeout=120, max_retries=0) as anthropic,
        httpx.Client(base_url=default_server.url, timeout=120) as http,
    ):
        yield openai, anthropic, http


def test_messages_buffered_streamed_and_counted(clients):
    _, a, _ = clients
    # Once before, so both requests below find the prompt's prefix checkpoint (equal usage),
    # whichever test ran first on the shared server.
    a.messages.create(model="local", messages=OK, max_tokens=1, extra_body=GREEDY)
    message = a.messages.create(model="local", messages=OK, max_tokens=16, extra_body=GREEDY)
    assert [b.type for b in message.content] == ["text"] and message.content[0].text == "OK"
    assert message.stop_reason == "end_turn" and message.usage.output_tokens >= 1
    with a.messages.stream(model="local", messages=OK, max_tokens=16, extra_body=GREEDY) as stream:
        assert "".join(stream.text_stream) == "OK"
        final = stream.get_final_message()
    assert final.stop_reason == "end_turn" and final.usage == message.usage
    counted = a.messages.count_tokens(model="local", messages=OK)
    assert counted.input_tokens == message.usage.input_tokens + message.usage.cache_read_input_tokens


def test_messages_stop_sequence_and_inline_system(clients):
    _, a, _ = clients
    stopped = a.messages.create(model="local", messages=OK, max_tokens=16, stop_sequences=["OK"], extra_body=GREEDY)
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "OK"
    assert "".join(b.text for b in stopped.content) == ""
    history = [
        {"role": "user", "content": "Hello"},
        {"role": "system", "content": [{"type": "text", "text": "Reply with exactly OK."}]},
    ]
    inline = a.messages.create(model="local", messages=history, max_tokens=16, extra_body=GREEDY)
    assert inline.content[0].text == "OK"
    limited = a.messages.create(
        model="local", messages=[{"role": "user", "content": "Count from 1 to 50."}], max_tokens=3, extra_body=GREEDY
    )
    assert limited.stop_reason == "max_tokens" and limited.usage.output_tokens == 3


def test_token_sequence_stops_end_on_the_real_model(clients):
    """api.md token stops: a run of ids the model is about to write ends generation; the run is
    neither text nor logprob entries, and Messages reports end_turn (a token stop)."""
    o, a, http = clients
    SEEDED = {**GREEDY, "seed": 5}
    count = [{"role": "user", "content": "Count from 1 to 20, separated by commas."}]
    free = http.post(
        "/v1/chat/completions", json={"messages": count, "max_tokens": 12, "return_token_ids": True, **SEEDED}
    ).json()["choices"][0]
    ids = free["token_ids"]
    # The first two-token run past the start that the model has not written before.
    at = next(i for i in range(2, len(ids) - 1) if all(ids[j : j + 2] != ids[i : i + 2] for j in range(i)))
    run = ids[at : at + 2]
    stopped = http.post(
        "/v1/chat/completions",
        json={
            "messages": count,
            "max_tokens": 12,
            "return_token_ids": True,
            "logprobs": True,
            "stream": False,
            "stop_token_sequences": [run],
            **SEEDED,
        },
    ).json()["choices"][0]
    assert stopped["finish_reason"] == "stop" and stopped["stop_reason"] == run
    assert stopped["token_ids"] == ids[: at + 2] and len(stopped["logprobs"]["content"]) == at
    assert free["message"]["content"].startswith(stopped["message"]["content"])
    streamed = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in o.chat.completions.create(
            model="local",
            messages=count,
            max_tokens=12,
            stream=True,
            extra_body={"stop_token_sequences": [run], **SEEDED},
        )
        if chunk.choices
    )
    assert streamed == stopped["message"]["content"]
    message = a.messages.create(
        model="local", messages=count, max_tokens=12, extra_body={"stop_token_sequences": [run], **SEEDED}
    )
    assert message.stop_reason == "end_turn" and message.usage.output_tokens == at + 2


def test_responses_buffered_streamed_and_compressed(clients):
    o, _, http = clients
    response = o.responses.create(model="local", input=OK, max_output_tokens=16, extra_body=GREEDY)
    assert response.status == "completed" and response.output_text == "OK"
    with o.responses.stream(model="local", input=OK, max_output_tokens=16, extra_body=GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert events[-1].type == "response.completed" and final.output_text == "OK"
    assert [e.sequence_number for e in events] == sorted(e.sequence_number for e in events)
    body = json.dumps({"input": "Reply with exactly OK.", "max_output_tokens": 16, **GREEDY}).encode()
    zipped = http.post("/v1/responses", content=gzip.compress(body), headers={"Content-Encoding": "gzip"})
    assert zipped.status_code == 200 and zipped.json()["output"][0]["content"][0]["text"] == "OK"
    cut = o.responses.create(model="local", input="Count from 1 to 50.", max_output_tokens=3, extra_body=GREEDY)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"


def test_four_protocols_concurrently(clients):
    _, _, http = clients
    calls = [
        ("/v1/chat/completions", {"messages": OK, "max_tokens": 16}, lambda j: j["choices"][0]["message"]["content"]),
        ("/v1/messages", {"messages": OK, "max_tokens": 16}, lambda j: j["content"][0]["text"]),
        ("/v1/responses", {"input": OK, "max_output_tokens": 16}, lambda j: j["output"][0]["content"][0]["text"]),
        ("/v1/completions", {"prompt": "The capital of France is", "max_tokens": 4}, lambda j: j["choices"][0]["text"]),
    ]

    def call(item):
        path, body, text = item
        response = http.post(path, json={**body, **GREEDY}, headers=ANTHROPIC)
        assert response.status_code == 200, response.text
        return text(response.json())

    with ThreadPoolExecutor(max_workers=4) as pool:
        answers = list(pool.map(call, calls))
    assert answers[:3] == ["OK"] * 3 and "Paris" in answers[3]


def test_ollama_discovery_matches_the_card(clients):
    _, _, http = clients
    card = http.get("/v1/models").json()["data"][0]
    [model] = http.get("/api/tags").json()["models"]
    info = http.post("/api/show", json={"model": model["name"]}).json()
    assert model["name"] == card["id"]
    assert info["model_info"]["flare.context_length"] == card["max_model_len"]
    assert "completion" in info["capabilities"]


def test_the_default_core_serves_the_native_context(clients, default_server, default_core):
    """Qwen2.5-Coder's native 32,768 tokens (coding agents send ~18k on their first turn): the
    card, /api/show and the manifest agree, the default pool holds two full-context sequences
    and says so at start-up, and a prompt past the limit is a 400 naming it, in each shape."""
    from helios.manifest import Manifest

    _, _, http = clients
    manifest = Manifest.load(default_core, verify_files=False)
    context = manifest.limits.context_length
    assert context == 32768
    assert manifest.limits.kv_pages * manifest.kv.page_tokens >= 2 * context
    card = http.get("/v1/models").json()["data"][0]
    info = http.post("/api/show", json={"model": card["id"]}).json()
    assert card["max_model_len"] == info["model_info"]["flare.context_length"] == context
    assert f"KV pool: {manifest.limits.kv_pages} pages x 16 tokens" in default_server.output()

    over = http.post("/v1/completions", json={"prompt": [100] * (context + 1), "max_tokens": 1})
    assert over.status_code == 400 and f"{context}-token context" in over.json()["error"]["message"]
    text = "hello " * (context + 100)
    over = http.post(
        "/v1/messages",
        headers=ANTHROPIC,
        json={"model": "local", "max_tokens": 8, "messages": [{"role": "user", "content": text}]},
    )
    assert over.status_code == 400, over.text
    error = over.json()
    assert error["type"] == "error" and f"{context}-token context" in error["error"]["message"]

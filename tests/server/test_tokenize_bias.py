"""POST /tokenize and /detokenize (vLLM's shapes) and OpenAI logit_bias, against a real server
over the tiny core (real Qwen tokenizer, real template)."""

from __future__ import annotations

import httpx
import pytest

from tests.unit.live import ANTHROPIC

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a prime number."},
]


def post(server, path: str, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60, **kwargs)


def test_tokenize_prompt_round_trip(tiny_server):
    text = "def add(a, b):\n    return a + b  # ünïcode ✓"
    tokens = post(tiny_server, "/tokenize", {"prompt": text, "return_token_strs": True}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 5
    assert len(tokens["token_strs"]) == tokens["count"]
    assert tokens["max_model_len"] == httpx.get(tiny_server.url + "/v1/models").json()["data"][0]["max_model_len"]
    assert post(tiny_server, "/detokenize", {"tokens": tokens["tokens"]}).json() == {"prompt": text}
    # The count is what /v1/completions bills for the same prompt.
    usage = post(tiny_server, "/v1/completions", {"prompt": text, "max_tokens": 1}).json()["usage"]
    assert usage["prompt_tokens"] == tokens["count"]


def test_tokenize_chat_equals_count_tokens_and_chat_usage(tiny_server):
    tokens = post(tiny_server, "/tokenize", {"messages": MESSAGES}).json()
    assert tokens["token_strs"] is None
    counted = post(
        tiny_server,
        "/v1/messages/count_tokens",
        {"model": "m", "system": MESSAGES[0]["content"], "messages": MESSAGES[1:]},
        headers=ANTHROPIC,
    ).json()
    assert counted["input_tokens"] == tokens["count"]
    usage = post(tiny_server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1}).json()["usage"]
    assert usage["prompt_tokens"] == tokens["count"]
    # Without the generation prompt the rendered prompt is shorter.
    bare = post(tiny_server, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}).json()
    assert bare["count"] < tokens["count"]
    text = post(tiny_server, "/detokenize", {"tokens": tokens["tokens"]}).json()["prompt"]
    assert "Name a prime number." in text and text.count("<|im_start|>") == 3


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"prompt": "x", "messages": MESSAGES}, "prompt"),
        ("/tokenize", {"messages": "hi"}, "messages"),
        ("/detokenize", {"tokens": [1, -2]}, "tokens"),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
        ("/detokenize", {"tokens": "1 2"}, "tokens"),
    ],
)
def test_tokenize_bad_input_is_a_400(tiny_server, path, body, param):
    response = post(tiny_server, path, body)
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert response.json()["error"]["param"] == param


def first_token(server, extra: dict) -> dict:
    body = {
        "messages": [{"role": "user", "content": "Say something."}],
        "max_tokens": 1,
        "temperature": 0,
        "seed": 7,
        "logprobs": True,
        "top_logprobs": 5,
        "return_tokens_as_token_ids": True,
        **extra,
    }
    response = post(server, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["logprobs"]["content"][0]


def token_id(label: str) -> int:
    return int(label.removeprefix("token_id:"))


def test_logit_bias_steers_the_choice_and_logprobs_stay_raw(tiny_server):
    plain = first_token(tiny_server, {})
    chosen = token_id(plain["token"])
    runner_up = token_id(plain["top_logprobs"][1]["token"])
    raw = {token_id(alt["token"]): alt["logprob"] for alt in plain["top_logprobs"]}

    pushed = first_token(tiny_server, {"logit_bias": {str(runner_up): 100}})
    assert token_id(pushed["token"]) == runner_up
    assert pushed["logprob"] == pytest.approx(raw[runner_up], abs=1e-5)  # the model's, not the biased one
    assert pushed["top_logprobs"] == plain["top_logprobs"]

    banned = first_token(tiny_server, {"logit_bias": {str(chosen): -100}})
    assert token_id(banned["token"]) != chosen

    completion = post(
        tiny_server,
        "/v1/completions",
        {
            "prompt": "Hello",
            "max_tokens": 1,
            "temperature": 0,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
            "logit_bias": {str(runner_up): 100},
        },
    ).json()
    assert completion["choices"][0]["logprobs"]["tokens"] == [f"token_id:{runner_up}"]


@pytest.mark.parametrize(
    "bias",
    [
        {"abc": 1},
        {"--5": 1},
        {"1_0": 1},
        {"9" * 5000: 1},
        {"-1": 1},
        {"999999999": 1},
        {"10": 101},
        {"10": "high"},
        {str(i): 1 for i in range(301)},
        [1, 2],
    ],
)
def test_bad_logit_bias_is_a_400(tiny_server, bias):
    response = post(tiny_server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1, "logit_bias": bias})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "logit_bias" or "logit_bias" in response.json()["error"]["param"]


def test_logit_bias_is_refused_where_the_protocol_has_none(tiny_server):
    response = post(
        tiny_server,
        "/v1/messages",
        {"model": "m", "max_tokens": 1, "messages": MESSAGES[1:], "logit_bias": {"10": 5}},
        headers=ANTHROPIC,
    )
    assert response.status_code == 400

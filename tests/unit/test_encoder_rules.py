"""A native encoder's rules (manifest `template.rejects`, DeepSeek V4/V4.1, api.md) are 400s from
helios before the template renders, on every conversational protocol and count_tokens; the
reasoning_effort template variable is validated like the top-level field."""

from __future__ import annotations

import httpx
import pytest

from tests.unit.live import ANTHROPIC, USER
from tests.unit.scripted import ScriptedServer

RULES = ["drop_thinking", "continuation", "add_generation_prompt_false"]


@pytest.fixture(scope="module")
def v41(tiny_core):
    """The tiny core's real tokenizer and template, exported as a DeepSeek V4.1 core declares it."""
    s = ScriptedServer(tiny_core, template={"rejects": RULES, "numeric_effort": [1, 100]})
    with httpx.Client(base_url=s.url, headers=ANTHROPIC, timeout=60) as http:
        yield http
    s.stop()


@pytest.fixture(scope="module")
def v4(tiny_core):
    s = ScriptedServer(tiny_core, template={"rejects": RULES})
    with httpx.Client(base_url=s.url, headers=ANTHROPIC, timeout=60) as http:
        yield http
    s.stop()


def _error(response: httpx.Response) -> str:
    assert response.status_code == 400, response.text
    body = response.json()
    return body["error"]["message"] + " param=" + str(body["error"].get("param"))


def test_encoder_rejections_are_400_on_every_protocol(v41):
    prefill = USER + [{"role": "assistant", "content": "Sure:"}]
    chat = "/v1/chat/completions"
    assert "drop_thinking" in _error(
        v41.post(chat, json={"messages": USER, "chat_template_kwargs": {"drop_thinking": True}})
    )
    assert "continuation" in _error(
        v41.post(chat, json={"messages": prefill, "continue_final_message": True, "add_generation_prompt": False})
    )
    assert "continuation" in _error(v41.post(chat, json={"messages": prefill}))
    assert "add_generation_prompt=false" in _error(
        v41.post(chat, json={"messages": USER, "add_generation_prompt": False})
    )
    assert "continuation" in _error(v41.post("/v1/messages", json={"messages": prefill, "max_tokens": 4}))
    assert "continuation" in _error(v41.post("/v1/messages/count_tokens", json={"messages": prefill}))
    assert "continuation" in _error(v41.post("/v1/responses", json={"input": prefill}))
    assert v41.post(chat, json={"messages": USER, "max_tokens": 2}).status_code == 200


def test_reasoning_effort_kwarg_is_validated_like_the_field(v41, v4):
    chat = "/v1/chat/completions"
    for good in (80, 1, 100, None, "high"):
        body = {"messages": USER, "max_tokens": 2, "chat_template_kwargs": {"reasoning_effort": good}}
        assert v41.post(chat, json=body).status_code == 200, good
    for bad in (0, 101, 80.0, True, "80"):
        body = {"messages": USER, "chat_template_kwargs": {"reasoning_effort": bad}}
        assert "reasoning_effort" in _error(v41.post(chat, json=body)), bad
    # V4 takes named effort only: a numeric score is refused, as api.md says.
    assert "numeric scores are not accepted" in _error(
        v4.post(chat, json={"messages": USER, "chat_template_kwargs": {"reasoning_effort": 80}})
    )
    assert "numeric scores are not accepted" in _error(v4.post(chat, json={"messages": USER, "reasoning_effort": 80}))
    assert (
        v4.post(
            chat, json={"messages": USER, "max_tokens": 2, "chat_template_kwargs": {"reasoning_effort": None}}
        ).status_code
        == 200
    )

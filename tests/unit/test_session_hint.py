"""The conversation id a client sends (OpenAI's prompt_cache_key, decoded by each protocol, or a
session header) reaches the engine request as its routing hint (helios.cluster's affinity reads
it), on every generation route, over a real tokenizer, template and HTTP server."""

from __future__ import annotations

import httpx
import pytest

from tests.unit.live import ANTHROPIC, USER
from tests.unit.scripted import ScriptedServer

ROUTES = {
    "/v1/chat/completions": {"messages": USER, "max_tokens": 4},
    "/v1/completions": {"prompt": "Hello", "max_tokens": 4},
    "/v1/responses": {"input": "Hello", "max_output_tokens": 4},
    "/v1/messages": {"messages": USER, "max_tokens": 4},
}


@pytest.fixture(scope="module")
def server(tiny_core):
    s = ScriptedServer(tiny_core)
    yield s
    s.stop()


def hint(server: ScriptedServer, path: str, extra: dict, headers: dict | None = None) -> str | None:
    server.say("Hi.")
    before = len(server.engine.requests)
    response = httpx.post(server.url + path, json={**ROUTES[path], **extra}, headers={**ANTHROPIC, **(headers or {})})
    assert response.status_code == 200, response.text
    [request] = server.engine.requests[before:]
    return request.session_hint


@pytest.mark.parametrize("path", ROUTES)
def test_prompt_cache_key_then_session_header_become_the_hint(server, path):
    assert hint(server, path, {"prompt_cache_key": "conv-7"}, {"x-session-id": "s-1"}) == "key:conv-7"
    assert hint(server, path, {}, {"x-session-id": "s-1"}) == "session:s-1"
    # Only a hint: a key that is not a short string is ignored, never an error.
    assert hint(server, path, {"prompt_cache_key": 7}) is None
    assert hint(server, path, {"prompt_cache_key": "k" * 257}, {"session_id": "s-2"}) == "session:s-2"

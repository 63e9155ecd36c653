"""What operators reach for on day one, against real servers on loopback: the access log (text and
JSON) with request ids, FLARE_* environment variables and their precedence, --version,
--served-model-name aliases, and CORS."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from helios.launcher import HeliosProcess
from helios.version import flare_version

ORIGIN = "http://console.example.test"
CHAT = {"messages": [{"role": "user", "content": "Reply with exactly OK."}], "max_tokens": 2}


def log_lines(server: HeliosProcess) -> list[str]:
    server.log.seek(0)
    return server.log.read().splitlines()


def wait_for_line(server: HeliosProcess, needle: str, timeout: float = 10.0) -> str:
    """The first log line containing `needle` (the access line is written just after the response)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in log_lines(server):
            if needle in line:
                return line
        time.sleep(0.05)
    raise AssertionError(f"no log line with {needle!r}:\n" + "\n".join(log_lines(server)[-20:]))


@pytest.fixture(scope="module")
def json_server(tiny_core) -> Iterator[HeliosProcess]:
    """JSON logs and two served names, both from the environment; CORS for one origin by flag,
    and a flag that overrides an environment variable (FLARE_LOG_LEVEL=error vs --log-level info)."""
    server = HeliosProcess(
        tiny_core,
        "--allowed-origins",
        ORIGIN,
        "--log-level",
        "info",
        env={"FLARE_LOG_FORMAT": "json", "FLARE_SERVED_MODEL_NAME": "alpha,beta", "FLARE_LOG_LEVEL": "error"},
    )
    yield server
    server.stop()


def test_text_access_log_names_the_request_id(tiny_server):
    response = httpx.post(tiny_server.url + "/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "trace-7"})
    assert response.status_code == 200
    assert response.headers["x-request-id"] == "trace-7"
    line = wait_for_line(tiny_server, "id=trace-7")
    assert '"POST /v1/chat/completions" 200' in line
    assert "helios.access [trace-7]" in line and "127.0.0.1" in line and "ms" in line


def test_json_access_log_and_generated_request_id(json_server):
    response = httpx.post(json_server.url + "/v1/chat/completions", json=CHAT)
    assert response.status_code == 200
    request_id = response.headers["x-request-id"]
    assert request_id == response.json()["id"]  # no client id: the response id
    entry = json.loads(wait_for_line(json_server, request_id))
    assert entry["logger"] == "helios.access" and entry["level"] == "INFO"
    assert (entry["method"], entry["path"], entry["status"]) == ("POST", "/v1/chat/completions", 200)
    assert entry["request_id"] == request_id and entry["client"] == "127.0.0.1"
    assert entry["bytes"] >= len(response.content) and entry["latency_ms"] > 0
    # Every log record is one JSON object: no text-format record among the lines (the rest are
    # the start-up banner on stdout).
    records = [line for line in log_lines(json_server) if line.startswith("{")]
    assert all(json.loads(line)["time"] for line in records)
    assert not any(" INFO helios" in line or " WARNING " in line for line in log_lines(json_server))


def test_polled_routes_log_at_debug_and_paths_stay_encoded(tiny_server):
    assert httpx.get(tiny_server.url + "/health").status_code == 200
    httpx.get(tiny_server.url + "/v1/models/no%0Asuch%20model")
    line = wait_for_line(tiny_server, "no%0Asuch")
    assert '"GET /v1/models/no%0Asuch%20model" 404' in line  # a crafted URL writes no line break
    assert not any('"GET /health"' in line for line in log_lines(tiny_server))


def test_a_request_its_client_abandons_is_logged_once_as_499(tiny_server):
    body = {**CHAT, "max_tokens": 400, "ignore_eos": True, "stream": True}
    headers = {"X-Request-Id": "walked-away"}
    with httpx.stream("POST", tiny_server.url + "/v1/chat/completions", json=body, headers=headers) as stream:
        for _ in stream.iter_lines():
            break  # the first frame, then hang up
    line = wait_for_line(tiny_server, "id=walked-away")
    assert '"POST /v1/chat/completions" 499' in line
    time.sleep(1)
    assert sum("id=walked-away" in line for line in log_lines(tiny_server)) == 1


def test_environment_names_and_flag_precedence(json_server):
    """FLARE_SERVED_MODEL_NAME gave two names; --log-level info beat FLARE_LOG_LEVEL=error (the
    access lines above exist only at info)."""
    cards = httpx.get(json_server.url + "/v1/models").json()["data"]
    assert [card["id"] for card in cards] == ["alpha"]  # api.md: one card, under the first name
    assert [m["name"] for m in httpx.get(json_server.url + "/api/tags").json()["models"]] == ["alpha"]
    assert httpx.get(json_server.url + "/v1/models/beta").json() == cards[0]  # an alias reaches the card
    shown = httpx.post(json_server.url + "/api/show", json={"model": "beta"})
    assert shown.status_code == 200
    assert httpx.get(json_server.url + "/v1/models/gamma").status_code == 404
    answer = httpx.post(json_server.url + "/v1/chat/completions", json={**CHAT, "model": "beta"}).json()
    assert answer["model"] == "alpha"  # the first name, as vLLM reports it
    messages = httpx.post(
        json_server.url + "/v1/messages",
        json={"model": "beta", "max_tokens": 2, "messages": CHAT["messages"]},
        headers={"anthropic-version": "2023-06-01"},
    ).json()
    assert messages["model"] == "alpha"
    wait_for_line(json_server, '"path": "/v1/models"')


def test_api_key_from_the_environment_and_the_file_flag_wins(tiny_core, tmp_path):
    env_key = "key-from-env"
    server = HeliosProcess(tiny_core, env={"FLARE_API_KEY": env_key})
    try:
        assert httpx.get(server.url + "/v1/models").status_code == 401
        assert httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {env_key}"}).status_code == 200
    finally:
        server.stop()
    (tmp_path / "key").write_text("key-from-file\n")
    server = HeliosProcess(tiny_core, "--api-key-file", str(tmp_path / "key"), env={"FLARE_API_KEY": env_key})
    try:
        assert httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {env_key}"}).status_code == 401
        ok = httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer key-from-file"})
        assert ok.status_code == 200
    finally:
        server.stop()


def test_bad_environment_value_is_a_one_line_error(tiny_core):
    result = subprocess.run(
        [sys.executable, "-m", "helios.cli", "serve", str(tiny_core)],
        env={**os.environ, "FLARE_LOG_FORMAT": "xml"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "log_format must be one of text, json" in result.stderr + result.stdout
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("cli", ["helios", "ignition"])
def test_version_on_both_clis(cli):
    result = subprocess.run(
        [sys.executable, "-m", f"{cli}.cli", "--version"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0
    assert f"{cli} {flare_version()}" in result.stdout + result.stderr


def test_version_route(tiny_server):
    assert httpx.get(tiny_server.url + "/version").json() == {"version": flare_version()}


def test_cors_preflight_and_stream_headers(json_server):
    preflight = httpx.options(
        json_server.url + "/v1/chat/completions",
        headers={
            "Origin": ORIGIN,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
    )
    assert preflight.status_code == 204
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert preflight.headers["access-control-allow-headers"] == "authorization, content-type"
    assert "access-control-allow-credentials" not in preflight.headers
    with httpx.stream(
        "POST", json_server.url + "/v1/chat/completions", json={**CHAT, "stream": True}, headers={"Origin": ORIGIN}
    ) as stream:
        assert stream.status_code == 200
        assert stream.headers["access-control-allow-origin"] == ORIGIN
        assert "x-request-id" in stream.headers["access-control-expose-headers"]
        stream.read()
    other = httpx.options(
        json_server.url + "/v1/chat/completions",
        headers={"Origin": "http://elsewhere.test", "Access-Control-Request-Method": "POST"},
    )
    assert other.status_code == 403 and other.json()["error"]["message"]
    anthropic = httpx.options(
        json_server.url + "/v1/messages",
        headers={"Origin": "http://elsewhere.test", "Access-Control-Request-Method": "POST"},
    )
    assert anthropic.status_code == 403 and anthropic.json()["type"] == "error"  # the route's own shape
    upper = httpx.options(
        json_server.url + "/v1/models",
        headers={"Origin": ORIGIN.upper().replace("HTTP://", "http://"), "Access-Control-Request-Method": "GET"},
    )
    assert upper.status_code == 204 and upper.headers.get_list("vary") == ["Origin"]
    plain = httpx.get(json_server.url + "/v1/models", headers={"Origin": "http://elsewhere.test"})
    assert plain.status_code == 200 and "access-control-allow-origin" not in plain.headers


def test_cors_is_off_by_default(tiny_server):
    preflight = httpx.options(
        tiny_server.url + "/v1/chat/completions", headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}
    )
    assert preflight.status_code == 405
    response = httpx.get(tiny_server.url + "/v1/models", headers={"Origin": ORIGIN})
    assert "access-control-allow-origin" not in response.headers


def test_wildcard_origin_never_allows_credentials(tiny_core):
    server = HeliosProcess(tiny_core, "--allowed-origins", "*")
    try:
        response = httpx.options(
            server.url + "/v1/models",
            headers={"Origin": "http://any.test", "Access-Control-Request-Method": "GET"},
        )
        assert response.status_code == 204
        assert response.headers["access-control-allow-origin"] == "*"
        assert "access-control-allow-credentials" not in response.headers
        stream = httpx.get(server.url + "/v1/models", headers={"Origin": "http://any.test"})
        assert stream.headers["access-control-allow-origin"] == "*"
    finally:
        server.stop()


def test_config_file_keys_for_the_new_options(tiny_core, tmp_path: Path):
    config = tmp_path / "helios.toml"
    config.write_text('[server]\nserved_model_names = ["from-file"]\nlog_format = "json"\n')
    server = HeliosProcess(tiny_core, "--config", str(config))
    try:
        assert httpx.get(server.url + "/v1/models").json()["data"][0]["id"] == "from-file"
    finally:
        server.stop()
    # An environment variable beats the file.
    server = HeliosProcess(tiny_core, "--config", str(config), env={"FLARE_SERVED_MODEL_NAME": "from-env"})
    try:
        assert httpx.get(server.url + "/v1/models").json()["data"][0]["id"] == "from-env"
    finally:
        server.stop()

"""`helios client-config`: written from a live server's card, keys by reference only."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib

import httpx

from tests.conftest import REPO, TINY_API_KEY

KEY_ENV = "FLARE_TEST_SERVING_KEY"


def client_config(url: str, client: str, out, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "helios.cli", "client-config", client, "--url", url, "--out", str(out), *extra],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
        env=env,
    )


def test_every_client_from_the_card(tiny_server, tmp_path):
    card = httpx.get(tiny_server.url + "/v1/models").json()["data"][0]
    for client in ("codex", "claude-code", "opencode"):
        done = client_config(tiny_server.url + "/v1/", client, tmp_path / client)  # /v1 and a slash are accepted
        assert done.returncode == 0, done.stderr
        assert f"context {card['max_model_len']} tokens" in done.stdout
    codex = tomllib.loads((tmp_path / "codex" / "config.toml").read_text())
    assert codex["model"] == card["id"] and codex["web_search"] == "disabled"
    provider = codex["model_providers"][codex["model_provider"]]
    assert provider["wire_api"] == "responses" and provider["base_url"] == tiny_server.url + "/v1"
    assert "env_key" not in provider  # no key on this server
    [entry] = json.loads((tmp_path / "codex" / "catalog.json").read_text())["models"]
    assert entry["slug"] == card["id"] and entry["context_window"] == card["max_model_len"]
    assert entry["apply_patch_tool_type"] == "freeform" and entry["input_modalities"] == ["text"]
    assert entry["supported_reasoning_levels"] == []  # the tiny core declares no reasoning parser
    claude = json.loads((tmp_path / "claude-code" / "settings.json").read_text())
    assert claude["env"]["ANTHROPIC_BASE_URL"] == tiny_server.url and claude["model"] == card["id"]
    assert claude["env"]["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == str(card["max_model_len"])
    assert claude["permissions"]["defaultMode"] != "auto"
    # no mid-conversation system turns: Claude Code folds its environment into the user's turn
    assert claude["env"]["CLAUDE_CODE_MODEL_CAPABILITIES"] == f"{card['id']}=-mid_conv_system"
    opencode = json.loads((tmp_path / "opencode" / "opencode.json").read_text())
    model = opencode["provider"]["ollama"]["models"][card["id"]]
    assert model["limit"]["context"] == card["max_model_len"] and model["tool_call"] is True
    v2 = json.loads((tmp_path / "opencode" / "opencode-v2.json").read_text())
    assert v2 == {"providers": {"ollama": {"settings": {"baseURL": tiny_server.url + "/v1"}}}}


def test_a_keyed_server_is_configured_by_reference(tiny_keyed_server, tmp_path):
    denied = client_config(tiny_keyed_server.url, "codex", tmp_path / "denied")
    assert denied.returncode == 2 and "401" in denied.stderr and "--api-key-env" in denied.stderr
    unset = client_config(
        tiny_keyed_server.url, "codex", tmp_path / "unset", "--api-key-env", KEY_ENV, env={"PATH": "/usr/bin:/bin"}
    )
    assert unset.returncode == 2 and KEY_ENV in unset.stderr
    env = {"PATH": "/usr/bin:/bin", KEY_ENV: TINY_API_KEY}
    for client in ("codex", "claude-code", "opencode"):
        done = client_config(tiny_keyed_server.url, client, tmp_path / client, "--api-key-env", KEY_ENV, env=env)
        assert done.returncode == 0, done.stderr
        for path in (tmp_path / client).iterdir():
            assert TINY_API_KEY not in path.read_text(), path  # the key itself is never written
    assert f'env_key = "{KEY_ENV}"' in (tmp_path / "codex" / "config.toml").read_text()
    claude = json.loads((tmp_path / "claude-code" / "settings.json").read_text())
    assert claude["apiKeyHelper"] == f"printenv {KEY_ENV}" and "ANTHROPIC_API_KEY" not in claude["env"]
    opencode = json.loads((tmp_path / "opencode" / "opencode.json").read_text())
    assert opencode["provider"]["ollama"]["options"]["apiKey"] == f"{{env:{KEY_ENV}}}"


def test_an_unreachable_server_is_a_clear_error(tmp_path):
    done = client_config("http://127.0.0.1:9", "opencode", tmp_path / "x")
    assert done.returncode == 2 and "cannot read http://127.0.0.1:9/v1/models" in done.stderr
    unknown = client_config("http://127.0.0.1:9", "vim", tmp_path / "y")
    assert unknown.returncode == 2 and "unknown client" in unknown.stderr

"""`helios client-config`: what Codex, Claude Code and OpenCode need to use a running helios.

Everything comes from the served card (GET /v1/models) and Ollama discovery (POST /api/show):
the model's name, its context limit and its capabilities as the core's manifest declares them.
Nothing is inferred from the model's name. The versions are the ones api.md qualifies (Codex
0.162.1, Claude Code 2.1.296) plus OpenCode 1.18.33 from npm; the settings that keep each
client from calling anything but helios are part of what is written.
"""

from __future__ import annotations

import json
import shlex
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

NO_KEY = "local"  # any nonempty key satisfies the clients when helios runs without one

# Codex 0.162.1 asks the catalog for the model's base instructions; a short text keeps a small
# model's prompt short (Codex's own default is ~17 KB).
CODEX_INSTRUCTIONS = """You are a coding agent in a terminal, working in the user's current repository.
- Look at files and run programs with the exec_command tool (for example `cat FILE`, `ls`, `rg PATTERN`, the project's tests).
- Change files with the apply_patch tool: a freeform patch from `*** Begin Patch` to `*** End Patch`, with `*** Update File: PATH`, `*** Add File: PATH` or `*** Delete File: PATH` sections and +/- lines.
- Work step by step: inspect, edit, then run the tests.
- When the task is done, reply with a short summary of what changed."""


class ClientConfigError(RuntimeError):
    pass


@dataclass
class ServedModel:
    """What the clients are told about the model, as the running helios reports it."""

    name: str  # the card id, which /api/tags lists as the model's name
    context_length: int  # max_model_len: prompt + output
    tools: bool
    reasoning: bool
    vision: bool

    @property
    def output_tokens(self) -> int:
        """The output budget a client should ask for: room for an edit, while the prompt keeps
        most of the context (Claude Code compacts once prompt + this exceeds its window)."""
        return max(1024, min(8192, self.context_length // 8))


def read_served_model(url: str, api_key: str | None = None, timeout: float = 10.0) -> ServedModel:
    """The card and discovery metadata of the helios at `url` (http://HOST:PORT)."""
    card = _get_json(f"{url}/v1/models", api_key, timeout)["data"][0]
    shown = _get_json(f"{url}/api/show", api_key, timeout, body={"model": card["id"]})
    capabilities = set(shown.get("capabilities", []))
    return ServedModel(
        name=card["id"],
        context_length=int(card["max_model_len"]),
        tools="tools" in capabilities,
        reasoning="thinking" in capabilities,
        vision="vision" in capabilities,
    )


def _get_json(url: str, api_key: str | None, timeout: float, body: dict | None = None) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method="POST" if body is not None else "GET")
    request.add_header("Content-Type", "application/json")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        hint = " (pass --api-key-env with the serving key)" if exc.code == 401 else ""
        raise ClientConfigError(f"{url} answered HTTP {exc.code}{hint}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise ClientConfigError(f"cannot read {url}: {exc}") from None


# -- Codex -----------------------------------------------------------------------------------


def codex_files(model: ServedModel, url: str, key_env: str | None, out: Path) -> dict[str, str]:
    """config.toml (the flare provider over Responses, hosted search off, no outbound sync) and
    the model catalog it names (context limit, freeform apply_patch, capabilities)."""
    catalog = out / "catalog.json"
    lines = [
        "# Written by `helios client-config codex`: Codex 0.162.1 against helios.",
        f"model = {json.dumps(model.name)}",
        'model_provider = "flare"',
        f"model_catalog_json = {json.dumps(str(catalog.resolve()))}",
        "# helios serves function and custom tools only: hosted web search is a 400 (api.md).",
        'web_search = "disabled"',
        "# `codex --oss` reaches helios through its Ollama discovery routes (no key is sent there).",
        'oss_provider = "ollama"',
        "check_for_update_on_startup = false",
        "",
        "# Nothing but helios: no analytics, no plugin or app sync from the network.",
        "[analytics]",
        "enabled = false",
        "",
        "[features]",
        "multi_agent = false",
        "goals = false",
        "plugins = false",
        "apps = false",
        "remote_plugin = false",
        "",
        "[model_providers.flare]",
        'name = "Flare (helios)"',
        f"base_url = {json.dumps(url + '/v1')}",
        'wire_api = "responses"',
    ]
    if key_env:
        lines.append(f"env_key = {json.dumps(key_env)}")
    levels = [{"effort": e, "description": f"{e} reasoning effort"} for e in ("low", "medium", "high")]
    entry = {
        "slug": model.name,
        "display_name": model.name,
        "description": f"{model.name} served by helios",
        "context_window": model.context_length,
        "max_context_window": model.context_length,
        "effective_context_window_percent": 95,
        "apply_patch_tool_type": "freeform",
        "shell_type": "unified_exec",
        "supported_reasoning_levels": levels if model.reasoning else [],
        "default_reasoning_summary": "auto" if model.reasoning else "none",
        "supports_reasoning_summary_parameter": model.reasoning,
        "visibility": "list",
        "supported_in_api": True,
        "priority": 0,
        "support_verbosity": False,
        "truncation_policy": {"mode": "tokens", "limit": min(10000, model.context_length // 4)},
        "experimental_supported_tools": [],
        "input_modalities": ["text", "image"] if model.vision else ["text"],
        "supports_search_tool": False,
        "include_apps_usage_instructions": False,
        "base_instructions": CODEX_INSTRUCTIONS,
    }
    if model.reasoning:
        entry["default_reasoning_level"] = "medium"
    return {"config.toml": "\n".join(lines) + "\n", "catalog.json": json.dumps({"models": [entry]}, indent=2) + "\n"}


# -- Claude Code -----------------------------------------------------------------------------


def claude_code_files(model: ServedModel, url: str, key_env: str | None, out: Path) -> dict[str, str]:
    """settings.json: base URL, model (also for the haiku/sonnet/opus roles Claude Code uses for
    side requests), key, the context window of a model it does not know, the model's
    capabilities, no outbound traffic."""
    env = {
        "ANTHROPIC_BASE_URL": url,
        "ANTHROPIC_MODEL": model.name,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": model.name,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": model.name,
        "ANTHROPIC_DEFAULT_OPUS_MODEL": model.name,
        "CLAUDE_CODE_MAX_CONTEXT_TOKENS": str(model.context_length),
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(model.output_tokens),
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
        # Auto memory names the project's own memory folder in the system prompt, so no two
        # projects would share the ~12k-token preamble's prefix checkpoint (a minute of CPU prefill
        # for each new project's first turn instead of seconds).
        "CLAUDE_CODE_DISABLE_AUTO_MEMORY": "1",
    }
    if not model.reasoning:
        env["CLAUDE_CODE_DISABLE_THINKING"] = "1"
    # Claude Code sends its environment (working directory, agents, skills) as a system turn
    # after the user's message to any model it does not know: a Claude capability the open
    # models a core serves are not trained for (the 0.5B default continues that turn instead of
    # answering). Declared off, the same text arrives as <system-reminder> blocks ahead of the
    # user's words. helios still accepts inline system turns from any client (api.md).
    env["CLAUDE_CODE_MODEL_CAPABILITIES"] = f"{model.name}=-mid_conv_system"
    settings: dict = {"env": env, "model": model.name}
    if key_env:
        settings["apiKeyHelper"] = f"printenv {shlex.quote(key_env)}"
    else:
        env["ANTHROPIC_API_KEY"] = NO_KEY
    # Claude Code's default `auto` mode sends shell commands to a safety classifier model on the
    # same base URL, which a local model cannot answer (the command is then refused).
    settings["permissions"] = {"defaultMode": "acceptEdits"}
    return {"settings.json": json.dumps(settings, indent=2) + "\n"}


# -- OpenCode --------------------------------------------------------------------------------


def opencode_files(model: ServedModel, url: str, key_env: str | None, out: Path) -> dict[str, str]:
    """opencode.json for OpenCode 1.18.33 from npm (a `provider.ollama` entry over its bundled
    openai-compatible package, with the model described, since 1.x reads no discovery route),
    and opencode-v2.json, api.md's form for OpenCode v2's built-in Ollama provider, which polls
    /api/tags and /api/show for the same facts."""
    key = f"{{env:{key_env}}}" if key_env else NO_KEY
    v1 = {
        "$schema": "https://opencode.ai/config.json",
        "model": f"ollama/{model.name}",
        "small_model": f"ollama/{model.name}",
        "autoupdate": False,
        "share": "disabled",
        "provider": {
            "ollama": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "Flare (helios)",
                "options": {"baseURL": url + "/v1", "apiKey": key},
                "models": {
                    model.name: {
                        "name": model.name,
                        "tool_call": model.tools,
                        "reasoning": model.reasoning,
                        "attachment": model.vision,
                        "temperature": True,
                        "limit": {"context": model.context_length, "output": model.output_tokens},
                    }
                },
            }
        },
    }
    settings = {"baseURL": url + "/v1", **({"apiKey": key} if key_env else {})}
    v2 = {"providers": {"ollama": {"settings": settings}}}
    return {"opencode.json": json.dumps(v1, indent=2) + "\n", "opencode-v2.json": json.dumps(v2, indent=2) + "\n"}


# -- the command -----------------------------------------------------------------------------


# Each client's files by name, from (model, server root URL, key variable, output folder).
WRITERS = {"codex": codex_files, "claude-code": claude_code_files, "opencode": opencode_files}
CLIENTS = tuple(WRITERS)


def server_root(url: str) -> str:
    """http://HOST:PORT from what a user may paste (a trailing slash or /v1)."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def write_client_config(
    client: str, url: str, out: Path, key_env: str | None, api_key: str | None
) -> tuple[ServedModel, list[Path]]:
    model = read_served_model(url, api_key)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in WRITERS[client](model, url, key_env, out).items():
        path = out / name
        path.write_text(text)
        written.append(path)
    return model, written


def usage(client: str, url: str, out: Path, model_name: str, key_env: str | None) -> str:
    """How to run the client with what was written (one line each)."""
    folder = shlex.quote(str(out.resolve()))
    prompt = shlex.quote("Reply with OK")
    if client == "codex":
        oss = (
            f"CODEX_HOME={folder} CODEX_OSS_BASE_URL={url}/v1 codex exec --oss --local-provider ollama "
            f"-m {shlex.quote(model_name)} {prompt}"
        )
        return f"CODEX_HOME={folder} codex exec {prompt}\n{oss}" + (
            "\n(--oss sends no key: it needs a helios without one)" if key_env else ""
        )
    if client == "claude-code":
        settings = shlex.quote(str((out / "settings.json").resolve()))
        return f"claude --settings {settings} -p {prompt}\nclaude --bare --settings {settings} -p {prompt}"
    config = shlex.quote(str((out / "opencode.json").resolve()))
    return (
        f"OPENCODE_CONFIG={config} OPENCODE_DISABLE_MODELS_FETCH=1 opencode run Reply with OK  (OpenCode 1.x)\n"
        f"merge {shlex.quote(str((out / 'opencode-v2.json').resolve()))} into ~/.config/opencode/opencode.json  (OpenCode v2)"
    )

"""Coding-client qualification (api.md "Clients and tests"): the real Claude Code 2.1.296 (normal
and bare), Codex 0.162.1 (custom provider and `--oss` through Ollama discovery) and OpenCode
1.18.33 binaries, headless, configured only by `helios client-config`.

- On the real model: each client answers "Reply with exactly OK." and exits 0 (Claude Code's
  normal mode with its ~15k-token first request of 20 tools and its environment).
- On a scripted engine (the tiny core's real tokenizer, template, tool parser and protocol
  encoders; only the generated tokens are fixed per turn): each client inspects a file, edits it
  with its own edit tool (Codex: the freeform apply_patch), runs the tests with its shell tool,
  and answers; the repository's final state, the client's exit code, the test output in the
  client's transcript and in its follow-up request are checked. This proves every streamed
  event, tool call, tool result and follow-up request of the real binaries against helios.

Two ways to run it:
- in the project's suite (default): the pinned clients are installed once from npm into the
  flare cache (skipped, with the reason, only where npm cannot install them) and the test starts
  its own helios on the real default core and a scripted server on the tiny core;
- against an already running service, as api.md describes: FLARE_RUN_CLIENT_TESTS=1
  FLARE_API_TEST_URL=http://HOST:PORT [FLARE_API_TEST_KEY=KEY], with `claude` and `codex` (and
  optionally `opencode`) on PATH; only the real-model runs apply there.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.server.clients import (
    PINNED,
    ClientUnavailable,
    Run,
    client_config,
    git_repo,
    install,
    opencode_env,
    path_folder,
    run,
)
from tests.unit.scripted import ScriptedServer

EXTERNAL_URL = (os.environ.get("FLARE_API_TEST_URL") or "").rstrip("/")
EXTERNAL_KEY = os.environ.get("FLARE_API_TEST_KEY") or None
KEY_ENV = "FLARE_API_TEST_KEY"
PROMPT_OK = "Reply with exactly OK."
TASK = "calc.py has a bug. Read it, fix it, then run python3 test_calc.py to check."
BUG, FIX = "    return a - b\n", "    return a + b\n"
FILES = {
    "calc.py": "def add(a, b):\n" + BUG,
    "test_calc.py": "from calc import add\n\nassert add(2, 3) == 5, add(2, 3)\nprint('TESTS PASSED')\n",
}
TEST_COMMAND = "python3 test_calc.py"
FINAL = "Fixed add() in calc.py: it returns a + b now, and the tests pass."
PATCH = "*** Begin Patch\n*** Update File: calc.py\n@@\n-" + BUG + "+" + FIX + "*** End Patch"

Invocation = tuple[list[str], dict[str, str]]


def claude(bare: bool) -> Callable[..., Invocation]:
    def build(config: Path, url: str, model: str, prompt: list[str], task: bool) -> Invocation:
        extra = ["--allowedTools", "Bash", "--output-format", "stream-json", "--verbose"] if task else []
        return [
            "claude",
            *(["--bare"] if bare else []),
            "--settings",
            str(config / "settings.json"),
            *extra,
            "-p",
            " ".join(prompt),
        ], {}

    return build


def codex(oss: bool) -> Callable[..., Invocation]:
    def build(config: Path, url: str, model: str, prompt: list[str], task: bool) -> Invocation:
        argv = ["codex", "exec", "--skip-git-repo-check"]
        env = {"CODEX_HOME": str(config)}
        if oss:
            argv += ["--oss", "--local-provider", "ollama", "-m", model]
            env["CODEX_OSS_BASE_URL"] = url + "/v1"
        if task:
            argv += ["--dangerously-bypass-approvals-and-sandbox", "--json"]
        return [*argv, " ".join(prompt)], env

    return build


def opencode(config: Path, url: str, model: str, prompt: list[str], task: bool) -> Invocation:
    # One argv word per prompt word: a quoted multi-word argument reaches the model with its quotes.
    return ["opencode", "run", *(["--format", "json"] if task else []), *prompt], {
        "OPENCODE_CONFIG": str(config / "opencode.json"),
        **opencode_env(),
    }


# variant -> (the client-config name, the command that runs it)
VARIANTS: dict[str, tuple[str, Callable[..., Invocation]]] = {
    "claude-normal": ("claude-code", claude(bare=False)),
    "claude-bare": ("claude-code", claude(bare=True)),
    "codex": ("codex", codex(oss=False)),
    "codex-oss": ("codex", codex(oss=True)),
    "opencode": ("opencode", opencode),
}


@pytest.fixture(scope="module")
def bin_folder(tmp_path_factory) -> Path:
    """A folder with the clients' commands, for their PATH."""
    folder = tmp_path_factory.mktemp("client-bin")
    if EXTERNAL_URL:
        if os.environ.get("FLARE_RUN_CLIENT_TESTS") != "1":
            pytest.skip("FLARE_API_TEST_URL is set: the coding clients run only with FLARE_RUN_CLIENT_TESTS=1")
        found = {c.command: shutil.which(c.command) for c in PINNED}
        missing = [name for name in ("claude", "codex") if not found[name]]
        if missing:
            pytest.skip(f"not on PATH: {', '.join(missing)}")
        return path_folder({name: Path(path) for name, path in found.items() if path}, folder)
    try:
        return path_folder({c.command: install(c) for c in PINNED}, folder)
    except ClientUnavailable as exc:
        pytest.skip(f"the pinned coding clients cannot be installed here: {exc}")


def served_name(url: str, key: str | None) -> str:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.get(url + "/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]


def run_variant(
    variant: str,
    url: str,
    key: str | None,
    bin_folder: Path,
    work: Path,
    prompt: list[str],
    task: bool,
    extra_args: tuple[str, ...] = (),
    extra_env: dict[str, str] | None = None,
) -> Run:
    """`helios client-config`, then the client with that configuration (plus `extra_args` after
    its own, `extra_env` over its environment), in `work`."""
    client, build = VARIANTS[variant]
    command = variant.split("-")[0]
    if not (bin_folder / command).exists():
        pytest.skip(f"{variant}: `{command}` is not on PATH")
    key_env = KEY_ENV if key else None
    secret = {KEY_ENV: key} if key else {}
    config = client_config(client, url, work.parent / f"{variant}-config", key_env, env=secret)
    argv, env = build(config, url, served_name(url, key), prompt, task)
    return run(
        [*argv, *extra_args], work, work.parent / f"{variant}-home", bin_folder, {**env, **(extra_env or {}), **secret}
    )


# -- the real model ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_service(request) -> tuple[str, str | None]:
    if EXTERNAL_URL:
        return EXTERNAL_URL, EXTERNAL_KEY
    return request.getfixturevalue("default_server").url, None


@pytest.mark.e2e
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_each_client_answers_on_the_real_model(variant, real_service, bin_folder, tmp_path):
    url, key = real_service
    if variant == "codex-oss" and key:
        pytest.skip("codex --oss sends no key: it needs a service without authentication")
    work = git_repo(tmp_path / "work", {"README.md": "A scratch repository.\n"})
    result = run_variant(variant, url, key, bin_folder, work, PROMPT_OK.split(), task=False)
    assert result.returncode == 0, result.transcript[-4000:]
    assert "OK" in result.stdout, result.transcript[-4000:]


# -- a scripted agent task -------------------------------------------------------------------


class ScriptedAgent:
    """The model's side of inspect -> edit -> test -> answer, in each client's own tools.

    The turn is the number of tool results the client has sent back so far (each one renders
    as a <tool_response> in the prompt); requests without the agent's tools (OpenCode's title)
    get a short text."""

    def __init__(self, repo: Path):
        self.repo = repo
        self.prompts: list[str] = []

    def steps(self, prompt: str) -> list[tuple[str, dict]]:
        calc = str(self.repo / "calc.py")
        if '"name": "exec_command"' in prompt:  # Codex
            return [
                ("exec_command", {"cmd": "cat calc.py"}),
                ("apply_patch", {"input": PATCH}),
                ("exec_command", {"cmd": TEST_COMMAND}),
            ]
        if '"name": "Read"' in prompt:  # Claude Code
            return [
                ("Read", {"file_path": calc}),
                ("Edit", {"file_path": calc, "old_string": BUG, "new_string": FIX}),
                ("Bash", {"command": TEST_COMMAND, "description": "Run the tests"}),
            ]
        if '"name": "read"' in prompt:  # OpenCode
            return [
                ("read", {"filePath": calc}),
                ("edit", {"filePath": calc, "oldString": BUG, "newString": FIX}),
                ("bash", {"command": TEST_COMMAND}),
            ]
        return []

    def answer(self, prompt: str) -> list[str]:
        self.prompts.append(prompt)
        steps = self.steps(prompt)
        if not steps:
            return ["Fix calc.py"]
        done = prompt.count("<tool_response>")
        if done < len(steps):
            name, arguments = steps[done]
            return ["<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"]
        return [FINAL]


@pytest.fixture(scope="module")
def scripted(tiny_core):
    server = ScriptedServer(tiny_core)
    yield server
    server.stop()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_each_client_inspects_edits_and_tests_a_repository(variant, scripted, bin_folder, tmp_path):
    if EXTERNAL_URL:
        pytest.skip("the scripted engine runs inside the project's suite, not against an external service")
    repo = git_repo(tmp_path / "repo", FILES)
    agent = ScriptedAgent(repo)
    scripted.engine.script = agent.answer
    result = run_variant(variant, scripted.url, None, bin_folder, repo, TASK.split(), task=True)
    assert result.returncode == 0, result.transcript[-4000:]
    assert (repo / "calc.py").read_text() == FILES["calc.py"].replace(BUG, FIX), result.transcript[-4000:]
    assert any("TESTS PASSED" in prompt for prompt in agent.prompts), "the test run's output never came back"
    assert "TESTS PASSED" in result.stdout, result.transcript[-4000:]  # the test run, in the transcript
    assert FINAL in result.stdout
    if variant.startswith("claude"):
        for prompt in agent.prompts:
            # its environment rides in the user's turn, not in a system turn after it
            assert prompt.count("<|im_start|>system") == 1
            if variant == "claude-normal":  # (bare mode states its short environment up front)
                # the ~12k-token preamble (system prompt + tools) names no project, in Claude
                # Code's spelling of a project folder either: every project shares its prefix
                preamble = prompt[: prompt.index("<|im_start|>user")]
                assert str(repo) not in preamble and re.sub(r"[^A-Za-z0-9]", "-", str(repo)) not in preamble


@pytest.fixture(scope="module")
def scripted_keyed(tiny_core):
    from helios.transport.config import ServerConfig

    server = ScriptedServer(tiny_core, ServerConfig(port=0, api_key="client-test-key"))
    yield server
    server.stop()


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v != "codex-oss"])
def test_each_client_authenticates_with_the_key_by_reference(variant, scripted_keyed, bin_folder, tmp_path):
    """A keyed helios: the configuration names the key's environment variable (Codex env_key,
    Claude Code apiKeyHelper, OpenCode {env:...}); the client reads it at run time."""
    if EXTERNAL_URL:
        pytest.skip("the scripted engine runs inside the project's suite, not against an external service")
    scripted_keyed.say("OK")
    work = git_repo(tmp_path / "work", {"README.md": "A scratch repository.\n"})
    result = run_variant(
        variant, scripted_keyed.url, "client-test-key", bin_folder, work, PROMPT_OK.split(), task=False
    )
    assert result.returncode == 0, result.transcript[-4000:]
    assert "OK" in result.stdout, result.transcript[-4000:]

"""The pinned coding clients (api.md "Clients and tests"), installed once from npm into the flare
cache, never into the repository, and run headless against a helios.

Each client is a native binary inside an npm platform package; it is run directly, with
standard input closed (Codex and OpenCode wait on an open pipe), an isolated HOME, and only the
configuration `helios client-config` writes plus the flags a headless run needs.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from helios.cache_dir import cache_root

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Client:
    command: str  # the executable's name on PATH
    package: str
    version: str
    binary: str  # inside the install folder: the linux-x64 platform package's native binary

    @property
    def folder(self) -> Path:
        return cache_root() / "clients" / f"{self.package.rsplit('/', 1)[-1]}-{self.version}"


CLAUDE = Client(
    "claude", "@anthropic-ai/claude-code", "2.1.296", "node_modules/@anthropic-ai/claude-code-linux-x64/claude"
)
CODEX = Client(
    "codex",
    "@openai/codex",
    "0.162.1",
    "node_modules/@openai/codex-linux-x64/vendor/x86_64-unknown-linux-musl/bin/codex",
)
OPENCODE = Client("opencode", "opencode-ai", "1.18.33", "node_modules/opencode-linux-x64/bin/opencode")
PINNED = (CLAUDE, CODEX, OPENCODE)


class ClientUnavailable(RuntimeError):
    """The client cannot be installed here (no npm, no registry, another platform)."""


def install(client: Client) -> Path:
    """The client's binary, installed from npm on first use."""
    binary = client.folder / client.binary
    if binary.is_file():
        return binary
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise ClientUnavailable(
            f"{client.package} is pinned for linux-x64, not {platform.system()} {platform.machine()}"
        )
    npm = shutil.which("npm")
    if npm is None:
        raise ClientUnavailable("npm is not installed")
    client.folder.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        [
            npm,
            "install",
            "--prefix",
            str(client.folder),
            "--no-audit",
            "--no-fund",
            "--save-exact",
            f"{client.package}@{client.version}",
        ],
        capture_output=True,
        text=True,
        timeout=900,
        stdin=subprocess.DEVNULL,
    )
    if done.returncode != 0 or not binary.is_file():
        raise ClientUnavailable(
            f"npm could not install {client.package}@{client.version}: {done.stderr.strip()[-600:]}"
        )
    return binary


def path_folder(binaries: dict[str, Path], folder: Path) -> Path:
    """A folder of links named as the clients' commands, for the clients' PATH."""
    folder.mkdir(parents=True, exist_ok=True)
    for command, binary in binaries.items():
        link = folder / command
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(binary)
    return folder


def client_config(
    client: str, url: str, out: Path, key_env: str | None = None, env: dict[str, str] | None = None
) -> Path:
    """`helios client-config CLIENT --url URL --out OUT`, the real command."""
    argv = [sys.executable, "-m", "helios.cli", "client-config", client, "--url", url, "--out", str(out)]
    if key_env:
        argv += ["--api-key-env", key_env]
    done = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=60, env={**os.environ, **(env or {})})
    assert done.returncode == 0, done.stdout + done.stderr
    return out


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str

    @property
    def transcript(self) -> str:
        return self.stdout + self.stderr


def run(
    argv: list[str], cwd: Path, home: Path, bin_folder: Path, env: dict[str, str] | None = None, timeout: float = 600
) -> Run:
    """One headless client run: stdin closed, its own HOME, PATH = the clients + the system's."""
    home.mkdir(parents=True, exist_ok=True)
    base = {"PATH": f"{bin_folder}:/usr/local/bin:/usr/bin:/bin", "HOME": str(home), "TERM": "dumb", "LANG": "C.UTF-8"}
    try:
        done = subprocess.run(
            argv,
            cwd=cwd,
            env={**base, **(env or {})},
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as exc:
        return Run(124, _text(exc.stdout), _text(exc.stderr) + f"\n[timed out after {timeout}s]")
    return Run(done.returncode, done.stdout, done.stderr)


def _text(data: bytes | str | None) -> str:
    if data is None:
        return ""
    return data if isinstance(data, str) else data.decode(errors="replace")


def opencode_env() -> dict[str, str]:
    """OpenCode 1.18.33 fetches the models.dev catalog and npm-installs a plugin package in the
    background on every start: the config describes the model fully, and npm gets a closed port."""
    return {
        "OPENCODE_DISABLE_MODELS_FETCH": "1",
        "OPENCODE_DISABLE_AUTOUPDATE": "1",
        "npm_config_registry": "http://127.0.0.1:9/",
    }


def git_repo(folder: Path, files: dict[str, str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text)
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@example.com",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@example.com",
    }
    for argv in (["git", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-qm", "start"]):
        subprocess.run(argv, cwd=folder, check=True, env=env, capture_output=True)
    return folder

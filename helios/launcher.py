"""A real `helios serve` (or `helios cluster serve`) process on a free loopback port, returned once
it answers: what the tests, the benchmark scripts and anything else that drives helios from outside
start. The process runs in its own session so stopping it also stops whatever it started."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import httpx


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(process: subprocess.Popen, url: str, timeout: float, ready: Callable[[], bool] = lambda: True) -> bool:
    """Poll `url`/health until it answers 200 and `ready()` holds (True), or `timeout` passes
    (False); RuntimeError when the process exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200 and ready():
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    return False


class HeliosProcess:
    """`helios serve CORE --port P ARGS...` in a subprocess, healthy when the constructor returns
    (`command` picks another helios command that serves)."""

    command: tuple[str, ...] = ("serve",)
    stop_timeout = 15.0  # after SIGTERM, before SIGKILL to the whole process group

    def __init__(
        self,
        core: Path | str,
        *args: str,
        timeout: float = 300.0,
        cwd: Path | None = None,
        env: Mapping[str, str] | None = None,
    ):
        """`env`: variables set for the process beside this one's environment."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # An anonymous file: the log is read on failure and never left beside the core (which may
        # sit in the shared flare cache).
        self.log = tempfile.TemporaryFile("w+")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "helios.cli", *self.command, str(core), "--port", str(self.port), *args],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            env={**os.environ, **env} if env else None,
            start_new_session=True,
        )
        try:
            healthy = wait_healthy(self.process, self.url, timeout, self.ready)
        except RuntimeError as exc:
            raise RuntimeError(f"helios: {exc}:\n{self.output()}") from None
        except BaseException:  # Ctrl-C while waiting: its own session never saw the signal
            self.stop()
            raise
        if not healthy:
            self.stop()
            raise RuntimeError(f"helios did not become healthy in {timeout}s:\n{self.output()}")

    def ready(self) -> bool:
        """Past a 200 from /health, what else serving needs (a cluster: all its replicas)."""
        return True

    def output(self, keep: int = 5000) -> str:
        """What the process printed: its first and last `keep` characters (the start-up lines,
        and the latest ones, between which an access log can write a lot)."""
        self.log.seek(0)
        text = self.log.read()
        if len(text) <= 2 * keep:
            return text
        return f"{text[:keep]}\n[...]\n{text[-keep:]}"

    def stop(self) -> int | None:
        """SIGTERM (a graceful drain), then SIGKILL to the process group; returns the exit code."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
        self.log.close()
        return self.process.returncode


class ClusterProcess(HeliosProcess):
    """`helios cluster serve CORE --port P --replicas N ARGS...`, ready once N replicas report
    healthy."""

    command = ("cluster", "serve")
    stop_timeout = 90.0  # the drain, then Ray's shutdown

    def __init__(self, core: Path, *args: str, replicas: int = 2, **kwargs):
        self.expected = replicas
        super().__init__(core, "--replicas", str(replicas), *args, **kwargs)

    def ready(self) -> bool:
        return len(self.replicas()) == self.expected

    def metrics(self) -> dict:
        return httpx.get(self.url + "/metrics?format=json", timeout=10).json()

    def replicas(self) -> list[dict]:
        return [r for r in self.metrics().get("replicas", []) if r["healthy"]]

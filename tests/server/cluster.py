"""A real `helios cluster serve` process for tests and scripts/cluster_bench.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.conftest import REPO, free_port


class Cluster:
    """A real `helios cluster serve CORE --replicas N ARGS...` on a loopback port, healthy once
    every replica reports in."""

    def __init__(self, core: Path, folder: Path, *args: str, replicas: int = 2, timeout: float = 300.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(folder / f"cluster-{self.port}.log", "w+")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "helios.cli", "cluster", "serve", str(core), "--replicas", str(replicas),
             "--port", str(self.port), *args],
            stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"helios cluster exited with {self.process.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200 and len(self.replicas()) == replicas:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"the cluster did not become healthy in {timeout}s:\n{self.output()}")

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()[-6000:]

    def metrics(self) -> dict:
        return httpx.get(self.url + "/metrics?format=json", timeout=10).json()

    def replicas(self) -> list[dict]:
        return [r for r in self.metrics().get("replicas", []) if r["healthy"]]

    def stop(self) -> int | None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
        self.log.close()
        return self.process.returncode

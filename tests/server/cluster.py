"""A real `helios cluster serve` process for tests and scripts/cluster_bench.py."""

from __future__ import annotations

import httpx

from tests.conftest import Server


class Cluster(Server):
    """`helios cluster serve CORE --port P ARGS...` (give `--replicas N` in ARGS when not 2),
    ready once that many replicas report healthy."""

    command = ("cluster", "serve")
    stop_timeout = 90.0  # the drain, then Ray's shutdown

    def __init__(self, core, *args: str, replicas: int = 2, **kwargs):
        self.expected = replicas
        super().__init__(core, "--replicas", str(replicas), *args, **kwargs)

    def ready(self) -> bool:
        return len(self.replicas()) == self.expected

    def metrics(self) -> dict:
        return httpx.get(self.url + "/metrics?format=json", timeout=10).json()

    def replicas(self) -> list[dict]:
        return [r for r in self.metrics().get("replicas", []) if r["healthy"]]

"""The cluster's frontend: helios' own aiohttp application, bound by a Ray Serve deployment, over
a ClusterEngine; plus the per-replica /metrics families.

Every route, its auth, limits and error shapes are `helios.app.create_app`'s: the cluster path
adds no protocol code. docs/architecture.md "Scale-out" says why the frontend binds the endpoint
itself rather than sitting behind Ray Serve's ASGI proxy.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from helios.app import CTX_KEY, create_app
from helios.cluster.affinity import DECISIONS
from helios.cluster.engine import ClusterEngine
from helios.cluster.spec import ClusterSpec
from helios.manifest import Manifest
from helios.transport import lifecycle, logs


class Frontend:
    async def __init__(self, spec: ClusterSpec, engines: Any):  # engines: DeploymentHandle of EngineReplica
        self.spec = spec
        self.runner: web.AppRunner | None = None
        # This actor's own process: its records (the access log) go to Ray's log for it.
        logs.configure(spec.settings.log_level, spec.settings.log_format)
        manifest = Manifest.load(spec.core)
        self.engine = ClusterEngine(engines)
        await self.engine.start()
        app = create_app(manifest, spec.core, self.engine, spec.settings, (ReplicaCollector(self.engine),))
        self.ctx = app[CTX_KEY]
        self.runner, self.bound = await lifecycle.listen(app, spec.settings)

    def address(self) -> str:
        """Where the endpoint listens (`helios cluster serve` prints it)."""
        return self.bound

    async def drain(self) -> None:
        """/health turns 503 and new work is refused; in-flight requests finish (to the deadline)."""
        await lifecycle.drain(self.ctx, self.spec.settings.drain_timeout_s)

    def check_health(self) -> None:
        if self.runner is None:
            raise RuntimeError("the frontend is not listening")

    async def __del__(self) -> None:
        if self.runner is not None:
            runner, self.runner = self.runner, None
            await runner.cleanup()


class ReplicaCollector:
    """Per-replica families (label `replica`: Ray's replica id) and the router's decisions."""

    def __init__(self, engine: ClusterEngine):
        self.engine = engine

    def rows(self) -> list[dict[str, Any]]:
        router = self.engine.router
        routed = router.requests_by_replica if router is not None else {}
        inflight = router.inflight if router is not None else {}
        rows = []
        for replica, info in sorted(self.engine.replica_stats().items()):
            s = info.get("stats")
            rows.append(
                {
                    "replica": replica,
                    "label": info.get("label", ""),
                    "healthy": bool(info.get("healthy", False)),
                    "routed": routed.get(replica, 0),
                    "inflight": inflight.get(replica, 0),
                    "active": s.active if s else 0,
                    "pending": s.pending if s else 0,
                    "free_pages": s.free_pages if s else 0,
                    "prefill_tokens": s.prefill_tokens_total if s else 0,
                    "generated_tokens": s.generated_tokens_total if s else 0,
                    "reused_tokens": s.reused_tokens_total if s else 0,
                }
            )
        return rows

    def collect(self) -> Iterator[Any]:
        rows = self.rows()
        gauges = [
            ("healthy", "Whether the replica's engine is alive (1) or not (0)"),
            ("inflight", "Requests this frontend has in flight on the replica"),
            ("active", "Active sequences on the replica"),
            ("pending", "Requests waiting on the replica"),
            ("free_pages", "Free KV pages on the replica"),
        ]
        for field, doc in gauges:
            family = GaugeMetricFamily(f"flare_replica_{field}", doc, labels=["replica"])
            for row in rows:
                family.add_metric([row["replica"]], float(row[field]))
            yield family
        counters = [
            ("routed", "Requests routed to the replica"),
            ("prefill_tokens", "Prompt tokens the replica prefilled"),
            ("generated_tokens", "Tokens the replica generated"),
            ("reused_tokens", "Prompt tokens the replica restored from prefix checkpoints"),
        ]
        for field, doc in counters:
            family = CounterMetricFamily(f"flare_replica_{field}", doc, labels=["replica"])
            for row in rows:
                family.add_metric([row["replica"]], row[field])
            yield family
        yield GaugeMetricFamily("flare_cluster_replicas", "Engine replicas Ray Serve lists as running", value=len(rows))
        router = self.engine.router
        decisions = CounterMetricFamily(
            "flare_cluster_routing_decisions_total", "Requests by what chose their replica", labels=["decision"]
        )
        for decision in DECISIONS:
            decisions.add_metric([decision], router.decisions.get(decision, 0) if router is not None else 0)
        yield decisions
        yield CounterMetricFamily(
            "flare_cluster_replica_failures_total",
            "Requests ended because their replica failed or died",
            value=self.engine.replica_failures,
        )

    def json_fields(self) -> dict[str, Any]:
        router = self.engine.router
        return {
            "replicas": self.rows(),
            "routing": {d: router.decisions.get(d, 0) if router is not None else 0 for d in DECISIONS},
            "replica_failures": self.engine.replica_failures,
        }

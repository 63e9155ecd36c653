"""The Ray Serve request router for engine replicas: prefix affinity over live replicas.

Ray Serve calls `choose_replicas` with the replicas it considers running (a replica being
stopped is already gone from them); this router drops those whose last routing stats say
unhealthy, asks the `AffinityTable` for a ranking and records where each request went. Loads are this router's own in-flight counts (it sees every
request its frontend sends). The frontend reads each replica's stats through `replica_stats`,
which Ray delivers with the routing information.

Ray Serve ships this module to the router by value (cloudpickle), so it holds no state of its
own: the registry the frontend reads is helios.cluster.affinity.ROUTERS, reached through its
module (a module is pickled by reference; a global dict would be copied).
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from helios.cluster import affinity
from helios.cluster.affinity import AffinityTable, RouteKey

MAX_PENDING_DECISIONS = 4096


class PrefixAffinityRouter(RequestRouter):
    def initialize_state(self, policy: str = "affinity", capacity: int = 8) -> None:
        self.policy = policy  # "affinity", or "power-of-two" (Ray Serve's default, for comparison)
        self.table = AffinityTable(capacity=capacity)
        self.inflight: Counter[str] = Counter()
        self.decisions: Counter[str] = Counter()
        self.requests_by_replica: Counter[str] = Counter()
        # Each routed request's decision from choose_replicas until on_request_routed reads it
        # (by Ray's request id; bounded, since a request cancelled before routing never comes back).
        self.pending_decisions: dict[str, str] = {}
        affinity.ROUTERS[self._deployment_id.name] = self  # through the module: see above

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        candidates = [r for r in candidate_replicas if (r.routing_stats or {}).get("healthy", True)]
        if not candidates:
            return []
        if self.policy != "affinity":
            return _power_of_two(candidates)
        by_id = {r.replica_id.unique_id: r for r in candidates}
        choice = self.table.choose(list(by_id), dict(self.inflight), _route_of(pending_request))
        if pending_request is not None:
            self.pending_decisions[pending_request.metadata.internal_request_id] = choice.decision
            if len(self.pending_decisions) > MAX_PENDING_DECISIONS:
                self.pending_decisions.pop(next(iter(self.pending_decisions)))
        return [[by_id[r] for r in rank] for rank in choice.ranks]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        replica = replica_id.unique_id
        self.inflight[replica] += 1
        self.requests_by_replica[replica] += 1
        decision = self.pending_decisions.pop(pending_request.metadata.internal_request_id, "default")
        self.decisions[decision] += 1
        if self.policy == "affinity":
            self.table.record(_route_of(pending_request), replica)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        replica = replica_id.unique_id
        if self.inflight[replica] > 0:
            self.inflight[replica] -= 1

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id.unique_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        before = {r.unique_id for r in self._replica_id_set}
        super().update_replicas(replicas)
        for gone in before - {r.unique_id for r in self._replica_id_set}:
            self._forget(gone)

    def replica_stats(self) -> dict[str, dict[str, Any]]:
        """The latest routing stats of every replica Ray lists as running, by replica id."""
        return {r.replica_id.unique_id: dict(r.routing_stats or {}) for r in list(self._replicas.values())}

    def _forget(self, replica: str) -> None:
        self.table.forget(replica)
        self.inflight.pop(replica, None)


def _route_of(pending_request: PendingRequest | None) -> RouteKey | None:
    if pending_request is None:
        return None
    route = pending_request.kwargs.get("route")
    return route if isinstance(route, RouteKey) else None


def _power_of_two(candidates: list[RunningReplica]) -> list[list[RunningReplica]]:
    """Ray Serve's default policy: two random replicas, the shorter queue wins (Ray probes them)."""
    return [random.sample(candidates, min(2, len(candidates)))]

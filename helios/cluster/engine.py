"""The engine interface of helios' frontend (submit, abort, stats, health) over Ray Serve handles.

The frontend's protocol codecs and request lifecycle run unchanged over a `ClusterEngine`: each
submitted request is checked here (a bad one is the same 400 as on one machine), routed to a
replica by its `RouteKey`, and its events are fed to the lifecycle's sink. A replica that dies
or fails mid-request ends the request with a retryable abort, which the protocol's own encoder
turns into its error shape (a 503, or its SSE error event under a started stream).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

from helios.cluster.affinity import ROUTERS, route_key
from helios.cluster.spec import ENGINES
from helios.engine.api import EngineStats, FinishReason, GenerationEvent, GenerationRequest, Sink
from helios.engine.host_store import HostStoreStats
from helios.engine.validation import RequestCheck

log = logging.getLogger("helios.cluster")

REPLICA_FAILED = "the engine replica serving this request stopped ({}); retry the request"
NO_REPLICA = "no engine replica is available right now; retry the request"
ROUTER_WAIT_S = 60.0


class ClusterEngine:
    def __init__(self, handle: Any):  # a DeploymentHandle of EngineReplica
        self.handle = handle
        self.check: RequestCheck | None = None
        self._tasks: dict[str, asyncio.Task] = {}
        self.replica_failures = 0

    async def start(self) -> None:
        """Wait for a replica (and with it this process's router), then take its request check."""
        self.check = await self.handle.request_check.remote()
        deadline = asyncio.get_running_loop().time() + ROUTER_WAIT_S
        while ENGINES not in ROUTERS and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)

    @property
    def router(self) -> Any:  # helios.cluster.router.PrefixAffinityRouter, once a request made it
        return ROUTERS.get(ENGINES)

    # -- the Engine interface the server uses -------------------------------------------------------

    def submit(self, request: GenerationRequest, sink: Sink) -> None:
        assert self.check is not None, "ClusterEngine.start() first"
        self.check(request)
        if request.request_id in self._tasks:
            raise ValueError(f"request id {request.request_id!r} is already active")
        self._tasks[request.request_id] = asyncio.get_running_loop().create_task(self._run(request, sink))

    def abort(self, request_id: str, reason: str | None = None) -> bool:
        task = self._tasks.get(request_id)
        if task is None:
            return False
        task.cancel(reason)
        return True

    def abort_all(self, reason: str) -> int:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel(reason)
        return len(tasks)

    def num_pending(self) -> int:
        """What the frontend's queue bound ([server] queue_size, per engine) is held against: the
        shortest replica queue, so a request is refused only when every replica's queue is full
        (the router spills to a replica with room)."""
        queues = [s["stats"].pending for s in self.replica_stats().values() if s.get("healthy") and "stats" in s]
        return min(queues, default=0)

    def healthy(self) -> bool:
        return any(s.get("healthy", False) for s in self.replica_stats().values())

    def stats(self) -> EngineStats:
        return sum_stats([s["stats"] for s in self.replica_stats().values() if "stats" in s])

    def replica_stats(self) -> dict[str, dict[str, Any]]:
        router = self.router
        return router.replica_stats() if router is not None else {}

    # -- one request --------------------------------------------------------------------------------

    async def _run(self, request: GenerationRequest, sink: Sink) -> None:
        finished, stream = False, None
        try:
            if self.router is not None and not self.healthy():  # Ray would hold it until one returns
                sink(_final(request, FinishReason.ABORT, NO_REPLICA))
                return
            stream = self.handle.options(stream=True).generate.remote(request, route=route_key(request))
            async for batch in stream:
                for event in batch:
                    sink(event)
                    finished = finished or event.finished
                if finished:
                    return
            raise RuntimeError("its stream ended before the request finished")
        except asyncio.CancelledError as cancel:
            if stream is not None:
                stream.cancel()  # the replica's generator aborts its engine request
            reason = cancel.args[0] if cancel.args else None
            sink(_final(request, FinishReason.ABORT, reason))
        except Exception as exc:
            self.replica_failures += 1
            log.warning("request %s failed on its replica: %s", request.request_id, exc)
            sink(_final(request, FinishReason.ABORT, REPLICA_FAILED.format(type(exc).__name__)))
        finally:
            self._tasks.pop(request.request_id, None)


def _final(request: GenerationRequest, reason: FinishReason, error: str | None) -> GenerationEvent:
    return GenerationEvent(
        request_id=request.request_id,
        token_ids=[],
        text="",
        finished=True,
        finish_reason=reason,
        error=error,
        prompt_tokens=len(request.prompt_token_ids),
    )


def sum_stats(snapshots: list[EngineStats]) -> EngineStats:
    """The cluster's stats: counters and gauges summed over replicas (dicts by key), flags or-ed,
    the pool's dtype as every replica's."""
    total = EngineStats(
        active=0,
        pending=0,
        free_pages=0,
        total_pages=0,
        page_tokens=0,
        prefill_tokens_total=0,
        generated_tokens_total=0,
        completed_total=0,
        cancelled_total=0,
        failed_total=0,
        steps_total=0,
        admitted_total=0,
        preempted_total=0,
        step_seconds_total=0.0,
        schedule_seconds_total=0.0,
    )
    for s in snapshots:
        _add_into(total, s)
        total.page_tokens = s.page_tokens
        total.kv_pool_dtype = s.kv_pool_dtype  # every replica serves the same core and settings
        if s.host_store is not None:
            if total.host_store is None:
                total.host_store = HostStoreStats()
            _add_into(total.host_store, s.host_store)
    return total


def _add_into(total: Any, part: Any) -> None:
    for f in dataclasses.fields(part):
        value, mine = getattr(part, f.name), getattr(total, f.name)
        if isinstance(value, bool):
            setattr(total, f.name, mine or value)
        elif isinstance(value, (int, float)):
            setattr(total, f.name, mine + value)
        elif isinstance(value, dict):
            setattr(total, f.name, _add_dicts(mine, value))


def _add_dicts(mine: dict, value: dict) -> dict:
    out = dict(mine)
    for key, item in value.items():
        if isinstance(item, (int, float)):
            out[key] = out.get(key, 0) + item
        elif isinstance(item, tuple) and len(item) == 2:  # a histogram: (cumulative buckets, sum)
            buckets, total = out.get(key, ([], 0.0))
            counts = dict(buckets)
            merged = [(le, counts.get(le, 0) + n) for le, n in item[0]]
            out[key] = (merged, total + item[1])
    return out

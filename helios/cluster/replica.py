"""One engine replica: an ordinary helios Engine over the core, reached through a Ray Serve handle.

It speaks the engine's plain data (GenerationRequest in, GenerationEvent lists out), never HTTP:
the frontend's protocol codecs stay in one place. Ray Serve restarts it when `check_health`
raises (the router skips it as soon as its routing stats say unhealthy), and on scale-down stops
routing to it and waits for its in-flight requests (graceful_shutdown_timeout_s, the drain
deadline) before `__del__` stops the engine.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import AsyncIterator
from typing import Any

from helios.cluster.spec import ClusterSpec
from helios.engine.api import GenerationEvent, GenerationRequest
from helios.engine.assembly import choose_runner
from helios.engine.engine import Engine
from helios.engine.validation import RequestCheck
from helios.manifest import Manifest

DRAIN_MESSAGE = "this replica is shutting down; retry the request"


class EngineReplica:
    def __init__(self, spec: ClusterSpec):
        settings = spec.settings
        manifest = Manifest.load(spec.core)
        self.engine = Engine(
            spec.core,
            manifest,
            max_concurrency=settings.max_concurrency,
            kv_pages=spec.kv_pages,
            threads=spec.replica_threads,
            prefix_cache=settings.prefix_cache_config(),
            host_store=settings.host_store_config(),
            speculation=settings.speculation_config(),
            choice=choose_runner(manifest, kv_dtype=settings.kv_dtype),
        )
        self.engine.start()
        self.label = f"{socket.gethostname()}:{os.getpid()}"

    async def generate(self, request: GenerationRequest, route: Any = None) -> AsyncIterator[list[GenerationEvent]]:
        """The request's events in batches, until its final event. `route` is for the router only.
        A cancelled call (the client left, or the frontend aborted it) aborts the engine request."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[GenerationEvent] = asyncio.Queue()
        self.engine.submit(request, lambda event: loop.call_soon_threadsafe(queue.put_nowait, event))
        finished = False
        try:
            while not finished:
                batch = [await queue.get()]
                while not queue.empty():
                    batch.append(queue.get_nowait())
                finished = batch[-1].finished
                yield batch
        finally:
            if not finished:
                self.engine.abort(request.request_id)

    def request_check(self) -> RequestCheck:
        return self.engine.check

    def check_health(self) -> None:
        if not self.engine.healthy():
            raise RuntimeError("the engine's step loop stopped")

    def record_routing_stats(self) -> dict[str, Any]:
        return {"healthy": self.engine.healthy(), "label": self.label, "stats": self.engine.stats()}

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)  # unset when __init__ failed before making it
        if engine is not None:
            engine.abort_all(DRAIN_MESSAGE)  # Ray already waited for in-flight requests
            engine.shutdown()

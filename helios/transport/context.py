"""What every protocol handler serves from: the loaded core, its frontend, the engine, limits.

Built once by `create_app`; protocol modules receive it instead of reaching into the app.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from aiohttp import web

from helios.engine.api import GenerationRequest, ServingEngine
from helios.manifest import Manifest
from helios.neutral.errors import RequestError
from helios.neutral.template import ChatTemplate
from helios.neutral.tokenizer import Tokenizer
from helios.transport import bodies
from helios.transport.admission import RETRY_AFTER_SECONDS, Admission, GenerationGroup, Reservation
from helios.transport.config import ServerConfig
from helios.transport.errors import ApiError, bad_request, unavailable
from helios.transport.logs import bind_request_id, client_request_id
from helios.transport.metrics import HttpStats

T = TypeVar("T")

INLINE_BODY_BYTES = 64 << 10
DRAINING_MESSAGE = "the server is draining: it finishes in-flight requests and takes no new ones; retry"
MAX_BODY_REST_S = 1.0


def _then_rest(worker: ThreadPoolExecutor, fn: Callable[..., T], *args: Any) -> T:
    """fn(*args) on the body worker, which then rests as long as fn took before its next body,
    so big bodies hold the GIL at most about half the time, whoever sends them (queued from the
    worker itself: a client that leaves cannot skip it)."""
    started = time.perf_counter()
    try:
        return fn(*args)
    finally:
        try:
            worker.submit(time.sleep, min(time.perf_counter() - started, MAX_BODY_REST_S))
        except RuntimeError:  # shutting down
            pass


@dataclass
class ServerContext:
    manifest: Manifest
    core_dir: Path
    tokenizer: Tokenizer
    template: ChatTemplate | None
    engine: ServingEngine
    config: ServerConfig
    admission: Admission
    http: HttpStats
    executor: ThreadPoolExecutor
    # Decoding of compressed and large bodies, one at a time: a burst of hostile bodies queues
    # here instead of filling `executor`, which every request's templating needs.
    body_executor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=1, thread_name_prefix="helios-bodies")
    )
    created: int = field(default_factory=lambda: int(time.time()))  # discovery init time
    draining: bool = False  # SIGTERM received: /health is 503 and no new generation is admitted

    @property
    def model_id(self) -> str:
        """The name every response reports: the first --served-model-name, else the core's."""
        names = self.config.served_model_names
        return names[0] if names else self.manifest.model_id

    @property
    def model_names(self) -> list[str]:
        """Every name the model answers to on /v1/models/{id} and /api/show (the card and
        /api/tags list the first, as api.md has one card)."""
        return list(self.config.served_model_names) or [self.manifest.model_id]

    @property
    def max_concurrency(self) -> int:
        return self.config.max_concurrency or self.manifest.limits.max_concurrency

    async def in_frontend(self, fn: Callable[..., T], *args: Any, executor: ThreadPoolExecutor | None = None) -> T:
        """Run CPU work (templating, tokenization) in the bounded worker pool.

        RequestError raised there becomes a 400 here.
        """
        # In this request's context, so records logged there carry its request id.
        work = functools.partial(contextvars.copy_context().run, fn, *args)
        try:
            return await asyncio.get_running_loop().run_in_executor(executor or self.executor, work)
        except RequestError as exc:
            raise ApiError.from_request_error(exc) from None

    @property
    def json_limits(self) -> bodies.JsonLimits:
        return self.config.json_limits(self.manifest.limits.context_length)

    async def read_json_object(self, request: web.Request) -> dict[str, Any]:
        encodings = bodies.content_encodings(request.headers.get("Content-Encoding"))
        limit = self.config.max_body_bytes
        raw = await bodies.read_encoded(request, limit, self.config.body_timeout_s)
        if not encodings and len(raw) <= INLINE_BODY_BYTES:
            # Small plain bodies parse in well under a millisecond: no queueing behind big ones.
            body = bodies.parse_json(raw, self.json_limits)
        else:
            body = await self.in_frontend(
                _then_rest,
                self.body_executor,
                bodies.decode_json,
                raw,
                encodings,
                limit,
                self.json_limits,
                executor=self.body_executor,
            )
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        return body

    def reserve(self, count: int) -> Reservation:
        if self.draining:
            raise unavailable(DRAINING_MESSAGE, RETRY_AFTER_SECONDS)
        pending = self.engine.num_pending() if self.admission.queue_size is not None else 0
        try:
            return self.admission.reserve(count, pending)
        except ApiError as exc:
            if exc.status == 429:
                self.http.rejected_rate_limited += 1
            raise

    def start_group(self, requests: list[GenerationRequest], reservation: Reservation | None) -> GenerationGroup:
        if self.config.queue_timeout_s and requests:
            # The first child only: once it runs, its siblings wait behind their own group, not
            # behind overload (a group larger than the batch is admitted in waves).
            requests[0].queue_deadline = time.monotonic() + self.config.queue_timeout_s
        group = GenerationGroup(self.engine, requests, reservation, self.http.first_response)
        group.submit()
        return group


def response_headers(request: web.Request, response_id: str) -> dict[str, str]:
    """x-request-id for a request that reached model submission: the client's own id when it
    sent a sane one (so it can correlate logs), else the response id. From here on the
    request's log records carry that id."""
    request_id = client_request_id(request.headers) or response_id
    bind_request_id(request_id)
    return {"x-request-id": request_id}


def new_response_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"

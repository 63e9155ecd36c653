"""HTTP admission slots and the bridge from engine-thread events to asyncio.

Each generated choice holds one slot from validation until its engine request has drained and
its response has been delivered (or the client left). Every child of a group is validated before
anything is submitted; a group larger than all slots is a 400, a temporary shortage a 429.

The engine calls each request's sink from its own thread; `GenerationGroup` moves events onto
the event loop with call_soon_threadsafe and hands them out in arrival order.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Protocol

from helios.engine.api import FinishReason, GenerationEvent, GenerationRequest, ServingEngine
from helios.neutral.errors import RequestError
from helios.transport.errors import ApiError, bad_request, rate_limited, server_error, unavailable

log = logging.getLogger("helios.server")

# What 429/503 answers suggest in Retry-After: overload clears as running requests finish.
RETRY_AFTER_SECONDS = 2


class Admission:
    """A counter of HTTP admission slots (one per generated choice)."""

    def __init__(self, slots: int, queue_size: int | None = None):
        self.slots = slots
        self.queue_size = queue_size  # bound on engine-pending requests; None: unbounded
        self.used = 0

    def reserve(self, count: int, pending_in_engine: int = 0) -> Reservation:
        if count > self.slots:
            raise bad_request(
                f"the request needs {count} admission slots (one per generated choice); this server has {self.slots}"
            )
        if self.used + count > self.slots:
            raise rate_limited(f"all {self.slots} admission slots are busy; retry shortly", RETRY_AFTER_SECONDS)
        # A group arriving at an empty queue always fits (slots bound it), so no n is refused forever.
        if self.queue_size is not None and pending_in_engine and pending_in_engine + count > self.queue_size:
            raise unavailable("the model request queue is full; retry shortly", RETRY_AFTER_SECONDS)
        self.used += count
        return Reservation(self, count)


class Reservation:
    def __init__(self, admission: Admission, count: int):
        self._admission = admission
        self.count = count
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._admission.used -= self.count


class FirstResponseRecorder(Protocol):
    def record(self, seconds: float) -> None: ...


class GenerationGroup:
    """The engine requests of one HTTP request (its choices), consumed as one event stream."""

    def __init__(
        self,
        engine: ServingEngine,
        requests: list[GenerationRequest],
        reservation: Reservation | None,
        first_response: FirstResponseRecorder | None = None,
        admitted_at: float | None = None,
    ):
        self._engine = engine
        self.requests = requests
        self._reservation = reservation
        self._first_response = first_response
        self._admitted_at = admitted_at if admitted_at is not None else time.monotonic()
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[tuple[int, GenerationEvent]] = asyncio.Queue()
        self._finished = [False] * len(requests)
        self._submitted = [False] * len(requests)
        self._closed = False
        self._first_text_seen = False

    def submit(self) -> None:
        """Submit every child; on any failure abort those already in and raise."""
        for index, request in enumerate(self.requests):
            try:
                self._engine.submit(request, self._sink(index))
            except ValueError as exc:
                self.close()
                raise bad_request(str(exc)) from None
            except RequestError as exc:
                self.close()
                raise ApiError.from_request_error(exc) from None
            except Exception as exc:  # the engine is not accepting work
                log.exception("engine submit failed")
                self.close()
                raise unavailable(f"the model runtime is unavailable: {exc}") from None
            self._submitted[index] = True

    def _sink(self, index: int) -> Callable[[GenerationEvent], None]:
        def sink(event: GenerationEvent) -> None:
            try:
                self._loop.call_soon_threadsafe(self._deliver, index, event)
            except RuntimeError:  # the loop is closed: the server is shutting down
                pass

        return sink

    def _deliver(self, index: int, event: GenerationEvent) -> None:
        if event.finished:
            self._finished[index] = True
        if not self._closed:
            self._queue.put_nowait((index, event))
        self._maybe_release()

    @property
    def all_finished(self) -> bool:
        return all(self._finished)

    async def next(self, timeout: float | None = None) -> tuple[int, GenerationEvent] | None:
        """The next event of any child, or None after `timeout` seconds without one."""
        try:
            item = await asyncio.wait_for(self._queue.get(), timeout)
        except TimeoutError:
            return None
        if not self._first_text_seen and item[1].text:
            self._first_text_seen = True
            if self._first_response is not None:
                self._first_response.record(time.monotonic() - self._admitted_at)
        return item

    def close(self) -> None:
        """The HTTP side is done (delivered, failed or disconnected): cancel unfinished children.

        The slots stay reserved until the engine's final events arrive, so native work drains
        before admission reuses its capacity.
        """
        if self._closed:
            return
        self._closed = True
        for index, request in enumerate(self.requests):
            if self._submitted[index] and not self._finished[index]:
                try:
                    self._engine.abort(request.request_id)
                except Exception:  # abort is best effort; the engine owns the request
                    log.exception("engine abort failed for %s", request.request_id)
            elif not self._submitted[index]:
                self._finished[index] = True
        self._maybe_release()

    def _maybe_release(self) -> None:
        if self._closed and self.all_finished and self._reservation is not None:
            self._reservation.release()
            self._reservation = None


def terminal_failure(event: GenerationEvent) -> ApiError | None:
    """The error a final event stands for, if it is not a normal completion: a server-side
    cancellation (queue deadline, drain) is a retryable 503, a failed step a 500."""
    if event.finish_reason == FinishReason.ABORT:
        return unavailable(event.error or "the request was cancelled by the model runtime", RETRY_AFTER_SECONDS)
    if event.finish_reason == FinishReason.ERROR or event.error:
        return server_error(f"generation failed: {event.error or 'engine error'}")
    return None

"""Running the application: listen, serve until SIGTERM/SIGINT, then drain.

Drain (api.md: /health is 503 with an error object when the server cannot take work):

1. The signal marks the context draining: /health answers 503 at once, so a load balancer stops
   routing here, and new generation requests get a retryable 503. The listener stays open.
2. In-flight generation requests may finish for up to `drain_timeout_s` (a second signal ends
   this wait at once).
3. Past the deadline the engine cancels what is left; each request ends with its protocol's
   terminal error (a 503, or an SSE error event under a started stream).
4. The listener closes and the remaining connections are shut down.

Header reads are bounded by aiohttp's keep-alive timer, which runs from connection start until
a request's headers are complete and again between requests (`header_timeout_s`).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable

from aiohttp import web

from helios.transport.config import ServerConfig
from helios.transport.context import ServerContext
from helios.transport.logs import AccessLogger, access_log

log = logging.getLogger("helios.server")

DRAIN_MESSAGE = "the server shut down before this request finished; retry it"
# After the deadline's cancellations, how long handlers get to write their terminal errors.
CANCEL_GRACE_S = 5.0
# After an early error (413, 408) aiohttp reads and drops the rest of the body so the client sees
# the answer; a stalled body must not hold the connection for aiohttp's default 10 s.
LINGER_S = 2.0


def serve(app: web.Application, ctx: ServerContext, config: ServerConfig, ready: Callable[[str], None]) -> None:
    """Serve `app` on config.host:port until a stop signal, then drain (blocking)."""
    asyncio.run(_serve(app, ctx, config, ready))


async def listen(app: web.Application, config: ServerConfig) -> tuple[web.AppRunner, str]:
    """Set `app` up and listen on config.host:port: the runner (its cleanup closes everything)
    and the bound address."""
    runner = web.AppRunner(
        app,
        access_log_class=AccessLogger,
        access_log=access_log,
        keepalive_timeout=config.header_timeout_s,
        lingering_time=LINGER_S,
        shutdown_timeout=CANCEL_GRACE_S,
    )
    await runner.setup()
    try:
        site = web.TCPSite(runner, config.host, config.port)
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner, site.name


async def _serve(app: web.Application, ctx: ServerContext, config: ServerConfig, ready: Callable[[str], None]) -> None:
    runner, address = await listen(app, config)
    stop, hurry = asyncio.Event(), asyncio.Event()

    def on_signal() -> None:  # the first signal drains; a second one ends the wait at once
        (hurry if stop.is_set() else stop).set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    try:
        ready(address)
        await stop.wait()
        await drain(ctx, config.drain_timeout_s, hurry)
    finally:
        await runner.cleanup()


async def drain(ctx: ServerContext, timeout: float, hurry: asyncio.Event | None = None) -> None:
    """Steps 1-3 above; returns when no generation request is in flight (or after the grace).
    `hurry` set (a second signal) cuts step 2 short."""
    ctx.draining = True
    busy = ctx.http.inflight_requests
    if busy:
        log.warning("draining: %d request(s) in flight, up to %.0f s", busy, timeout)
    if await _until_idle(ctx, timeout, hurry):
        return
    cancelled = ctx.engine.abort_all(DRAIN_MESSAGE)
    log.warning("drain ended: cancelled %d request(s)", cancelled)
    await _until_idle(ctx, CANCEL_GRACE_S)


async def _until_idle(ctx: ServerContext, timeout: float, hurry: asyncio.Event | None = None) -> bool:
    deadline = time.monotonic() + timeout
    while ctx.http.inflight_requests > 0:
        if time.monotonic() >= deadline or (hurry is not None and hurry.is_set()):
            return False
        await asyncio.sleep(0.05)
    return True

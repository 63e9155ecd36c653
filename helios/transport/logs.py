"""Server logging: the level and format operators choose, the access log, and the request id.

Every record carries `request_id`: the id of the request whose handler (or engine callback in
the same task) logged it, "-" outside one. Generation requests bind the id they answer in
x-request-id (the client's sane X-Request-Id, else the response id) as soon as it is known.

The access log is one record per request on the `helios.access` logger: method, path, status,
bytes sent, latency, request id and client address; text or JSON (`--log-format`). A request
whose client left before the answer is logged with status 499; polled routes log at debug.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import sys
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
LOG_FORMATS = ("text", "json")
NO_REQUEST = "-"
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"
ACCESS_FIELDS = ("method", "path", "status", "bytes", "latency_ms", "request_id", "client")

current_request_id: contextvars.ContextVar[str] = contextvars.ContextVar("helios_request_id", default=NO_REQUEST)
access_log = logging.getLogger("helios.access")


def client_request_id(headers: Any) -> str | None:
    """The client's X-Request-Id when it is a sane one (short, no spaces or controls)."""
    supplied = headers.get("X-Request-Id", "")
    if 0 < len(supplied) <= 128 and all(c.isalnum() or c in "-_.:" for c in supplied):
        return supplied
    return None


def bind_request_id(request_id: str) -> None:
    """Tag the rest of this request's task (its log records) with `request_id`."""
    current_request_id.set(request_id)


class RequestIdFilter(logging.Filter):
    """Gives each record the current request id (unless it names one itself)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = current_request_id.get()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, request_id, message, then access fields."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "request_id": getattr(record, "request_id", NO_REQUEST),
            "message": record.getMessage(),
        }
        for name in ACCESS_FIELDS:
            if name in record.__dict__ and name not in entry:
                entry[name] = record.__dict__[name]
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def configure(level: str = "info", fmt: str = "text") -> None:
    """Route every logger through one stderr handler at `level`, in `fmt` (text or json)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    # aiohttp's own access logger would repeat ours; its other loggers stay at the chosen level.
    logging.getLogger("aiohttp.access").disabled = True


# Polled routes (load balancers, Prometheus, the web page) log at debug, not once a second at info.
QUIET_PATHS = frozenset({"/health", "/metrics"})
CLIENT_CLOSED = 499  # nginx's status for a request its client abandoned before the answer
CLIENT_LEFT = "helios.client_left"  # request key: a stream's writes failed because the client left


def mark_client_left(request: web.BaseRequest) -> None:
    """A stream whose client hung up returns normally; its access record still says 499."""
    request[CLIENT_LEFT] = True


def write_access(request: web.BaseRequest, status: int, sent: int, seconds: float, request_id: str) -> None:
    """One access record. The path is the raw (still percent-encoded) one, so a crafted URL
    cannot write a line break into a text log."""
    fields = {
        "method": request.method,
        "path": request.rel_url.raw_path,
        "status": status,
        "bytes": sent,
        "latency_ms": round(seconds * 1000, 1),
        "request_id": request_id,
        "client": request.remote or NO_REQUEST,
    }
    level = logging.DEBUG if request.path in QUIET_PATHS and status < 400 else logging.INFO
    access_log.log(
        level,
        '%s "%s %s" %d %dB %.1fms id=%s',
        fields["client"],
        fields["method"],
        fields["path"],
        status,
        sent,
        fields["latency_ms"],
        request_id,
        extra=fields,
    )


class AccessLogger(AbstractAccessLogger):
    """aiohttp calls `log` once a response is fully sent (streams included); `sent` counts every
    byte written, headers and chunk framing included."""

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        request_id = response.headers.get("x-request-id") or client_request_id(request.headers) or NO_REQUEST
        status = CLIENT_CLOSED if request.get(CLIENT_LEFT) else response.status
        write_access(request, status, response.body_length, time, request_id)


@web.middleware
async def request_id_middleware(request: web.Request, handler: Callable) -> web.StreamResponse:
    """Tags the request's task with the client's id (a generation request rebinds its answered
    id once it has one) and writes the access record of a request its client abandoned, which
    aiohttp cancels without calling the access logger."""
    bind_request_id(client_request_id(request.headers) or NO_REQUEST)
    started = asyncio.get_running_loop().time()
    try:
        return await handler(request)
    except asyncio.CancelledError:
        write_access(request, CLIENT_CLOSED, 0, asyncio.get_running_loop().time() - started, current_request_id.get())
        raise

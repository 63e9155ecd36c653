"""The aiohttp application: the route table, authentication, error shapes, lifecycle.

The top of the house: it wires the protocol codecs (helios.protocols) onto the transport
(helios.transport). Each generating protocol is a `Codec` served by the one request lifecycle
(helios.transport.generation); this module owns what every route shares (auth, WebSocket refusal,
JSON 404/405, draining, in-flight accounting) and picks each route's error shape (OpenAI,
Anthropic Messages, Ollama discovery). A new protocol is one module plus one line in `ROUTES`.
"""

from __future__ import annotations

import hmac
import logging
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from helios.engine.api import ServingEngine
from helios.manifest import Manifest
from helios.neutral import parsers
from helios.neutral.errors import RequestError
from helios.neutral.grammar import compiler_for
from helios.neutral.template import ChatTemplate
from helios.neutral.tokenizer import Tokenizer
from helios.protocols import (
    chat,
    completions,
    decisions,
    messages,
    models,
    ollama,
    responses,
    systemone,
    tokenize,
)
from helios.transport import cors, logs, metrics
from helios.transport.admission import RETRY_AFTER_SECONDS, Admission
from helios.transport.config import ConfigError, ServerConfig
from helios.transport.context import DRAINING_MESSAGE, ServerContext
from helios.transport.errors import (
    ApiError,
    bad_request,
    json_response,
    messages_error_response,
    method_not_allowed,
    not_found,
    ollama_error_response,
    openai_error_response,
    server_error,
    unauthorized,
    unavailable,
)
from helios.transport.generation import Codec, serve

log = logging.getLogger("helios.server")

CTX_KEY = web.AppKey("flare_context", ServerContext)
COLLECTOR_KEY = web.AppKey("flare_collector", metrics.FlareCollector)
# More /metrics families beside the engine's (helios.cluster adds per-replica ones).
EXTRA_COLLECTORS_KEY = web.AppKey("flare_extra_collectors", tuple)

# Aggregate-only routes anyone may read (api.md: no request content is exposed there).
OPEN_PATHS = frozenset({"/health", "/metrics", "/version", "/"})
# The web page's own files (it asks for the key itself and sends it on its API calls).
PAGE_PREFIX = "/ui/"
PAGE_DIR = Path(__file__).resolve().parent / "web"
PAGE_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css"}
# Anthropic routes: Messages error shape, and x-api-key accepted next to Bearer.
ANTHROPIC_PREFIX = "/v1/messages"
OLLAMA_PREFIX = "/api/"

Handler = Callable[[web.Request, ServerContext], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    target: Codec | Handler  # a Codec is served by the shared generation lifecycle
    generation: bool = False  # refused while draining, counted in flight

    def handler(self) -> Handler:
        target = self.target
        if not isinstance(target, Codec):
            return target

        async def generate(request: web.Request, ctx: ServerContext) -> web.StreamResponse:
            return await serve(request, ctx, target)

        return generate


ROUTES = (
    Route("GET", "/v1/models", models.list_models),
    Route("GET", "/v1/models/{model:.*}", models.retrieve_model),
    Route("POST", "/v1/chat/completions", chat.CODEC, generation=True),
    Route("POST", "/v1/completions", completions.CODEC, generation=True),
    Route("POST", "/v1/messages", messages.CODEC, generation=True),
    Route("POST", "/v1/messages/count_tokens", messages.handle_count),
    Route("POST", "/v1/responses", responses.CODEC, generation=True),
    Route("POST", "/v1/systemone", systemone.handle, generation=True),
    Route("POST", "/v1/decisions", decisions.handle, generation=True),
    Route("GET", "/api/version", ollama.version),
    Route("GET", "/api/tags", ollama.tags),
    Route("POST", "/api/show", ollama.show),
    Route("POST", "/tokenize", tokenize.tokenize),
    Route("POST", "/detokenize", tokenize.detokenize),
    Route("GET", "/version", tokenize.version),
)


def check_startup(manifest: Manifest, config: ServerConfig, tokenizer: Tokenizer | None = None) -> None:
    """Refuse configurations this core cannot serve (before binding any port)."""
    config.validate()
    if not parsers.tool_syntax_known(manifest.parsers.tool):
        raise ConfigError(f"this core declares an unknown tool syntax {manifest.parsers.tool!r}")
    try:
        parsers.reasoning_syntax(manifest.parsers.reasoning)
    except parsers.UnknownSyntax as exc:
        raise ConfigError(f"this core declares {exc}") from None
    if config.thinking_token_budget is not None:
        if not manifest.parsers.reasoning:
            raise ConfigError(
                "thinking_token_budget is set but this core declares no reasoning syntax; remove it from [server]"
            )
        reasoning = parsers.resolve_reasoning(manifest.parsers.reasoning, tokenizer) if tokenizer else None
        if reasoning is not None and reasoning.close_id is None:
            raise ConfigError(
                "thinking_token_budget is set but this core's reasoning close delimiter is not "
                "one token, so a budget cannot close reasoning; remove it from [server]"
            )


def create_app(
    manifest: Manifest,
    core_dir: Path,
    engine: ServingEngine,
    config: ServerConfig,
    extra_collectors: tuple[metrics.ExtraCollector, ...] = (),
) -> web.Application:
    """Build the application over a started (or about to start) engine. The caller owns the engine
    and has run check_startup on this core and configuration (before loading the engine)."""
    if not isinstance(engine, ServingEngine):
        raise TypeError(f"{type(engine).__name__} does not implement ServingEngine (helios/engine/api.py)")
    tokenizer = Tokenizer.from_core(core_dir, manifest)
    # Build the grammar tokenizer (about a second) now, not on the first structured request.
    threading.Thread(
        target=lambda: compiler_for(tokenizer, manifest).llg, name="helios-grammar-warmup", daemon=True
    ).start()
    template = ChatTemplate.from_core(core_dir, manifest, bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token)
    max_concurrency = config.max_concurrency or manifest.limits.max_concurrency
    admission = Admission(config.http_admission_slots, config.effective_queue_size(max_concurrency))
    http = metrics.HttpStats(admission_slots=config.http_admission_slots)
    executor = ThreadPoolExecutor(max_workers=config.frontend_workers, thread_name_prefix="helios-frontend")
    ctx = ServerContext(
        manifest=manifest,
        core_dir=Path(core_dir),
        tokenizer=tokenizer,
        template=template,
        engine=engine,
        config=config,
        admission=admission,
        http=http,
        executor=executor,
    )
    app = web.Application(
        middlewares=[logs.request_id_middleware, _error_middleware, _auth_middleware],
        # We decode bodies ourselves (bounded); disconnects cancel handlers so engine work is aborted.
        handler_args={"auto_decompress": False, "handler_cancellation": True},
    )
    cors.install(app, config.allowed_origins, error_renderer)
    app[CTX_KEY] = ctx
    app[COLLECTOR_KEY] = metrics.FlareCollector(engine, http, admission, manifest.decode_weight_bytes)
    app[EXTRA_COLLECTORS_KEY] = extra_collectors

    def bind(handler: Handler, generation: bool) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def wrapped(request: web.Request) -> web.StreamResponse:
            if not generation:
                return await handler(request, ctx)
            if ctx.draining:  # refused before its body is read or planned
                raise unavailable(DRAINING_MESSAGE, RETRY_AFTER_SECONDS)
            ctx.http.inflight_requests += 1
            try:
                return await handler(request, ctx)
            finally:
                ctx.http.inflight_requests -= 1

        return wrapped

    app.router.add_get("/", page)
    app.router.add_get(PAGE_PREFIX + "{name}", page)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics_route)
    for r in ROUTES:
        handler = bind(r.handler(), r.generation)
        if r.method == "GET":
            app.router.add_get(r.path, handler)  # HEAD too
        else:
            app.router.add_route(r.method, r.path, handler)

    async def on_shutdown(_: web.Application) -> None:
        ctx.draining = True

    async def on_cleanup(_: web.Application) -> None:
        executor.shutdown(wait=False, cancel_futures=True)
        ctx.body_executor.shutdown(wait=False, cancel_futures=True)

    app.on_shutdown.append(on_shutdown)
    app.on_cleanup.append(on_cleanup)
    return app


# -- middlewares -----------------------------------------------------------------------------------


def is_anthropic(path: str) -> bool:
    return path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/")


def error_renderer(path: str) -> Callable[[ApiError], web.Response]:
    """Each protocol's error shape, chosen by route so errors raised before a handler runs
    (auth, body limits, encodings, 404/405) already speak the client's protocol."""
    if is_anthropic(path):
        return messages_error_response
    if path.startswith(OLLAMA_PREFIX):
        return ollama_error_response
    return openai_error_response


@web.middleware
async def _error_middleware(request: web.Request, handler: Callable) -> web.StreamResponse:
    render = error_renderer(request.path)
    if request.headers.get("Upgrade", "").lower() == "websocket":
        return render(bad_request("WebSocket connections are not supported; use HTTP or SSE"))
    try:
        return await handler(request)
    except ApiError as exc:
        return render(exc)
    except RequestError as exc:
        return render(ApiError.from_request_error(exc))
    except web.HTTPNotFound:
        return render(not_found(f"no route for {request.method} {request.path}"))
    except web.HTTPMethodNotAllowed:
        return render(method_not_allowed(f"{request.method} is not allowed on {request.path}"))
    except web.HTTPException as exc:
        if exc.status == 413:
            return render(ApiError(413, "request_too_large", exc.text or "request too large", "request_too_large"))
        return render(ApiError(exc.status, "invalid_request_error", exc.reason))
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return render(server_error("internal server error"))


def _key_matches(presented: str, key: str) -> bool:
    """Constant-time comparison of the key's bytes. aiohttp keeps undecodable header bytes as
    surrogate escapes, so encode them back to the bytes that were sent (never a match)."""
    try:
        sent = presented.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return False
    return hmac.compare_digest(sent, key.encode("utf-8"))


def authorized(headers: Any, key: str, anthropic: bool) -> bool:
    """OpenAI routes: Authorization: Bearer KEY. Anthropic routes also accept x-api-key: KEY;
    when both headers are sent, both must match."""
    presented: list[str] = []
    header = headers.get("Authorization")
    if header is not None:
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer":
            return False
        presented.append(token.strip())
    if anthropic and headers.get("x-api-key") is not None:
        presented.append(headers["x-api-key"].strip())
    return bool(presented) and all(_key_matches(p, key) for p in presented)


@web.middleware
async def _auth_middleware(request: web.Request, handler: Callable) -> web.StreamResponse:
    ctx = request.app[CTX_KEY]
    key = ctx.config.api_key
    if key and request.path not in OPEN_PATHS and not request.path.startswith(PAGE_PREFIX):
        anthropic = is_anthropic(request.path)
        if not authorized(request.headers, key, anthropic):
            if anthropic:
                raise unauthorized("a valid API key is required (x-api-key: KEY or Authorization: Bearer KEY)")
            raise unauthorized()
    return await handler(request)


# -- open routes -----------------------------------------------------------------------------------


async def health(request: web.Request) -> web.Response:
    ctx = request.app[CTX_KEY]
    if ctx.draining:
        raise unavailable(DRAINING_MESSAGE, RETRY_AFTER_SECONDS)
    try:
        ctx.engine.stats()
        healthy = ctx.engine.healthy()
    except Exception as exc:  # the runtime cannot even report
        raise unavailable(f"the model runtime is unavailable: {exc}") from None
    if not healthy:
        raise unavailable("the model runtime is unavailable")
    return json_response({"status": "ok"})


async def metrics_route(request: web.Request) -> web.Response:
    collector, extra = request.app[COLLECTOR_KEY], request.app[EXTRA_COLLECTORS_KEY]
    if metrics.wants_json(request.query.get("format"), request.headers.get("Accept")):
        return json_response(metrics.json_snapshot(collector, extra))
    return web.Response(
        body=metrics.prometheus_text(collector, extra), headers={"Content-Type": metrics.TEXT_CONTENT_TYPE}
    )


async def page(request: web.Request) -> web.Response:
    """The web page: index.html at /, its files under /ui/ (only files shipped in helios/web)."""
    name = request.match_info.get("name", "index.html")
    path = PAGE_DIR / name
    kind = PAGE_TYPES.get(path.suffix)
    if kind is None or "/" in name or name.startswith(".") or not path.is_file():
        raise not_found(f"no page file {name!r}")
    return web.Response(
        body=path.read_bytes(),
        headers={"Content-Type": f"{kind}; charset=utf-8", "Cache-Control": "no-cache"},
    )

"""CORS for browser clients, off unless `allowed_origins` names origins (or "*").

A preflight (OPTIONS with Access-Control-Request-Method) from an allowed origin is answered
here, before authentication (browsers never send keys on a preflight); one from another origin
is a 403. Every other response to an allowed origin, streams included, gets the origin headers
as its headers are sent. "*" is answered as "*" and never with Access-Control-Allow-Credentials:
no response ever allows credentials, since keys travel in headers, not cookies.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from aiohttp import web

from helios.transport.errors import ApiError

ANY_ORIGIN = "*"
ALLOWED_METHODS = "GET, POST, OPTIONS"
# Headers the SDKs and the web page send (a preflight's own request list is echoed when allowed).
DEFAULT_ALLOWED_HEADERS = "authorization, content-type, x-api-key, anthropic-version, x-request-id"
EXPOSED_HEADERS = "x-request-id, retry-after"
PREFLIGHT_MAX_AGE_S = "600"


Renderer = Callable[[str], Callable[[ApiError], web.Response]]  # path -> that route's error shape


class Cors:
    def __init__(self, origins: Sequence[str], renderer: Renderer):
        self.any = ANY_ORIGIN in origins
        # Scheme and host compare case-insensitively (browsers send them lower-case).
        self.origins = frozenset(o.rstrip("/").lower() for o in origins if o != ANY_ORIGIN)
        self.renderer = renderer

    def allow(self, origin: str | None) -> str | None:
        """The Access-Control-Allow-Origin value for `origin`, None when it is not allowed."""
        if not origin:
            return None
        if self.any:
            return ANY_ORIGIN
        return origin if origin.lower() in self.origins else None

    def preflight(self, request: web.Request) -> web.Response:
        allowed = self.allow(request.headers.get("Origin"))
        if allowed is None:
            # Outside the error middleware: rendered here, in the route's own error shape.
            return self.renderer(request.path)(
                ApiError(403, "invalid_request_error", "this origin is not allowed (helios --allowed-origins)")
            )
        requested = request.headers.get("Access-Control-Request-Headers")
        return web.Response(
            status=204,
            headers={
                "Access-Control-Allow-Origin": allowed,
                "Access-Control-Allow-Methods": ALLOWED_METHODS,
                "Access-Control-Allow-Headers": requested or DEFAULT_ALLOWED_HEADERS,
                "Access-Control-Max-Age": PREFLIGHT_MAX_AGE_S,
                "Vary": "Origin",
            },
        )

    @web.middleware
    async def middleware(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
            return self.preflight(request)
        return await handler(request)

    async def on_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        allowed = self.allow(request.headers.get("Origin"))
        if allowed is not None:
            response.headers["Access-Control-Allow-Origin"] = allowed
            response.headers["Access-Control-Expose-Headers"] = EXPOSED_HEADERS
            if "Origin" not in response.headers.getall("Vary", []):
                response.headers.add("Vary", "Origin")


def install(app: web.Application, origins: Sequence[str], renderer: Renderer) -> None:
    """CORS on `app` for `origins` (nothing when empty). Call before the app is frozen; the
    middleware goes first so preflights bypass authentication."""
    if not origins:
        return
    cors = Cors(origins, renderer)
    app.middlewares.insert(0, cors.middleware)
    app.on_response_prepare.append(cors.on_prepare)

"""HTTP errors in the OpenAI shape and the status mapping of api.md "Transport and admission".

Chat Completions, Completions and Responses errors are
{"error": {"type", "message", "param": null, "code"}}; Messages errors are
{"type": "error", "error": {"type", "message"}} with api_error for 5xx; Ollama discovery errors
are {"error": "message"}. Every route raises the same `ApiError`; the renderer of its protocol
picks the shape (see `app.error_renderer`).
"""

from __future__ import annotations

import json
import re
from typing import Any

from aiohttp import web

from helios.neutral.errors import RequestError


class ApiError(Exception):
    """An error response: HTTP status, error type, message and optional code."""

    def __init__(self, status: int, type_: str, message: str, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.type = type_
        self.message = message
        self.code = code
        self.param: str | None = None  # the offending request field, when one is known
        self.headers: dict[str, str] = {}  # e.g. x-request-id once the request reached the model

    def with_headers(self, headers: dict[str, str]) -> ApiError:
        self.headers = {**self.headers, **headers}
        return self

    @classmethod
    def from_request_error(cls, exc: RequestError) -> ApiError:
        error = bad_request(exc.message, code=exc.code)
        error.param = exc.param
        return error


# One constructor per row of the status table.
def bad_request(message: str, code: str | None = None) -> ApiError:
    return ApiError(400, "invalid_request_error", message, code)


def unauthorized(message: str = "a valid API key is required (Authorization: Bearer KEY)") -> ApiError:
    return ApiError(401, "authentication_error", message, "invalid_api_key")


def not_found(message: str, code: str = "not_found") -> ApiError:
    return ApiError(404, "invalid_request_error", message, code)


def method_not_allowed(message: str) -> ApiError:
    return ApiError(405, "invalid_request_error", message, "method_not_allowed")


def too_large(limit: int) -> ApiError:
    return ApiError(413, "request_too_large", f"the request body exceeds the {limit}-byte limit", "request_too_large")


def unsupported_encoding(encoding: str) -> ApiError:
    return ApiError(
        415,
        "invalid_request_error",
        f"unsupported Content-Encoding {encoding!r}; use identity, gzip, deflate, br or zstd",
        "unsupported_content_encoding",
    )


def request_timeout(message: str) -> ApiError:
    return ApiError(408, "invalid_request_error", message, "request_timeout").with_headers({"Connection": "close"})


def rate_limited(message: str, retry_after: int = 1) -> ApiError:
    return ApiError(429, "rate_limit_error", message, "rate_limit_exceeded").with_headers(
        {"Retry-After": str(retry_after)}
    )


def unavailable(message: str, retry_after: int | None = None) -> ApiError:
    """503. With `retry_after` (overload, draining) the condition is temporary: clients may retry."""
    error = ApiError(503, "server_error", message, "service_unavailable")
    return error.with_headers({"Retry-After": str(retry_after)}) if retry_after is not None else error


def server_error(message: str) -> ApiError:
    return ApiError(500, "server_error", message, "internal_error")


def openai_error_body(error: ApiError) -> dict[str, Any]:
    return {"error": {"type": error.type, "message": error.message, "param": error.param, "code": error.code}}


_SURROGATE = re.compile("[\ud800-\udfff]")


def dumps(data: Any) -> str:
    """Compact JSON that always encodes as UTF-8: non-ASCII stays readable; a lone surrogate
    (echoed from a header or path) becomes U+FFFD; a non-finite number becomes null."""
    try:
        text = json.dumps(data, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except ValueError:  # NaN/Infinity has no JSON spelling
        text = json.dumps(_finite(data), ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return _SURROGATE.sub("\ufffd", text) if not text.isascii() else text


def _finite(data: Any) -> Any:
    if isinstance(data, float):
        return data if data == data and abs(data) != float("inf") else None
    if isinstance(data, dict):
        return {k: _finite(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [_finite(v) for v in data]
    return data


def json_response(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(text=dumps(data), status=status, content_type="application/json", headers=headers)


def openai_error_response(error: ApiError) -> web.Response:
    return json_response(openai_error_body(error), status=error.status, headers=error.headers or None)


# Anthropic's error types by status; everything 5xx is api_error (api.md).
_MESSAGES_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
}


def messages_error_body(error: ApiError) -> dict[str, Any]:
    if error.status >= 500:
        kind = "api_error"
    else:
        kind = _MESSAGES_TYPES.get(error.status, "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def messages_error_response(error: ApiError) -> web.Response:
    return json_response(messages_error_body(error), status=error.status, headers=error.headers or None)


def ollama_error_response(error: ApiError) -> web.Response:
    """Ollama discovery errors are {"error": "message"}; authentication stays OpenAI-shaped (api.md)."""
    if error.status == 401:
        return openai_error_response(error)
    return json_response({"error": error.message}, status=error.status, headers=error.headers or None)

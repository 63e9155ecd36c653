"""Errors the frontend raises for a request it cannot serve.

The frontend (tokenizer, template, sampling, output) knows nothing about HTTP; the server maps
`RequestError` to HTTP 400 invalid_request_error and `OutputFailure` to HTTP 500 server_error, in
each protocol's error shape.
"""

from __future__ import annotations


class RequestError(ValueError):
    """A malformed, unsupported or over-context request (HTTP 400)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class OutputFailure(Exception):
    """Generated output that breaks its contract (a malformed tool envelope, a forbidden or
    missing call): the request fails (HTTP 500, or a terminal stream error)."""

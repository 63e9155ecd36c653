"""Readers of request JSON fields: the one place a wrong type becomes a RequestError (HTTP 400).

Every protocol decoder and the frontend's own resolvers (sampling, budgets) read fields here, so
one field gets one message whichever endpoint carried it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from helios.neutral.errors import RequestError


def require_number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(f"{name} must be a number", param=name)
    if not math.isfinite(value):
        raise RequestError(f"{name} must be finite", param=name)
    return float(value)


def require_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"{name} must be an integer", param=name)
    return value


def require_bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be a boolean", param=name)
    return value


def opt_bool(body: Mapping[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    return default if value is None else require_bool(value, name)


def opt_int(body: Mapping[str, Any], name: str, default: int | None) -> int | None:
    value = body.get(name)
    return default if value is None else require_int(value, name)


def opt_object(body: Mapping[str, Any], name: str) -> dict[str, Any] | None:
    value = body.get(name)
    if value is not None and not isinstance(value, dict):
        raise RequestError(f"{name} must be an object", param=name)
    return value


def reject_present(body: Mapping[str, Any], names: tuple[str, ...], why: str) -> None:
    for name in names:
        if body.get(name) is not None:
            raise RequestError(f"{name} is not supported {why}", param=name)


def choice_count(body: Mapping[str, Any]) -> int:
    n = opt_int(body, "n", 1)
    assert n is not None
    if n < 1:
        raise RequestError("n must be at least 1", param="n")
    return n

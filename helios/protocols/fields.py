"""Readers of request body fields, for the protocol decoders: an omitted or null field takes its
default, a present one must pass its type rule (helios/neutral/fields.py). Bodies stop here: the
neutral layer receives the values."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from helios.neutral.errors import RequestError
from helios.neutral.fields import require_bool, require_int


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

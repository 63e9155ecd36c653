"""The type rules of request values: the one place a wrong type becomes a RequestError (HTTP 400).

Every protocol decoder (through helios/protocols/fields.py) and the neutral resolvers (sampling,
budgets) check values here, so one field gets one message whichever endpoint carried it.
"""

from __future__ import annotations

import math
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

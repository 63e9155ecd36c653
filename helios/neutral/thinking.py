"""Reasoning controls: enable/disable, named effort levels and token budgets, resolved to template
variables and the engine's `ReasoningControl`.

- Thinking on/off is the template's `enable_thinking` variable (chat_template_kwargs, a
  top-level `enable_thinking`, Messages `thinking.type`, or effort "none"). Values the client put
  in chat_template_kwargs win over derived ones.
- Named effort (Responses reasoning.effort, Anthropic output_config.effort, or derived from a
  Messages budget: up to 5,000 low, up to 20,000 high, above that max) maps onto the levels the
  prepared template accepts, read from its source (for example Qwen's low/medium/xhigh), and is
  passed as `reasoning_effort`. A template without that variable ignores effort. Where the core's
  template takes integer scores (manifest `template.numeric_effort`, DeepSeek V4.1: 1..100), Chat
  Completions' top-level `reasoning_effort` may also be such an integer, passed through as is;
  other cores, and the Responses/Messages effort fields, refuse numbers (400).
- thinking_token_budget caps generated reasoning tokens when output starts inside reasoning and
  the close delimiter is one token; the engine then forces that token at the cap.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from helios.neutral.errors import RequestError

INT32_MAX = (1 << 31) - 1
EFFORT_LEVELS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
_RANK = {name: i for i, name in enumerate(EFFORT_LEVELS)}


def effort_from_budget(budget: int) -> str:
    if budget <= 5000:
        return "low"
    if budget <= 20000:
        return "high"
    return "max"


def check_effort(value: Any, param: str, numeric: list[int] | tuple[int, int] | None = None) -> str | int | None:
    """A named effort level, or, where the core's template takes integer scores (`numeric`: the
    manifest's template.numeric_effort, DeepSeek V4.1's [1, 100]), a JSON integer in that range.
    Floats, booleans and numeric strings are refused; so is any integer on other cores."""
    if value is None:
        return None
    named = ", ".join(EFFORT_LEVELS)
    if numeric is not None:
        low, high = numeric
        if isinstance(value, int) and not isinstance(value, bool):
            if not low <= value <= high:
                raise RequestError(
                    f"{param} must be an integer from {low} through {high} or one of {named}", param=param.split(".")[0]
                )
            return value
        if not isinstance(value, str) or value not in EFFORT_LEVELS:
            raise RequestError(
                f"{param} must be an integer from {low} through {high} or one of {named}", param=param.split(".")[0]
            )
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        raise RequestError(
            f"{param} must be one of {named} (numeric scores are not accepted here)", param=param.split(".")[0]
        )
    if not isinstance(value, str) or value not in EFFORT_LEVELS:
        raise RequestError(f"{param} must be one of {named}", param=param.split(".")[0])
    return value


def template_levels(source: str) -> list[str]:
    """Effort levels a template names (in quotes) when it reads reasoning_effort."""
    if "reasoning_effort" not in source:
        return []
    found = set(re.findall(r"""['"]([a-z]+)['"]""", source))
    return [level for level in EFFORT_LEVELS[1:] if level in found]


def resolve_effort(level: str, accepted: list[str]) -> str | None:
    """The accepted level nearest to `level` (ties go to the stronger one)."""
    if not accepted or level == "none":
        return None
    if level in accepted:
        return level
    want = _RANK[level]
    return min(accepted, key=lambda a: (abs(_RANK[a] - want), -_RANK[a]))


def template_kwargs(
    kwargs: dict[str, Any], *, enabled: bool | None, effort: str | int | None, template_source: str | None
) -> dict[str, Any]:
    """chat_template_kwargs with the derived thinking variables filled in where absent. An integer
    effort (already checked against the core's numeric range) goes to the template as it is."""
    out = dict(kwargs)
    if isinstance(effort, int):
        if enabled is not None:
            out.setdefault("enable_thinking", enabled)
        out.setdefault("reasoning_effort", effort)
        return out
    if effort == "none" and enabled is None:
        enabled = False
    if enabled is not None:
        out.setdefault("enable_thinking", enabled)
    if effort and effort != "none" and template_source:
        mapped = resolve_effort(effort, template_levels(template_source))
        if mapped is not None:
            out.setdefault("reasoning_effort", mapped)
    return out


def check_budget(value: Any, param: str = "thinking_token_budget") -> int | None:
    """An explicit budget: a positive 32-bit integer (None when omitted or null)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"{param} must be a positive 32-bit integer", param=param)
    if not 1 <= value <= INT32_MAX:
        raise RequestError(f"{param} must be a positive 32-bit integer", param=param)
    return value


@dataclass
class Budget:
    """The reasoning budget of one request."""

    tokens: int | None = None  # the cap; None: uncapped
    explicit: bool = False  # the request set thinking_token_budget (unsupported formats are a 400)
    advisory: bool = False  # Messages thinking.budget_tokens: a hint where no hard cap is possible

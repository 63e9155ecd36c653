"""Helpers for tests against a live `helios serve` (tiny core): SSE parsing, metrics, idling,
and a deterministic way to make a random-weight model stop (a token stop on a seeded run)."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx

ANTHROPIC = {"anthropic-version": "2023-06-01"}
USER = [{"role": "user", "content": "Reply with exactly OK."}]


def sse(text: str) -> list[tuple[str | None, Any]]:
    """(event name, parsed data) per SSE frame; comments are dropped, [DONE] kept as a string."""
    frames = []
    for block in text.split("\n\n"):
        name, data = None, []
        for line in block.splitlines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data.append(line[6:])
        if data:
            payload = "\n".join(data)
            frames.append((name, payload if payload == "[DONE]" else json.loads(payload)))
    return frames


def metrics(http: httpx.Client) -> dict[str, float]:
    response = http.get("/metrics")
    response.raise_for_status()
    return {
        key: float(value)
        for line in response.text.splitlines()
        if line and not line.startswith("#")
        for key, value in [line.rsplit(" ", 1)]
    }


def wait_for(check, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def wait_idle(http: httpx.Client, timeout: float = 15) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(http)
        idle = (
            m["flare_active_requests"] == 0
            and m["flare_http_inflight_requests"] == 0
            and m["flare_http_admission_slots_used"] == 0
        )
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.02)


def second_token(http: httpx.Client, seed: int, headers: dict[str, str] | None = None) -> int:
    """The second token the tiny model generates for USER under `seed` (chat template, same
    sampling as the other protocols), so a stop_token_ids request ends deterministically
    with a natural stop instead of the length limit."""
    body = {"messages": USER, "max_tokens": 3, "seed": seed, "ignore_eos": True, "return_token_ids": True}
    response = http.post("/v1/chat/completions", json=body, headers=headers)
    response.raise_for_status()
    return response.json()["choices"][0]["token_ids"][1]

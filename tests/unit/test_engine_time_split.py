"""/metrics reports where engine step time goes (scripts/bench.py reads it): the step graph's
share, the scheduler's, and grammar-mask time, each a part of real serving work."""

from __future__ import annotations

import httpx


def snapshot(url: str) -> dict:
    return httpx.get(url + "/metrics", params={"format": "json"}, timeout=30).json()


def test_step_time_splits_into_graph_and_host_work(tiny_server):
    before = snapshot(tiny_server.url)
    response = httpx.post(
        tiny_server.url + "/v1/completions",
        json={"prompt": "Hello there", "max_tokens": 6, "ignore_eos": True},
        timeout=120,
    )
    assert response.status_code == 200
    after = snapshot(tiny_server.url)
    steps = after["engine_steps"] - before["engine_steps"]
    step = after["engine_step_ns"] - before["engine_step_ns"]
    graph = after["engine_graph_ns"] - before["engine_graph_ns"]
    schedule = after["engine_schedule_ns"] - before["engine_schedule_ns"]
    accepted = after["accepted_drafts"] - before["accepted_drafts"]  # drafts commit tokens without a step
    assert steps + accepted >= 6  # a prefill step and a decode step per further token
    assert 0 < graph < step and 0 < schedule < step
    assert graph + schedule <= step
    assert after["grammar_mask_ns"] == before["grammar_mask_ns"]  # unconstrained: no masks

    text = httpx.get(tiny_server.url + "/metrics", timeout=30).text
    assert "flare_engine_graph_seconds_total" in text and "flare_grammar_mask_seconds_total" in text


def test_constrained_requests_count_grammar_mask_time(tiny_server):
    before = snapshot(tiny_server.url)
    response = httpx.post(
        tiny_server.url + "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "Give me JSON."}],
            "max_tokens": 8,
            "response_format": {"type": "json_object"},
        },
        timeout=120,
    )
    assert response.status_code == 200
    after = snapshot(tiny_server.url)
    assert after["grammar_mask_ns"] > before["grammar_mask_ns"]

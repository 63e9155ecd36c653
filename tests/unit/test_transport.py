"""Transport and admission across protocols on a live keyed tiny server: authentication rules,
encoded bodies and bombs, per-protocol error shapes, 429, disconnects, x-request-id, keepalives,
Chat/Completions usage details, health and metrics."""

from __future__ import annotations

import asyncio
import gzip
import json
import time
import zlib

import brotli
import httpx
import pytest
import zstandard

from helios.engine.api import GenerationEvent
from helios.transport.generation import follow
from tests.conftest import TINY_ADMISSION_SLOTS, TINY_API_KEY, TINY_MAX_BODY_BYTES
from tests.unit.live import ANTHROPIC, USER, metrics, sse, wait_idle

BEARER = {"Authorization": f"Bearer {TINY_API_KEY}"}
ROUTES = {  # path -> (minimal generating body, error shape)
    "/v1/chat/completions": ({"messages": USER, "max_tokens": 1}, "openai"),
    "/v1/completions": ({"prompt": "Hello", "max_tokens": 1}, "openai"),
    "/v1/messages": ({"messages": USER, "max_tokens": 1}, "messages"),
    "/v1/messages/count_tokens": ({"messages": USER}, "messages"),
    "/v1/responses": ({"input": USER, "max_output_tokens": 1}, "openai"),
}


@pytest.fixture(scope="module")
def server(tiny_keyed_server):
    return tiny_keyed_server


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={**BEARER, **ANTHROPIC}, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def anon(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def error_of(response: httpx.Response, shape: str) -> dict:
    body = response.json()
    if shape == "messages":
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    else:
        assert set(body["error"]) == {"type", "message", "param", "code"}, body
    return body["error"]


# -- authentication --------------------------------------------------------------------------------


def test_health_and_metrics_are_open(anon: httpx.Client):
    assert anon.get("/health").json() == {"status": "ok"}
    assert anon.get("/metrics").status_code == 200
    assert anon.get("/metrics", params={"format": "json"}).status_code == 200


@pytest.mark.parametrize("path", sorted(ROUTES))
def test_openai_and_anthropic_key_rules(anon: httpx.Client, path):
    body, shape = ROUTES[path]
    anthropic = shape == "messages"
    good, bad = TINY_API_KEY, TINY_API_KEY + "-wrong"
    cases = [
        ({}, False),
        ({"Authorization": f"Bearer {bad}"}, False),
        ({"Authorization": good}, False),  # no Bearer scheme
        ({"Authorization": f"Bearer {good}"}, True),
        ({"x-api-key": good}, anthropic),  # x-api-key only on Anthropic routes
        ({"x-api-key": bad}, False),
        ({"x-api-key": good, "Authorization": f"Bearer {good}"}, True),
        ({"x-api-key": good, "Authorization": f"Bearer {bad}"}, False),  # both sent: both must match
        ({"x-api-key": bad, "Authorization": f"Bearer {good}"}, not anthropic),
    ]
    for headers, allowed in cases:
        response = anon.post(path, json=body, headers={**ANTHROPIC, **headers})
        if allowed:
            assert response.status_code == 200, (headers, response.text)
        else:
            assert response.status_code == 401, (headers, response.text)
            assert error_of(response, shape)["type"] == "authentication_error"


def test_discovery_routes_need_the_key(anon: httpx.Client):
    for method, path in [("GET", "/v1/models"), ("GET", "/api/version"), ("GET", "/api/tags"), ("POST", "/api/show")]:
        denied = anon.request(method, path, json={"model": "qwen2.5-coder"}, headers={"x-api-key": TINY_API_KEY})
        assert denied.status_code == 401
        assert error_of(denied, "openai")["type"] == "authentication_error"  # OpenAI shape, Ollama too
        assert anon.request(method, path, json={"model": "qwen2.5-coder"}, headers=BEARER).status_code == 200


# -- bodies and shapes -----------------------------------------------------------------------------

ENCODINGS = [
    ("gzip", gzip.compress),
    ("deflate", zlib.compress),
    ("br", brotli.compress),
    ("zstd", lambda b: zstandard.ZstdCompressor().compress(b)),
    ("identity", lambda b: b),
]


@pytest.mark.parametrize("encoding,compress", ENCODINGS)
@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens", "/v1/responses"])
def test_encoded_request_bodies(http: httpx.Client, path, encoding, compress):
    raw = json.dumps(ROUTES[path][0]).encode()
    response = http.post(
        path, content=compress(raw), headers={"Content-Encoding": encoding, "Content-Type": "application/json"}
    )
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("path", sorted(ROUTES))
def test_body_limits_encodings_and_malformed_json_per_shape(http: httpx.Client, path):
    shape = ROUTES[path][1]
    bomb = http.post(
        path, content=gzip.compress(b" " * (8 * TINY_MAX_BODY_BYTES)), headers={"Content-Encoding": "gzip"}
    )
    assert bomb.status_code == 413 and error_of(bomb, shape)["type"] == "request_too_large"
    zbomb = zstandard.ZstdCompressor().compress(b" " * (4 * TINY_MAX_BODY_BYTES))
    assert http.post(path, content=zbomb, headers={"Content-Encoding": "zstd"}).status_code == 413
    # A bomb of structure stops earlier still: its first mebibyte already breaks the nesting bound.
    nested = zstandard.ZstdCompressor().compress(b"[" * (4 * TINY_MAX_BODY_BYTES))
    deep = http.post(path, content=nested, headers={"Content-Encoding": "zstd"})
    assert deep.status_code == 400 and "nesting" in error_of(deep, shape)["message"]
    oversize = http.post(path, content=b" " * (TINY_MAX_BODY_BYTES + 1))
    assert oversize.status_code == 413 and error_of(oversize, shape)["type"] == "request_too_large"
    unknown = http.post(path, content=b"{}", headers={"Content-Encoding": "compress"})
    assert unknown.status_code == 415 and error_of(unknown, shape)["type"] == "invalid_request_error"
    corrupt = http.post(path, content=b"not gzip", headers={"Content-Encoding": "gzip"})
    assert corrupt.status_code == 400 and error_of(corrupt, shape)["type"] == "invalid_request_error"
    for raw in (b"{", b"[]", b'"text"', b'{"a": Infinity}', '{"é": 1}'.encode("latin-1")):
        bad = http.post(path, content=raw)
        assert bad.status_code == 400 and error_of(bad, shape)["type"] == "invalid_request_error"
    socket = http.get(path, headers={"Upgrade": "websocket", "Connection": "Upgrade"})
    assert socket.status_code == 400 and error_of(socket, shape)
    assert http.get(path).status_code == 405 and error_of(http.get(path), shape)


def test_unknown_anthropic_path_is_404_in_messages_shape(http: httpx.Client):
    response = http.post("/v1/messages/batches", json={})
    assert response.status_code == 404 and error_of(response, "messages")["type"] == "not_found_error"


# -- admission -------------------------------------------------------------------------------------


def test_rate_limit_is_429_in_each_shape(http: httpx.Client):
    wait_idle(http)
    hold = {"prompt": "Count:", "n": TINY_ADMISSION_SLOTS, "max_tokens": 100000, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=hold) as held:
        assert held.status_code == 200
        busy = {path: http.post(path, json=ROUTES[path][0]) for path in ("/v1/messages", "/v1/responses")}
        if any(r.status_code != 429 for r in busy.values()):
            pytest.skip("the held group drained before the probes")
        assert error_of(busy["/v1/messages"], "messages")["type"] == "rate_limit_error"
        assert error_of(busy["/v1/responses"], "openai")["type"] == "rate_limit_error"
        # Counting generates nothing: it needs no admission slot.
        assert http.post("/v1/messages/count_tokens", json={"messages": USER}).status_code == 200
    after = wait_idle(http)
    assert after["flare_http_admission_slots_used"] == 0


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/messages", {"messages": USER, "max_tokens": 100000, "ignore_eos": True, "stream": True}),
        ("/v1/responses", {"input": USER, "max_output_tokens": 100000, "ignore_eos": True, "stream": True}),
    ],
)
def test_stream_disconnect_cancels_and_frees_the_slot(http: httpx.Client, path, body):
    before = wait_idle(http)
    with http.stream("POST", path, json=body) as response:
        assert response.status_code == 200 and response.headers.get("x-request-id")
        for line in response.iter_lines():  # leave after the first generated text
            if line.startswith("data: ") and (
                '"content_block_delta"' in line or '"response.output_text.delta"' in line
            ):
                break
    after = wait_idle(http)
    assert after["flare_active_requests"] == 0 and after["flare_http_inflight_requests"] == 0
    assert after["flare_http_admission_slots_used"] == 0
    assert after["flare_requests_cancelled_total"] == before["flare_requests_cancelled_total"] + 1
    assert (
        http.post(
            path,
            json={
                **body,
                "stream": False,
                "ignore_eos": False,
                **({"max_tokens": 1} if "messages" in body else {"max_output_tokens": 1}),
            },
        ).status_code
        == 200
    )


def test_the_chat_role_chunk_waits_for_the_first_token(http: httpx.Client):
    """The stream's first chunk (the assistant role) comes once the first token exists: after a
    prompt of several prefill chunks is prefilled, never at admission."""
    chunk = http.get("/v1/models").json()["data"][0]["flare"]["prefill_chunk_size"]
    before = wait_idle(http)
    text = " ".join(f"item{i}" for i in range(3 * chunk))  # several chunks, unlike any earlier prompt
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 4, "top_k": 1, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        first = json.loads(next(line for line in response.iter_lines() if line.startswith("data: "))[6:])
        at_first = metrics(http)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert at_first["flare_generated_tokens_total"] > before["flare_generated_tokens_total"]
    assert at_first["flare_prefill_tokens_total"] - before["flare_prefill_tokens_total"] > 3 * chunk


def test_a_paused_reader_resumes_without_loss(http: httpx.Client):
    """A reader that stops after the first chunk until generation has finished (no model slot is
    held any more) gets every token on resuming."""
    body = {"prompt": "A paused reader", "max_tokens": 600, "top_k": 1, "ignore_eos": True}
    buffered = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    wait_idle(http)
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        lines = response.iter_lines()
        received = [json.loads(next(line for line in lines if line.startswith("data: "))[6:])]
        deadline = time.monotonic() + 60
        while metrics(http)["flare_active_requests"] > 0 and time.monotonic() < deadline:
            time.sleep(0.05)  # the model finishes while this reader sleeps
        assert metrics(http)["flare_active_requests"] == 0
        received += [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert "".join(chunk["choices"][0]["text"] for chunk in received) == buffered


def test_x_request_id(http: httpx.Client):
    for path in ("/v1/messages", "/v1/responses", "/v1/chat/completions", "/v1/completions"):
        echoed = http.post(path, json=ROUTES[path][0], headers={"X-Request-Id": "client-id-1"})
        assert echoed.headers["x-request-id"] == "client-id-1"
        generated = http.post(path, json=ROUTES[path][0], headers={"X-Request-Id": "bad id\twith spaces"})
        assert generated.headers["x-request-id"] != "bad id\twith spaces" and generated.headers["x-request-id"]
    rejected = http.post("/v1/messages", json={"messages": []})
    assert "x-request-id" not in rejected.headers  # it never reached the model
    assert "x-request-id" not in http.post("/v1/messages/count_tokens", json={"messages": USER}).headers


def test_keepalive_comments_while_the_model_is_quiet(monkeypatch):
    from helios.transport import generation

    monkeypatch.setattr(generation, "KEEPALIVE_SECONDS", 0.01)

    class Quiet:
        requests = [object()]

        def __init__(self):
            self.calls = 0

        async def next(self, timeout):
            self.calls += 1
            if self.calls < 3:
                await asyncio.sleep(timeout)
                return None
            return 0, GenerationEvent("r", [1], "x", finished=True)

    async def run() -> tuple[int, list[GenerationEvent]]:
        comments = 0

        async def keepalive() -> None:
            nonlocal comments
            comments += 1

        events = [e async for _, e in follow(Quiet(), keepalive)]
        return comments, events

    comments, events = asyncio.run(run())
    assert comments == 2 and len(events) == 1 and events[0].finished


# -- chat and completions usage details ------------------------------------------------------------


def test_cached_tokens_always_reported(http: httpx.Client):
    chat = http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2}).json()
    # Present always; the live server may already hold a checkpoint of this prompt (prefix reuse).
    assert set(chat["usage"]["prompt_tokens_details"]) == {"cached_tokens"}
    assert 0 <= chat["usage"]["prompt_tokens_details"]["cached_tokens"] < chat["usage"]["prompt_tokens"]
    assert chat["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}
    completion = http.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 1}).json()
    assert 0 <= completion["usage"]["prompt_tokens_details"]["cached_tokens"] < completion["usage"]["prompt_tokens"]
    assert "completion_tokens_details" not in completion["usage"]  # no reasoning region
    zero = http.post("/v1/completions", json={"prompt": "a", "max_tokens": 0}).json()
    assert zero["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    for path, body in [("/v1/chat/completions", {"messages": USER}), ("/v1/completions", {"prompt": "Hi"})]:
        frames = [
            d
            for _, d in sse(
                http.post(
                    path,
                    json={
                        **body,
                        "max_tokens": 3,
                        "ignore_eos": True,
                        "stream": True,
                        "stream_options": {"include_usage": True},
                    },
                ).text
            )
        ]
        assert frames[-1] == "[DONE]" and frames[-2]["choices"] == []
        usage = frames[-2]["usage"]
        assert 0 <= usage["prompt_tokens_details"]["cached_tokens"] < usage["prompt_tokens"]
        assert all(f.get("usage") is None for f in frames[:-2])


def test_completions_continuous_usage(http: httpx.Client):
    frames = [
        d
        for _, d in sse(
            http.post(
                "/v1/completions",
                json={
                    "prompt": "Hi",
                    "max_tokens": 4,
                    "ignore_eos": True,
                    "stream": True,
                    "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                },
            ).text
        )
        if d != "[DONE]"
    ]
    counts = [f["usage"]["completion_tokens"] for f in frames]
    assert counts == sorted(counts) and counts[-1] == 4
    ignored = [
        d
        for _, d in sse(
            http.post(
                "/v1/completions",
                json={
                    "prompt": "Hi",
                    "max_tokens": 2,
                    "stream": True,
                    "stream_options": {"continuous_usage_stats": True},
                },
            ).text
        )
        if d != "[DONE]"
    ]
    assert all("usage" not in f or f["usage"] is None for f in ignored)  # needs include_usage


def test_chat_token_observations(http: httpx.Client):
    body = {
        "messages": USER,
        "max_tokens": 4,
        "ignore_eos": True,
        "return_token_ids": True,
        "return_token_timestamps": True,
    }
    result = http.post("/v1/chat/completions", json=body).json()
    assert result["reused_prompt_tokens"] == result["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert len(result["choices"][0]["token_ids"]) == result["usage"]["completion_tokens"] == 4
    stamps = result["choices"][0]["token_timestamps_ns"]
    assert len(stamps) == 4 and stamps == sorted(stamps)
    assert result["prompt_token_ids"] and len(result["prompt_token_ids"]) == result["usage"]["prompt_tokens"]
    for include_usage in (False, True):
        frames = [
            d
            for _, d in sse(
                http.post(
                    "/v1/chat/completions",
                    json={**body, "stream": True, "stream_options": {"include_usage": include_usage}},
                ).text
            )
            if d != "[DONE]"
        ]
        terminal = next(f for f in frames if f["choices"] and f["choices"][0]["finish_reason"])
        usage = frames[-1]["usage"]  # on the terminal chunk when no separate usage chunk is asked for
        assert usage["prompt_tokens_details"]["cached_tokens"] == terminal["reused_prompt_tokens"]
        assert (
            sum(len(f["choices"][0].get("token_ids", [])) for f in frames if f["choices"])
            == usage["completion_tokens"]
            == 4
        )


# -- observability ---------------------------------------------------------------------------------

API_MD_METRICS = (
    "flare_prefill_tokens_total",
    "flare_generated_tokens_total",
    "flare_decode_weight_bytes",
    "flare_verification_draft_tokens_total",
    "flare_verification_request_rounds_total",
    "flare_accepted_draft_tokens_total",
    "flare_draft_request_rounds_total",
    "flare_active_requests",
    "flare_pending_requests",
    "flare_requests_completed_total",
    "flare_reasoning_budget_cuts_total",
    "flare_requests_failed_total",
    "flare_replay_gpu_nanoseconds_total",
    "flare_replay_readiness_wait_nanoseconds_total",
    "flare_replay_readiness_samples_total",
    "flare_cache_reused_tokens_total",
    "flare_cached_kv_pages",
    "flare_free_kv_pages",
    "flare_total_kv_pages",
    "flare_kv_page_tokens",
    "flare_host_cache_hits_total",
    "flare_host_cache_reused_tokens_total",
    "flare_host_cache_memory_records",
    "flare_host_cache_disk_records",
    "flare_host_cache_bytes_out_total",
    "flare_host_cache_bytes_in_total",
    "flare_history_drafts_enabled",
    "flare_checkpoint_extra_work_nanoseconds_total",
    "flare_checkpoint_anchor_reservations",
    "flare_host_cache_copyout_headroom_deferrals_total",
    "flare_host_cache_parked_records",
    "flare_host_cache_store_skipped_total",
    "flare_host_cache_slots_in_use",
    "flare_host_cache_slots_total",
    "flare_host_cache_intake_slots",
    "flare_requests_admitted_total",
    "flare_requests_cancelled_total",
    "flare_http_inflight_requests",
    "flare_uptime_seconds",
    "flare_input_decoded_images_total",
    'flare_checkpoint_captures_total{role="anchor"}',
    'flare_checkpoint_skips_total{reason="work_budget"}',
    'flare_host_cache_held_total{tier="nvme"}',
    'flare_host_cache_dropped_total{reason="io_error",tier="dram"}',
    'flare_speculative_rounds_total{width="0"}',
    'flare_graph_launches_total{kind="step"}',
    'flare_host_cache_missing_tokens_bucket{le="+Inf"}',
    "flare_host_cache_estimated_transfer_ns_count",
    "flare_host_cache_estimated_prefill_ns_sum",
)
JSON_FIELDS = (
    "prefill_tokens",
    "generated_tokens",
    "decode_weight_bytes",
    "draft_steps",
    "verify_steps",
    "verification_drafts",
    "verification_rounds",
    "accepted_drafts",
    "draft_rounds",
    "active",
    "pending",
    "completed",
    "reasoning_budget_cuts",
    "failed",
    "replay_gpu_ns",
    "replay_readiness_wait_ns",
    "replay_readiness_samples",
    "reused_tokens",
    "cached_pages",
    "free_pages",
    "total_pages",
    "page_tokens",
    "host_hits",
    "host_reused_tokens",
    "host_memory_records",
    "host_disk_records",
    "host_bytes_out",
    "host_bytes_in",
)


def test_metrics_cover_api_md(anon: httpx.Client, http: httpx.Client):
    http.post("/v1/messages", json={"messages": USER, "max_tokens": 2})
    values = metrics(anon)
    missing = [name for name in API_MD_METRICS if name not in values]
    assert not missing
    assert all(name.startswith("flare_") for name in values)
    snapshot = anon.get("/metrics", params={"format": "json"}).json()
    for name in JSON_FIELDS:
        assert isinstance(snapshot[name], int) and not isinstance(snapshot[name], bool), name
    assert snapshot["learned_drafter"] is False
    # Beside the table: the KV pool's bytes (also a gauge) and element type.
    assert snapshot["kv_pool_dtype"] in ("float32", "bfloat16", "float16")
    assert snapshot["kv_pool_bytes"] == values["flare_kv_pool_bytes"] > 0
    assert snapshot["input_decoded_images_total"] == 0
    assert snapshot["generated_tokens"] == values["flare_generated_tokens_total"] > 0
    widths = {name: value for name, value in values.items() if name.startswith("flare_speculative_rounds_total")}
    assert snapshot["verify_steps"] == sum(widths.values()) > 0  # api.md: verify_steps is their sum
    first = snapshot["first_response"]
    assert set(first) == {"median_seconds", "samples", "window_seconds", "capacity", "truncated"}
    assert first["samples"] >= 1 and first["median_seconds"] > 0 and first["window_seconds"] == 60
    text = anon.get("/metrics", headers={"Accept": "application/json;q=0.5, text/plain"})
    assert text.headers["content-type"].startswith("text/plain")
    assert anon.get("/metrics", headers={"Accept": "application/json, text/plain"}).json()["page_tokens"] > 0

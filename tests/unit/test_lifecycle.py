"""A server's life beyond single requests, on real servers (tiny core): bounded queueing with
retryable 503s, graceful drain on SIGTERM (health first, then in-flight work, then terminal
errors past the deadline), and an engine step that raises, end to end."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from helios.app import create_app
from helios.engine.engine import QUEUE_DEADLINE_MESSAGE, Engine
from helios.launcher import HeliosProcess
from helios.manifest import Manifest
from helios.transport.config import ServerConfig
from helios.transport.lifecycle import DRAIN_MESSAGE
from tests.unit.live import ANTHROPIC, USER, metrics, sse, wait_for, wait_idle
from tests.unit.scripted import LoopbackServer

HOLD = {"prompt": "Count:", "max_tokens": 100000, "ignore_eos": True, "stream": True}


def config_server(core: Path, folder: Path, *args: str, **table: object) -> HeliosProcess:
    lines = "".join(f"{key} = {value}\n" for key, value in table.items())
    (folder / "helios.toml").write_text(f"[server]\n{lines}")
    return HeliosProcess(core, "--config", str(folder / "helios.toml"), *args)


def first_data(stream: httpx.Response) -> Iterator[str]:
    """The stream's lines after its first data line. Keep the iterator: dropping a partly read
    httpx iterator closes the connection (the server would see a disconnect)."""
    lines = stream.iter_lines()
    for line in lines:
        if line.startswith("data: "):
            return lines
    raise AssertionError("the stream ended before any data")


def rest(lines: Iterator[str]) -> list:
    return sse("\n".join(lines))


def test_default_queue_is_bounded_by_the_cores_concurrency():
    config = ServerConfig()
    assert config.effective_queue_size(8) == 32 and config.queue_timeout_s > 0
    assert ServerConfig(queue_size=5).effective_queue_size(8) == 5


def test_overload_gets_retryable_503s_in_each_shape(tiny_core, tmp_path):
    server = config_server(tiny_core, tmp_path, "--max-concurrency", "1", queue_size=1, queue_timeout_s=3)
    try:
        with httpx.Client(base_url=server.url, headers=ANTHROPIC, timeout=60) as http:
            with http.stream("POST", "/v1/completions", json=HOLD) as held:  # the one batch slot
                assert held.status_code == 200
                held_lines = first_data(held)
                queued: dict[str, httpx.Response] = {}
                waiter = threading.Thread(
                    target=lambda: queued.update(r=http.post("/v1/messages", json={"messages": USER, "max_tokens": 2}))
                )
                waiter.start()
                wait_for(lambda: metrics(http)["flare_pending_requests"] == 1)
                full = http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2})
                assert full.status_code == 503 and full.headers["retry-after"].isdigit()
                error = full.json()["error"]
                assert error["type"] == "server_error" and "queue is full" in error["message"]
                waiter.join(30)
                late = queued["r"]  # waited past the queue deadline: 503 in the Messages shape
                assert late.status_code == 503 and late.headers["retry-after"].isdigit()
                assert late.json() == {
                    "type": "error",
                    "error": {"type": "api_error", "message": QUEUE_DEADLINE_MESSAGE},
                }
                streamed = http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2, "stream": True})
                assert streamed.status_code == 200  # enqueued, then a terminal error event, no [DONE]
                frames = sse(streamed.text)
                assert frames[-1][1]["error"]["message"] == QUEUE_DEADLINE_MESSAGE and "[DONE]" not in streamed.text
                # The request holding the slot streamed on through the overload, untouched by it.
                frame = json.loads(next(line for line in held_lines if line.startswith("data: "))[6:])
                assert "error" not in frame and frame["choices"][0]["text"] is not None
            after = wait_idle(http)
            assert after["flare_http_admission_slots_used"] == 0 and after["flare_pending_requests"] == 0
            assert http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2}).status_code == 200
    finally:
        server.stop()


def test_sigterm_drains_in_flight_streams_then_exits(tiny_core, tmp_path):
    server = config_server(tiny_core, tmp_path, drain_timeout_s=60)
    with httpx.Client(base_url=server.url, timeout=60) as http:
        body = {
            "prompt": "Count:",
            "max_tokens": 1200,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        with http.stream("POST", "/v1/completions", json=body) as stream:
            lines = first_data(stream)
            server.process.send_signal(signal.SIGTERM)
            wait_for(lambda: http.get("/health").status_code == 503)
            health = http.get("/health")
            assert set(health.json()["error"]) == {"type", "message", "param", "code"}
            assert health.headers["retry-after"].isdigit()
            refused = http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2})
            assert refused.status_code == 503 and refused.headers["retry-after"].isdigit()
            frames = rest(lines)
        assert frames[-1][1] == "[DONE]"  # the stream ran to its full length after the signal
        assert frames[-2][1]["usage"]["completion_tokens"] == 1200
    assert server.process.wait(30) == 0
    server.stop()


def test_drain_deadline_ends_remaining_requests_with_their_protocol_errors(tiny_core, tmp_path):
    server = config_server(tiny_core, tmp_path, drain_timeout_s=1)
    with httpx.Client(base_url=server.url, headers=ANTHROPIC, timeout=60) as http:
        buffered: dict[str, httpx.Response] = {}
        waiter = threading.Thread(
            target=lambda: buffered.update(
                r=http.post("/v1/messages", json={"messages": USER, "max_tokens": 100000, "ignore_eos": True})
            )
        )
        with http.stream(
            "POST",
            "/v1/chat/completions",
            json={"messages": USER, "max_tokens": 100000, "ignore_eos": True, "stream": True},
        ) as stream:
            lines = first_data(stream)
            waiter.start()
            # Both in the engine: counted in flight earlier, the Messages request might still be
            # planned when SIGTERM comes, and a draining server refuses it with another message.
            wait_for(lambda: (m := metrics(http))["flare_active_requests"] + m["flare_pending_requests"] == 2)
            started = time.monotonic()
            server.process.send_signal(signal.SIGTERM)
            frames = rest(lines)
        assert time.monotonic() - started < 15
        assert frames[-1][1]["error"]["message"] == DRAIN_MESSAGE and "[DONE]" not in [f[1] for f in frames]
        waiter.join(30)
        late = buffered["r"]
        assert late.status_code == 503 and late.json()["error"] == {"type": "api_error", "message": DRAIN_MESSAGE}
    assert server.process.wait(30) == 0
    server.stop()


def real_engine_server(core: Path) -> tuple[LoopbackServer, Engine]:
    """create_app over a real engine, served in this process."""
    manifest = Manifest.load(core)
    engine = Engine(core, manifest, max_concurrency=4, kv_pages=256)
    engine.start()
    return LoopbackServer(create_app(manifest, core, engine, ServerConfig(port=0))), engine


def test_a_step_that_raises_fails_its_requests_and_the_server_keeps_serving(tiny_core):
    server, engine = real_engine_server(tiny_core)
    runner = engine.runner
    real_step = runner.step
    failures = {"left": 0}

    def flaky_step(rows):
        if failures["left"]:
            failures["left"] -= 1
            raise RuntimeError("injected device fault")
        return real_step(rows)

    runner.step = flaky_step
    try:
        with httpx.Client(base_url=server.url, headers=ANTHROPIC, timeout=60) as http:
            failures["left"] = 1
            chat = http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 4})
            assert chat.status_code == 500 and chat.headers.get("x-request-id")
            error = chat.json()["error"]
            assert error["type"] == "server_error" and "injected device fault" in error["message"]
            failures["left"] = 1
            messages = http.post("/v1/messages", json={"messages": USER, "max_tokens": 4})
            assert messages.status_code == 500 and messages.json()["error"]["type"] == "api_error"
            failures["left"] = 1
            stream = http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 4, "stream": True})
            frames = sse(stream.text)
            assert stream.status_code == 200 and "injected device fault" in frames[-1][1]["error"]["message"]
            assert all(f[1] != "[DONE]" for f in frames)
            assert len(frames) == 1  # it failed before the first token: no role chunk, only the error
            assert http.get("/health").json() == {"status": "ok"}  # the loop survived the fault
            ok = http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 4})
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
            after = wait_idle(http)
            assert after["flare_http_admission_slots_used"] == 0 and after["flare_active_requests"] == 0
            assert after["flare_free_kv_pages"] + after["flare_cached_kv_pages"] == after["flare_total_kv_pages"]
            assert after["flare_requests_failed_total"] >= 3
    finally:
        server.stop()
        engine.shutdown()


def test_a_second_signal_ends_the_drain_at_once(tiny_core, tmp_path):
    server = config_server(tiny_core, tmp_path, drain_timeout_s=600)
    with httpx.Client(base_url=server.url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=HOLD) as stream:
            lines = first_data(stream)
            server.process.send_signal(signal.SIGTERM)
            wait_for(lambda: http.get("/health").status_code == 503)
            started = time.monotonic()
            server.process.send_signal(signal.SIGTERM)
            frames = rest(lines)
        assert time.monotonic() - started < 15  # not the 600 s drain deadline
        assert frames[-1][1]["error"]["message"] == DRAIN_MESSAGE
    assert server.process.wait(30) == 0
    server.stop()

"""The web page at / in a real headless Chromium against real tiny servers on loopback: the model
card and its sampling controls, a streamed multi-turn chat (what the page shows equals what went
over the wire), reasoning shown dimmed, the live plots, the API-key prompt, and no console errors
throughout.

Screenshots land under $FLARE_TEST_ARTIFACTS/web when it is set (kept for a person to look at),
else under the test's tmp_path. The driver is tests/server/browser.py (DevTools over a websocket).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from helios.launcher import HeliosProcess
from tests.conftest import TINY_API_KEY
from tests.server.browser import Browser, ConsoleError, Exchange, find_chromium
from tests.unit.live import sse

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p")
PLOT_SERIES = {"throughput", "ttft", "requests", "kv", "reuse", "hits", "spec-depth", "spec-accept"}
MAX_TOKENS = 8  # the tiny model's text is random: short replies keep each turn quick
SEED = 7  # with the tiny checkpoint's seeded weights, the same reply on every run
KEY_STORAGE = "helios.apiKey"  # the sessionStorage name app.js keeps the key under

IDLE_WITH_STATS = "document.body.dataset.state === 'idle' && document.querySelector('#stats [data-stat]') !== null"
SHOWN_STATS = (
    "Object.fromEntries([...document.querySelectorAll('#stats [data-stat]')].map(e => [e.dataset.stat, e.textContent]))"
)
LAST_REPLY = "document.querySelector('#messages .assistant:last-child .content').textContent"
CANVAS_PIXELS = (
    "Object.fromEntries([...document.querySelectorAll('canvas.plot')].map(c => [c.dataset.series, c.toDataURL()]))"
)


# A string condition is evaluated when each test is set up, before its fixtures: a machine without
# Chromium skips without exporting cores or starting servers (and collecting never installs it).
pytestmark = pytest.mark.skipif(
    "find_chromium() is None",
    reason="no Chromium: install Debian's `chromium` package (apt-get, as root) to run the web page tests",
)


@pytest.fixture(scope="module")
def chromium() -> str:
    binary = find_chromium()
    assert binary is not None  # the skip mark above checked
    return binary


@pytest.fixture
def browser(chromium: str) -> Iterator[Browser]:
    with Browser(chromium) as opened:
        yield opened


@pytest.fixture(scope="module")
def think_server(tiny_think_core) -> Iterator[HeliosProcess]:
    """The tiny reasoning core (tests/data/qwen3_tiny.toml): its replies open in reasoning, and its
    card fixes min_p (a null range)."""
    server = HeliosProcess(tiny_think_core)
    yield server
    server.stop()


@pytest.fixture
def artifacts(tmp_path: Path) -> Path:
    root = os.environ.get("FLARE_TEST_ARTIFACTS")
    folder = Path(root) / "web" if root else tmp_path
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def model_card(url: str, key: str | None = None) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    response = httpx.get(url + "/v1/models", headers=headers, timeout=30)
    response.raise_for_status()
    return response.json()["data"][0]


def open_page(browser: Browser, url: str, model_id: str) -> None:
    browser.navigate(url + "/")
    browser.wait_for(f"document.getElementById('model-id').textContent === {json.dumps(model_id)}")


def save_screenshot(browser: Browser, folder: Path, name: str) -> Path:
    path = browser.screenshot(folder / f"{name}.png")
    assert path.is_file() and path.stat().st_size > 0
    assert path.read_bytes().startswith(b"\x89PNG")
    return path


def streamed(exchange: Exchange, part: str = "content") -> tuple[str, dict[str, Any]]:
    """The text of one delta field (content, reasoning_content) and the usage object a chat
    completion stream carried."""
    frames = [data for _, data in sse(exchange.response_body or "")]
    assert frames[-1] == "[DONE]"
    chunks = [frame for frame in frames if isinstance(frame, dict)]
    text = "".join(choice["delta"].get(part) or "" for chunk in chunks for choice in chunk["choices"])
    usage = next(chunk["usage"] for chunk in reversed(chunks) if chunk.get("usage"))
    return text, usage


def assert_no_errors(errors: list[ConsoleError]) -> None:
    assert errors == [], "the page logged errors:\n" + "\n".join(map(str, errors))


def test_page_loads_the_model_card(tiny_server, browser, artifacts):
    card = model_card(tiny_server.url)
    open_page(browser, tiny_server.url, card["id"])
    flare = card["flare"]
    assert browser.evaluate("document.getElementById('model-card').textContent").count(str(card["max_model_len"])) == 1
    for name in SAMPLING_FIELDS:
        control = browser.evaluate(
            f"(() => {{ const e = document.getElementById('{name}');"
            " return {value: e.value, min: e.min, max: e.max, disabled: e.disabled}; })()"
        )
        assert float(control["value"]) == flare["sampling_defaults"][name]
        bounds = flare["sampling_ranges"][name]
        assert control["disabled"] is (bounds is None)
        if bounds is not None:
            assert (float(control["min"]), float(control["max"])) == (bounds["min"], bounds["max"])
    assert int(browser.evaluate("document.getElementById('max_tokens').value")) == flare["default_max_tokens"]
    save_screenshot(browser, artifacts, "model-card")

    # A core that fixes a field (a null range): its input is disabled and the request leaves it
    # out; values beyond a range are clamped to it before they are sent.
    fixed = json.loads(json.dumps(card))
    fixed["flare"]["sampling_ranges"]["top_k"] = None
    browser.evaluate(f"showCard({json.dumps(fixed)})")
    assert browser.evaluate("document.getElementById('top_k').disabled") is True
    browser.evaluate("document.getElementById('temperature').value = '99'")
    body = browser.evaluate("samplingBody()")
    assert "top_k" not in body
    assert body["temperature"] == flare["sampling_ranges"]["temperature"]["max"]
    assert_no_errors(browser.errors)


def test_chat_streams_replies_and_their_stats(tiny_server, browser, artifacts):
    card = model_card(tiny_server.url)
    open_page(browser, tiny_server.url, card["id"])
    browser.evaluate(f"document.getElementById('max_tokens').value = '{MAX_TOKENS}'")
    browser.type("#seed", str(SEED))

    browser.type("#prompt", "Write a haiku about paged attention.")
    browser.click("#send")
    browser.wait_for(f"document.querySelectorAll('#messages .assistant').length === 1 && {IDLE_WITH_STATS}", 60)
    [first] = browser.requests("/v1/chat/completions")
    sent = json.loads(first.request_body or "{}")
    assert sent["model"] == card["id"]
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
    assert (sent["max_tokens"], sent["seed"]) == (MAX_TOKENS, SEED)
    assert sent["messages"] == [{"role": "user", "content": "Write a haiku about paged attention."}]
    text, usage = streamed(first)
    shown_text = browser.evaluate(LAST_REPLY)
    assert shown_text.strip() and shown_text == text  # exactly what streamed, token by token appended
    stats = browser.evaluate(SHOWN_STATS)
    assert stats["completion_tokens"] == str(usage["completion_tokens"])
    assert 0 < usage["completion_tokens"] <= MAX_TOKENS
    assert stats["prompt_tokens"] == str(usage["prompt_tokens"])
    assert stats["cached_tokens"] == str(usage["prompt_tokens_details"]["cached_tokens"])
    assert stats["ttft_ms"] != "–"
    save_screenshot(browser, artifacts, "chat-first-reply")

    # The second turn, sent with Enter, carries the first one (system prompt first).
    browser.click(".system-box summary")  # the system prompt box starts folded
    browser.type("#system", "You are terse.")
    browser.type("#prompt", "And another one.")
    browser.press_enter()
    browser.wait_for(f"document.querySelectorAll('#messages .assistant').length === 2 && {IDLE_WITH_STATS}", 60)
    first, second = browser.requests("/v1/chat/completions")
    assert json.loads(second.request_body or "{}")["messages"] == [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Write a haiku about paged attention."},
        {"role": "assistant", "content": text},
        {"role": "user", "content": "And another one."},
    ]
    second_text, second_usage = streamed(second)
    assert browser.evaluate(LAST_REPLY) == second_text
    assert browser.evaluate(SHOWN_STATS)["completion_tokens"] == str(second_usage["completion_tokens"])
    save_screenshot(browser, artifacts, "chat-second-reply")

    # Shift+Enter is a new line, not a send; Reset forgets the conversation.
    browser.type("#prompt", "line one")
    browser.press_enter(shift=True)
    assert browser.evaluate("document.getElementById('prompt').value") == "line one\n"
    assert len(browser.requests("/v1/chat/completions")) == 2
    browser.click("#reset")
    assert browser.evaluate("document.querySelectorAll('#messages .message').length") == 0
    assert browser.evaluate("state.history.length") == 0
    assert_no_errors(browser.errors)


def test_reasoning_is_shown_dimmed_and_fixed_fields_are_disabled(think_server, browser, artifacts):
    card = model_card(think_server.url)
    assert card["flare"]["sampling_ranges"]["min_p"] is None
    open_page(browser, think_server.url, card["id"])
    assert browser.evaluate("document.getElementById('min_p').disabled") is True
    browser.evaluate(f"document.getElementById('max_tokens').value = '{MAX_TOKENS}'")
    browser.type("#seed", str(SEED))
    browser.type("#prompt", "Think first.")
    browser.click("#send")
    browser.wait_for(f"document.querySelectorAll('#messages .assistant').length === 1 && {IDLE_WITH_STATS}", 60)
    [exchange] = browser.requests("/v1/chat/completions")
    assert "min_p" not in json.loads(exchange.request_body or "{}")  # fixed: the server's default stands
    reasoning, usage = streamed(exchange, "reasoning_content")
    answer, _ = streamed(exchange)
    assert reasoning
    shown = browser.evaluate(
        "(() => { const reply = document.querySelector('#messages .assistant:last-child');"
        " const reasoning = reply.querySelector('.reasoning'), content = reply.querySelector('.content');"
        " return {reasoning: reasoning.textContent, hidden: reasoning.hidden, content: content.textContent,"
        " dim: getComputedStyle(reasoning).color, plain: getComputedStyle(content).color}; })()"
    )
    assert (shown["reasoning"], shown["content"], shown["hidden"]) == (reasoning, answer, False)
    assert shown["dim"] != shown["plain"]
    assert browser.evaluate(SHOWN_STATS)["completion_tokens"] == str(usage["completion_tokens"])
    save_screenshot(browser, artifacts, "reasoning")

    # Tool calls (the page sends no tools, so none stream here): a call whose arguments arrive in
    # pieces after its name renders as one call.
    pieces = [
        {"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather"}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]},
    ]
    rendered = browser.evaluate(
        f"(() => {{ const reply = new ReplyView(); for (const d of {json.dumps(pieces)}) reply.apply(d);"
        " return [...reply.parts.tools.querySelectorAll('.tool-call')].map(e => e.textContent); })()"
    )
    assert rendered == ['get_weather({"city": "Paris"})']
    assert_no_errors(browser.errors)


def test_plots_follow_the_metrics(tiny_server, browser, artifacts):
    card = model_card(tiny_server.url)
    open_page(browser, tiny_server.url, card["id"])
    series = browser.evaluate("[...document.querySelectorAll('canvas.plot')].map(c => c.dataset.series)")
    assert set(series) == PLOT_SERIES
    polls = browser.wait_for("window.heliosPolls >= 2 && window.heliosPolls")
    time.sleep(3)
    assert browser.evaluate("window.heliosPolls") >= polls + 2  # about one a second

    before = browser.evaluate(CANVAS_PIXELS)
    body = {"model": card["id"], "messages": [{"role": "user", "content": "Count to ten."}], "max_tokens": 48}
    response = httpx.post(tiny_server.url + "/v1/chat/completions", json={**body, "ignore_eos": True}, timeout=120)
    assert response.status_code == 200, response.text
    polls = browser.evaluate("window.heliosPolls")
    browser.wait_for(f"window.heliosPolls >= {polls + 2}")  # a poll after the generation, and its delta
    after = browser.evaluate(CANVAS_PIXELS)
    assert before["throughput"] != after["throughput"]
    # The generated-token rate over the history saw the generation.
    assert browser.evaluate("Math.max(...samples.throughput.map(s => s[0]))") > 0
    assert len(browser.evaluate("samples.requests")) <= 60  # a rolling window
    assert browser.evaluate("document.getElementById('server-status').textContent") == "live"
    save_screenshot(browser, artifacts, "plots")
    assert_no_errors(browser.errors)


def test_a_failed_poll_is_shown_not_thrown(tiny_server, browser, artifacts):
    card = model_card(tiny_server.url)
    open_page(browser, tiny_server.url, card["id"])
    browser.wait_for("window.heliosPolls >= 1")
    offline = {"latency": 0, "downloadThroughput": -1, "uploadThroughput": -1}
    browser.send("Network.emulateNetworkConditions", offline=True, **offline)
    browser.wait_for("document.getElementById('server-status').textContent.startsWith('metrics unavailable')")
    save_screenshot(browser, artifacts, "poll-failed")
    browser.send("Network.emulateNetworkConditions", offline=False, **offline)
    polls = browser.evaluate("window.heliosPolls")
    browser.wait_for(f"window.heliosPolls > {polls} && document.getElementById('server-status').textContent === 'live'")
    # Only the browser's own log lines for the refused requests: no exception, no console.error.
    assert all(e.kind == "log" and e.source == "network" for e in browser.errors), browser.errors


def test_keyed_server_asks_for_the_key(tiny_keyed_server, browser, artifacts):
    url = tiny_keyed_server.url
    card = model_card(url, TINY_API_KEY)
    browser.navigate(url + "/")
    browser.wait_for("!document.getElementById('key-form').hidden")
    assert browser.evaluate("document.getElementById('model-id').textContent") != card["id"]
    save_screenshot(browser, artifacts, "key-prompt")

    # A wrong key is refused and asked again; the right one loads the card.
    browser.type("#api-key", "not-the-key")
    browser.click("#api-key-save")
    browser.wait_for(
        "!document.getElementById('key-form').hidden"
        " && document.getElementById('key-message').textContent.includes('refused')"
    )
    browser.type("#api-key", TINY_API_KEY)
    browser.click("#api-key-save")
    browser.wait_for(f"document.getElementById('model-id').textContent === {json.dumps(card['id'])}")
    assert browser.evaluate("document.getElementById('key-form').hidden") is True
    assert browser.evaluate(f"sessionStorage.getItem('{KEY_STORAGE}')") == TINY_API_KEY
    assert browser.evaluate("localStorage.length") == 0
    assert browser.evaluate("document.cookie") == ""
    polls = browser.evaluate("window.heliosPolls")
    browser.wait_for(f"window.heliosPolls > {polls}")  # a poll sent with the key
    save_screenshot(browser, artifacts, "key-accepted")

    # Every call after the key carries it (the metrics poll too, though /metrics is open).
    models = browser.requests("/v1/models")
    assert [m.status for m in models] == [401, 401, 200]
    assert models[-1].request_headers.get("authorization") == f"Bearer {TINY_API_KEY}"
    latest_poll = browser.requests("/metrics")[-1]
    assert latest_poll.request_headers.get("authorization") == f"Bearer {TINY_API_KEY}"
    # The browser logs each 401 response itself; nothing else may appear.
    refused = [e for e in browser.errors if e.source == "network" and "401" in e.text]
    assert len(refused) == 2
    assert_no_errors([e for e in browser.errors if e not in refused])

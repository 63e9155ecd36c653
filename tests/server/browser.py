"""A minimal Chrome DevTools Protocol driver for the web page tests: headless Chromium, one page.

No browser-automation dependency: Chromium's own --remote-debugging-port, its target list over
HTTP (httpx) and the page's websocket through aiohttp (already a helios dependency). The websocket
runs on an asyncio loop in a background thread, so the tests stay synchronous like the rest of
tests/server. Console errors, uncaught exceptions (unhandled rejections included) and error log
entries are collected into `Browser.errors`; requests and their bodies are kept so a test can
compare what the page shows with what went over the wire.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import aiohttp
import httpx

CHROMIUM_NAMES = ("chromium", "chromium-browser")
APT_TIMEOUT_S = 900  # a fresh install fetches ~100 MB of packages
START_TIMEOUT_S = 30.0
COMMAND_TIMEOUT_S = 30.0


def _which_chromium() -> str | None:
    return next((path for name in CHROMIUM_NAMES if (path := shutil.which(name))), None)


@functools.cache
def find_chromium() -> str | None:
    """The Chromium binary; installed with apt-get when missing and this process may (root on a
    Debian-like system); None when there is none and it cannot be installed."""
    found = _which_chromium()
    if found or getattr(os, "geteuid", lambda: 1)() != 0 or shutil.which("apt-get") is None:
        return found
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "--no-install-recommends", "chromium"]
    try:
        if subprocess.run(install, env=env, capture_output=True, timeout=APT_TIMEOUT_S).returncode != 0:
            # Stale or missing package lists: refresh them once, then try again.
            subprocess.run(["apt-get", "update"], env=env, capture_output=True, timeout=APT_TIMEOUT_S)
            subprocess.run(install, env=env, capture_output=True, timeout=APT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return None
    return _which_chromium()


class DevToolsError(RuntimeError):
    """A DevTools command answered with an error."""


class JavaScriptError(RuntimeError):
    """An expression given to `Browser.evaluate` threw."""


@dataclass(frozen=True)
class ConsoleError:
    kind: str  # "console" (console.error), "exception" (uncaught, rejections included) or "log"
    source: str  # the log entry's source ("network", "javascript", ...); the kind otherwise
    text: str
    url: str = ""


@dataclass
class Exchange:
    """One HTTP request the page made, with its response once it finished."""

    request_id: str
    url: str
    method: str
    request_headers: dict[str, str]  # names in lower case (HTTP names are case-insensitive)
    request_body: str | None
    status: int | None = None
    finished: bool = False
    failed: str | None = None  # Chromium's error text when the request failed
    response_body: str | None = field(default=None, repr=False)


class Browser:
    """Headless Chromium with one page target, driven over its DevTools websocket."""

    def __init__(self, binary: str, window: tuple[int, int] = (1280, 900)):
        self.errors: list[ConsoleError] = []
        self.exchanges: dict[str, Exchange] = {}
        self._profile = Path(tempfile.mkdtemp(prefix="flare-chromium-"))
        self._stderr = tempfile.TemporaryFile("w+")
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._next_id = 0
        self._loaded: asyncio.Event | None = None
        self._session: aiohttp.ClientSession | None = None
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._reader: asyncio.Task[None] | None = None
        self.process = subprocess.Popen(
            [
                binary,
                "--headless=new",
                "--no-sandbox",  # root in a container: Chromium's sandbox cannot start there
                "--disable-gpu",
                "--remote-debugging-port=0",  # any free port, written to DevToolsActivePort
                f"--user-data-dir={self._profile}",
                "--no-first-run",
                "--no-default-browser-check",
                "--disable-extensions",
                "--disable-background-networking",
                f"--window-size={window[0]},{window[1]}",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=self._stderr,
            start_new_session=True,  # its renderers and helpers end with it (close() stops the group)
        )
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="devtools", daemon=True)
        self._thread.start()
        try:
            self._run(self._connect(self._page_websocket(self._devtools_port())), START_TIMEOUT_S)
            for domain in ("Page", "Runtime", "Log", "Network"):
                self.send(f"{domain}.enable")
            # The viewport itself (--window-size also counts the headless window's frame).
            self.send(
                "Emulation.setDeviceMetricsOverride",
                width=window[0],
                height=window[1],
                deviceScaleFactor=1,
                mobile=False,
            )
        except BaseException:
            self.close()
            raise

    # -- the public driver ---------------------------------------------------------------------------

    def navigate(self, url: str, timeout: float = COMMAND_TIMEOUT_S) -> None:
        """Open `url` in the page and return once its load event fired."""
        self._run(self._navigate(url, timeout), timeout + 5)

    def evaluate(self, expression: str, timeout: float = COMMAND_TIMEOUT_S) -> Any:
        """The value of a JavaScript expression in the page (promises awaited, returned as JSON)."""
        result = self.send(
            "Runtime.evaluate",
            timeout,
            expression=expression,
            returnByValue=True,
            awaitPromise=True,
            userGesture=True,
        )
        details = result.get("exceptionDetails")
        if details:
            thrown = details.get("exception", {}).get("description") or details.get("text", "")
            raise JavaScriptError(f"{expression!r} threw: {thrown}")
        return result.get("result", {}).get("value")

    def wait_for(self, condition: str, timeout: float = 10.0, interval: float = 0.05) -> Any:
        """Poll a JavaScript expression until it is truthy; its value, or TimeoutError."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.evaluate(condition)
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"{condition!r} still falsy after {timeout}s; page errors: {self.errors}")
            time.sleep(interval)

    def screenshot(self, path: Path) -> Path:
        """The page's viewport as a PNG file at `path`."""
        data = self.send("Page.captureScreenshot", format="png")["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path

    def click(self, selector: str) -> None:
        """A real mouse click (press and release) at the middle of the element `selector` names."""
        box = self.evaluate(
            f"(() => {{ const e = document.querySelector({json.dumps(selector)}); e.scrollIntoView({{block: 'center'}});"
            " const r = e.getBoundingClientRect(); return {x: r.x + r.width / 2, y: r.y + r.height / 2}; })()"
        )
        for kind in ("mousePressed", "mouseReleased"):
            self.send("Input.dispatchMouseEvent", type=kind, x=box["x"], y=box["y"], button="left", clickCount=1)

    def type(self, selector: str, text: str) -> None:
        """Focus the element `selector` names and type `text` into it (as an input method would)."""
        self.evaluate(f"document.querySelector({json.dumps(selector)}).focus()")
        self.send("Input.insertText", text=text)

    def press_enter(self, shift: bool = False) -> None:
        """Enter (Shift+Enter with `shift`) to the focused element."""
        keys = {"key": "Enter", "code": "Enter", "windowsVirtualKeyCode": 13, "modifiers": 8 if shift else 0}
        self.send("Input.dispatchKeyEvent", type="keyDown", text="\r", **keys)
        self.send("Input.dispatchKeyEvent", type="keyUp", **keys)

    def requests(self, url_part: str) -> list[Exchange]:
        """The finished requests whose URL contains `url_part`, oldest first, with their bodies."""
        found = []
        for exchange in list(self.exchanges.values()):
            if url_part not in exchange.url or not exchange.finished:
                continue
            if exchange.response_body is None:
                body = self.send("Network.getResponseBody", requestId=exchange.request_id)
                raw = body["body"]
                exchange.response_body = base64.b64decode(raw).decode() if body.get("base64Encoded") else raw
            found.append(exchange)
        return found

    def send(self, method: str, timeout: float = COMMAND_TIMEOUT_S, **params: Any) -> dict[str, Any]:
        """One DevTools command; its result, or DevToolsError."""
        return self._run(self._command(method, params, timeout), timeout + 5)

    def close(self) -> None:
        if self._loop.is_running():
            try:
                self._run(self._disconnect(), 10)
            except Exception:
                pass  # the browser may already be gone; the process is stopped below either way
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        if not self._loop.is_running() and not self._loop.is_closed():
            self._loop.close()
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
        self._stderr.close()
        shutil.rmtree(self._profile, ignore_errors=True)

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    # -- startup ---------------------------------------------------------------------------------------

    def _devtools_port(self) -> int:
        """The port Chromium chose, from the DevToolsActivePort file it writes into the profile."""
        marker = self._profile / "DevToolsActivePort"
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"chromium exited with {self.process.returncode}:\n{self._output()}")
            lines = marker.read_text().splitlines() if marker.is_file() else []
            if lines and lines[0].isdigit():
                return int(lines[0])
            time.sleep(0.05)
        raise RuntimeError(f"chromium wrote no DevToolsActivePort in {START_TIMEOUT_S}s:\n{self._output()}")

    def _page_websocket(self, port: int) -> str:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            targets = httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=5).json()
            pages = [t["webSocketDebuggerUrl"] for t in targets if t.get("type") == "page"]
            if pages:
                return pages[0]
            time.sleep(0.05)
        raise RuntimeError("chromium opened no page target")

    def _output(self) -> str:
        self._stderr.seek(0)
        return self._stderr.read()[-3000:]

    # -- the websocket (on the loop thread) ------------------------------------------------------------

    def _run(self, coroutine: Coroutine[Any, Any, Any], timeout: float) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    async def _connect(self, url: str) -> None:
        self._session = aiohttp.ClientSession()
        # No size limit: screenshots and response bodies arrive as one large message each.
        self._ws = await self._session.ws_connect(url, max_msg_size=0)
        self._reader = asyncio.create_task(self._read())

    async def _disconnect(self) -> None:
        if self._ws is not None and not self._ws.closed:
            try:
                await asyncio.wait_for(self._command("Browser.close", {}, 5), 5)
            except (DevToolsError, ConnectionError, TimeoutError):
                pass
            await self._ws.close()
        if self._session is not None:
            await self._session.close()

    async def _command(self, method: str, params: dict[str, Any], timeout: float) -> dict[str, Any]:
        assert self._ws is not None
        self._next_id += 1
        message_id = self._next_id
        future: asyncio.Future[dict[str, Any]] = self._loop.create_future()
        self._pending[message_id] = future
        await self._ws.send_json({"id": message_id, "method": method, "params": params})
        try:
            reply = await asyncio.wait_for(future, timeout)
        finally:
            self._pending.pop(message_id, None)
        if "error" in reply:
            raise DevToolsError(f"{method}: {reply['error'].get('message')} {reply['error'].get('data', '')}".strip())
        return reply.get("result", {})

    async def _navigate(self, url: str, timeout: float) -> None:
        self._loaded = asyncio.Event()
        result = await self._command("Page.navigate", {"url": url}, timeout)
        if result.get("errorText"):
            raise DevToolsError(f"navigating to {url}: {result['errorText']}")
        await asyncio.wait_for(self._loaded.wait(), timeout)

    async def _read(self) -> None:
        assert self._ws is not None
        async for message in self._ws:
            if message.type != aiohttp.WSMsgType.TEXT:
                continue
            payload = json.loads(message.data)
            if "id" in payload:
                future = self._pending.get(payload["id"])
                if future is not None and not future.done():
                    future.set_result(payload)
            else:
                self._on_event(payload.get("method", ""), payload.get("params", {}))
        for future in self._pending.values():
            if not future.done():
                future.set_exception(ConnectionError("the DevTools connection closed"))

    def _on_event(self, method: str, params: dict[str, Any]) -> None:
        if method == "Page.loadEventFired" and self._loaded is not None:
            self._loaded.set()
        elif method == "Runtime.consoleAPICalled" and params.get("type") == "error":
            text = " ".join(_remote_text(arg) for arg in params.get("args", []))
            self.errors.append(ConsoleError("console", "console", text))
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            text = details.get("exception", {}).get("description") or details.get("text", "")
            self.errors.append(ConsoleError("exception", "exception", text, details.get("url", "")))
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            entry = params["entry"]
            self.errors.append(
                ConsoleError("log", entry.get("source", ""), entry.get("text", ""), entry.get("url", ""))
            )
        elif method == "Network.requestWillBeSent":
            request = params["request"]
            self.exchanges[params["requestId"]] = Exchange(
                params["requestId"],
                request["url"],
                request["method"],
                request.get("headers", {}),
                request.get("postData"),
            )
        elif method == "Network.responseReceived" and params["requestId"] in self.exchanges:
            self.exchanges[params["requestId"]].status = params["response"]["status"]
        elif method == "Network.loadingFinished" and params["requestId"] in self.exchanges:
            self.exchanges[params["requestId"]].finished = True
        elif method == "Network.loadingFailed" and params["requestId"] in self.exchanges:
            self.exchanges[params["requestId"]].failed = params.get("errorText", "failed")


def _remote_text(value: dict[str, Any]) -> str:
    """A console argument (a Runtime.RemoteObject) as text."""
    if "value" in value:
        return str(value["value"])
    return str(value.get("description") or value.get("type", ""))

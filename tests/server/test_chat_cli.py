"""`helios chat`, driven through a pseudo-terminal against a real server: streaming replies with
their usage line, the conversation kept across turns, /system, /reset, multi-line input, errors
shown without leaving the chat, and /exit."""

from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import sys
import time

import httpx

from helios.launcher import HeliosProcess
from tests.conftest import TINY_API_KEY

ANSI = re.compile(r"\x1b\[[0-9;]*m")
USAGE = re.compile(r"\[(\d+) prompt tokens \((\d+) cached\), (\d+) generated, finish: (\w+)\]")


class Terminal:
    """A process on a pseudo-terminal: type lines, read what it printed (ANSI codes stripped)."""

    def __init__(self, *args: str):
        self.master, slave = pty.openpty()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "helios.cli", *args], stdin=slave, stdout=slave, stderr=slave, close_fds=True
        )
        os.close(slave)
        self.seen = ""

    def type(self, line: str) -> None:
        os.write(self.master, (line + "\n").encode())

    def expect(self, pattern: str, timeout: float = 60.0) -> re.Match:
        """Wait until the output after what earlier expects consumed matches `pattern`."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while True:
            match = regex.search(self.seen)
            if match:
                self.seen = self.seen[match.end() :]
                return match
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"no {pattern!r} in:\n{self.seen}"
            ready, _, _ = select.select([self.master], [], [], remaining)
            if ready:
                try:
                    chunk = os.read(self.master, 4096)
                except OSError:  # the process closed the terminal
                    chunk = b""
                if not chunk:
                    assert regex.search(self.seen), f"the chat ended without {pattern!r}:\n{self.seen}"
                    continue
                self.seen += ANSI.sub("", chunk.decode("utf-8", "replace").replace("\r\n", "\n"))

    def close(self) -> int:
        try:
            return self.process.wait(30)
        finally:
            os.close(self.master)


def test_chat_in_a_terminal(tiny_server):
    model = httpx.get(tiny_server.url + "/v1/models").json()["data"][0]["id"]
    term = Terminal("chat", tiny_server.url, "--max-tokens", "4")
    try:
        term.expect(f"chatting with {re.escape(model)}")
        term.type("Hello there")
        first = term.expect(USAGE.pattern)
        assert int(first.group(3)) >= 1
        term.type("And again")
        second = term.expect(USAGE.pattern)
        assert int(second.group(1)) > int(first.group(1))  # the first turn went back with it
        term.type("/reset")
        term.expect("conversation reset")
        term.type("Hello there")
        assert term.expect(USAGE.pattern).group(1) == first.group(1)  # the same prompt as turn one
        term.type("/system You are brief.")
        term.expect("system prompt set")
        term.type("Hello there")
        # The system turn replaces the template's default one: a different prompt length.
        assert term.expect(USAGE.pattern).group(1) != first.group(1)
        term.type("/reset")
        term.expect("conversation reset")
        term.type("first line \\")
        term.type("second line")
        two_lines = int(term.expect(USAGE.pattern).group(1))
        term.type("/reset")
        term.type('"""')
        term.type("first line ")
        term.type("second line")
        term.type('"""')
        assert int(term.expect(USAGE.pattern).group(1)) == two_lines  # the same message either way
        term.type("/nonsense")
        term.expect("unknown command /nonsense")
        term.type("/exit")
        assert term.close() == 0
    finally:
        if term.process.poll() is None:
            term.process.kill()


def test_chat_without_the_key_is_a_one_line_error(tiny_keyed_server):
    term = Terminal("chat", tiny_keyed_server.url)
    try:
        term.expect(r"error: HTTP 401")
        assert term.close() == 2
    finally:
        if term.process.poll() is None:
            term.process.kill()


def test_chat_with_the_key_from_the_environment(tiny_keyed_server):
    os.environ["FLARE_CHAT_TEST_KEY"] = TINY_API_KEY
    try:
        term = Terminal("chat", tiny_keyed_server.url, "--api-key-env", "FLARE_CHAT_TEST_KEY", "--max-tokens", "2")
        term.expect("chatting with")
        term.type("Hi")
        term.expect(USAGE.pattern)
        term.expect(">>> ")
        os.write(term.master, b"\x04")  # Ctrl-D on an empty line ends the chat
        assert term.close() == 0
    finally:
        os.environ.pop("FLARE_CHAT_TEST_KEY", None)


def test_chat_keeps_going_when_the_server_goes_away(tiny_core):
    """A failed turn is reported on its own line and dropped from the history; the chat goes on."""
    server = HeliosProcess(tiny_core)
    term = Terminal("chat", server.url, "--max-tokens", "2")
    try:
        term.expect("chatting with")
        term.type("Hi")
        term.expect(USAGE.pattern)
        term.expect(">>> ")
        server.stop()
        term.type("Still there?")
        term.expect(r"\nerror: the connection to http://127\.0\.0\.1:\d+ failed")
        term.expect(">>> ")
        term.type("/exit")
        assert term.close() == 0
    finally:
        server.stop()
        if term.process.poll() is None:
            term.process.kill()

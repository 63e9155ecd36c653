"""`helios chat [URL|MODEL]`: a terminal chat over /v1/chat/completions, streaming.

Against a running server (URL), or a model it serves itself for the session (MODEL: anything
`helios serve` takes). Lines starting with / are commands (/help lists them). A line ending
with a backslash continues on the next line, and a line of three quotes starts or ends a block,
for multi-line messages. Reasoning is shown dimmed, tool calls by name and arguments.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TextIO

import httpx

from helios.launcher import HeliosProcess

HELP = """commands:
  /reset          forget the conversation (the system prompt stays)
  /system TEXT    set the system prompt (empty: none) and start over
  /help           this list
  /exit, /quit    leave (or Ctrl-D)
a line ending with \\ continues on the next line; a line of \"\"\" starts or ends a block"""
BLOCK = '"""'
DIM, BOLD, CYAN, RED, RESET = "\x1b[2m", "\x1b[1m", "\x1b[36m", "\x1b[31m", "\x1b[0m"


class ChatError(RuntimeError):
    """The server could not be reached or refused the request (its message is shown)."""


@dataclass
class Style:
    """ANSI styling when writing to a terminal, plain text otherwise."""

    enabled: bool

    def __call__(self, code: str, text: str) -> str:
        return f"{code}{text}{RESET}" if self.enabled and text else text


@dataclass
class Conversation:
    system: str = ""
    turns: list[dict[str, Any]] = field(default_factory=list)

    def messages(self) -> list[dict[str, Any]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.turns


@dataclass
class Reply:
    content: str = ""
    reasoning: str = ""
    tool_calls: dict[int, dict[str, str]] = field(default_factory=dict)  # index -> name, arguments
    usage: dict[str, Any] | None = None
    finish_reason: str | None = None

    def message(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": f"call_{i}", "type": "function", "function": dict(call)}
                for i, call in sorted(self.tool_calls.items())
            ]
        return message


class ChatClient:
    def __init__(self, url: str, api_key: str | None, max_tokens: int | None = None):
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=httpx.Timeout(600, connect=10))
        self.max_tokens = max_tokens

    def model(self) -> str:
        try:
            response = self.http.get("/v1/models")
        except httpx.HTTPError as exc:
            raise ChatError(f"cannot reach helios at {self.url}: {exc}") from None
        _raise_for_error(response)
        try:
            return str(response.json()["data"][0]["id"])
        except (ValueError, KeyError, IndexError, TypeError):
            raise ChatError(f"{self.url}/v1/models is not a model list; is this a helios server?") from None

    def stream(self, model: str, messages: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        """The chat.completion.chunk objects of one streamed reply."""
        body: dict[str, Any] = {
            "model": model,
            "messages": messages,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.max_tokens is not None:
            body["max_tokens"] = self.max_tokens
        try:
            with self.http.stream("POST", "/v1/chat/completions", json=body) as response:
                if response.status_code != 200:
                    response.read()
                    _raise_for_error(response)
                for line in response.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        return
                    try:
                        chunk = json.loads(data)
                    except ValueError:
                        raise ChatError(f"the server sent a frame that is not JSON: {data[:80]!r}") from None
                    if not isinstance(chunk, dict):
                        raise ChatError(f"the server sent an unexpected frame: {data[:80]!r}")
                    if "error" in chunk:
                        error = chunk["error"]
                        message = error.get("message") if isinstance(error, dict) else str(error)
                        raise ChatError(message or "the server reported an error")
                    yield chunk
        except httpx.HTTPError as exc:
            raise ChatError(f"the connection to {self.url} failed: {exc}") from None


def _raise_for_error(response: httpx.Response) -> None:
    if response.status_code == 200:
        return
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text[:200]
    hint = " (set the key with --api-key-env NAME)" if response.status_code == 401 else ""
    raise ChatError(f"HTTP {response.status_code}: {message}{hint}")


class Session:
    """The read-send-show loop over one conversation."""

    def __init__(self, client: ChatClient, read: Callable[[str], str], out: TextIO, style: Style):
        self.client, self.read, self.out, self.style = client, read, out, style
        self.conversation = Conversation()

    def write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()

    def run(self) -> None:
        model = self.client.model()
        self.write(f"chatting with {self.style(BOLD, model)} at {self.client.url} (/help for commands)\n")
        while True:
            text = self.next_message()
            if text is None:
                self.write("\n")
                return
            if not text.strip():
                continue
            if text.startswith("/"):
                if not self.command(text):
                    return
                continue
            self.conversation.turns.append({"role": "user", "content": text})
            try:
                reply = self.show(self.client.stream(model, self.conversation.messages()))
            except ChatError as exc:  # the partial reply (if any) stays on screen, not in the history
                self.conversation.turns.pop()
                self.write("\n" + self.style(RED, f"error: {exc}") + "\n")
                continue
            except KeyboardInterrupt:  # Ctrl-C stops this reply (closing the stream aborts it), not the chat
                self.conversation.turns.pop()
                self.write("\n" + self.style(DIM, "[interrupted]") + "\n")
                continue
            self.conversation.turns.append(reply.message())

    def next_message(self) -> str | None:
        """One message: a line, a backslash-continued run of lines, or a triple-quoted block."""
        try:
            line = self.read(">>> ")
            if line.strip() == BLOCK:
                lines: list[str] = []
                while (line := self.read("... ")).strip() != BLOCK:
                    lines.append(line)
                return "\n".join(lines)
            lines = [line]
            while lines[-1].endswith("\\"):
                lines[-1] = lines[-1][:-1]
                lines.append(self.read("... "))
            return "\n".join(lines)
        except EOFError:
            return None

    def command(self, text: str) -> bool:
        """Run a /command; False ends the session."""
        name, _, rest = text.partition(" ")
        if name in ("/exit", "/quit"):
            return False
        if name == "/reset":
            self.conversation.turns.clear()
            self.write("conversation reset\n")
        elif name == "/system":
            self.conversation = Conversation(system=rest.strip())
            self.write(f"system prompt {'set' if rest.strip() else 'cleared'}; conversation reset\n")
        elif name == "/help":
            self.write(HELP + "\n")
        else:
            self.write(f"unknown command {name} (/help lists them)\n")
        return True

    def show(self, chunks: Iterator[dict[str, Any]]) -> Reply:
        """Print a streamed reply as it arrives: reasoning dimmed, then the answer, tool calls."""
        reply, in_reasoning = Reply(), False
        for chunk in chunks:
            if chunk.get("usage"):
                reply.usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                delta = choice.get("delta") or {}
                if delta.get("reasoning_content"):
                    in_reasoning = True
                    reply.reasoning += delta["reasoning_content"]
                    self.write(self.style(DIM, delta["reasoning_content"]))
                if delta.get("content"):
                    if in_reasoning:
                        self.write("\n")
                        in_reasoning = False
                    reply.content += delta["content"]
                    self.write(delta["content"])
                for call in delta.get("tool_calls") or []:
                    entry = reply.tool_calls.setdefault(call.get("index", 0), {"name": "", "arguments": ""})
                    function = call.get("function") or {}
                    entry["name"] += function.get("name") or ""
                    entry["arguments"] += function.get("arguments") or ""
                reply.finish_reason = choice.get("finish_reason") or reply.finish_reason
        for call in reply.tool_calls.values():
            self.write("\n" + self.style(CYAN, f"tool call {call['name']}({call['arguments']})"))
        self.write("\n" + self.style(DIM, _usage_line(reply)) + "\n")
        return reply


def _usage_line(reply: Reply) -> str:
    usage = reply.usage or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return (
        f"[{usage.get('prompt_tokens', '?')} prompt tokens ({cached} cached), "
        f"{usage.get('completion_tokens', '?')} generated, finish: {reply.finish_reason}]"
    )


def is_url(target: str) -> bool:
    return target.startswith(("http://", "https://"))


def run_chat(target: str, api_key: str | None, max_tokens: int | None, serve_args: tuple[str, ...] = ()) -> None:
    """Chat with the server at `target`, or with `target` served for this session."""
    server = None if is_url(target) else start_server(target, serve_args)
    url = target if server is None else server.url
    if sys.stdin.isatty():
        import readline  # noqa: F401  (line editing and history for input(); not on every platform)
    try:
        session = Session(ChatClient(url, api_key, max_tokens), input, sys.stdout, Style(sys.stdout.isatty()))
        session.run()
    finally:
        if server is not None:
            server.stop()


def start_server(model: str, serve_args: tuple[str, ...]) -> HeliosProcess:
    """`helios serve MODEL` on a free loopback port (a checkpoint is compiled first, once)."""
    sys.stdout.write(f"starting helios serve {model} ...\n")
    sys.stdout.flush()
    try:
        return HeliosProcess(model, *serve_args, timeout=3600)
    except RuntimeError as exc:
        raise ChatError(str(exc)) from None

"""helios chat's rendering of a streamed reply: reasoning dimmed and then the answer, tool calls
assembled from their argument fragments, the usage line, and the assistant turn it keeps."""

from __future__ import annotations

import io

from helios.chat import DIM, RESET, ChatClient, Session, Style


def chunk(delta: dict | None = None, finish: str | None = None, usage: dict | None = None) -> dict:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    return {"object": "chat.completion.chunk", "choices": choices, "usage": usage}


def test_reasoning_answer_tool_calls_and_usage():
    out = io.StringIO()
    session = Session(ChatClient("http://127.0.0.1:9", None), input, out, Style(True))
    chunks = [
        chunk({"role": "assistant"}),
        chunk({"reasoning_content": "Think"}),
        chunk({"reasoning_content": "ing."}),
        chunk({"content": "Calling"}),
        chunk({"tool_calls": [{"index": 0, "id": "c0", "function": {"name": "get_weather", "arguments": ""}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Oslo"}'}}]}, finish="tool_calls"),
        chunk(usage={"prompt_tokens": 12, "completion_tokens": 9, "prompt_tokens_details": {"cached_tokens": 4}}),
    ]
    reply = session.show(iter(chunks))
    text = out.getvalue()
    assert f"{DIM}Think{RESET}{DIM}ing.{RESET}\nCalling" in text
    assert 'tool call get_weather({"city": "Oslo"})' in text
    assert "[12 prompt tokens (4 cached), 9 generated, finish: tool_calls]" in text
    assert reply.message() == {
        "role": "assistant",
        "content": "Calling",
        "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
        ],
    }


def test_plain_output_without_a_terminal():
    out = io.StringIO()
    session = Session(ChatClient("http://127.0.0.1:9", None), input, out, Style(False))
    session.show(iter([chunk({"reasoning_content": "hm"}), chunk({"content": "OK"}, finish="stop")]))
    assert "\x1b" not in out.getvalue() and "hm\nOK" in out.getvalue()

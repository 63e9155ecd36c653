"""Server-sent events: one writer per streaming response."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from helios.transport.errors import dumps

# api.md: keepalive comments may precede generation during waits longer than 15 s.
KEEPALIVE_SECONDS = 15.0


class SSEWriter:
    def __init__(self, response: web.StreamResponse):
        self.response = response

    @classmethod
    async def start(cls, request: web.Request, headers: dict[str, str] | None = None) -> SSEWriter:
        response = web.StreamResponse(
            status=200,
            headers={
                "Content-Type": "text/event-stream; charset=utf-8",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",  # proxies must not hold chunks back
                **(headers or {}),
            },
        )
        await response.prepare(request)
        return cls(response)

    async def send(self, data: Any, event: str | None = None) -> None:
        payload = data if isinstance(data, str) else dumps(data)
        head = f"event: {event}\n" if event else ""
        await self.response.write(f"{head}data: {payload}\n\n".encode())

    async def comment(self, text: str = "keepalive") -> None:
        await self.response.write(f": {text}\n\n".encode())

    async def done(self) -> None:
        """The OpenAI `[DONE]` sentinel, then end of body."""
        await self.response.write(b"data: [DONE]\n\n")
        await self.close()

    async def close(self) -> None:
        await self.response.write_eof()

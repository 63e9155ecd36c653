"""A real Helios application over a scripted engine, for deterministic protocol tests.

The engine double generates a scripted continuation (text and token ids, tokenized with the
core's real tokenizer) through the engine's own stop checker and detokenizer, so events, stop
causes and released text are exactly what the real engine would publish for those tokens. The
application (decoders, template, parsers, tool policy, encoders) is the real one, served on a
loopback port so the OpenAI and Anthropic SDKs can drive it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from helios.app import create_app
from helios.engine.api import EngineStats, FinishReason, GenerationEvent, GenerationRequest, TokenLogprob
from helios.engine.detokenizer import IncrementalDetokenizer
from helios.engine.stops import StopChecker
from helios.manifest import Manifest
from helios.neutral.tokenizer import Tokenizer
from helios.transport.config import ServerConfig


@dataclass
class ScriptedEngine:
    tokenizer: Tokenizer
    eos_token_ids: list[int]
    context_length: int
    # Text pieces and token ids, then EOS; or a function of the request's rendered prompt that
    # returns them (a multi-turn agent: the answer depends on the tool results so far).
    script: list[Any] | Callable[[str], list[Any]] = field(default_factory=lambda: ["OK"])
    requests: list[GenerationRequest] = field(default_factory=list)

    def ids(self, request: GenerationRequest | None = None) -> list[int]:
        script = self.script
        if callable(script):
            script = script(self.tokenizer.decode(request.prompt_token_ids) if request else "")
        out: list[int] = []
        for piece in script:
            out += [piece] if isinstance(piece, int) else self.tokenizer.encode(piece, add_bos=False)
        return out + [self.eos_token_ids[0]]

    def submit(self, request: GenerationRequest, sink) -> None:
        self.requests.append(request)
        s = request.sampling
        max_new = min(s.max_tokens, self.context_length - len(request.prompt_token_ids))
        checker = StopChecker(
            s, self.eos_token_ids, max_new, IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids)
        )
        for n, token in enumerate(self.ids(request), start=1):
            outcome = checker.on_token(token, n)
            entries = None
            if s.logprobs is not None:
                own = TokenLogprob(token, -0.5, [(token, -0.5)]) if outcome.has_logprob_entry else None
                entries = checker.entries(outcome, own)
            event = GenerationEvent(
                request.request_id,
                [token],
                outcome.text,
                entries,
                prompt_tokens=len(request.prompt_token_ids),
                completion_tokens=n,
            )
            if outcome.finished:
                event.finished, event.finish_reason, event.stop_reason = (
                    True,
                    outcome.finish_reason,
                    outcome.stop_reason,
                )
                sink(event)
                return
            sink(event)
        sink(
            GenerationEvent(
                request.request_id,
                [],
                checker.finish_text(),
                [] if s.logprobs is not None else None,
                finished=True,
                finish_reason=FinishReason.STOP,
            )
        )

    def abort(self, request_id: str, reason: str | None = None) -> bool:
        return False  # every request ended at submit

    def abort_all(self, reason: str) -> int:
        return 0

    def healthy(self) -> bool:
        return True

    def num_pending(self) -> int:
        return 0  # every request runs at submit

    def stats(self) -> EngineStats:
        return EngineStats(
            active=0,
            pending=0,
            free_pages=1,
            total_pages=1,
            page_tokens=16,
            prefill_tokens_total=0,
            generated_tokens_total=0,
            completed_total=0,
            cancelled_total=0,
            failed_total=0,
            steps_total=0,
            admitted_total=len(self.requests),
            preempted_total=0,
            step_seconds_total=0.0,
            schedule_seconds_total=0.0,
        )

    @property
    def prompt(self) -> str:
        """The last request's rendered prompt."""
        return self.tokenizer.decode(self.requests[-1].prompt_token_ids)


class LoopbackServer:
    """A helios application on a loopback port, served from a thread of this process (so a test
    can reach into its engine)."""

    def __init__(self, app: web.Application):
        self._loop = asyncio.new_event_loop()
        self._runner = web.AppRunner(app)
        started = threading.Event()

        def serve() -> None:
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            self._loop.run_until_complete(site.start())
            self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
            started.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=serve, daemon=True)
        self._thread.start()
        started.wait(30)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)


class ScriptedServer(LoopbackServer):
    def __init__(self, core: Path, config: ServerConfig | None = None, template: dict[str, Any] | None = None):
        """`template`: manifest template fields as another recipe would export them (a DeepSeek
        core's encoder rules over the tiny core's real tokenizer and template)."""
        manifest = Manifest.load(core, verify_files=False)
        if template:
            manifest = dataclasses.replace(manifest, template=dataclasses.replace(manifest.template, **template))
        tokenizer = Tokenizer.from_core(core, manifest)
        self.engine = ScriptedEngine(tokenizer, list(manifest.tokenizer.eos_token_ids), manifest.limits.context_length)
        self.tokenizer = tokenizer
        super().__init__(create_app(manifest, core, self.engine, config or ServerConfig(port=0)))

    def say(self, *script: Any) -> None:
        self.engine.script = list(script)

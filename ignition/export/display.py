"""The export's live progress on a terminal: one status line for the running stage, then a
check line per finished stage with its time and last detail (`ignition export`, and `helios
serve MODEL` when it compiles a core first)."""

from __future__ import annotations

import time

from rich.console import Console
from rich.markup import escape

# The pipeline's stages, as the CLI shows them (ignition.export.pipeline.STAGES; not imported
# here, since the pipeline pulls in torch and `helios serve CORE` never compiles).
STAGES = ("read", "convert", "export", "quantize", "validate", "write")

# Stages that run before the pipeline's own (installing and joining a packaged model's parts).
PRE_STAGES = ("digest", "install", "join", "verify")


class StageDisplay:
    """Shows (stage, detail) reports: a spinner line for the current stage, a ✓ line when the
    next stage starts or the display closes."""

    def __init__(self, console: Console):
        self.console = console
        self.stage: str | None = None
        self.detail = ""
        self.started = time.monotonic()
        self.status = console.status("starting")

    def __enter__(self) -> StageDisplay:
        self.status.__enter__()
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is None:
            self._done(time.monotonic())
        self.status.__exit__(kind, value, traceback)

    def _done(self, now: float) -> None:
        if self.stage is not None:
            self.console.print(f"[green]✓[/] {self.stage:<9} {now - self.started:6.1f}s  [dim]{escape(self.detail)}[/]")

    def report(self, stage: str, detail: str) -> None:
        """A stage reports once or more (the last detail is kept); the next stage ends it."""
        now = time.monotonic()
        if stage != self.stage:
            self._done(now)
            self.stage, self.started = stage, now
        self.detail = detail
        order = (*PRE_STAGES, *STAGES)
        step = f" ({STAGES.index(stage) + 1}/{len(STAGES)})" if stage in STAGES else ""
        self.status.update(f"[bold]{stage}[/]{step}: {escape(detail)}" if stage in order else escape(detail))

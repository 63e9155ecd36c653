"""`helios top URL`: a terminal dashboard over a server's /metrics JSON snapshot.

`Snapshot` reads the object (absent fields read as zero, so older or newer servers still
display); `View` keeps the rate history between polls and renders it with rich, so tests render
it to a string without a terminal. WEIGHTS is decode_weight_bytes times verification graphs
per second: the weight bandwidth the model consumes. DEPTH is the change in verification_drafts
over the change in verification_rounds (shown as "-" without rounds).
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import httpx
from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

SPARK = "▁▂▃▄▅▆▇█"
DEFAULT_HISTORY = 60


@dataclass(frozen=True)
class ReplicaRow:
    """One engine replica behind a `helios cluster` endpoint (the snapshot's `replicas`)."""

    replica: str
    label: str  # host:pid
    healthy: bool
    inflight: int
    active: int
    routed: int
    reused_tokens: int

    @classmethod
    def from_json(cls, row: dict[str, Any]) -> ReplicaRow:
        def count(name: str) -> int:
            value = row.get(name)
            return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0

        return cls(
            str(row.get("replica", "?")),
            str(row.get("label", "")),
            bool(row.get("healthy")),
            count("inflight"),
            count("active"),
            count("routed"),
            count("reused_tokens"),
        )


@dataclass
class Snapshot:
    prefill_tokens: int = 0
    generated_tokens: int = 0
    decode_weight_bytes: int = 0
    verify_steps: int = 0
    verification_drafts: int = 0
    verification_rounds: int = 0
    accepted_drafts: int = 0
    active: int = 0
    pending: int = 0
    completed: int = 0
    failed: int = 0
    cancelled: int = 0
    reused_tokens: int = 0
    cached_pages: int = 0
    free_pages: int = 0
    total_pages: int = 0
    kv_pool_bytes: int = 0
    kv_pool_dtype: str = ""
    host_reused_tokens: int = 0
    host_hits: int = 0
    http_inflight_requests: int = 0
    uptime_seconds: int = 0
    learned_drafter: bool = False
    input_decoded_images_total: int = 0  # images a vision core decoded for generation
    input_prepared_cache_hits_total: int = 0  # of them, served from encoded features
    first_response_median: float | None = None
    first_response_samples: int = 0
    replicas: tuple[ReplicaRow, ...] = ()  # a cluster endpoint's engine replicas (empty: one server)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Snapshot:
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            raw = data.get(f.name)
            if f.name.startswith("first_response") or f.name == "replicas" or raw is None:
                continue
            if f.name == "learned_drafter":
                values[f.name] = bool(raw)
            elif f.name == "kv_pool_dtype":
                values[f.name] = str(raw)
            elif isinstance(raw, (int, float)) and not isinstance(raw, bool):
                values[f.name] = int(raw)
        first = data.get("first_response")
        if isinstance(first, dict):
            median = first.get("median_seconds")
            values["first_response_median"] = float(median) if isinstance(median, (int, float)) else None
            samples = first.get("samples")
            values["first_response_samples"] = int(samples) if isinstance(samples, int) else 0
        rows = data.get("replicas")
        if isinstance(rows, list):
            values["replicas"] = tuple(ReplicaRow.from_json(r) for r in rows if isinstance(r, dict))
        return cls(**values)

    @property
    def used_pages(self) -> int:
        return max(0, self.total_pages - self.free_pages)


# Series the view plots: (key, label, unit).
SERIES = (
    ("tokens", "tokens/s", "tok/s"),
    ("prefill", "prefill", "tok/s"),
    ("requests", "requests", "req/s"),
    ("running", "active+pending", ""),
    ("pages", "KV pages", ""),
    ("reuse", "cache reuse", "tok/s"),
    ("weights", "WEIGHTS", "B/s"),
)


def sparkline(values: list[float], width: int) -> str:
    """The last `width` values as block characters scaled to their own maximum."""
    tail = list(values)[-width:]
    if not tail:
        return ""
    peak = max(tail)
    if peak <= 0:
        return SPARK[0] * len(tail)
    return "".join(SPARK[min(len(SPARK) - 1, int(v / peak * (len(SPARK) - 1) + 0.5))] for v in tail)


def human(value: float, unit: str) -> str:
    if unit == "B/s":
        for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
            if value >= scale:
                return f"{value / scale:.2f} {prefix}B/s"
        return f"{value:.0f} B/s"
    text = f"{value:.1f}" if isinstance(value, float) and value != int(value) else f"{int(value)}"
    return f"{text} {unit}".rstrip()


class View:
    """Rate history between polls plus the latest snapshot."""

    def __init__(self, url: str, history: int = DEFAULT_HISTORY):
        self.url = url
        self.history: dict[str, deque[float]] = {key: deque(maxlen=history) for key, _, _ in SERIES}
        self.latest: Snapshot | None = None
        self._previous: tuple[float, Snapshot] | None = None
        self.depth: float | None = None
        self.error: str | None = None

    def update(self, snapshot: Snapshot, at: float) -> None:
        self.error = None
        if self._previous is not None:
            then, old = self._previous
            dt = at - then
            if dt > 0:

                def rate(name: str) -> float:
                    return max(0, getattr(snapshot, name) - getattr(old, name)) / dt

                self.history["tokens"].append(rate("generated_tokens"))
                self.history["prefill"].append(rate("prefill_tokens"))
                self.history["requests"].append(rate("completed"))
                self.history["reuse"].append(rate("reused_tokens") + rate("host_reused_tokens"))
                self.history["weights"].append(snapshot.decode_weight_bytes * rate("verify_steps"))
                rounds = snapshot.verification_rounds - old.verification_rounds
                drafts = snapshot.verification_drafts - old.verification_drafts
                self.depth = drafts / rounds if rounds > 0 else None
        self.history["running"].append(float(snapshot.active + snapshot.pending))
        self.history["pages"].append(float(snapshot.used_pages))
        self._previous = (at, snapshot)
        self.latest = snapshot

    def render(self, width: int = 40) -> Group:
        s = self.latest or Snapshot()
        title = f"helios top · {self.url}"
        if self.error:
            title += f" · [red]{self.error}[/]"
        table = Table(expand=False, box=None, pad_edge=False)
        table.add_column("series", style="bold")
        table.add_column("now", justify="right")
        table.add_column("history")
        table.add_column("peak", justify="right")
        for key, label, unit in SERIES:
            values = list(self.history[key])
            now = values[-1] if values else 0.0
            peak = max(values) if values else 0.0
            if key == "pages":
                shown = f"{s.used_pages}/{s.total_pages}"
            else:
                shown = human(now, unit)
            table.add_row(label, shown, Text(sparkline(values, width), style="cyan"), human(peak, unit))
        first = "-" if s.first_response_median is None else f"{s.first_response_median * 1000:.0f} ms"
        depth = "-" if self.depth is None else f"{self.depth:.2f}"
        footer = Text(
            f"active {s.active}  pending {s.pending}  inflight {s.http_inflight_requests}  "
            f"completed {s.completed}  failed {s.failed}  cancelled {s.cancelled}  "
            f"cached pages {s.cached_pages}  host hits {s.host_hits} ({s.host_reused_tokens} tokens)  DEPTH {depth}  first response {first}  uptime {s.uptime_seconds}s"
            f"  KV pool {s.kv_pool_bytes / 2**30:.2f} GiB {s.kv_pool_dtype or '-'}"
            + (
                f"  images {s.input_decoded_images_total} ({s.input_prepared_cache_hits_total} reused)"
                if s.input_decoded_images_total
                else ""
            )
        )
        parts = [Panel(table, title=title, title_align="left"), footer]
        if s.replicas:
            parts.append(replica_table(s.replicas))
        return Group(*parts)


def replica_table(rows: tuple[ReplicaRow, ...]) -> Table:
    table = Table(title="replicas", title_justify="left", expand=False, box=None, pad_edge=False)
    for column in ("replica", "host:pid", "health", "inflight", "active", "routed", "reused tokens"):
        table.add_column(column, justify="left" if column in ("replica", "host:pid", "health") else "right")
    for r in rows:
        health = Text("ok", style="green") if r.healthy else Text("down", style="red")
        table.add_row(r.replica, r.label, health, str(r.inflight), str(r.active), str(r.routed), str(r.reused_tokens))
    return table


def fetch(client: httpx.Client, url: str) -> Snapshot:
    response = client.get(url.rstrip("/") + "/metrics", params={"format": "json"})
    response.raise_for_status()
    return Snapshot.from_json(response.json())


def run(
    url: str, interval: float = 1.0, history: int = DEFAULT_HISTORY, console: Console | None = None, stop: Any = None
) -> None:
    """Poll and redraw until interrupted (or until `stop.is_set()`, for the serve thread)."""
    view = View(url, history)
    with (
        httpx.Client(timeout=max(2.0, interval * 2)) as client,
        Live(view.render(), console=console, refresh_per_second=4, screen=False) as live,
    ):
        while stop is None or not stop.is_set():
            try:
                view.update(fetch(client, url), time.monotonic())
            except (httpx.HTTPError, ValueError) as exc:
                view.error = type(exc).__name__
            live.update(view.render())
            if stop is not None:
                if stop.wait(interval):
                    break
            else:
                time.sleep(interval)

"""GET /metrics: Prometheus text (0.0.4) by default, one JSON object on request.

Engine counters come from `Engine.stats()` at scrape time through a custom collector, so the
engine never imports prometheus_client and the numbers in text and JSON come from one snapshot.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from helios.server.errors import bad_request

TEXT_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
FIRST_RESPONSE_WINDOW_SECONDS = 60.0
FIRST_RESPONSE_CAPACITY = 4096


class FirstResponseWindow:
    """Seconds from HTTP admission to the first offered text, over a sliding window."""

    def __init__(self, window: float = FIRST_RESPONSE_WINDOW_SECONDS, capacity: int = FIRST_RESPONSE_CAPACITY):
        self.window = window
        self.capacity = capacity
        self._samples: deque[tuple[float, float]] = deque()
        self._dropped_at: float | None = None  # newest time a sample fell off for capacity

    def record(self, seconds: float) -> None:
        now = time.monotonic()
        self._samples.append((now, seconds))
        if len(self._samples) > self.capacity:
            self._samples.popleft()
            self._dropped_at = now
        self._expire(now)

    def _expire(self, now: float) -> None:
        while self._samples and now - self._samples[0][0] > self.window:
            self._samples.popleft()

    def snapshot(self) -> dict[str, Any]:
        now = time.monotonic()
        self._expire(now)
        values = [s for _, s in self._samples]
        truncated = self._dropped_at is not None and now - self._dropped_at <= self.window
        return {
            "median_seconds": statistics.median(values) if values else None,
            "samples": len(values),
            "window_seconds": int(self.window),
            "capacity": self.capacity,
            "truncated": truncated,
        }


@dataclass
class HttpStats:
    """HTTP-side gauges the engine cannot see."""

    admission_slots: int
    inflight_requests: int = 0
    started_monotonic: float = field(default_factory=time.monotonic)
    first_response: FirstResponseWindow = field(default_factory=FirstResponseWindow)
    rejected_rate_limited: int = 0


class FlareCollector:
    """prometheus_client custom collector over Engine.stats() and the HTTP gauges."""

    def __init__(self, engine: Any, http: HttpStats, admission: Any, decode_weight_bytes: int):
        self.engine = engine
        self.http = http
        self.admission = admission
        self.decode_weight_bytes = decode_weight_bytes

    def collect(self):  # noqa: ANN201 - prometheus_client protocol
        s = self.engine.stats()
        counters = [
            ("flare_generated_tokens_total", "Committed generated tokens, including EOS and tokens withheld by stops",
             s.generated_tokens_total),
            ("flare_prefill_tokens_total", "Prompt tokens consumed by completed prefill", s.prefill_tokens_total),
            ("flare_requests_completed_total", "Requests whose generation completed successfully", s.completed_total),
            ("flare_requests_failed_total", "Requests failed by admission, execution or output processing",
             s.failed_total),
            ("flare_requests_cancelled_total", "Requests cancelled by their client", s.cancelled_total),
            ("flare_requests_admitted_total", "Requests admitted into the model scheduler", s.admitted_total),
            ("flare_requests_preempted_total", "Preemptions (recompute) for lack of KV pages",
             getattr(s, "preempted_total", 0)),
            ("flare_engine_steps_total", "Engine steps (graph launches)", s.steps_total),
            ("flare_engine_step_seconds_total", "Seconds spent running engine steps", s.step_seconds_total),
            ("flare_engine_schedule_seconds_total", "Seconds spent scheduling engine steps", s.schedule_seconds_total),
            ("flare_cache_reused_tokens_total", "Tokens covered by prefix-cache hits", 0),
            ("flare_reasoning_budget_cuts_total", "Requests whose reasoning was closed by their token budget", 0),
            ("flare_http_rate_limited_total", "Requests refused for lack of HTTP admission slots",
             self.http.rejected_rate_limited),
        ]
        for name, doc, value in counters:
            yield CounterMetricFamily(name, doc, value=value)
        gauges = [
            ("flare_active_requests", "Model slots with a live request", s.active),
            ("flare_pending_requests", "Requests waiting in the model scheduler", s.pending),
            ("flare_free_kv_pages", "KV pages free for new history", s.free_pages),
            ("flare_total_kv_pages", "Pages in the KV pool", s.total_pages),
            ("flare_kv_page_tokens", "History tokens per KV page", s.page_tokens),
            ("flare_cached_kv_pages", "KV pages owned by immutable prefix checkpoints", 0),
            ("flare_http_inflight_requests", "HTTP generation requests in progress", self.http.inflight_requests),
            ("flare_http_admission_slots", "HTTP admission slots (one per generated choice)", self.admission.slots),
            ("flare_http_admission_slots_used", "HTTP admission slots in use", self.admission.used),
            ("flare_decode_weight_bytes", "Weight bytes one decode step reads for one request",
             self.decode_weight_bytes),
            ("flare_uptime_seconds", "Seconds since the server started",
             time.monotonic() - self.http.started_monotonic),
        ]
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=value)


def prometheus_text(collector: FlareCollector) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return generate_latest(registry)


def json_snapshot(collector: FlareCollector) -> dict[str, Any]:
    """The api.md "Health and metrics" object (absent speculative/host-cache features are 0)."""
    s = collector.engine.stats()
    return {
        "prefill_tokens": s.prefill_tokens_total,
        "generated_tokens": s.generated_tokens_total,
        "decode_weight_bytes": collector.decode_weight_bytes,
        "draft_steps": 0,
        "verify_steps": 0,
        "verification_drafts": 0,
        "verification_rounds": 0,
        "accepted_drafts": 0,
        "draft_rounds": 0,
        "active": s.active,
        "pending": s.pending,
        "completed": s.completed_total,
        "reasoning_budget_cuts": 0,
        "failed": s.failed_total,
        "replay_gpu_ns": 0,
        "replay_readiness_wait_ns": 0,
        "replay_readiness_samples": 0,
        "reused_tokens": 0,
        "cached_pages": 0,
        "free_pages": s.free_pages,
        "total_pages": s.total_pages,
        "page_tokens": s.page_tokens,
        "host_hits": 0,
        "host_reused_tokens": 0,
        "host_memory_records": 0,
        "host_disk_records": 0,
        "host_bytes_out": 0,
        "host_bytes_in": 0,
        "learned_drafter": False,
        "first_response": collector.http.first_response.snapshot(),
        # Flare extensions beyond the table (integers, like the table's fields).
        "cancelled": s.cancelled_total,
        "admitted": s.admitted_total,
        "http_inflight_requests": collector.http.inflight_requests,
        "http_admission_slots": collector.admission.slots,
        "http_admission_slots_used": collector.admission.used,
        "uptime_seconds": int(time.monotonic() - collector.http.started_monotonic),
    }


def wants_json(format_param: str | None, accept: str | None) -> bool:
    """format=json / format=prometheus decide; otherwise Accept quality (ties: earlier range)."""
    if format_param is not None:
        if format_param == "json":
            return True
        if format_param == "prometheus":
            return False
        raise bad_request(f"unknown metrics format {format_param!r}; use json or prometheus")
    if not accept:
        return False
    ranges = _parse_accept(accept)
    json_q, json_pos = _quality(ranges, "application", "json")
    text_q, text_pos = _quality(ranges, "text", "plain")
    if json_q != text_q:
        return json_q > text_q
    return json_q > 0 and json_pos < text_pos


def _parse_accept(header: str) -> list[tuple[str, str, float]]:
    ranges = []
    for item in header.split(","):
        fields = [f.strip() for f in item.split(";")]
        media = fields[0].lower()
        if "/" not in media:
            continue
        kind, _, sub = media.partition("/")
        q = 1.0
        for param in fields[1:]:
            key, _, value = param.partition("=")
            if key.strip().lower() == "q":
                try:
                    q = min(max(float(value), 0.0), 1.0)
                except ValueError:
                    q = 0.0
        ranges.append((kind, sub, q))
    return ranges


def _quality(ranges: list[tuple[str, str, float]], kind: str, sub: str) -> tuple[float, int]:
    """(q, position) of the most specific range matching kind/sub; (0, inf) if none matches."""
    best: tuple[int, float, int] | None = None  # (specificity, q, position)
    for pos, (k, s, q) in enumerate(ranges):
        if k == kind and s == sub:
            spec = 2
        elif k == kind and s == "*":
            spec = 1
        elif k == "*" and s == "*":
            spec = 0
        else:
            continue
        if best is None or spec > best[0]:
            best = (spec, q, pos)
    if best is None:
        return 0.0, 1 << 30
    return best[1], best[2]

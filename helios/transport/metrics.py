"""GET /metrics: Prometheus text (0.0.4) by default, one JSON object on request.

Engine counters come from `Engine.stats()` at scrape time through a custom collector, so the
engine never imports prometheus_client and the numbers in text and JSON come from one snapshot.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from helios.engine.api import EngineStats, ServingEngine
from helios.engine.host_store import DROP_REASONS as HOST_DROP_REASONS
from helios.engine.host_store import TIERS as HOST_TIERS
from helios.transport.admission import Admission
from helios.transport.errors import bad_request

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
    output_failures: int = 0  # responses failed by output processing (tool contract, parsing)


# Image preparation and prepared-input caches: text-only cores never touch them, so they stay
# zero; their names are part of the JSON object (api.md) as well as the text.
INPUT_METRICS = (
    "input_decoded_images_total",
    "input_image_cache_hits_total",
    "input_image_cache_misses_total",
    "input_prepared_cache_hits_total",
    "input_prepared_cache_misses_total",
)
CHECKPOINT_ROLES = ("anchor", "message", "endpoint")
CHECKPOINT_SKIP_REASONS = ("unknown_cost", "work_budget", "storage", "recurrent_state")
HOST_HISTOGRAMS = (
    ("flare_host_cache_missing_tokens", "Prompt tokens a host prefix-store lookup could not cover"),
    ("flare_host_cache_estimated_transfer_ns", "Estimated host-to-GPU transfer time of a host prefix-store chain"),
    ("flare_host_cache_estimated_prefill_ns", "Estimated prefill time a host prefix-store chain would replace"),
)


def engine_fields(s: EngineStats, decode_weight_bytes: int, output_failures: int = 0) -> dict[str, Any]:
    """The api.md JSON table from one Engine.stats() snapshot.

    Features this runtime does not use are 0 (replay timing off a GPU); the host prefix
    store's numbers are 0 when the engine runs without one.
    """
    host = s.host_store
    return {
        "prefill_tokens": s.prefill_tokens_total,
        "generated_tokens": s.generated_tokens_total,
        "decode_weight_bytes": decode_weight_bytes,
        "draft_steps": s.draft_steps_total,  # history drafts run no drafter graph
        # Every step graph is a verification graph (of zero-draft rounds when nothing is drafted):
        # it reads the weights once, so decode_weight_bytes x verify_steps/s is the WEIGHTS bandwidth.
        "verify_steps": s.steps_total,
        "verification_drafts": s.verification_drafts_total,
        "verification_rounds": s.verification_rounds_total,
        "accepted_drafts": s.accepted_drafts_total,
        "draft_rounds": s.draft_rounds_total,
        "active": s.active,
        "pending": s.pending,
        "completed": s.completed_total,
        "reasoning_budget_cuts": s.reasoning_budget_cuts_total,
        "failed": s.failed_total + output_failures,
        "replay_gpu_ns": s.replay_gpu_ns_total,
        "replay_readiness_wait_ns": 0,
        "replay_readiness_samples": 0,
        "reused_tokens": s.reused_tokens_total,
        "cached_pages": s.cached_pages,
        "free_pages": s.free_pages,
        "total_pages": s.total_pages,
        "page_tokens": s.page_tokens,
        "kv_pool_bytes": s.kv_pool_bytes,
        "kv_pool_dtype": s.kv_pool_dtype,
        "host_hits": host.hits if host else 0,
        "host_reused_tokens": host.reused_tokens if host else 0,
        "host_memory_records": host.memory_records if host else 0,
        "host_disk_records": host.disk_records if host else 0,
        "host_bytes_out": host.bytes_out if host else 0,
        "host_bytes_in": host.bytes_in if host else 0,
        "learned_drafter": s.learned_drafter,
        **{name: s.images.get(name, 0) for name in INPUT_METRICS},
    }


class FlareCollector:
    """prometheus_client custom collector over Engine.stats() and the HTTP gauges."""

    def __init__(self, engine: ServingEngine, http: HttpStats, admission: Admission, decode_weight_bytes: int):
        self.engine = engine
        self.http = http
        self.admission = admission
        self.decode_weight_bytes = decode_weight_bytes

    def collect(self):
        s = self.engine.stats()
        f = engine_fields(s, self.decode_weight_bytes, self.http.output_failures)
        host = s.host_store
        counters = [
            (
                "flare_generated_tokens_total",
                "Committed generated tokens, including EOS and tokens withheld by stops",
                f["generated_tokens"],
            ),
            ("flare_prefill_tokens_total", "Prompt tokens consumed by completed prefill", f["prefill_tokens"]),
            ("flare_requests_completed_total", "Requests whose generation completed successfully", f["completed"]),
            (
                "flare_requests_failed_total",
                "Requests failed by admission, execution or output processing",
                f["failed"],
            ),
            ("flare_requests_cancelled_total", "Requests cancelled by their client", s.cancelled_total),
            ("flare_requests_admitted_total", "Requests admitted into the model scheduler", s.admitted_total),
            (
                "flare_requests_preempted_total",
                "Preemptions (recompute) for lack of KV pages",
                s.preempted_total,
            ),
            ("flare_engine_steps_total", "Engine steps (graph launches)", s.steps_total),
            ("flare_engine_step_seconds_total", "Seconds spent running engine steps", s.step_seconds_total),
            ("flare_engine_schedule_seconds_total", "Seconds spent scheduling engine steps", s.schedule_seconds_total),
            (
                "flare_engine_graph_seconds_total",
                "Seconds of engine steps spent inside the step graph",
                s.graph_seconds_total,
            ),
            (
                "flare_grammar_mask_seconds_total",
                "Seconds spent computing grammar masks",
                s.grammar_mask_seconds_total,
            ),
            ("flare_cache_reused_tokens_total", "Tokens covered by GPU prefix-cache hits", f["reused_tokens"]),
            ("flare_cache_hits_total", "Admissions that restored a prefix checkpoint", s.cache_hits_total),
            (
                "flare_reasoning_budget_cuts_total",
                "Requests whose reasoning was closed by their token budget",
                f["reasoning_budget_cuts"],
            ),
            (
                "flare_verification_draft_tokens_total",
                "Draft positions allocated for progressing request rounds",
                f["verification_drafts"],
            ),
            (
                "flare_verification_request_rounds_total",
                "Progressing decode or verification request rounds",
                f["verification_rounds"],
            ),
            (
                "flare_accepted_draft_tokens_total",
                "Accepted draft tokens, excluding the bonus token",
                f["accepted_drafts"],
            ),
            ("flare_draft_request_rounds_total", "Request rounds that offered at least one draft", f["draft_rounds"]),
            ("flare_replay_gpu_nanoseconds_total", "Summed device durations of completed graphs", f["replay_gpu_ns"]),
            (
                "flare_replay_readiness_wait_nanoseconds_total",
                "Exposed embedding readiness delay",
                f["replay_readiness_wait_ns"],
            ),
            (
                "flare_replay_readiness_samples_total",
                "Completed graphs with readiness timing outputs",
                f["replay_readiness_samples"],
            ),
            ("flare_host_cache_hits_total", "Host prefix-store lookups whose chain admission fetched", f["host_hits"]),
            (
                "flare_host_cache_reused_tokens_total",
                "Tokens covered by host prefix-store chains",
                f["host_reused_tokens"],
            ),
            (
                "flare_host_cache_bytes_out_total",
                "Bytes copied from GPU checkpoints to the host store",
                f["host_bytes_out"],
            ),
            ("flare_host_cache_bytes_in_total", "Bytes copied from the host store into GPU pages", f["host_bytes_in"]),
            (
                "flare_host_cache_copyout_headroom_deferrals_total",
                "Copy-out offers deferred by the headroom check",
                host.copyout_deferrals if host else 0,
            ),
            (
                "flare_host_cache_store_skipped_total",
                "Host store offers skipped (duplicates and retries)",
                host.store_skipped if host else 0,
            ),
            (
                "flare_checkpoint_extra_work_nanoseconds_total",
                "Charged predicted extra prefill and copy work",
                s.checkpoint_extra_work_ns_total,
            ),
            ("flare_embedding_row_cache_hits_total", "Embedding row-cache hits", 0),
            ("flare_embedding_row_cache_misses_total", "Embedding row-cache misses", 0),
            (
                "flare_http_rate_limited_total",
                "Requests refused for lack of HTTP admission slots",
                self.http.rejected_rate_limited,
            ),
            *(
                (f"flare_{name}", "Image preparation and prepared-input cache counter", f[name])
                for name in INPUT_METRICS
            ),
        ]
        for name, doc, value in counters:
            yield CounterMetricFamily(name, doc, value=value)
        labelled = [
            (
                "flare_speculative_rounds_total",
                "Completed speculative or verification graphs by draft width",
                ["width"],
                [([str(w)], n) for w, n in sorted((s.rounds_by_width or {0: 0}).items())],
            ),
            (
                "flare_graph_launches_total",
                "Graph launches by kind",
                ["kind"],
                [
                    (["step"], s.steps_total),
                    (["decode_graph"], s.decode_graph_launches_total),
                    (["vision"], s.images.get("vision_graph_launches", 0)),
                ],
            ),
            (
                "flare_checkpoint_captures_total",
                "GPU prefix checkpoints captured by role",
                ["role"],
                [([role], s.checkpoint_captures.get(role, 0)) for role in CHECKPOINT_ROLES],
            ),
            (
                "flare_checkpoint_skips_total",
                "Checkpoint selections or captures rejected by reason",
                ["reason"],
                [([reason], s.checkpoint_skips.get(reason, 0)) for reason in CHECKPOINT_SKIP_REASONS],
            ),
            (
                "flare_host_cache_held_total",
                "Checkpoint records held by the host store by tier",
                ["tier"],
                [([tier], host.held.get(tier, 0) if host else 0) for tier in HOST_TIERS],
            ),
            (
                "flare_host_cache_dropped_total",
                "Host store records dropped by tier and reason",
                ["tier", "reason"],
                [
                    ([tier, reason], host.dropped.get((tier, reason), 0) if host else 0)
                    for tier in HOST_TIERS
                    for reason in HOST_DROP_REASONS
                ],
            ),
        ]
        for name, doc, labels, samples in labelled:
            family = CounterMetricFamily(name, doc, labels=labels)
            for values, value in samples:
                family.add_metric(values, value)
            yield family
        gauges = [
            ("flare_active_requests", "Model slots with a live request", f["active"]),
            ("flare_pending_requests", "Requests waiting in the model scheduler", f["pending"]),
            ("flare_free_kv_pages", "KV pages free for new history", f["free_pages"]),
            ("flare_total_kv_pages", "Pages in the KV pool", f["total_pages"]),
            ("flare_kv_page_tokens", "History tokens per KV page", f["page_tokens"]),
            (
                "flare_kv_pool_bytes",
                "Memory of the KV pool (its element type: the JSON's kv_pool_dtype)",
                f["kv_pool_bytes"],
            ),
            ("flare_cached_kv_pages", "KV pages owned by immutable prefix checkpoints", f["cached_pages"]),
            ("flare_checkpoint_anchor_reservations", "Unused anchor guards", 0),
            (
                "flare_host_cache_memory_records",
                "Checkpoint records in the host store's memory",
                f["host_memory_records"],
            ),
            (
                "flare_host_cache_disk_records",
                "Checkpoint records in the host store's directory",
                f["host_disk_records"],
            ),
            (
                "flare_host_cache_parked_records",
                "Complete DRAM copies awaiting disk writes",
                host.parked_records if host else 0,
            ),
            # Slots are KV pages: those checkpoints own, their budget, and those fetched from the host.
            ("flare_host_cache_slots_in_use", "Local checkpoint pool slots in use", f["cached_pages"]),
            ("flare_host_cache_slots_total", "Local checkpoint pool slots", s.checkpoint_storage_pages),
            ("flare_host_cache_intake_slots", "Local checkpoint pool intake slots", s.intake_pages),
            (
                "flare_history_drafts_enabled",
                "Whether shared decoded history augments learned proposals",
                int(s.history_drafts_enabled),
            ),
            ("flare_http_inflight_requests", "HTTP generation requests in progress", self.http.inflight_requests),
            ("flare_http_admission_slots", "HTTP admission slots (one per generated choice)", self.admission.slots),
            ("flare_http_admission_slots_used", "HTTP admission slots in use", self.admission.used),
            (
                "flare_decode_weight_bytes",
                "Weight bytes one decode step reads for one request",
                f["decode_weight_bytes"],
            ),
            (
                "flare_uptime_seconds",
                "Seconds since the server started",
                time.monotonic() - self.http.started_monotonic,
            ),
        ]
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=value)
        histograms = host.histograms if host else {}
        for name, doc in HOST_HISTOGRAMS:
            buckets, total = histograms.get(name.removeprefix("flare_host_cache_"), ([("+Inf", 0)], 0.0))
            yield HistogramMetricFamily(name, doc, buckets=buckets, sum_value=total)


class ExtraCollector(Protocol):
    """More families beside FlareCollector's (a prometheus_client collector), and their JSON."""

    def collect(self) -> Iterator[Any]: ...
    def json_fields(self) -> dict[str, Any]: ...


def prometheus_text(collector: FlareCollector, extra: tuple[ExtraCollector, ...] = ()) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    for each in (collector, *extra):
        registry.register(each)
    return generate_latest(registry)


def json_snapshot(collector: FlareCollector, extra: tuple[ExtraCollector, ...] = ()) -> dict[str, Any]:
    """The api.md "Health and metrics" object; helios.dashboard.Snapshot reads it back."""
    s = collector.engine.stats()
    host = s.host_store
    more = {key: value for each in extra for key, value in each.json_fields().items()}
    return {
        **engine_fields(s, collector.decode_weight_bytes, collector.http.output_failures),
        "first_response": collector.http.first_response.snapshot(),
        # Flare extensions beyond the table (integers, like the table's fields).
        "cancelled": s.cancelled_total,
        "admitted": s.admitted_total,
        "prefix_cache_hits": s.cache_hits_total,  # admissions that restored a KV checkpoint
        "http_inflight_requests": collector.http.inflight_requests,
        "http_admission_slots": collector.admission.slots,
        "http_admission_slots_used": collector.admission.used,
        "uptime_seconds": int(time.monotonic() - collector.http.started_monotonic),
        # Engine time split (scripts/bench.py): step wall time, the part inside the step graph,
        # the part spent scheduling, and grammar-mask time (computed beside the graph run).
        "engine_steps": s.steps_total,
        "engine_step_ns": int(s.step_seconds_total * 1e9),
        "engine_graph_ns": int(s.graph_seconds_total * 1e9),
        "engine_schedule_ns": int(s.schedule_seconds_total * 1e9),
        "grammar_mask_ns": int(s.grammar_mask_seconds_total * 1e9),
        # Host prefix store beyond the table: chains declined because recomputing was predicted cheaper.
        "host_restores_declined": host.restores_declined if host else 0,
        **more,
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

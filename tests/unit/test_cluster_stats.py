"""The cluster's aggregate engine stats (helios.cluster.engine.sum_stats): what /metrics shows
through a cluster endpoint is the sum over replicas, histograms merged bucket by bucket."""

from __future__ import annotations

import pytest

pytest.importorskip("ray.serve", reason="the `cluster` extra (ray[serve]) is not installed")

from helios.cluster import affinity
from helios.cluster.engine import ClusterEngine, sum_stats
from helios.cluster.spec import ENGINES
from helios.engine.api import EngineStats
from helios.engine.host_store import HostStoreStats


def stats(active: int, generated: int, host: HostStoreStats | None = None, **extra) -> EngineStats:
    return EngineStats(
        active=active,
        pending=1,
        free_pages=10,
        total_pages=100,
        page_tokens=16,
        prefill_tokens_total=5,
        generated_tokens_total=generated,
        completed_total=1,
        cancelled_total=0,
        failed_total=0,
        steps_total=3,
        admitted_total=1,
        preempted_total=0,
        step_seconds_total=0.5,
        schedule_seconds_total=0.1,
        host_store=host,
        **extra,
    )


def test_counters_gauges_dicts_and_flags_add_up():
    a = stats(2, 7, checkpoint_captures={"anchor": 1}, history_drafts_enabled=False, rounds_by_width={0: 3})
    b = stats(
        1,
        5,
        checkpoint_captures={"anchor": 2, "endpoint": 4},
        history_drafts_enabled=True,
        rounds_by_width={0: 1, 2: 5},
    )
    total = sum_stats([a, b])
    assert (total.active, total.pending, total.free_pages, total.total_pages) == (3, 2, 20, 200)
    assert total.generated_tokens_total == 12 and total.step_seconds_total == pytest.approx(1.0)
    assert total.page_tokens == 16  # a property of the core, not summed
    assert total.checkpoint_captures == {"anchor": 3, "endpoint": 4}
    assert total.rounds_by_width == {0: 4, 2: 5}
    assert total.history_drafts_enabled is True and total.host_store is None


def test_host_store_stats_and_histograms_merge():
    buckets = [("1000.0", 1), ("+Inf", 2)]
    one = HostStoreStats(
        hits=1, held={"dram": 2}, dropped={("nvme", "io_error"): 1}, histograms={"missing_tokens": (buckets, 10.0)}
    )
    two = HostStoreStats(hits=2, held={"dram": 1, "nvme": 4}, histograms={"missing_tokens": (buckets, 5.0)})
    total = sum_stats([stats(0, 0, one), stats(0, 0, two), stats(0, 0)])
    host = total.host_store
    assert host.hits == 3 and host.held == {"dram": 3, "nvme": 4} and host.dropped == {("nvme", "io_error"): 1}
    assert host.histograms["missing_tokens"] == ([("1000.0", 2), ("+Inf", 4)], 15.0)


def test_no_replicas_is_an_empty_engine():
    total = sum_stats([])
    assert total.active == 0 and total.total_pages == 0 and total.host_store is None


class StubRouter:
    def __init__(self, rows: dict):
        self.rows = rows

    def replica_stats(self) -> dict:
        return self.rows


def test_the_queue_bound_holds_per_replica_and_health_needs_one_live_replica(monkeypatch):
    """Admission's queue bound is per engine: a cluster refuses only when every live replica's
    queue is full; an unhealthy replica neither counts nor keeps /health up."""
    engine = ClusterEngine(handle=None)
    rows = {
        "a": {"healthy": True, "stats": stats(1, 0)},
        "b": {"healthy": True, "stats": stats(1, 0)},
        "c": {"healthy": False, "stats": stats(1, 0)},
    }
    rows["a"]["stats"].pending, rows["b"]["stats"].pending, rows["c"]["stats"].pending = 40, 3, 0
    monkeypatch.setitem(affinity.ROUTERS, ENGINES, StubRouter(rows))
    assert engine.num_pending() == 3 and engine.healthy()
    assert engine.stats().pending == 43  # the aggregate still counts every replica
    rows["b"]["healthy"] = False
    assert engine.num_pending() == 40
    rows["a"]["healthy"] = False
    assert engine.num_pending() == 0 and not engine.healthy()

"""`helios top`: snapshot parsing, rate history, sparklines and rendering to a string, against
synthetic snapshots and a live tiny server."""

from __future__ import annotations

import io
import threading

import httpx
from rich.console import Console

from helios import dashboard
from helios.dashboard import Snapshot, View, sparkline


def render(view: View, width: int = 120) -> str:
    console = Console(file=io.StringIO(), width=width, record=True, color_system=None)
    console.print(view.render())
    return console.export_text()


def test_snapshot_reads_absent_fields_as_zero():
    snap = Snapshot.from_json(
        {
            "generated_tokens": 7,
            "unknown_field": 3,
            "learned_drafter": True,
            "first_response": {"median_seconds": 0.25, "samples": 4},
        }
    )
    assert snap.generated_tokens == 7 and snap.prefill_tokens == 0 and snap.verify_steps == 0
    assert snap.learned_drafter is True
    assert snap.first_response_median == 0.25 and snap.first_response_samples == 4
    empty = Snapshot.from_json({"first_response": {"median_seconds": None}})
    assert empty == Snapshot()
    assert Snapshot.from_json({"active": "three", "pending": True}).active == 0  # malformed reads as zero


def test_sparkline_scales_to_its_own_peak():
    assert sparkline([], 10) == ""
    assert sparkline([0, 0], 10) == "▁▁"
    assert sparkline([0, 5, 10], 10) == "▁▅█"
    assert len(sparkline(list(range(100)), 20)) == 20


def test_rates_weights_depth_and_render():
    view = View("http://example:8000", history=5)
    base = dict(total_pages=100, free_pages=100, decode_weight_bytes=1_000_000_000)
    view.update(Snapshot(**base), at=10.0)
    text = render(view)
    assert "helios top" in text and "http://example:8000" in text and "DEPTH -" in text
    view.update(
        Snapshot(
            **{**base, "free_pages": 60},
            generated_tokens=500,
            prefill_tokens=2000,
            completed=4,
            verify_steps=20,
            reused_tokens=60,
            host_reused_tokens=40,
            host_hits=1,
            verification_drafts=30,
            verification_rounds=10,
            active=2,
            pending=1,
        ),
        at=12.0,
    )
    assert list(view.history["tokens"]) == [250.0]
    assert list(view.history["requests"]) == [2.0]
    assert list(view.history["reuse"]) == [50.0]
    assert list(view.history["weights"]) == [10e9]  # 1 GB per graph x 10 graphs/s
    assert list(view.history["pages"]) == [0.0, 40.0] and list(view.history["running"]) == [0.0, 3.0]
    assert view.depth == 3.0
    text = render(view)
    for label in ("tokens/s", "requests", "KV pages", "cache reuse", "WEIGHTS", "active+pending"):
        assert label in text, label
    assert "10.00 GB/s" in text and "40/100" in text and "250 tok/s" in text and "DEPTH 3.00" in text
    assert "host hits 1 (40 tokens)" in text
    assert "█" in text
    for i in range(10):  # history is bounded
        view.update(Snapshot(**base), at=13.0 + i)
    assert all(len(series) <= 5 for series in view.history.values())
    view.update(Snapshot(**base, generated_tokens=0), at=30.0)  # a restarted server: no negative rates
    assert min(view.history["tokens"]) >= 0


def test_cluster_replicas_are_read_and_shown():
    data = {
        "total_pages": 8,
        "replicas": [
            {
                "replica": "abc123",
                "label": "node:41",
                "healthy": True,
                "inflight": 2,
                "active": 1,
                "routed": 9,
                "reused_tokens": 640,
            },
            {"replica": "def456", "label": "node:42", "healthy": False, "routed": "x"},
            "not a row",
        ],
    }
    snapshot = Snapshot.from_json(data)
    assert [r.replica for r in snapshot.replicas] == ["abc123", "def456"]
    assert snapshot.replicas[0].reused_tokens == 640 and snapshot.replicas[1].routed == 0
    view = View("http://cluster:8000")
    view.update(snapshot, at=1.0)
    text = render(view)
    assert "replicas" in text and "node:41" in text and "640" in text and "down" in text
    assert "node:" not in render_one(Snapshot.from_json({"total_pages": 8}))  # one server: no table


def render_one(snapshot: Snapshot) -> str:
    view = View("http://one:8000")
    view.update(snapshot, at=1.0)
    return render(view)


def test_live_server_snapshot_and_run(tiny_server):
    with httpx.Client(timeout=30) as client:
        httpx.post(tiny_server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        snap = dashboard.fetch(client, tiny_server.url)
    assert snap.generated_tokens > 0 and snap.total_pages > 0 and snap.decode_weight_bytes > 0
    assert snap.kv_pool_dtype in ("float32", "bfloat16", "float16") and snap.kv_pool_bytes > 0
    out = io.StringIO()
    console = Console(file=out, width=120, color_system=None, force_terminal=False)
    stop = threading.Event()
    thread = threading.Thread(
        target=dashboard.run, args=(tiny_server.url,), kwargs={"interval": 0.1, "console": console, "stop": stop}
    )
    thread.start()
    threading.Timer(0.5, stop.set).start()
    thread.join(10)
    assert not thread.is_alive()
    assert "WEIGHTS" in out.getvalue() and "tokens/s" in out.getvalue()
    assert f"GiB {snap.kv_pool_dtype}" in out.getvalue()  # the footer names the pool's type
    view = View("http://127.0.0.1:1")  # nothing listens: the view shows the error, no exception
    with httpx.Client(timeout=1) as client:
        try:
            dashboard.fetch(client, view.url)
        except httpx.HTTPError as exc:
            view.error = type(exc).__name__
    assert "ConnectError" in render(view)

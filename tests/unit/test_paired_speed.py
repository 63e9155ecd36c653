"""scripts/paired_speed.py: the bench's paired decode turns (medians of each pair's ratio) and
the runner loop protocol the peers' --serve modes speak."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


@pytest.fixture
def paired(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import paired_speed

    return paired_speed


def test_ratios_are_medians_of_pairs_and_a_peer_without_the_batch_is_left_out(paired, monkeypatch):
    helios_speeds = iter([100.0, 90.0, 300.0, 800.0, 800.0, 800.0])

    def helios(streams, tokens):
        return next(helios_speeds)

    def one_stream_peer(streams, tokens):
        return 50.0 if streams == 1 else None

    monkeypatch.setattr(paired, "SETTLE_SECONDS", 0.0)
    out = paired.paired_decode(helios, {"peer": one_stream_peer}, turns=3, tokens=8)
    # Three turns at one stream: ratios 2.0, 1.8, 6.0 -> median 2.0; helios median 100.
    assert out["decode_b1"]["peer"]["ratio"] == pytest.approx(2.0)
    assert out["decode_b1"]["peer"]["helios_tps"] == 100.0
    assert len(out["decode_b1"]["peer"]["pairs"]) == 3
    assert out["decode_b8"] == {}
    lines = paired.paired_lines({"turns": 3, "tokens": 8, **out}, {"decode_b1_tps": 1.5})
    assert any("decode_b1 vs the fastest peer (peer): 2.00x (target >= 1.5)" in line for line in lines)


def test_a_peer_that_fails_mid_run_is_reported_and_the_others_kept(paired, monkeypatch):
    monkeypatch.setattr(paired, "SETTLE_SECONDS", 0.0)

    def broken(streams, tokens):
        raise ValueError("the runner went away")

    out = paired.paired_decode(lambda s, t: 90.0, {"broken": broken, "fine": lambda s, t: 45.0}, turns=2, tokens=8)
    assert out["decode_b1"]["broken"] == {"error": "the runner went away"}
    assert out["decode_b1"]["fine"]["ratio"] == pytest.approx(2.0)
    lines = paired.paired_lines({"turns": 2, "tokens": 8, **out}, {})
    assert "  decode_b1: peer broken failed: the runner went away" in lines
    assert any("vs the fastest peer (fine): 2.00x" in line for line in lines)


def test_peer_loop_speaks_the_serve_protocol(paired, tmp_path):
    runner = tmp_path / "runner.py"
    runner.write_text(
        textwrap.dedent(
            """
            import json, sys
            assert sys.argv[-1] == "--serve"
            print("ready", flush=True)
            for line in sys.stdin:
                streams, steps = map(int, line.split())
                print(json.dumps({"tps": streams * 10.0 + steps} if streams < 8 else {"error": "one stream"}), flush=True)
            """
        )
    )
    loop = paired.PeerLoop(Path(sys.executable), runner, [])
    try:
        assert loop.decode(1, 5) == 15.0
        assert loop.decode(8, 5) is None
    finally:
        loop.close()
    assert loop.process.returncode == 0


def test_peer_loop_that_does_not_start_says_so(paired, tmp_path):
    runner = tmp_path / "broken.py"
    runner.write_text("print('no model here')\n")
    with pytest.raises(RuntimeError, match="did not start"):
        paired.PeerLoop(Path(sys.executable), runner, [])

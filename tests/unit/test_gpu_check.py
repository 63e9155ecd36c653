"""scripts/gpu_check.py's plumbing: its --cpu-smoke run (every phase, tiny shapes, on the CPU) ends
with every phase recorded and no exception, so the one device run it is written for cannot fail on
a typo. The GPU numbers themselves are only measured on the device."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO

PHASES = ["env", "kernels", "compat", "model:tiny", "peer", "targets"]


def test_cpu_smoke_records_every_phase(tmp_path):
    pytest.importorskip("triton")
    pytest.importorskip("transformers")
    out = tmp_path / "gpu_check.json"
    run = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "gpu_check.py"),
            "--cpu-smoke",
            "--out",
            str(out),
            "--fixture",
            str(tmp_path / "absent"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["finished"]
    assert list(results["phases"]) == PHASES
    for name, phase in results["phases"].items():
        assert phase["status"] == "ok", (name, phase.get("error"), phase.get("errors"))
    assert results["phases"]["kernels"]["failed"] == []
    compat = results["phases"]["compat"]
    assert compat["cpu_vs_device_pass"] and compat["graph_vs_eager_b3"]["same_bucket_bitwise"]
    assert results["phases"]["model:tiny"]["parity"]["top1_agreement"] >= 0.9  # bf16 program vs fp32 reference
    assert set(results["phases"]["targets"]["targets"]) >= {"graph_equals_eager", "b1_runner_of_bound", "prefill_2048"}

"""A family core's torch step program (fp32, `--target cpu,cuda`, exported and validated against
the family's reference beside its ONNX graph) equals the core's ONNX step graph through helios'
runners: two prefill chunks of two rows, then batched decode steps on shuffled page tables
(recurrent state slots included). Every compiled family with FLARE_ALL_TORCH_FAMILIES=1, three
representative ones by default (tests/unit/conftest.py, TORCH_PROGRAM_RECIPES)."""

from __future__ import annotations

import numpy as np
import pytest

from helios.engine.runner import Runner
from helios.engine.step_io import StepRow
from helios.engine.torch_runner import TorchRunner
from helios.manifest import Manifest
from tests.unit.conftest import TORCH_PROGRAM_RECIPES

PAGES = 16


@pytest.mark.parametrize("recipe", TORCH_PROGRAM_RECIPES)
def test_torch_program_equals_the_onnx_graph(family_env, recipe):
    core, _ = family_env(recipe)
    manifest = Manifest.load(core)
    program = manifest.engine("step", "cuda")
    assert program.dtype == "float32" and program.parity is not None and program.parity.top1_agreement == 1.0
    onnx_runner = Runner(core, manifest, PAGES, threads=1, state_slots=4)
    torch_runner = TorchRunner(core, manifest, PAGES, device="cpu", state_slots=4)
    rng = np.random.default_rng(0)
    vocab = min(manifest.architecture.vocab_size, 4000)
    seqs = [rng.integers(3, vocab, 40).tolist(), rng.integers(3, vocab, 23).tolist()]
    order = [int(p) for p in rng.permutation(PAGES)]
    tables = [order[:4], order[4:7]]  # shuffled, disjoint
    steps = [
        [StepRow(seqs[0][:17], 0, tables[0], state_slot=1), StepRow(seqs[1][:20], 0, tables[1], state_slot=3)],
        [StepRow(seqs[0][17:40], 17, tables[0], state_slot=1), StepRow(seqs[1][20:23], 20, tables[1], state_slot=3)],
    ]
    for i in range(3):
        steps.append(
            [StepRow([5 + i], 40 + i, tables[0], state_slot=1), StepRow([9 + i], 23 + i, tables[1], state_slot=3)]
        )
    for rows in steps:
        want, got = onnx_runner.step(rows), torch_runner.step(rows)
        scale = max(float(np.abs(want.logits).max()), 1.0)
        assert float(np.abs(got.logits - want.logits).max()) <= 1e-4 * scale, recipe
        np.testing.assert_array_equal(got.top_ids[:, :3], want.top_ids[:, :3])

"""The torch step program (`ignition export --target cuda`) and helios' torch runner on CPU torch:
the program equals the ONNX step graph of the same core, the runner keeps the StepRunner contract
(pages, copies, verification positions, explicit ids, prompt scores), and the decode-graph path's
buckets, padding and spare page give what the eager path gives (graphs replaced by eager calls,
as on a machine without a GPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helios.engine.runner import Runner
from helios.engine.step_io import StepRow, StepRunner, new_token_slots
from helios.engine.torch_runner import DecodeGraphs, TorchRunner, decode_buckets
from helios.kernels import kv_dtype
from helios.manifest import Manifest

PAGES = 24


def prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(10, 5000, n).tolist()


def runners(core, **torch_options) -> tuple[Runner, TorchRunner]:
    manifest = Manifest.load(core)
    return Runner(core, manifest, PAGES), TorchRunner(core, manifest, PAGES, device="cpu", **torch_options)


def assert_same_outputs(got, want, atol: float = 1e-4) -> None:
    for field in ("logits", "logsumexp", "top_logprobs"):
        np.testing.assert_allclose(getattr(got, field), getattr(want, field), rtol=1e-4, atol=atol, err_msg=field)
    np.testing.assert_array_equal(got.top_ids[:, :5], want.top_ids[:, :5])
    assert got.first == want.first


def test_manifest_names_the_torch_engine(tiny_core):
    manifest = Manifest.load(tiny_core)
    program = manifest.engine("step", "cuda")
    assert (program.file, program.dtype, program.torch_version) == ("step.cuda.pt2", "float32", torch.__version__)
    assert manifest.engine("step").file == "step.onnx"  # older helios: the first "step" engine is the ONNX one
    assert program.parity is not None and program.parity.max_abs_logit_error <= 1e-3
    assert program.parity.top1_agreement == 1.0
    assert [s.name for s in program.inputs] == [s.name for s in manifest.engine("step").inputs]


def test_both_runners_are_step_runners(tiny_core):
    onnx_runner, torch_runner = runners(tiny_core)
    assert isinstance(onnx_runner, StepRunner) and isinstance(torch_runner, StepRunner)
    assert torch_runner.can_verify and torch_runner.can_score_prompts and torch_runner.pool_dtype == "float32"


def test_program_equals_the_onnx_graph(tiny_core):
    """Prefill chunks, a mixed step, decode rows with explicit ids, a verification row and prompt
    scores: the same outputs and the same K/V in the same pages."""
    onnx_runner, torch_runner = runners(tiny_core)
    a, b, c = prompt(40, 1), prompt(23, 2), prompt(9, 3)
    tables = {"a": [5, 2, 17], "b": [9, 1], "c": [3]}
    steps = [
        [StepRow(a[:20], 0, tables["a"]), StepRow(b[:23], 0, tables["b"], score_targets=b[1:23] + [-1])],
        [StepRow(a[20:40], 20, tables["a"]), StepRow(c, 0, tables["c"])],  # history read back from the pool
        [
            StepRow([7], 40, tables["a"], logprob_ids=[7, 11, 400]),
            StepRow([8], 23, tables["b"]),
            StepRow([9, 10, 11], 9, tables["c"], output_positions=[0, 1, 2]),
        ],
    ]
    for rows in steps:
        want, got = onnx_runner.step(rows), torch_runner.step(rows)
        assert_same_outputs(got, want)
        if want.token_logprobs is not None:
            np.testing.assert_allclose(got.token_logprobs[:, :3], want.token_logprobs[:, :3], atol=1e-4)
        if want.prompt_scores is not None:
            np.testing.assert_allclose(
                got.prompt_scores[1].target_logprobs, want.prompt_scores[1].target_logprobs, atol=1e-4
            )
    used = sorted({p for t in tables.values() for p in t})
    np.testing.assert_allclose(torch_runner.read_pages(used), onnx_runner.read_pages(used), atol=1e-5)


def test_pages_move_exactly_in_bf16_too(tiny_core):
    onnx_runner, torch_runner = runners(tiny_core)
    onnx_runner.step([StepRow(prompt(30, 4), 0, [4, 7])])
    data = onnx_runner.read_pages([4, 7])
    torch_runner.write_pages([11, 2], data)
    np.testing.assert_array_equal(torch_runner.read_pages([11, 2]), data)
    torch_runner.copy_page(11, 0)
    np.testing.assert_array_equal(torch_runner.read_pages([0]), data[:, :, :1])
    # A bf16 pool (a GPU core's): pages leave as bfloat16 (the host store keeps that type) and come
    # back bit for bit; float32 pages are rounded on the way in, as the ONNX runner's bf16 pool does.
    torch_runner.dtype, torch_runner.pool = torch.bfloat16, torch_runner.pool.to(torch.bfloat16)
    torch_runner.pages = torch_runner.pool.view(torch_runner.pages.shape)
    torch_runner.write_pages([3, 5], data)
    narrow = torch_runner.read_pages([3, 5])
    assert narrow.dtype == kv_dtype.numpy_dtype("bfloat16")
    np.testing.assert_array_equal(narrow, data.astype(narrow.dtype))
    torch_runner.write_pages([6, 8], narrow)
    np.testing.assert_array_equal(torch_runner.read_pages([6, 8]).view(np.uint16), narrow.view(np.uint16))


def test_decode_buckets():
    assert decode_buckets(8) == [1, 2, 4, 8]
    assert decode_buckets(6) == [1, 2, 4, 6]
    assert decode_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert decode_buckets(1) == [1]


def test_decode_graph_path_equals_eager_steps(tiny_core):
    """Decode batches of 1, 3 and 4 rows through the bucketed static buffers (eager stand-ins for
    the graphs) give the eager runner's outputs and K/V; padded rows write only the spare page."""
    manifest = Manifest.load(tiny_core)
    graphed = TorchRunner(tiny_core, manifest, PAGES, device="cpu", graphs=True, max_batch=4)
    eager = TorchRunner(tiny_core, manifest, PAGES, device="cpu", graphs=False)
    assert isinstance(graphed.graphs, DecodeGraphs) and graphed.graphs.buckets == [1, 2, 4]
    assert graphed.graphs.width == PAGES  # block tables as wide as the pool
    seqs = [prompt(n, 10 + i) for i, n in enumerate((15, 16, 17, 31))]  # page edges
    tables = [[1, 8], [2, 9], [3, 10, 20], [4, 11, 21]]
    for runner in (graphed, eager):
        runner.step([StepRow(s, 0, t) for s, t in zip(seqs, tables)])
    spare_before = graphed.pages[:, :, PAGES].clone()
    for batch in ([0], [0, 2, 3], [0, 1, 2, 3]):
        rows = [StepRow([100 + i], len(seqs[i]), tables[i], logprob_ids=[5] if i == 2 else None) for i in batch]
        launches = graphed.decode_graph_launches
        got, want = graphed.step(rows), eager.step(rows)
        assert graphed.decode_graph_launches == launches + 1
        assert_same_outputs(got, want, atol=1e-5)
        if want.token_logprobs is not None:
            np.testing.assert_allclose(got.token_logprobs[:, :1], want.token_logprobs[:, :1], atol=1e-5)
        for i in batch:
            seqs[i].append(100 + i)
    used = sorted({p for t in tables for p in t})
    np.testing.assert_allclose(graphed.read_pages(used), eager.read_pages(used), atol=1e-5)
    assert not torch.equal(graphed.pages[:, :, PAGES], spare_before)  # the 3-row batch padded into the spare page
    # Rows the graphs do not take run eagerly: a prefill chunk, verification positions.
    launches = graphed.decode_graph_launches
    graphed.step([StepRow([1, 2], len(seqs[3]), tables[3], output_positions=[0, 1])])
    assert graphed.decode_graph_launches == launches


def test_new_token_slots():
    rows = [StepRow([1, 2, 3], 14, [7, 3]), StepRow([4], 0, [5])]
    pages, offsets, row_index, token_index = new_token_slots(rows, 16)
    assert pages.tolist() == [7, 7, 3, 5] and offsets.tolist() == [14, 15, 0, 0]
    assert row_index.tolist() == [0, 0, 0, 1] and token_index.tolist() == [0, 1, 2, 0]


def test_runner_refuses_what_the_onnx_runner_refuses(tiny_core):
    _, torch_runner = runners(tiny_core)
    with pytest.raises(ValueError, match="out of range"):
        torch_runner.step([StepRow([1], 0, [PAGES])])
    with pytest.raises(ValueError, match="at least one row"):
        torch_runner.step([])

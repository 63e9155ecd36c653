"""The recurrent-state contract (docs/architecture.md, "Recurrent state"), on a tiny Qwen 3.5
(gated DeltaNet + gated attention) checkpoint written by transformers:

- chunked prefill (several chunk splits) gives the one-pass prefill's logits and final state;
- a right-padded row's new state equals the same row run alone (padding never touches the state);
- a row with history 0 ignores whatever its slot holds (stale values, even NaN);
- the same through the exported ONNX graph and `Runner` (Scan over a dynamic L, state pool bound
  in place, new_state written back to the slot, split graph calls), the scheduler's slots
  (waiting for one, freeing at finish and preemption), prefix checkpoints with state snapshots
  (exact-boundary capture and restore; refused without snapshots), and the manifest's checks.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helios.engine.step_io import step_groups
from helios.manifest import FORMAT_VERSION, Manifest, ManifestError, StateLayer, StateLayout

pytest.importorskip("transformers")

pytestmark = pytest.mark.families("qwen38_dense")

VOCAB = 265  # 256 bytes + the 9 Qwen control tokens of family_checkpoints.SPECIALS


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(checkpoint folder, ConfiguredLM, transformers model) of the tiny dense Qwen 3.5."""
    from ignition.checkpoints.safetensors_dir import read_safetensors_dir
    from ignition.models import build_model
    from tests.unit.family_checkpoints import write_family_checkpoint

    folder, reference = write_family_checkpoint(tmp_path_factory.mktemp("q35") / "ckpt", "qwen3_5")
    return folder, build_model(*read_safetensors_dir(folder).model_inputs()), reference


def _step(model, chunks, histories, slots, pool, kv_pool=None):
    """One step graph call in torch: rows `chunks` (token lists) after `histories`."""
    batch, length = len(chunks), max(len(c) for c in chunks)
    ids = torch.zeros(batch, length, dtype=torch.int64)
    positions = torch.zeros(batch, length, dtype=torch.int64)
    for b, (chunk, hist) in enumerate(zip(chunks, histories)):
        ids[b, : len(chunk)] = torch.tensor(chunk)
        positions[b, : len(chunk)] = torch.arange(hist, hist + len(chunk))
    if kv_pool is None:  # no attention history needed: every row starts at 0 or is checked alone
        kv_pool = torch.zeros(2 * len(model.kv_layers), 16, model.arch.num_kv_heads, model.arch.head_dim)
    with torch.no_grad():
        out = model(
            ids,
            positions,
            torch.tensor(histories),
            torch.tensor([len(c) for c in chunks]),
            torch.zeros(batch, 1, dtype=torch.int64),
            kv_pool,
            torch.zeros(batch, 1, dtype=torch.int64),
            state_pool=pool,
            state_slots=torch.tensor(slots),
        )
    return out[0], out[-1]  # logits [B, V], new_state [B, W]


def test_the_plan_keeps_state_for_linear_layers_only(tiny):
    _, model, _ = tiny
    assert [k for _, k, _, _ in model.state_layout] == ["gated_deltanet", "gated_deltanet"]
    assert model.kv_layers == [1]  # only the full-attention layer has K/V rows
    conv = 3 * (2 * 2 * 16 + 4 * 8)  # (K-1) x conv_dim
    assert model.state_width == 2 * (conv + 4 * 16 * 8)


def test_padded_rows_and_fresh_rows_in_torch(tiny):
    """Row 1 is right-padded (5 of 9 tokens): its state must equal the state of the same 5 tokens
    alone. Slots hold garbage (NaN in one): rows with history 0 must not read them."""
    _, model, _ = tiny
    rng = np.random.default_rng(1)
    a, b = rng.integers(0, VOCAB, 9).tolist(), rng.integers(0, VOCAB, 5).tolist()
    pool = torch.randn(3, model.state_width)
    pool[0, 7] = float("nan")
    logits, state = _step(model, [a, b], [0, 0], [0, 2], pool)
    alone_logits, alone_state = _step(model, [b], [0], [1], torch.zeros(3, model.state_width))
    assert torch.isfinite(state).all()
    torch.testing.assert_close(state[1], alone_state[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logits[1], alone_logits[0], rtol=1e-5, atol=1e-5)


def _prefill_in_chunks(model, tokens, splits):
    """Prefill `tokens` in chunks ending at `splits` through the paged pool and one state slot;
    returns the logits after each chunk and the final state."""
    page = 16
    pages = -(-len(tokens) // page)
    kv = torch.zeros(2 * len(model.kv_layers) * pages, page, model.arch.num_kv_heads, model.arch.head_dim)
    pool = torch.full((2, model.state_width), 123.0)  # stale: the first chunk must ignore it
    table = torch.arange(pages).unsqueeze(0)
    out, start = [], 0
    for end in [*splits, len(tokens)]:
        chunk = tokens[start:end]
        ids = torch.tensor([chunk])
        positions = torch.arange(start, end).unsqueeze(0)
        with torch.no_grad():
            res = model(
                ids,
                positions,
                torch.tensor([start]),
                torch.tensor([len(chunk)]),
                table,
                kv,
                torch.zeros(1, 1, dtype=torch.int64),
                state_pool=pool,
                state_slots=torch.tensor([1]),
            )
        new_kv = res[5]  # [kv layers, 2, 1, L, heads, dim] -> pool rows (layer*2+kind)*P + page
        for j in range(len(model.kv_layers)):
            for kind in (0, 1):
                for t, pos in enumerate(range(start, end)):
                    kv[(2 * j + kind) * pages + pos // page, pos % page] = new_kv[j, kind, 0, t]
        pool[1] = res[-1][0]
        out.append(res[0][0])
        start = end
    return out, pool[1].clone()


@pytest.mark.parametrize("splits", [[1], [7, 8, 20], [13], [2, 3, 4, 5, 30]])
def test_chunked_prefill_equals_one_pass(tiny, splits):
    _, model, reference = tiny
    tokens = np.random.default_rng(2).integers(0, VOCAB, 33).tolist()
    whole, whole_state = _prefill_in_chunks(model, tokens, [])
    chunked, state = _prefill_in_chunks(model, tokens, splits)
    torch.testing.assert_close(chunked[-1], whole[-1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state, whole_state, rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        want = reference(torch.tensor([tokens])).logits[0]
    for end, logits in zip([*splits, len(tokens)], chunked):
        assert float((logits - want[end - 1]).abs().max() / want.abs().max()) < 1e-4


@pytest.fixture(scope="module")
def graph(family_env):
    """The tiny Qwen 3.5's fp32 step graph (the qwen38_dense family core's: the same seeded
    checkpoint as `tiny`) with its KV and state layouts and transformers reference."""
    core, reference = family_env("qwen38_dense")
    manifest = Manifest.load(core)
    step = next(e for e in manifest.engines if e.name == "step")
    assert [i.name for i in step.inputs][-2:] == ["state_pool", "state_slots"]
    assert step.outputs[-1].name == "new_state" and step.outputs[-1].shape == ["B", manifest.state.width]
    return core / step.file, manifest.kv, manifest.state, reference


def test_runner_state_slots_through_the_onnx_graph(graph):
    """Two sequences batched with padding, chunked prefill then decode; each slot written back;
    every logit matches transformers; a stale slot is ignored at history 0."""
    from helios.engine.runner import Runner, StepRow

    path, kv, state, reference = graph
    rng = np.random.default_rng(3)
    seqs = [rng.integers(0, VOCAB, 30).tolist(), rng.integers(0, VOCAB, 21).tolist()]
    with torch.no_grad():
        want = [reference(torch.tensor([s])).logits[0].double().numpy() for s in seqs]
    runner = Runner.from_graph(path, kv, num_pages=8, state=state, state_slots=5)
    runner.state_pool[...] = rng.standard_normal(runner.state_pool.shape, dtype=np.float32)
    tables, slots = [[5, 1], [3, 6]], [4, 0]

    def check(out, rows_pos):
        for b, (seq_index, pos) in enumerate(rows_pos):
            ref = want[seq_index][pos]
            assert np.abs(out.logits[b] - ref).max() / np.abs(ref).max() < 1e-4

    # Prefill: row 0 in chunks of 1, 18 and 1, row 1 in one chunk of 19 then a decode. Beside each
    # other these pad 17 tokens > PAD_WASTE_TOKENS, so the runner splits both steps into two graph
    # calls, each reading and writing its own rows' slots.
    out = runner.step(
        [StepRow(seqs[0][:1], 0, tables[0], state_slot=4), StepRow(seqs[1][:19], 0, tables[1], state_slot=0)]
    )
    assert len(step_groups([StepRow(seqs[0][:1], 0, []), StepRow(seqs[1][:19], 0, [])])) == 2
    check(out, [(0, 0), (1, 18)])
    out = runner.step(
        [StepRow(seqs[0][1:19], 1, tables[0], state_slot=4), StepRow(seqs[1][19:20], 19, tables[1], state_slot=0)]
    )
    check(out, [(0, 18), (1, 19)])
    out = runner.step([StepRow(seqs[0][19:20], 19, tables[0], state_slot=4)])
    check(out, [(0, 19)])
    # Decode the rest one token per row per step (row 1 ends first: then row 0 alone).
    for i in range(10):
        rows, pos = [StepRow([seqs[0][20 + i]], 20 + i, tables[0], state_slot=slots[0])], [(0, 20 + i)]
        if 20 + i < len(seqs[1]):
            rows.append(StepRow([seqs[1][20 + i]], 20 + i, tables[1], state_slot=slots[1]))
            pos.append((1, 20 + i))
        check(runner.step(rows), pos)
    with pytest.raises(ValueError, match="state_slot"):
        runner.step([StepRow([1], 0, [0])])
    with pytest.raises(ValueError, match="share a state slot"):
        runner.step([StepRow([1], 0, [0], state_slot=1), StepRow([2], 0, [2], state_slot=1)])


def test_scheduler_slots_and_prefix_cache_skips():
    """Each running sequence owns one slot; with none free the head waits; finishing frees it.
    A recurrent core's prefix cache neither restores nor captures and counts the skips."""
    from helios.engine.api import CheckpointCandidate, CheckpointRole, FinishReason, GenerationRequest, SamplingParams
    from helios.engine.block_manager import BlockManager
    from helios.engine.prefix_cache import PrefixCache
    from helios.engine.scheduler import Scheduler
    from helios.engine.sequence import Sequence
    from helios.engine.stops import StopChecker

    bm = BlockManager(64, 16)
    cache = PrefixCache(bm, copy_page=lambda a, b: None, page_bytes=1, recurrent_state=True)
    sched = Scheduler(
        bm, max_concurrency=8, max_batch_tokens=256, prefill_chunk_size=64, prefix_cache=cache, state_slots=2
    )

    def seq(i: int) -> Sequence:
        request = GenerationRequest(
            request_id=f"r{i}",
            prompt_token_ids=list(range(1, 30)),
            sampling=SamplingParams(max_tokens=4),
            checkpoints=[
                CheckpointCandidate(16, CheckpointRole.ANCHOR),
                CheckpointCandidate(29, CheckpointRole.ENDPOINT),
            ],
        )
        return Sequence(request, i, StopChecker(request.sampling, [], 4, None))

    seqs = [seq(i) for i in range(3)]
    for s in seqs:
        sched.add(s)
    batch = sched.schedule()
    assert [r.seq.request_id for r in batch.rows] == ["r0", "r1"]  # r2 waits for a slot
    assert sorted(s.state_slot for s in seqs[:2]) == [0, 1] and seqs[2].state_slot is None
    assert cache.skips["recurrent_state"] == 4 and cache.num_checkpoints == 0
    sched.commit(batch)
    freed = seqs[0].state_slot
    sched.finish(seqs[0], FinishReason.STOP)
    assert seqs[0].state_slot is None
    batch = sched.schedule()
    assert "r2" in [r.seq.request_id for r in batch.rows] and seqs[2].state_slot == freed
    assert cache.match(seqs[1].token_ids) == (None, 0) and seqs[2].cached_tokens == 0


def test_manifest_state_layout_is_checked():
    from helios.manifest import _build

    assert FORMAT_VERSION == "1.16"
    good = {
        "width": 30,
        "dtype": "float32",
        "layers": [
            {"layer": 0, "kind": "gated_deltanet", "offset": 0, "size": 10},
            {"layer": 2, "kind": "gated_deltanet", "offset": 10, "size": 20},
        ],
    }
    layout = _build(StateLayout, good, "core.state")
    layout.check(3)
    assert layout == StateLayout(30, [StateLayer(0, "gated_deltanet", 0, 10), StateLayer(2, "gated_deltanet", 10, 20)])
    bad = [
        {**good, "width": 31},  # slices do not cover the width
        {**good, "dtype": "float16"},
        {
            **good,
            "layers": [
                {"layer": 0, "kind": "x", "offset": 0, "size": 10},
                {"layer": 0, "kind": "x", "offset": 10, "size": 20},
            ],
        },
        {**good, "layers": [{"layer": 0, "kind": "x", "offset": 5, "size": 25}]},  # a gap
        {**good, "layers": [{"layer": 3, "kind": "x", "offset": 0, "size": 30}]},  # not a layer
    ]
    for data in bad:
        with pytest.raises(ManifestError):
            _build(StateLayout, data, "core.state").check(3)
    with pytest.raises(ManifestError):
        _build(StateLayout, {"width": 30, "layers": [{"layer": 0, "kind": "x", "offset": 0}]}, "core.state")


# -- prefix reuse with state snapshots (engine on an exported core) ---------------------------------


@pytest.fixture(scope="module")
def core(family_env):
    """The tiny Qwen 3.5 checkpoint exported as an fp32 core (qwen38_dense recipe)."""
    core, _ = family_env("qwen38_dense")
    manifest = Manifest.load(core)
    assert manifest.state is not None and manifest.kv.num_layers == 1 and manifest.format_version == FORMAT_VERSION
    return core


def _engine(core, **config):
    from helios.engine.engine import Engine
    from helios.engine.prefix_cache import PrefixCacheConfig

    manifest = Manifest.load(core, verify_files=False)
    return Engine(core, manifest, kv_pages=64, threads=1, prefix_cache=PrefixCacheConfig(**config))


def _run(engine, ids, checkpoints=(), max_tokens=6):
    from helios.engine.api import CheckpointCandidate, GenerationRequest, SamplingParams

    _run.n = getattr(_run, "n", 0) + 1
    request = GenerationRequest(
        f"r{_run.n}",
        list(ids),
        SamplingParams(max_tokens=max_tokens, top_k=1, ignore_eos=True),
        checkpoints=[CheckpointCandidate(p, role) for p, role in checkpoints],
    )
    events = engine.generate(request)
    assert events[-1].finished and events[-1].error is None, events[-1].error
    return [t for e in events for t in e.token_ids], events[-1].cached_tokens


def test_checkpoints_snapshot_and_restore_recurrent_state(core):
    """A follow-up prompt restores the first prompt's endpoint (K/V pages + the state snapshot) and
    generates exactly what an uncached engine generates; boundaries are captured exactly (prefill
    chunks end there), mid-page ones with a copied tail page."""
    from helios.engine.api import CheckpointRole

    A, M, E = CheckpointRole.ANCHOR, CheckpointRole.MESSAGE, CheckpointRole.ENDPOINT
    rng = np.random.default_rng(11)
    first = rng.integers(0, 256, 45).tolist()
    second = first + rng.integers(0, 256, 30).tolist()
    cold = _engine(core, enabled=False)
    warm = _engine(core)
    assert warm.prefix_cache.snapshots and warm.runner.num_state_slots >= 1
    want = [_run(cold, first)[0], _run(cold, second)[0]]
    got, cached = _run(warm, first, [(21, A), (45, E)])
    assert got == want[0] and cached == 0
    # A state core restores strictly less than a prompt, so its endpoint is captured one token
    # before the prompt's end: the same prompt again can reuse all but its last token.
    assert sorted(c.length for c in warm.prefix_cache.checkpoints()) == [21, 44]
    assert all(c.state is not None for c in warm.prefix_cache.checkpoints())
    got, cached = _run(warm, second, [(21, A), (45, M), (75, E)])
    assert got == want[1] and cached == 44
    got, cached = _run(warm, second, [(75, E)])  # the same prompt again: all but its last token
    assert got == want[1] and cached == 74
    assert warm.stats().checkpoint_skips["recurrent_state"] == 0


def test_host_records_carry_the_state_snapshot(core, tmp_path):
    """A state core's host records hold the state after their last token: a restarted engine
    restores a chain from disk (pages + state) and generates what an uncached engine does."""
    from helios.engine.api import CheckpointRole
    from helios.engine.engine import Engine
    from helios.engine.host_store import HostStoreConfig
    from helios.engine.prefix_cache import PrefixCacheConfig

    A, E = CheckpointRole.ANCHOR, CheckpointRole.ENDPOINT
    rng = np.random.default_rng(13)
    first = rng.integers(0, 256, 45).tolist()
    second = first + rng.integers(0, 256, 30).tolist()
    want = _run(_engine(core, enabled=False), second)[0]

    def engine() -> Engine:
        return Engine(
            core,
            Manifest.load(core, verify_files=False),
            kv_pages=64,
            threads=1,
            prefix_cache=PrefixCacheConfig(),
            host_store=HostStoreConfig(dram_bytes=0, directory=tmp_path, restore="always"),
        )

    writer = engine()
    assert writer.prefix_cache.host is not None
    _run(writer, first, [(21, A), (45, E)])
    writer.shutdown()
    assert len(list(tmp_path.rglob("*.rec"))) == 2  # the anchor and a link from it to the endpoint
    reader = engine()
    got, cached = _run(reader, second, [(75, E)])
    assert got == want and cached == 44  # the endpoint one token before the first prompt's end
    stats = reader.stats().host_store
    assert stats.hits == 1 and stats.reused_tokens == 44 and stats.dropped[("nvme", "io_error")] == 0
    reader.shutdown()


def test_checkpoints_are_refused_without_state_snapshots(core):
    """With no room for a snapshot the cache neither captures nor restores and counts the skips."""
    from helios.engine.api import CheckpointRole

    engine = _engine(core, state_storage_bytes=0)
    assert not engine.prefix_cache.snapshots
    ids = np.random.default_rng(12).integers(0, 256, 40).tolist()
    _run(engine, ids, [(16, CheckpointRole.ANCHOR), (40, CheckpointRole.ENDPOINT)])
    tokens, cached = _run(engine, ids + [5, 6, 7], [(40, CheckpointRole.MESSAGE)])
    assert cached == 0 and engine.prefix_cache.num_checkpoints == 0
    assert engine.stats().checkpoint_skips["recurrent_state"] == 3


def test_concurrent_sequences_with_preemption_match_sequential_runs(core):
    """Three sequences share the engine with too few pages: preempted ones give their slot back
    and recompute from history 0; every output equals the same prompt run alone."""
    from helios.engine.api import GenerationRequest, SamplingParams

    prompts = [np.random.default_rng(20 + i).integers(0, 256, 40).tolist() for i in range(3)]
    cold = _engine(core, enabled=False)
    expected = [_run(cold, p, max_tokens=30)[0] for p in prompts]
    from helios.engine.engine import Engine
    from helios.engine.prefix_cache import PrefixCacheConfig

    engine = Engine(
        core,
        Manifest.load(core, verify_files=False),
        kv_pages=9,
        threads=1,
        prefix_cache=PrefixCacheConfig(enabled=False),
    )
    outs: dict[str, list[int]] = {f"p{i}": [] for i in range(3)}
    done: set[str] = set()
    for i, p in enumerate(prompts):

        def sink(event, rid=f"p{i}"):
            outs[rid].extend(event.token_ids)
            if event.finished:
                done.add(rid)

        engine.submit(GenerationRequest(f"p{i}", p, SamplingParams(max_tokens=30, top_k=1, ignore_eos=True)), sink)
    while len(done) < 3:
        engine.step()
    assert [outs[f"p{i}"] for i in range(3)] == expected
    assert engine.stats().preempted_total >= 1
    assert sorted(engine.scheduler.free_state_slots) == list(range(engine.runner.num_state_slots))

"""Prefix reuse through immutable KV checkpoints: selection, budgets, eviction, exact restores,
and usage reporting through every protocol.

Engine tests run the real Runner on the tiny exported core (random weights: outputs are compared
with each other, never read); protocol tests use the live tiny server.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from helios.engine.api import CheckpointCandidate, CheckpointRole, GenerationRequest, SamplingParams
from helios.engine.assembly import RunnerChoice
from helios.engine.engine import Engine
from helios.engine.prefix_cache import PrefixCacheConfig
from helios.manifest import Manifest
from tests.unit.live import ANTHROPIC, metrics, sse
from tests.unit.test_engine_core import FakeRunner, core_dir, make_manifest, tokenizer  # noqa: F401 (fixtures)

A, H, M, E = CheckpointRole.ANCHOR, CheckpointRole.HINT, CheckpointRole.MESSAGE, CheckpointRole.ENDPOINT
PT = 16  # the tiny core's page tokens (checked below)


# Every pool type: a 16-bit pool's restores, chunked prefills and preemptions are exact too.
POOLS = ["float32", "bfloat16", "float16"]


def make_engine(core: Path, *, kv_pages: int = 256, pool: str = "float32", **config) -> Engine:
    manifest = Manifest.load(core, verify_files=False)
    assert manifest.kv.page_tokens == PT
    return Engine(
        core,
        manifest,
        kv_pages=kv_pages,
        threads=1,
        prefix_cache=PrefixCacheConfig(**config),
        choice=RunnerChoice(kv_dtype=pool),
    )


def prompt(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(100, 5000, n).tolist()


_ids = iter(range(1 << 30))


def run(engine: Engine, ids: list[int], checkpoints=(), max_tokens: int = 6, logprobs: int | None = None, **sampling):
    sampling.setdefault("temperature", 1.0)
    request = GenerationRequest(
        f"r{next(_ids)}",
        list(ids),
        SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs, **sampling),
        checkpoints=[CheckpointCandidate(p, role) for p, role in checkpoints],
    )
    events = engine.generate(request)
    final = events[-1]
    assert final.finished and final.error is None, final.error
    tokens = [t for e in events for t in e.token_ids]
    entries = [lp for e in events for lp in (e.logprobs or [])]
    return tokens, final.cached_tokens, entries


def roles(engine: Engine) -> dict[int, str]:
    return {c.length: c.role.value for c in engine.prefix_cache.checkpoints()}


# -- restored output equals uncached output --------------------------------------------------------


@pytest.mark.parametrize("sampling", [{"top_k": 1}, {"seed": 1234, "temperature": 1.0}], ids=["greedy", "seeded"])
@pytest.mark.parametrize("length", [100, 96])  # the endpoint inside a page, and page aligned
@pytest.mark.parametrize("pool", POOLS)
def test_restored_output_identical_to_uncached(tiny_core, sampling, length, pool):
    ids = prompt(length, seed=length)
    cold = make_engine(tiny_core, enabled=False, pool=pool)
    expected, cached, expected_lp = run(cold, ids, [(length, E)], max_tokens=12, logprobs=3, **sampling)
    assert cached == 0 and cold.stats().cached_pages == 0

    warm = make_engine(tiny_core, pool=pool)
    first, cached, _ = run(warm, ids, [(40, A), (length, E)], max_tokens=12, logprobs=3, **sampling)
    assert cached == 0 and first == expected
    again, cached, again_lp = run(warm, ids, [(40, A), (length, E)], max_tokens=12, logprobs=3, **sampling)
    assert cached == length - 1  # the whole prompt but its last token, which must give logits
    assert again == expected
    for a, b in zip(again_lp, expected_lp):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
    # A longer prompt through the same prefix restores the endpoint checkpoint exactly.
    longer = ids + prompt(30, seed=99)
    cold_out, _, _ = run(cold, longer, max_tokens=8, **sampling)
    warm_out, cached, _ = run(warm, longer, max_tokens=8, **sampling)
    assert cached == length and warm_out == cold_out
    stats = warm.stats()
    assert stats.reused_tokens_total == 2 * length - 1 and stats.cache_hits_total == 2


@pytest.mark.parametrize("pool", POOLS)
def test_chunked_prefill_and_concurrent_restores_match(tiny_core, pool):
    """Restores into a batch with other prefills and decodes, with chunked prefill, still match."""
    base = prompt(700, seed=3)  # longer than one 512-token chunk
    cold = make_engine(tiny_core, enabled=False, pool=pool)
    warm = make_engine(tiny_core, pool=pool)
    run(warm, base, [(300, M), (700, E)], max_tokens=1)
    tails = [base[:300] + prompt(50, seed=s) for s in range(3)] + [base + prompt(20, seed=9)]
    expected = [run(cold, t, max_tokens=5, top_k=1)[0] for t in tails]
    outs: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    requests = []
    for i, t in enumerate(tails):
        rid = f"c{i}"
        outs[rid] = []

        def sink(event, rid=rid):
            outs[rid].extend(event.token_ids)
            if event.finished:
                cached[rid] = event.cached_tokens

        requests.append((GenerationRequest(rid, t, SamplingParams(max_tokens=5, top_k=1, ignore_eos=True)), sink))
    for request, sink in requests:
        warm.submit(request, sink)
    while len(cached) < len(tails):
        warm.step()
    assert [outs[f"c{i}"] for i in range(len(tails))] == expected
    assert [cached[f"c{i}"] for i in range(len(tails))] == [300, 300, 300, 700]


# -- selection -------------------------------------------------------------------------------------


def test_checkpoint_selection_per_role(tiny_core):
    engine = make_engine(tiny_core)
    ids = prompt(200, seed=5)
    run(engine, ids, [(21, A), (90, H), (150, M), (170, M), (200, E), (250, M), (0, M)], max_tokens=2)
    assert roles(engine) == {21: "anchor", 90: "hint", 150: "message", 170: "message", 200: "endpoint"}
    stats = engine.stats()
    assert stats.checkpoint_captures == {"anchor": 1, "message": 3, "endpoint": 1}  # hints count as message
    assert stats.checkpoint_skips == {"unknown_cost": 0, "work_budget": 0, "storage": 0, "recurrent_state": 0}
    # Checkpoints share the pages of one prefix: full pages once; partial tail pages are copies.
    cache = engine.prefix_cache
    by_len = {c.length: c for c in cache.checkpoints()}
    assert by_len[170].pages[: 150 // PT] == by_len[150].pages[: 150 // PT]
    assert stats.cached_pages == len(set().union(*(c.pages for c in cache.checkpoints())))
    # The same prefix again captures nothing new; one position offered twice keeps the best role.
    run(engine, ids, [(21, M), (21, A), (200, E)], max_tokens=1)
    assert engine.stats().checkpoint_captures == {"anchor": 1, "message": 3, "endpoint": 1}
    # A prompt that leaves the prefix between two marks restores the last mark before it, never
    # the unmarked position where it diverges.
    other = ids[:120] + prompt(40, seed=6)
    _, cached, _ = run(engine, other, max_tokens=1)
    assert cached == 90


def test_unhinted_suffix_change_reuses_only_the_anchor(tiny_core):
    engine = make_engine(tiny_core)
    preamble, history = prompt(24, seed=7), prompt(300, seed=8)
    first = preamble + history + prompt(10, seed=9)
    second = preamble + history + prompt(12, seed=10)

    def marks(ids: list[int], hinted: bool) -> list:
        return [(24, A), (len(ids), E)] + ([(24 + 300, H)] if hinted else [])

    run(engine, preamble + prompt(8, seed=11), marks(preamble, False), max_tokens=1)  # warm the anchor
    _, c1, _ = run(engine, first, marks(first, False), max_tokens=1)
    _, c2, _ = run(engine, second, marks(second, False), max_tokens=1)
    assert c1 == c2 == 24
    other_history = prompt(300, seed=12)
    first = preamble + other_history + prompt(10, seed=9)
    second = preamble + other_history + prompt(12, seed=10)
    _, c1, _ = run(engine, first, marks(first, True), max_tokens=1)
    _, c2, _ = run(engine, second, marks(second, False), max_tokens=1)
    assert c1 == 24 and c2 == 324


def test_budget_skips(tiny_core):
    # No work allowance: boundaries whose page is complete when the prefill reaches them are free
    # (page aligned, or inside the prompt); the endpoint's page is still filling: a copy, skipped.
    engine = make_engine(tiny_core, work_allowance_ns=0)
    ids = prompt(100, seed=13)
    run(engine, ids, [(20, A), (32, M), (70, H), (100, E)], max_tokens=1)
    assert sorted(roles(engine)) == [20, 32, 70]
    assert engine.stats().checkpoint_skips["work_budget"] == 1
    assert engine.prefix_cache.copies == 0 and engine.stats().checkpoint_extra_work_ns_total == 0
    # A restore that ends inside a page shifts the chunk boundaries: with 64-token chunks after
    # restoring 100 tokens, the first commit ends at 164, inside the page [160, 176) of 161.
    engine = make_engine(tiny_core, work_allowance_ns=0)
    engine.scheduler.prefill_chunk_size = 64
    run(engine, ids, [(100, E)], max_tokens=1)  # charged: a copy...
    assert engine.stats().checkpoint_skips["work_budget"] == 1  # ...which the allowance refuses
    engine.prefix_cache.config.work_allowance_ns = 10**9
    run(engine, ids, [(100, E)], max_tokens=1)
    longer = ids + prompt(100, seed=14)
    engine.prefix_cache.config.work_allowance_ns = 0
    _, cached, _ = run(engine, longer, [(150, M), (161, H), (176, M)], max_tokens=1)
    assert cached == 100 and sorted(roles(engine)) == [100, 150, 176]
    assert engine.stats().checkpoint_skips["work_budget"] == 2
    # A runner that cannot copy pages cannot price a capture that needs one.
    engine = make_engine(tiny_core)
    engine.runner.copy_page = None
    engine.prefix_cache._copy_page = None
    run(engine, ids, [(20, A), (32, M), (100, E)], max_tokens=1)
    assert sorted(roles(engine)) == [20, 32] and engine.stats().checkpoint_skips["unknown_cost"] == 1
    _, cached, _ = run(engine, ids, max_tokens=1)
    assert cached == 32  # restores round down to whole pages without copies
    # Storage: checkpoints may own 5 pages of the pool; one needing 7 is skipped, the anchor fits
    # (a full page plus a copied tail page).
    engine = make_engine(tiny_core, kv_pages=20, storage_fraction=0.25)
    run(engine, ids, [(20, A), (100, E)], max_tokens=1)
    assert roles(engine) == {20: "anchor"} and engine.stats().cached_pages == 2
    assert engine.stats().checkpoint_skips["storage"] == 1
    # New checkpoints (3 pages each) evict the least recently used ones to fit; the anchor last.
    first, second = prompt(40, seed=14), prompt(40, seed=15)
    run(engine, first, [(40, E)], max_tokens=1)
    assert roles(engine) == {20: "anchor", 40: "endpoint"} and engine.stats().cached_pages == 5
    run(engine, second, [(40, E)], max_tokens=1)
    assert roles(engine) == {20: "anchor", 40: "endpoint"} and engine.stats().cached_pages == 5
    assert engine.stats().checkpoint_evictions_total == 1
    assert run(engine, first, max_tokens=1)[1] == 0 and run(engine, second, max_tokens=1)[1] == 39


def test_eviction_under_page_pressure(tiny_core):
    # 24 pages of 16 tokens, all of which checkpoints may own.
    engine = make_engine(tiny_core, kv_pages=24, storage_fraction=1.0)
    warmed = [prompt(60, seed=20 + i) for i in range(4)]
    for ids in warmed:  # anchor: page 0; endpoint: pages 0-2 and a copied tail page
        run(engine, ids, [(16, A), (60, E)], max_tokens=1)
    assert engine.stats().cached_pages == 16 and engine.stats().free_pages == 8
    assert run(engine, warmed[0], max_tokens=1)[1] == 59  # restoring touches warmed[0]'s endpoint
    # 200 + 10 tokens need 14 pages: the two least recently used endpoints are evicted (3 pages
    # each), nothing is preempted, anchors stay.
    out, cached, _ = run(engine, prompt(200, seed=30), max_tokens=10)
    stats = engine.stats()
    assert cached == 0 and len(out) == 10
    assert stats.preempted_total == 0 and stats.checkpoint_evictions_total == 2
    assert sorted(c.role.value for c in engine.prefix_cache.checkpoints()) == ["anchor"] * 4 + ["endpoint"] * 2
    assert [run(engine, ids, max_tokens=1)[1] for ids in warmed] == [59, 16, 16, 59]


@pytest.mark.parametrize("pool", POOLS)
def test_preempted_sequence_resumes_identically(tiny_core, pool):
    """Live sequences outgrow the pool: checkpoints go first, preemption recomputes correctly."""
    cold = make_engine(tiny_core, enabled=False, kv_pages=64, pool=pool)
    warm = make_engine(tiny_core, kv_pages=12, pool=pool)
    prompts = [prompt(70, seed=40 + i) for i in range(3)]
    expected = [run(cold, p, max_tokens=40, top_k=1)[0] for p in prompts]
    for p in prompts:
        run(warm, p, [(32, A), (70, E)], max_tokens=1)
    outs: dict[str, list[int]] = {f"p{i}": [] for i in range(3)}
    done: set[str] = set()
    for i, p in enumerate(prompts):

        def sink(event, rid=f"p{i}"):
            outs[rid].extend(event.token_ids)
            if event.finished:
                done.add(rid)

        warm.submit(
            GenerationRequest(
                f"p{i}",
                p,
                SamplingParams(max_tokens=40, top_k=1, ignore_eos=True),
                checkpoints=[CheckpointCandidate(70, E)],
            ),
            sink,
        )
    while len(done) < 3:
        warm.step()
    assert [outs[f"p{i}"] for i in range(3)] == expected
    assert warm.stats().preempted_total >= 1


# -- frontend candidates ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def frontend(tiny_core):
    from types import SimpleNamespace

    from helios.neutral.template import ChatTemplate
    from helios.neutral.tokenizer import Tokenizer

    manifest = Manifest.load(tiny_core, verify_files=False)
    core_tokenizer = Tokenizer.from_core(tiny_core, manifest)
    template = ChatTemplate.from_core(
        tiny_core, manifest, bos_token=core_tokenizer.bos_token, eos_token=core_tokenizer.eos_token
    )
    from helios.transport.config import ServerConfig

    return SimpleNamespace(
        manifest=manifest,
        tokenizer=core_tokenizer,
        template=template,
        model_id=manifest.model_id,
        admission=SimpleNamespace(slots=16),
        config=ServerConfig(),
    )


def _candidates(frontend, protocol: str, body: dict) -> tuple[list[int], list[tuple[str, str]]]:
    from helios.protocols import chat, completions, messages, responses

    planned = {"chat": chat, "completions": completions, "messages": messages, "responses": responses}[protocol]
    plan = planned.plan(frontend, body, "id")
    request = plan.requests[0] if hasattr(plan, "requests") else plan.request
    ids = request.prompt_token_ids
    return ids, [(c.role.value, frontend.tokenizer.decode(ids[: c.position])) for c in request.checkpoints]


def test_frontend_offers_anchor_message_ends_hints_and_endpoint(frontend):
    turns = [
        {"role": "user", "content": "First question."},
        {"role": "assistant", "content": "First answer."},
        {"role": "user", "content": "Second question."},
    ]
    ids, marks = _candidates(
        frontend, "chat", {"messages": [{"role": "system", "content": "Be terse."}, *turns], "max_tokens": 1}
    )
    assert [role for role, _ in marks] == ["anchor", "message", "message", "message", "endpoint"]
    prefixes = [text for _, text in marks]
    assert prefixes[0].endswith("Be terse.<|im_end|>\n<|im_start|>user\n")  # preamble + the first opener
    assert prefixes[1].endswith("First question.<|im_end|>\n")
    assert prefixes[2].endswith("First answer.<|im_end|>\n")
    assert prefixes[3].endswith("Second question.<|im_end|>\n")
    assert prefixes[4] == frontend.tokenizer.decode(ids)
    # Tools belong to the preamble; the anchor without a system message still ends before the
    # first user message (the template's default system prompt included).
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}
    _, marks = _candidates(frontend, "chat", {"messages": turns, "tools": [tool], "max_tokens": 1})
    assert marks[0][0] == "anchor" and '"lookup"' in marks[0][1] and "First question" not in marks[0][1]
    # Responses and Messages render the same conversation to the same boundaries.
    _, via_responses = _candidates(frontend, "responses", {"input": turns, "instructions": "Be terse."})
    hinted = {"type": "text", "text": "A long history block.", "cache_control": {"type": "ephemeral"}}
    _, via_messages = _candidates(
        frontend,
        "messages",
        {
            "system": "Be terse.",
            "max_tokens": 1,
            "messages": [*turns[:2], {"role": "user", "content": [hinted, {"type": "text", "text": "Go."}]}],
        },
    )
    assert [r for r, _ in via_responses] == ["anchor", "message", "message", "message", "endpoint"]
    assert [r for r, _ in via_messages] == ["anchor", "message", "message", "hint", "message", "endpoint"]
    assert via_messages[3][1].endswith("A long history block")  # "." joins the separator token
    # Raw completions: the exact endpoint only.
    ids, marks = _candidates(frontend, "completions", {"prompt": "Once upon a time", "max_tokens": 1})
    assert marks == [("endpoint", "Once upon a time")]


def test_frontend_drops_boundaries_the_full_prompt_does_not_share(frontend):
    # An assistant prefill continues the final message: its end is not a boundary of the prompt.
    ids, marks = _candidates(
        frontend,
        "chat",
        {
            "messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi"}],
            "add_generation_prompt": False,
            "continue_final_message": True,
            "max_tokens": 1,
        },
    )
    assert [role for role, _ in marks] == ["anchor", "message", "endpoint"]
    assert marks[1][1].endswith("Say hi.<|im_end|>\n") and marks[2][1].endswith("Hi")
    # With a developer message every instruction merges into the leading system message, so a
    # later system message changes the preamble: neither the anchor nor the first message end is
    # a boundary of this prompt (they would end inside its system message).
    ids, marks = _candidates(
        frontend,
        "chat",
        {
            "max_tokens": 1,
            "messages": [
                {"role": "developer", "content": "Rule A."},
                {"role": "user", "content": "Question."},
                {"role": "system", "content": "Rule B."},
            ],
        },
    )
    assert [role for role, _ in marks] == ["message", "endpoint"]
    assert "Rule B." in marks[0][1] and marks[0][1].endswith("Question.<|im_end|>\n")


# -- protocols against the live tiny server --------------------------------------------------------


@pytest.fixture(scope="module")
def http(tiny_server):
    with httpx.Client(base_url=tiny_server.url, headers=ANTHROPIC, timeout=120) as client:
        yield client


def _text(tag: str) -> str:
    return f"{tag} {time.time_ns()}. " + "A cached prefix avoids repeated computation. " * 30


@pytest.mark.parametrize("protocol", ["chat", "completions", "messages", "responses"])
def test_cached_tokens_reported_by_every_protocol(http, protocol):
    text = _text(protocol)
    messages = [{"role": "user", "content": text}]
    path, body = {
        "chat": ("/v1/chat/completions", {"messages": messages, "max_tokens": 2}),
        "completions": ("/v1/completions", {"prompt": text, "max_tokens": 2}),
        "messages": ("/v1/messages", {"messages": messages, "max_tokens": 2}),
        "responses": ("/v1/responses", {"input": messages, "max_output_tokens": 2}),
    }[protocol]

    def cached(usage):
        if protocol == "messages":
            return usage["cache_read_input_tokens"], usage["input_tokens"] + usage["cache_read_input_tokens"]
        if protocol == "responses":
            return usage["input_tokens_details"]["cached_tokens"], usage["input_tokens"]
        return usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"]

    first = http.post(path, json={**body, "ignore_eos": True}).json()["usage"]
    reused, total = cached(first)
    assert reused < 40  # at most the shared preamble (the anchor) on a fresh prompt
    again = http.post(path, json={**body, "ignore_eos": True}).json()["usage"]
    assert cached(again) == (total - 1, total)  # everything but the last prompt token
    stream = {**body, "ignore_eos": True, "stream": True}
    if protocol in ("chat", "completions"):
        stream["stream_options"] = {"include_usage": True}
    frames = [d for _, d in sse(http.post(path, json=stream).text) if d != "[DONE]"]
    if protocol == "messages":
        start = next(f for f in frames if f["type"] == "message_start")["message"]["usage"]
        assert start["cache_read_input_tokens"] == 0  # message_start reports the full prompt
        usage = next(f for f in frames if f["type"] == "message_delta")["usage"]
        usage = {**usage, "input_tokens": usage["input_tokens"]}
    elif protocol == "responses":
        usage = frames[-1]["response"]["usage"]
    else:
        usage = frames[-1]["usage"]
    assert cached(usage) == (total - 1, total)


def test_completion_batch_counts_first_choice_per_input(http):
    prompts = [_text(f"batch {i}") for i in range(2)]
    body = {"prompt": prompts, "max_tokens": 2, "ignore_eos": True}
    first = http.post("/v1/completions", json=body).json()["usage"]
    again = http.post("/v1/completions", json={**body, "n": 2}).json()["usage"]
    assert again["prompt_tokens"] == first["prompt_tokens"]
    assert again["prompt_tokens_details"]["cached_tokens"] == first["prompt_tokens"] - 2  # one per input


@pytest.mark.parametrize("hinted", [False, True])
def test_messages_block_hint_reuses_history(http, hinted):
    history = {"type": "text", "text": f"History {time.time_ns()}. " + "Earlier a file was read.\n" * 60}
    if hinted:
        history["cache_control"] = {"type": "ephemeral"}
    blocks = [history, {"type": "text", "text": "First action: inspect the file."}]

    def send(content) -> dict:
        response = http.post("/v1/messages", json={"messages": [{"role": "user", "content": content}], "max_tokens": 1})
        assert response.status_code == 200, response.text
        return response.json()["usage"]

    send("Warm the shared preamble.")
    first = send(blocks)
    blocks[1] = {"type": "text", "text": "Second action: run the tests."}
    history.pop("cache_control", None)
    second = send(blocks)
    reused = second["cache_read_input_tokens"] - first["cache_read_input_tokens"]
    if hinted:
        assert reused > 300
    else:
        assert reused == 0 and first["cache_read_input_tokens"] > 0  # the anchor only


def test_checkpoint_metrics(http):
    text = _text("metrics")
    for _ in range(2):
        http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": text}], "max_tokens": 1})
    m = metrics(http)
    assert m['flare_checkpoint_captures_total{role="anchor"}'] >= 1
    assert m['flare_checkpoint_captures_total{role="message"}'] >= 1
    assert m['flare_checkpoint_captures_total{role="endpoint"}'] >= 1
    for reason in ("unknown_cost", "work_budget", "storage", "recurrent_state"):
        assert f'flare_checkpoint_skips_total{{reason="{reason}"}}' in m
    assert m["flare_cached_kv_pages"] > 0 and m["flare_cache_reused_tokens_total"] > 0
    assert m["flare_cache_hits_total"] >= 1
    assert m["flare_checkpoint_extra_work_nanoseconds_total"] > 0
    snapshot = http.get("/metrics?format=json").json()
    assert snapshot["cached_pages"] > 0 and snapshot["reused_tokens"] > 0
    assert snapshot["prefix_cache_hits"] == m["flare_cache_hits_total"]


# -- randomized invariants on the engine-core test double ------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_random_workload_matches_uncached_and_keeps_pages_consistent(core_dir, seed):  # noqa: F811 (the fixture imported above)
    """Shared prefixes, random marks, a tight pool: outputs equal the uncached engine's, every
    checkpoint's pages still spell its ids, and every page comes back when the cache is cleared."""

    class CopyingRunner(FakeRunner):
        copies_pages = True

        def copy_page(self, src: int, dst: int) -> None:
            self.pool[dst] = self.pool[src]

    def engine(enabled: bool) -> Engine:
        manifest = make_manifest(kv_pages=32, page_tokens=4, max_concurrency=4, prefill_chunk_size=16)
        runner = CopyingRunner(32, 4)
        # Odd seeds: no work allowance (only captures that need no copy).
        return Engine(
            core_dir,
            manifest,
            runner=runner,
            prefix_cache=PrefixCacheConfig(
                enabled=enabled, storage_fraction=0.75, work_allowance_ns=0 if seed % 2 else 10**8
            ),
        )

    rng = np.random.default_rng(seed)
    families = [rng.integers(0, 250, int(rng.integers(8, 40))).tolist() for _ in range(4)]
    waves = []
    for w in range(12):
        wave = []
        for i in range(int(rng.integers(1, 5))):
            base = families[int(rng.integers(len(families)))]
            ids = base + rng.integers(0, 250, int(rng.integers(1, 30))).tolist()
            roles_ = list(CheckpointRole)
            marks = [
                CheckpointCandidate(int(p), roles_[int(rng.integers(4))])
                for p in rng.integers(1, len(ids) + 1, int(rng.integers(0, 4)))
            ]
            marks.append(CheckpointCandidate(len(base), CheckpointRole.ANCHOR))
            marks.append(CheckpointCandidate(len(ids), CheckpointRole.ENDPOINT))
            wave.append(
                GenerationRequest(
                    f"w{w}-{i}",
                    ids,
                    SamplingParams(max_tokens=int(rng.integers(1, 40)), seed=w * 10 + i, ignore_eos=True),
                    checkpoints=marks,
                )
            )
        waves.append(wave)

    def play(e: Engine) -> tuple[dict[str, list[int]], int]:
        outs: dict[str, list[int]] = {}
        finished: set[str] = set()
        errors: list[tuple[str, str]] = []  # recorded, not asserted: the engine swallows a sink's exception
        for wave in waves:
            for request in wave:
                outs[request.request_id] = []

                def sink(event, rid=request.request_id):
                    if event.error is not None:
                        errors.append((rid, event.error))
                    outs[rid].extend(event.token_ids)
                    if event.finished:
                        finished.add(rid)

                e.submit(request, sink)
            while not all(r.request_id in finished for r in wave):
                e.step()
        assert errors == []
        return outs, e.stats().reused_tokens_total

    expected, _ = play(engine(False))
    warm = engine(True)
    got, reused = play(warm)
    assert got == expected and reused > 0
    cache, bm = warm.prefix_cache, warm.block_manager
    assert cache.hits > 0 and warm.stats().preempted_total > 0  # restores and preemptions happened
    for ckpt in cache.checkpoints():
        assert (warm.runner.pool[ckpt.pages].reshape(-1)[: ckpt.length] == ckpt.ids).all()
        assert all(bm.ref_count(p) >= 1 for p in ckpt.pages)
    assert bm.num_free + cache.cached_pages == bm.num_pages  # nothing live, nothing leaked
    cache.clear()
    assert bm.num_free == bm.num_pages and cache.cached_pages == 0

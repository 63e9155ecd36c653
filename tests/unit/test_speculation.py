"""Speculative decoding with history drafts (helios.engine.speculation): the step graph's outputs
at chosen positions, exact commits, rollback, adaptive width and api.md's counters, on a real
tiny core (greedy identity on the real default model is in tests/e2e/test_default_model.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

from helios.engine.api import GenerationRequest, SamplingParams
from helios.engine.assembly import RunnerChoice
from helios.engine.engine import Engine
from helios.engine.prefix_cache import PrefixCacheConfig
from helios.engine.runner import StepRow
from helios.engine.speculation import HistoryDrafts, SpeculationConfig, Speculator
from helios.launcher import HeliosProcess
from helios.manifest import Manifest
from helios.neutral.grammar import OutputFormat, compiler_for
from helios.neutral.tokenizer import Tokenizer

REPEATED = list(range(300, 340))


POOLS = ["float32", "bfloat16", "float16"]  # verification is exact over a 16-bit pool too


def engine(core: Path, mode: str = "auto", pool: str = "float32", **config) -> Engine:
    return Engine(
        core,
        Manifest.load(core, verify_files=False),
        kv_pages=96,
        threads=1,
        prefix_cache=PrefixCacheConfig(enabled=False),
        speculation=SpeculationConfig(mode=mode, **config),
        choice=RunnerChoice(kv_dtype=pool),
    )


def generate(e: Engine, ids: list[int], name: str, **sampling) -> tuple[list[int], list]:
    params = {"max_tokens": 24, "top_k": 1, "ignore_eos": True, **sampling}
    events = e.generate(GenerationRequest(name, list(ids), SamplingParams(**params)))
    assert events[-1].finished and events[-1].error is None, events[-1].error
    return [t for ev in events for t in ev.token_ids], [entry for ev in events for entry in (ev.logprobs or [])]


def test_history_drafts_propose_what_followed_the_tail():
    drafts = HistoryDrafts(SpeculationConfig(max_ngram=3))
    text = [1, 2, 3, 4, 5, 9, 9, 1, 2, 3]
    assert drafts.propose(text, 3) == [4, 5, 9]  # "1 2 3" was followed by "4 5 9"
    assert drafts.propose(text + [7], 3) == []  # "2 3 7" / "3 7" never occurred
    assert HistoryDrafts(SpeculationConfig()).propose([5, 6, 5, 6, 5, 6], 4) == [5, 6]  # latest, cut at the end
    drafts.acceptance = 1.0
    assert drafts.width() == SpeculationConfig().max_width == 8
    drafts.acceptance = 0.05
    widths = [drafts.width() for _ in range(2 * HistoryDrafts.PROBE_EVERY)]
    assert widths.count(0) == len(widths) - 2  # drafts that are never kept only cost...
    assert widths.count(1) == 2  # ...but a probe now and then can win the rate back
    drafts.record(1, 1)
    assert drafts.acceptance > 0.05


def test_outputs_at_chosen_positions_equal_separate_last_position_runs(tiny_core):
    """One row asking for outputs at positions 0..3 gets what four rows, each ending at one of
    those positions, get at their last position (the verification contract)."""
    e = engine(tiny_core, mode="off")
    runner = e.runner
    assert runner.can_verify
    history = np.random.default_rng(3).integers(100, 5000, 21).tolist()
    table = list(range(4))
    runner.step([StepRow(history, 0, table)])
    new = [501, 502, 503, 504]
    joint = runner.step([StepRow(new, 21, table, output_positions=[0, 1, 2, 3])])
    assert joint.logits.shape[0] == 4 and joint.first == [0]
    for j in range(4):
        alone = runner.step([StepRow(new[: j + 1], 21, table)])
        np.testing.assert_allclose(joint.logits[j], alone.logits[0], rtol=1e-4, atol=1e-4)
        assert joint.top_ids[j, 0] == alone.top_ids[0, 0]
    # Mixed with a plain row in one step: each row's outputs come back in row order.
    mixed = runner.step([StepRow([7], 5, [10]), StepRow(new, 21, table, output_positions=[0, 1, 2, 3])])
    assert mixed.first == [0, 1] and mixed.logits.shape[0] == 5
    np.testing.assert_allclose(mixed.logits[mixed.index(1, 2)], joint.logits[2], rtol=1e-4, atol=1e-4)
    e.shutdown()


@pytest.mark.parametrize("pool", POOLS)
def test_greedy_output_and_logprobs_match_without_speculation(tiny_core, pool):
    """A prompt whose tail occurred earlier makes history drafts fire; the committed tokens and
    their logprobs are the target's (the same as a run without speculation)."""
    off, on = engine(tiny_core, mode="off", pool=pool), engine(tiny_core, max_batch_rows=8, pool=pool)
    first, _ = generate(off, REPEATED, "seed", max_tokens=40)
    prompt = REPEATED + first + REPEATED + first[:8]  # its tail occurred before: drafts from there
    want, want_logprobs = generate(off, prompt, "off", logprobs=2)
    got, got_logprobs = generate(on, prompt, "on", logprobs=2)
    stats = on.stats()
    assert stats.draft_rounds_total > 0 and stats.verification_drafts_total > 0
    assert got == want
    for a, b in zip(want_logprobs, got_logprobs):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
    # A request's first token comes from its prefill, not a decode round (api.md's DEPTH).
    assert off.stats().draft_rounds_total == 0 and off.stats().verification_rounds_total == 39 + 23
    off.shutdown()
    on.shutdown()


@pytest.mark.parametrize("pool", POOLS)
def test_accepted_drafts_and_rounds_are_counted_and_pages_come_back(tiny_core, pool):
    """A model made to repeat (its own output fed back as the prompt) accepts drafts; every
    round counts (zero-draft ones too), and a finished or cancelled request leaves no pages."""
    e = engine(tiny_core, max_batch_rows=8, pool=pool)
    first, _ = generate(e, REPEATED, "seed", max_tokens=40)
    # The model's greedy continuation of its own output repeats it: drafts from history hit.
    echo = REPEATED + first + REPEATED + first[:8]
    generate(e, echo, "echo", max_tokens=30)
    s = e.stats()
    assert s.accepted_drafts_total > 0
    assert s.verification_rounds_total >= s.draft_rounds_total > 0
    assert s.generated_tokens_total == 40 + 30
    # Rounds: one per token after each request's first (a prefill's), less the accepted drafts.
    assert s.verification_rounds_total == s.generated_tokens_total - 2 - s.accepted_drafts_total
    assert sum(s.rounds_by_width.values()) == s.steps_total and max(s.rounds_by_width) > 0
    assert e.block_manager.num_free == e.block_manager.num_pages

    events = []
    e.submit(GenerationRequest("cancel", echo, SamplingParams(max_tokens=30, top_k=1, ignore_eos=True)), events.append)
    for _ in range(6):
        e.step()
    e.abort("cancel")
    while not (events and events[-1].finished):
        e.step()
    assert e.block_manager.num_free == e.block_manager.num_pages
    e.shutdown()


@pytest.mark.parametrize("pool", POOLS)
def test_seeded_sampling_matches_without_speculation(tiny_core, pool):
    """Sampled drafts follow the target distribution exactly: each committed token is drawn from
    the target's distribution at its position with one draw from the request's generator,
    drafted or not, so seeded runs are the same token for token with and without speculation,
    including runs where sampled tokens accepted drafts."""
    off, on = engine(tiny_core, mode="off", pool=pool), engine(tiny_core, max_batch_rows=8, pool=pool)
    first, _ = generate(off, REPEATED, "seed", max_tokens=40)
    echo = REPEATED + first + REPEATED + first[:8]
    # A low temperature: the random tiny model then mostly follows its greedy path, so drafts
    # are offered and accepted, while every token is still drawn from the distribution.
    sampling = {"top_k": 5, "temperature": 0.05, "max_tokens": 24}
    for seed in range(4):
        want = generate(off, echo, f"off{seed}", seed=seed, **sampling)[0]
        assert generate(on, echo, f"on{seed}", seed=seed, **sampling)[0] == want
    assert on.stats().accepted_drafts_total > 0
    off.shutdown()
    on.shutdown()


class FixedDraft(Speculator):
    """Drafts one token per round, looked up by the last committed token: a deterministic draft
    source, so the test exercises the commit rule alone."""

    def __init__(self, after: dict[int, int]):
        super().__init__(SpeculationConfig())
        self.after = after

    def drafts(self, seq, decoding_rows: int, room: int) -> list[int]:
        room = min(room, seq.stop_checker.max_new_tokens - seq.num_generated - 1)
        draft = self.after.get(seq.token_ids[-1])
        return [draft] if room > 0 and draft is not None else []


def test_sampled_tokens_after_an_accepted_draft_follow_the_target_distribution(tiny_core):
    """Chi-square: with a draft D offered after the first token t1 (t1's likeliest successor), D
    is accepted at the target's rate p(D | prompt, t1), and the token committed after an accepted
    D is drawn from the target's top-5 distribution given (prompt, t1, D) (temperature 1, top-k 5)."""
    prompt = REPEATED[:12]
    sampling = {"temperature": 1.0, "top_k": 5}
    off = engine(tiny_core, mode="off")

    def top5(ids: list[int]) -> dict[int, float]:
        (entry,) = generate(off, ids, f"p{len(ids)}-{ids[-1]}", max_tokens=1, logprobs=5, **sampling)[1]
        weights = {token: float(np.exp(logprob)) for token, logprob in entry.top[:5]}
        total = sum(weights.values())
        return {token: w / total for token, w in weights.items()}

    first = top5(prompt)
    second = {t1: top5(prompt + [t1]) for t1 in first}
    drafts = {t1: max(dist, key=dist.get) for t1, dist in second.items()}  # each t1's likeliest next
    on = engine(tiny_core)
    on.scheduler.speculator = FixedDraft(drafts)
    draws = 800
    runs = [generate(on, prompt, f"s{seed}", max_tokens=3, seed=seed, **sampling)[0] for seed in range(draws)]
    assert on.stats().draft_rounds_total == draws
    chi2, dof = 0.0, 0
    for t1 in first:
        after = [run for run in runs if run[0] == t1]
        if len(after) < 40:
            continue
        draft = drafts[t1]
        p_draft = second[t1][draft]
        accepted = [run for run in after if run[1] == draft]
        expected = len(after) * p_draft
        if 5 <= expected <= len(after) - 5:  # the acceptance rate, a binomial
            chi2 += (len(accepted) - expected) ** 2 / (expected * (1 - p_draft))
            dof += 1
        if len(accepted) >= 40:  # what follows an accepted draft
            target = top5(prompt + [t1, draft])
            counts = {token: sum(run[2] == token for run in accepted) for token in target}
            assert sum(counts.values()) == len(accepted)  # never a token outside the target's top 5
            cells, rest = [], [0, 0.0]  # cells expecting fewer than 5 draws are pooled
            for token, prob in target.items():
                if prob * len(accepted) >= 5:
                    cells.append((counts[token], prob * len(accepted)))
                else:
                    rest[0] += counts[token]
                    rest[1] += prob * len(accepted)
            if rest[1] >= 5:
                cells.append((rest[0], rest[1]))
            chi2 += sum((count - want) ** 2 / want for count, want in cells)
            dof += max(0, len(cells) - 1)
    assert dof >= 3
    assert chi2 < dof + 4 * np.sqrt(2 * dof)  # ~p < 0.001 for these degrees of freedom
    off.shutdown()
    on.shutdown()


def test_shared_history_drafts_from_other_requests_outputs(tiny_core):
    """A request whose own tokens hold no earlier match drafts from what a finished request wrote
    (an agent's next session re-emitting what the last one produced); output unchanged."""
    on, off = engine(tiny_core, max_batch_rows=8), engine(tiny_core, mode="off")
    written, _ = generate(on, REPEATED, "writer", max_tokens=40)
    # The same context up to written[8]: its continuation is the writer's, whose n-grams only the
    # shared history holds (the reader's own tokens end where the writer's output went on).
    reader = REPEATED + written[:8]
    before = on.stats().accepted_drafts_total
    got, _ = generate(on, reader, "reader", max_tokens=20)
    shared = on.stats().accepted_drafts_total - before
    assert shared > 0
    assert got == generate(off, reader, "plain", max_tokens=20)[0]
    alone = engine(tiny_core, max_batch_rows=8, shared_history_tokens=0)  # its own tokens only
    generate(alone, REPEATED, "writer", max_tokens=40)
    before = alone.stats().accepted_drafts_total
    generate(alone, reader, "reader", max_tokens=20)
    assert alone.stats().accepted_drafts_total - before < shared
    for e in (on, off, alone):
        e.shutdown()


def test_constrained_requests_and_off_mode_never_draft(tiny_core):
    e = engine(tiny_core, max_batch_rows=8)
    manifest = Manifest.load(tiny_core, verify_files=False)
    grammar = compiler_for(Tokenizer.from_core(tiny_core, manifest), manifest).output_grammar(
        OutputFormat("json_object", None), None, {}, "x"
    )
    prompt = REPEATED + REPEATED[:30]
    request = GenerationRequest("json", prompt, SamplingParams(max_tokens=8, top_k=1), grammar=grammar)
    events = e.generate(request)
    assert events[-1].finished
    assert e.stats().draft_rounds_total == 0
    e.shutdown()
    with pytest.raises(ValueError):
        SpeculationConfig(mode="sometimes").validate()


def test_serve_flag_and_metrics(tiny_core):
    server = HeliosProcess(tiny_core, "--speculation", "auto")
    try:
        body = {
            "prompt": " ".join(["alpha beta gamma delta"] * 30),
            "max_tokens": 24,
            "temperature": 0,
            "ignore_eos": True,
        }
        assert httpx.post(server.url + "/v1/completions", json=body, timeout=120).status_code == 200
        snapshot = httpx.get(server.url + "/metrics", params={"format": "json"}, timeout=30).json()
        assert snapshot["verification_rounds"] > 0 and snapshot["verification_rounds"] <= 24
        text = httpx.get(server.url + "/metrics", timeout=30).text
        assert "flare_history_drafts_enabled 1.0" in text
    finally:
        server.stop()
    # The CLI refuses an unknown mode before binding a port.
    result = subprocess.run(
        [sys.executable, "-m", "helios.cli", "serve", str(tiny_core), "--speculation", "always"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "speculation mode" in result.stderr + result.stdout

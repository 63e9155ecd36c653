"""The sampler: seeded draws independent of batch neighbours, the top-k / top-p / min-p filters
against a naive full-sort reference, penalties, temperature extremes, non-finite rows, and raw
token logprobs."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from helios.engine.api import SamplingParams
from helios.engine.sampler import apply_penalties, candidates, sample, token_logprob


class Row:
    def __init__(self, seed=None, prompt=(), output=(), **params):
        self.sampling = SamplingParams(seed=seed, **params)
        self.rng = np.random.default_rng(seed)
        self.prompt_unique_ids = np.unique(np.asarray(prompt, dtype=np.int64))
        self.output_ids = list(output)
        self.seen_ids = set(prompt) | set(self.output_ids)
        self.output_counts = collections.Counter(self.output_ids)


def _draws(logits_row: np.ndarray, n: int, **params) -> np.ndarray:
    row = Row(seed=0, **params)
    return np.array([sample(logits_row[None], [row])[0] for _ in range(n)])


def test_seeded_sampling_is_independent_of_batch_neighbours():
    rng = np.random.default_rng(1)
    V = 5000
    target = rng.standard_normal(V).astype(np.float32) * 2
    params = dict(temperature=0.9, top_k=50, top_p=0.9, min_p=0.01, repetition_penalty=1.1)

    def run(position: int, batch: int, neighbour_seed: int) -> list[int]:
        row = Row(seed=1234, prompt=[1, 2, 3], output=[4], **params)
        others = [
            Row(
                seed=neighbour_seed + i,
                top_k=[-1, 3, 2000][i % 3],
                top_p=[1.0, 0.5, 0.99][i % 3],
                temperature=[1.0, 0.3, 2.0][i % 3],
                presence_penalty=0.5,
                output=[1, 2],
            )
            for i in range(batch - 1)
        ]
        rows = others[:position] + [row] + others[position:]
        out = []
        nrng = np.random.default_rng(neighbour_seed)
        for _ in range(40):
            logits = nrng.standard_normal((batch, V)).astype(np.float32) * 2
            logits[position] = target
            out.append(int(sample(logits, rows)[position]))
        return out

    base = run(0, 1, 0)
    assert run(3, 6, 99) == base
    assert run(5, 9, 7) == base
    assert len(set(base)) > 1  # actually random, not collapsed to argmax


def kept(logits, **params) -> list[int]:
    ids, _ = candidates(np.asarray(logits, dtype=np.float32), SamplingParams(**params))
    return sorted(ids.tolist())


def test_top_k_keeps_only_k_best():
    logits = np.array([0.0, 3.0, 1.0, 2.5, -1.0, 2.9], dtype=np.float32)
    assert kept(logits, top_k=2) == [1, 5]
    assert kept(logits, top_k=1) == [1]
    assert kept(logits, top_k=6) == kept(logits, top_k=-1) == kept(logits, top_k=0) == list(range(6))
    assert set(_draws(logits, 300, top_k=3).tolist()) == {1, 3, 5}


def test_top_p_nucleus_and_wide_fallback():
    logits = np.log(np.array([0.05, 0.5, 0.15, 0.3]))
    assert kept(logits, top_p=0.7) == [1, 3]  # 0.5 < 0.7, then 0.8 >= 0.7
    assert kept(logits, top_p=0.85) == [1, 2, 3]
    assert kept(logits, top_p=0.01) == [1]  # the best token always survives
    # top-p renormalizes over what top-k kept: there token 1 has 0.5 / 0.8 = 0.625 >= 0.6.
    assert kept(logits, top_p=0.6) == [1, 3]
    assert kept(logits, top_k=2, top_p=0.6) == [1]
    assert kept(logits, top_k=2, top_p=0.63) == [1, 3]
    # A flat distribution whose nucleus is wider than the partitioned prefix (full sort path).
    V = 5000
    flat = np.random.default_rng(0).permutation(np.arange(V, dtype=np.float32) * -1e-4)
    p = np.sort(np.exp(flat.astype(np.float64)))[::-1] / np.exp(flat.astype(np.float64)).sum()
    expected = int(((np.cumsum(p) - p) < 0.5).sum())
    assert expected > 2000
    assert len(kept(flat, top_p=0.5)) == expected
    # A wide candidate set whose nucleus is narrow (found in the prefix).
    peaked = flat.copy()
    peaked[123] = 20.0
    assert kept(peaked, top_p=0.9) == [123]
    assert set(_draws(logits.astype(np.float32), 400, top_p=0.7).tolist()) == {1, 3}


def test_min_p_is_relative_to_the_best_token():
    logits = np.log(np.array([0.6, 0.3, 0.1]))
    assert kept(logits, min_p=0.2) == [0, 1]  # 0.1 < 0.2 * 0.6
    assert kept(logits, min_p=0.1) == [0, 1, 2]
    # After temperature: T=0.5 squares the ratios, 0.3/0.6 -> 0.25 < 0.3.
    assert kept(logits, min_p=0.3, temperature=0.5) == [0]


def test_far_tail_is_never_a_candidate():
    logits = np.zeros(1000, dtype=np.float32)
    logits[:3] = 100.0
    assert kept(logits) == [0, 1, 2]  # e^-100 per token: below float32 resolution
    assert len(kept(logits, temperature=4.0)) == 1000  # flatter after temperature: all count


def _reference_kept(z: np.ndarray, s: SamplingParams) -> list[int]:
    """Naive full-sort HF pipeline (distinct logits, so tie rules do not matter)."""
    v = z.astype(np.float64) / s.temperature
    alive = v >= v.max() - 35.0  # the documented far-tail cutoff (mass < 1e-10)
    order = np.argsort(-v)
    if 0 < s.top_k < alive.sum():
        alive[order[s.top_k :]] = False
    if s.top_p < 1.0:
        p = np.where(alive, np.exp(v - v.max()), 0.0)
        p /= p.sum()
        ps = p[order]
        drop = (np.cumsum(ps) - ps) >= s.top_p
        drop[0] = False
        alive[order[drop]] = False
    if s.min_p > 0:
        alive &= v >= v.max() + np.log(s.min_p)
    return np.flatnonzero(alive).tolist()


def test_filters_match_a_naive_full_sort_reference():
    rng = np.random.default_rng(5)
    for trial in range(200):
        V = int(rng.integers(2, 6000))
        z = (rng.standard_normal(V) * rng.choice([0.3, 2.0, 6.0])).astype(np.float32)
        s = SamplingParams(
            temperature=float(rng.choice([0.2, 0.7, 1.0, 1.5])),
            top_k=int(rng.choice([-1, 1, 5, 50, 3000])),
            top_p=float(rng.choice([1.0, 0.9, 0.5, 0.999])),
            min_p=float(rng.choice([0.0, 0.0, 0.05])),
        )
        got, _ = candidates(z, s)
        assert sorted(got.tolist()) == _reference_kept(z, s), (trial, s)


def test_penalties_follow_hf_and_openai_semantics():
    z = np.array([[2.0, -2.0, 1.0, 0.5]] * 3, dtype=np.float32)
    rows = [
        Row(prompt=[0, 1], output=[1], repetition_penalty=2.0),
        Row(prompt=[3], output=[2, 2, 0], presence_penalty=0.5, frequency_penalty=0.25),
        Row(prompt=[0], output=[0]),  # neutral
    ]
    apply_penalties(z, rows)
    np.testing.assert_allclose(z[0], [1.0, -4.0, 1.0, 0.5])  # positive divided, negative multiplied
    # presence once per distinct generated token, frequency per occurrence; prompt untouched.
    np.testing.assert_allclose(z[1], [2.0 - 0.5 - 0.25, -2.0, 1.0 - 0.5 - 0.5, 0.5])
    np.testing.assert_allclose(z[2], [2.0, -2.0, 1.0, 0.5])
    # End to end: a strong repetition penalty moves sampling off the repeated argmax.
    logits = np.array([5.0, 4.9, 0.0], dtype=np.float32)
    assert set(_draws(logits, 50, temperature=1e-6).tolist()) == {0}
    assert set(_draws(logits, 50, temperature=1e-6, output=[0], repetition_penalty=1.5).tolist()) == {1}


def test_temperature_extremes():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(50).astype(np.float32)
    best = int(np.argmax(logits))
    assert set(_draws(logits, 50, temperature=1e-7).tolist()) == {best}  # greedy path
    assert set(_draws(logits, 50, temperature=1e-3).tolist()) == {best}  # sharpened, still sampled
    hot = _draws(logits, 2000, temperature=1e4)
    assert len(set(hot.tolist())) == 50  # practically uniform


def test_non_finite_logits_fail_only_their_row():
    logits = np.zeros((3, 8), dtype=np.float32)
    logits[0, 2] = 5.0
    logits[1, 3] = np.nan
    logits[2, :7] = -np.inf  # masked tokens are fine
    out = sample(logits, [Row(seed=0, temperature=1e-6), Row(seed=1), Row(seed=2)])
    assert out.tolist() == [2, -1, 7]


def test_token_logprob_uses_raw_distribution_and_breaks_ties_by_id():
    logits = np.array([1.0, 3.0, 3.0, 0.0], dtype=np.float32)
    lse = float(np.log(np.exp(logits).sum()))
    top_ids = np.array([2, 1, 0, 3])  # tie between 1 and 2 in the wrong order
    top_lp = (logits[top_ids] - lse).astype(np.float32)
    entry = token_logprob(3, logits, lse, top_lp, top_ids, 2)
    assert entry.token_id == 3 and entry.logprob == pytest.approx(0.0 - lse)
    assert [t for t, _ in entry.top] == [1, 2]
    assert token_logprob(1, logits, lse, top_lp, top_ids, 0).top == []


def test_logit_bias_moves_the_draw_and_bypasses_the_top_ids_fast_path():
    """A +bias lifts a token the graph's top ids do not hold (the fast path would miss it); a
    -100 bias removes the best token; neighbours without a bias are untouched."""
    V = 1000
    logits = np.linspace(-5, 5, V, dtype=np.float32)[None].repeat(2, axis=0)
    top_ids = np.argsort(-logits, axis=1)[:, :8]
    lifted = Row(seed=1, temperature=0.5, top_k=4, logit_bias={3: 100.0})
    plain = Row(seed=1, temperature=0.5, top_k=4)
    out = sample(logits, [lifted, plain], top_ids=top_ids)
    assert out[0] == 3
    assert out[1] in top_ids[1, :4]
    greedy = Row(temperature=0.0, logit_bias={V - 1: -100.0})
    assert sample(logits[:1], [greedy])[0] == V - 2
    assert logits[0, 3] == np.float32(np.linspace(-5, 5, V, dtype=np.float32)[3])  # input untouched


def test_engine_refuses_logit_bias_outside_the_vocabulary():
    """A caller past the HTTP decoders (cluster, scripts) gets the engine's ValueError, not an
    IndexError inside a batch's sampling."""
    from helios.engine.api import GenerationRequest
    from helios.engine.validation import RequestCheck

    check = RequestCheck(
        context_length=64,
        vocab_size=100,
        max_top_logprobs=20,
        explicit_token_ids=True,
        max_explicit_token_ids=128,
        can_score_prompts=False,
    )
    check(GenerationRequest("ok", [1, 2], SamplingParams(logit_bias={99: 5.0})))
    for bias in ({100: 1.0}, {-1: 1.0}, {3: float("nan")}):
        with pytest.raises(ValueError, match="logit_bias"):
            check(GenerationRequest("bad", [1, 2], SamplingParams(logit_bias=bias)))

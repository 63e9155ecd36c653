"""The sampler's top-k fast path (candidates from the step graph's top ids) must draw exactly
what the full-vocabulary path draws, and fall back whenever the K candidates might not hold
every top-k survivor."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from helios.engine import sampler, top_ids_draw
from helios.engine.api import SamplingParams
from helios.engine.sampler import sample

K = 20


class Row:
    def __init__(self, seed, prompt=(), output=(), **params):
        self.sampling = SamplingParams(seed=seed, **params)
        self.rng = np.random.default_rng(seed)
        self.prompt_unique_ids = np.unique(np.asarray(prompt, dtype=np.int64))
        self.output_ids = list(output)
        self.seen_ids = set(prompt) | set(self.output_ids)
        self.output_counts = collections.Counter(self.output_ids)


def top_ids(logits: np.ndarray) -> np.ndarray:
    # ONNX TopK order: decreasing value, ties by lower index.
    return np.stack([np.lexsort((np.arange(row.size), -row))[:K] for row in logits])


def logsumexp(logits: np.ndarray) -> np.ndarray:
    """As the step graph reports it: NaN for a row with a NaN or +inf logit."""
    top = logits.max(axis=1, keepdims=True)
    with np.errstate(invalid="ignore", over="ignore"):
        return (top[:, 0] + np.log(np.exp(logits - top).sum(axis=1))).astype(np.float32)


def outside_logit(logits: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """As the fused head reports it: each row's largest logit outside its top ids."""
    rest = logits.copy()
    np.put_along_axis(rest, ids, -np.inf, axis=1)
    return rest.max(axis=1)


def draws(
    logits: np.ndarray,
    make_rows,
    use_top_ids: bool,
    steps: int = 30,
    certify: bool = False,
    outside: bool = False,
) -> list[list[int]]:
    rows = make_rows()
    ids = top_ids(logits) if use_top_ids else None
    lse = logsumexp(logits) if certify else None
    bound = outside_logit(logits, ids) if outside else None
    return [sample(logits, rows, top_ids=ids, logsumexp=lse, outside_logit=bound).tolist() for _ in range(steps)]


def batch_rows(top):
    return [
        Row(
            1,
            prompt=top[0][:3],
            output=[int(top[0][3])] * 2,
            top_k=20,
            temperature=0.7,
            top_p=0.8,
            repetition_penalty=1.05,
        ),
        Row(2, output=[int(top[1][0])], top_k=5, temperature=1.0, presence_penalty=0.4, frequency_penalty=0.3),
        Row(3, top_k=1, temperature=0.5),
        Row(4, top_k=10, temperature=1.3, min_p=0.05, top_p=0.95),
        # Not eligible: no top-k, top-k above K, greedy, a penalty that can raise a logit.
        Row(5, top_p=0.9),
        Row(6, top_k=50),
        Row(7, top_k=10, temperature=1e-7),
        Row(8, top_k=10, presence_penalty=-0.5, output=[5, 6]),
    ]


@pytest.mark.parametrize("scale", [0.5, 3.0, 12.0])
def test_fast_path_draws_exactly_what_the_full_path_draws(scale):
    rng = np.random.default_rng(int(scale * 10))
    logits = (rng.standard_normal((8, 3000)) * scale).astype(np.float32)
    top = top_ids(logits)
    full = draws(logits, lambda: batch_rows(top), use_top_ids=False)
    fast = draws(logits, lambda: batch_rows(top), use_top_ids=True)
    assert fast == full
    # The graph's finite logsumexp only lets the fast path skip its vocabulary scan.
    assert draws(logits, lambda: batch_rows(top), use_top_ids=True, certify=True) == full


def test_fast_path_is_taken_for_eligible_rows_and_skipped_otherwise(monkeypatch):
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((8, 3000)) * 3).astype(np.float32)
    top = top_ids(logits)
    taken = []
    original = sampler._top_k_fast

    def spy(row_logits, row_top, row, *rest):
        result = original(row_logits, row_top, row, *rest)
        taken.append(result is not None)
        return result

    monkeypatch.setattr(sampler, "_top_k_fast", spy)
    sample(logits, batch_rows(top), top_ids=top)
    assert taken == [True, True, True, True, False, False, False, False]


def test_certified_rows_are_drawn_together_from_the_top_ids(monkeypatch):
    # With the graph's finite logsumexp the eligible rows are drawn at once (top_ids_draw); only
    # the others take the one-row paths.
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((8, 3000)) * 3).astype(np.float32)
    top = top_ids(logits)
    together, alone = [], []
    original_draw, original_fast = sampler.draw_rows, sampler._top_k_fast

    def spy_draw(*args):
        tokens, drawn = original_draw(*args)
        together.append((list(args[0].rows), drawn.tolist()))
        return tokens, drawn

    def spy_fast(row_logits, row_top, row, *rest):
        alone.append(row.sampling.seed)
        return original_fast(row_logits, row_top, row, *rest)

    monkeypatch.setattr(sampler, "draw_rows", spy_draw)
    monkeypatch.setattr(sampler, "_top_k_fast", spy_fast)
    sample(logits, batch_rows(top), top_ids=top, logsumexp=logsumexp(logits))
    assert together == [([0, 1, 2, 3], [True, True, True, True])]
    assert alone == [5, 6, 7, 8]  # the rows that do not qualify, which it turns down


def test_a_rows_draw_does_not_depend_on_its_batch_neighbours():
    rng = np.random.default_rng(11)
    logits = (rng.standard_normal((8, 3000)) * 3).astype(np.float32)
    top, lse = top_ids(logits), logsumexp(logits)
    rows = batch_rows(top)
    together = [sample(logits, rows, top_ids=top, logsumexp=lse).tolist() for _ in range(20)]
    for b in range(4):
        row = batch_rows(top)[b]
        alone = [
            int(sample(logits[b : b + 1], [row], top_ids=top[b : b + 1], logsumexp=lse[b : b + 1])[0])
            for _ in range(20)
        ]
        assert alone == [draw[b] for draw in together]


@pytest.mark.parametrize("seed", range(6))
def test_drawing_together_equals_the_full_path_on_peaked_and_flat_rows(seed):
    # Rows from nearly flat to sharply peaked, every filter combination, top_k == K included (it
    # needs the one-pass tie check) and repeated tokens among the candidates.
    rng = np.random.default_rng(100 + seed)
    scales = np.array([0.05, 0.5, 2.0, 8.0, 30.0, 1.0, 4.0, 0.2], dtype=np.float32)[:, None]
    logits = (rng.standard_normal((8, 4000)).astype(np.float32) * scales).astype(np.float32)
    top = top_ids(logits)

    def rows():
        params = [
            dict(top_k=K, temperature=0.7, top_p=0.8, repetition_penalty=1.05),
            dict(top_k=K, temperature=1.0),
            dict(top_k=7, temperature=0.3, min_p=0.2),
            dict(top_k=12, temperature=1.5, top_p=0.5, frequency_penalty=0.5, presence_penalty=0.2),
            dict(top_k=1, temperature=1.0),
            dict(top_k=K, temperature=0.9, top_p=0.95, min_p=0.01, repetition_penalty=1.3),
            dict(top_k=3, temperature=2.0, top_p=0.3),
            dict(top_k=19, temperature=0.05, repetition_penalty=1.1),
        ]
        return [
            Row(seed * 10 + b, prompt=top[b][::3], output=[int(top[b][1])] * 3 + [int(top[b][4])], **p)
            for b, p in enumerate(params)
        ]

    full = draws(logits, rows, False, steps=40)
    assert draws(logits, rows, use_top_ids=True, steps=40, certify=True) == full
    assert draws(logits, rows, use_top_ids=True, steps=40, certify=True, outside=True) == full
    assert draws(logits, rows, use_top_ids=True, steps=40, outside=True) == full  # one row at a time


@pytest.mark.parametrize("width", [K, 64])
def test_the_heads_outside_logit_spares_rows_the_vocabulary_pass(monkeypatch, width):
    # With only K ids, top_k == K and nothing penalized makes the k-th candidate the K-th raw
    # logit, which only the largest logit outside can prove strictly ahead of everything else.
    # With the head's 64 candidates, a top_k of 40 and repeated tokens among the best qualify too.
    rng = np.random.default_rng(3)
    logits = (rng.standard_normal((4, 5000)) * 2).astype(np.float32)
    ids = np.stack([np.lexsort((np.arange(row.size), -row))[:width] for row in logits])
    bound = outside_logit(logits, ids)

    def rows():
        if width == K:
            return [Row(b, top_k=K, temperature=1.0, top_p=0.9) for b in range(4)]
        seen = [int(t) for t in ids[0][:12:3]]
        return [Row(b, prompt=seen, top_k=40, temperature=0.8, repetition_penalty=1.1) for b in range(4)]

    full = draws(logits, rows, False, steps=10)
    passes, together = [], []
    original_flatnonzero, original_draw = np.flatnonzero, sampler.draw_rows
    monkeypatch.setattr(top_ids_draw.np, "flatnonzero", lambda a: passes.append(a.size) or original_flatnonzero(a))

    def spy_draw(*args):
        tokens, done = original_draw(*args)
        together.extend(done.tolist())
        return tokens, done

    monkeypatch.setattr(sampler, "draw_rows", spy_draw)

    def drawn(bounds):
        made = rows()
        return [
            sample(logits, made, top_ids=ids, logsumexp=logsumexp(logits), outside_logit=bounds).tolist()
            for _ in range(10)
        ]

    assert drawn(bound) == full
    assert 5000 not in passes and together == [True] * 40  # every row drawn together, every step
    if width == K:
        assert drawn(None) == full
        assert 5000 in passes  # without the head's figure: one vocabulary pass a row


def test_heavily_penalized_candidates_widen_the_candidate_set():
    # The 20 best tokens are all repeated with a huge penalty: the survivors lie outside them,
    # so the set widens to every token whose raw logit reaches the k-th penalized value.
    rng = np.random.default_rng(5)
    logits = (rng.standard_normal((1, 2000)) * 0.1).astype(np.float32)
    logits[0, :K] = 5.0 + np.arange(K, dtype=np.float32) * 0.01
    top = top_ids(logits)

    def rows():
        return [Row(9, prompt=list(range(K)), top_k=5, repetition_penalty=1000.0, temperature=1.0)]

    ids, _ = sampler._top_k_fast(logits[0], top[0], rows()[0])
    assert ids.size > K and set(range(K)) <= set(ids.tolist())
    fast = draws(logits, rows, use_top_ids=True)
    assert fast == draws(logits, rows, use_top_ids=False)
    assert fast == draws(logits, rows, use_top_ids=True, certify=True)  # drawn together, widened
    assert fast == draws(logits, rows, use_top_ids=True, certify=True, outside=True)
    assert all(token[0] >= K for token in fast)


def test_ties_with_the_kth_logit_outside_the_candidates_are_kept():
    # Token 500 ties the 20th-best raw logit but is not among the K ids: top_k=20 keeps it.
    logits = np.zeros((1, 1000), dtype=np.float32)
    logits[0, :K] = np.linspace(3.0, 1.0, K, dtype=np.float32)
    logits[0, 500] = logits[0, K - 1]
    top = top_ids(logits)
    assert 500 not in top[0]
    ids, _ = sampler._top_k_fast(logits[0], top[0], Row(3, top_k=K, temperature=1.0))
    assert 500 in ids
    full = draws(logits, lambda: [Row(3, top_k=K, temperature=1.0)], False, 200)
    assert draws(logits, lambda: [Row(3, top_k=K, temperature=1.0)], True, 200) == full
    assert draws(logits, lambda: [Row(3, top_k=K, temperature=1.0)], True, 200, certify=True) == full
    # The head's figure equals the tie: the row still widens.
    assert draws(logits, lambda: [Row(3, top_k=K, temperature=1.0)], True, 200, certify=True, outside=True) == full
    assert 500 in {token[0] for token in full}


def test_non_finite_logits_still_fail_the_row():
    logits = np.zeros((2, 100), dtype=np.float32)
    logits[0, 7] = np.nan
    logits[1, :K] = np.arange(K, dtype=np.float32)
    rows = [Row(1, top_k=5), Row(2, top_k=5)]
    out = sample(logits, rows, top_ids=top_ids(np.nan_to_num(logits, nan=-1.0)))
    assert out[0] == -1 and out[1] >= 0
    lse = logsumexp(logits)
    assert np.isnan(lse[0]) and np.isfinite(lse[1])
    rows = [Row(1, top_k=5), Row(2, top_k=5)]
    out = sample(logits, rows, top_ids=top_ids(np.nan_to_num(logits, nan=-1.0)), logsumexp=lse)
    assert out[0] == -1 and out[1] >= 0

"""One draw for every top-k row of a step at once, from the step's candidate ids.

A row with 0 < top_k <= K (K: candidate ids per row, the fused head's 64 or the graph's 20 top
ids; helios.engine.step_io.StepOutput.sampling_candidates), no grammar mask, no logit_bias,
penalties that can only lower a logit and finite logits samples among its K raw-best tokens when
those provably hold every top-k survivor (helios.engine.sampler._top_k_fast gives the argument).
Here the rows that qualify go through penalties, temperature, top-k, top-p, min-p and the
inverse CDF: in one call of the kernel library (helios.kernels.host.draw_top_k) for rows whose
set is their K ids, else together as [rows, K] arrays, a few dozen numpy calls a step instead of
a few dozen a row. Cache-cold, as host work runs between graph runs, the library's call took a
decode step's sampling from ~0.56 to ~0.21 ms at one row and ~0.61 to ~0.39 at eight (Zen 4).

Every operation is elementwise or runs along one row, in the same float32/float64 operations as
the sampler's one-row small-set path (helios.engine.sampler: `_top_p_small`, `_inverse_cdf`),
so a row draws exactly what the full-vocabulary path draws, whatever its neighbours. Tokens a
row does not keep stay in its arrays with probability exactly 0, and adding 0.0 leaves every
float64 running sum unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Set
from dataclasses import dataclass

import numpy as np

from helios.engine.api import SamplingParams
from helios.kernels import host

# Tokens more than this many nats below the best (after temperature) are never candidates (the
# sampler's reasoning, which imports it from here).
CANDIDATE_CUTOFF = 35.0
# A set of at most this many tokens is sampled by the small-set formulas (top-p by sorting, one
# inverse-CDF block; sampler.CDF_BLOCK); a row whose set is larger is left to the sampler.
SMALL_SET = 1024


@dataclass(frozen=True)
class CandidateRows:
    """The rows of a step that draw from their candidate ids, and what each row's draw reads."""

    logits: np.ndarray  # [B, V]; the rows drawn are finite
    top_ids: np.ndarray  # [B, K]: each row's candidate ids, any order
    rows: list[int]  # the batch rows drawn, [F]
    params: list[SamplingParams]
    seen: list[Set[int]]  # prompt and output ids: the repetition penalty's
    counts: list[Mapping[int, int]]  # generated id -> occurrences: presence and frequency penalties
    uniforms: list[float]  # the row's draw, in [0, 1)
    # [F]: each row's largest raw logit outside its top ids; None: the K-th raw logit stands in
    # for it, which ties with the k-th candidate whenever top_k == K and nothing is penalized, so
    # such rows cost a vocabulary pass.
    outside: np.ndarray | None = None

    def only(self, picked: list[int]) -> CandidateRows:
        """The rows at positions `picked` of this set."""
        return CandidateRows(
            self.logits,
            self.top_ids,
            [self.rows[f] for f in picked],
            [self.params[f] for f in picked],
            [self.seen[f] for f in picked],
            [self.counts[f] for f in picked],
            [self.uniforms[f] for f in picked],
            None if self.outside is None else self.outside[picked],
        )


def draw_rows(batch: CandidateRows) -> tuple[np.ndarray, np.ndarray]:
    """One token for each row of `batch` from its sampling parameters, penalties and uniform.
    Returns (tokens [F], drawn [F]): a row is not drawn when so many tokens tie at its k-th
    value that its set exceeds SMALL_SET (the caller's one-row path takes it).

    The kernel library's draw takes every row whose set is its K ids (the usual case) in one
    call, in the same operations; the rows it leaves (a vocabulary pass) are drawn here."""
    if not host.can_draw():
        return _draw_in_numpy(batch)
    tokens = _draw_in_library(batch)
    left = np.flatnonzero(tokens < 0).tolist()
    drawn = np.ones(len(batch.rows), dtype=bool)
    if left:
        tokens[left], drawn[left] = _draw_in_numpy(batch.only(left))
    return tokens, drawn


def _draw_in_library(batch: CandidateRows) -> np.ndarray:
    """host.draw_top_k over the batch: a token each, -1 where the row needs the vocabulary pass.
    (Plain lists and one cached log a row: this runs every decode step, cache-cold.)"""
    id_lists = batch.top_ids[batch.rows].tolist()
    penalties = _penalty_table(batch.params, batch.seen, batch.counts, id_lists)
    bounds = [float("nan")] * len(batch.rows) if batch.outside is None else batch.outside.tolist()
    columns = [
        [
            s.top_k,
            s.temperature,
            s.top_p,
            log_min_p(s.min_p),
            s.repetition_penalty,
            s.presence_penalty,
            s.frequency_penalty,
            u,
            o,
        ]
        for s, u, o in zip(batch.params, batch.uniforms, bounds)
    ]
    return host.draw_top_k(batch.logits, batch.top_ids, batch.rows, np.array(columns, dtype=np.float64), penalties)


@functools.lru_cache(maxsize=256)
def log_min_p(min_p: float) -> float:
    """float32 log(min_p) as _draw_in_numpy computes it (-inf for 0: no floor), as a float."""
    with np.errstate(divide="ignore"):
        return float(np.log(np.array([min_p], dtype=np.float64)).astype(np.float32)[0])


def _penalty_table(
    params: list[SamplingParams], seen: list[Set[int]], counts: list[Mapping[int, int]], id_lists: list[list[int]]
) -> np.ndarray:
    """Per row and id of id_lists, float32 [rows, 2, ids]: whether the repetition penalty applies
    (0/1) and how often the id was generated; only the rows a penalty applies to look their ids
    up."""
    table = np.zeros((len(id_lists), 2, len(id_lists[0]) if id_lists else 0), dtype=np.float32)
    for f, s in enumerate(params):
        if s.repetition_penalty != 1.0:
            table[f, 0] = [t in seen[f] for t in id_lists[f]]
        if s.presence_penalty != 0.0 or s.frequency_penalty != 0.0:
            table[f, 1] = [counts[f].get(t, 0) for t in id_lists[f]]
    return table


def _penalty_lookups(
    params: list[SamplingParams], seen: list[Set[int]], counts: list[Mapping[int, int]], id_lists: list[list[int]]
) -> tuple[np.ndarray, np.ndarray]:
    """_penalty_table's two planes: (repetition hits, generated counts), each [rows, ids]."""
    table = _penalty_table(params, seen, counts, id_lists)
    return table[:, 0], table[:, 1]


def _draw_in_numpy(batch: CandidateRows) -> tuple[np.ndarray, np.ndarray]:
    """draw_rows' arithmetic in numpy, for any row."""
    logits, rows, params, outside = batch.logits, batch.rows, batch.params, batch.outside
    n, k_ids = len(rows), batch.top_ids.shape[1]
    span = np.arange(n)
    ids = np.sort(batch.top_ids[rows], axis=1)
    raw = logits[np.asarray(rows)[:, None], ids]
    vals = _penalized(raw, params, *_penalty_lookups(params, batch.seen, batch.counts, ids.tolist()))
    top_k = np.array([s.top_k for s in params], dtype=np.int64)
    # Every top-k survivor is among the K ids unless a token outside them reaches the k-th
    # penalized value: it cannot when that value is above every raw logit outside. Otherwise (a
    # penalized token fell that low, or a tie may sit outside) the row's set is every token whose
    # raw logit reaches it: one pass, and it is the K ids themselves unless something outside
    # does reach it.
    kth = np.sort(vals, axis=1)[span, k_ids - top_k]
    bound = raw.min(axis=1) if outside is None else outside
    wide = {f: np.flatnonzero(logits[rows[f]] >= kth[f]) for f in np.flatnonzero(kth <= bound).tolist()}
    wide = {f: w for f, w in wide.items() if w.size > k_ids}
    drawn = np.ones(n, dtype=bool)
    for f in [f for f, w in wide.items() if w.size > SMALL_SET]:
        drawn[f] = False
        del wide[f]
    if wide:
        ids, vals = _widened(batch, ids, vals, wide)
    width = ids.shape[1]
    temperature = np.array([[s.temperature] for s in params], dtype=np.float32)
    scaled = vals / temperature
    best = scaled.max(axis=1, keepdims=True)
    keep = scaled >= best - np.float32(CANDIDATE_CUTOFF)
    # top-k: the k largest and ties with the k-th (no-op where fewer than k are near the best).
    keep &= scaled >= np.sort(scaled, axis=1)[span, width - top_k][:, None]
    weights = host.exp(scaled - best)  # 0 for padding
    top_p = np.array([[s.top_p] for s in params], dtype=np.float64)
    if (top_p < 1.0).any():
        keep &= _nucleus(ids, scaled, np.where(keep, weights, np.float32(0)), top_p) | (top_p >= 1.0)
    min_p = np.array([[s.min_p] for s in params], dtype=np.float64)
    if (min_p > 0.0).any():
        with np.errstate(divide="ignore"):  # log(0) = -inf: rows without min-p keep everything
            floor = best + np.log(min_p).astype(np.float32)
        keep &= scaled >= floor
    # Inverse CDF over the kept tokens in id order (sampler._inverse_cdf).
    cdf = np.cumsum(np.where(keep, weights, np.float32(0)), axis=1, dtype=np.float64)
    target = np.asarray(batch.uniforms, dtype=np.float64)[:, None] * cdf[:, -1:]
    pick = (cdf <= target).sum(axis=1)
    last_kept = width - 1 - np.argmax(keep[:, ::-1], axis=1)
    return ids[span, np.minimum(pick, last_kept)], drawn


def _widened(
    batch: CandidateRows, ids: np.ndarray, vals: np.ndarray, wide: dict[int, np.ndarray]
) -> tuple[np.ndarray, np.ndarray]:
    """The candidate arrays with rows `wide` replaced by their wider sets (increasing ids),
    every row padded to the widest with id -1 at -inf (probability 0, never kept)."""
    width = max(w.size for w in wide.values())
    padded_ids = np.full((len(batch.rows), width), -1, dtype=np.int64)
    padded_vals = np.full((len(batch.rows), width), -np.inf, dtype=np.float32)
    padded_ids[:, : ids.shape[1]] = ids
    padded_vals[:, : ids.shape[1]] = vals
    for f, w in wide.items():
        padded_ids[f, : w.size] = w
        row = batch.logits[batch.rows[f]]
        padded_vals[f, : w.size] = penalized_row(row, w, batch.params[f], batch.seen[f], batch.counts[f])
    return padded_ids, padded_vals


def penalized_row(
    logits: np.ndarray, ids: np.ndarray, params: SamplingParams, seen: Set[int], counts: Mapping[int, int]
) -> np.ndarray:
    """One row's float32 logits at `ids` after its penalties (the sampler's one-row path uses it
    too, so both paths penalize in the same operations)."""
    lookups = _penalty_lookups([params], [seen], [counts], [ids.tolist()])
    return _penalized(logits[ids].astype(np.float32)[None], [params], *lookups)[0]


def _penalized(raw: np.ndarray, params: list[SamplingParams], hits: np.ndarray, generated: np.ndarray) -> np.ndarray:
    """The candidates' logits (raw [F, W]) after repetition, presence and frequency penalties
    (hits and generated: _penalty_lookups'), in the float32 operations of
    sampler.apply_penalties."""
    vals = raw
    if hits.any():
        repetition = np.array([[s.repetition_penalty] for s in params], dtype=np.float32)
        vals = np.where(hits > 0, np.where(vals > 0, vals / repetition, vals * repetition), vals)
    if generated.any():
        presence = np.array([[s.presence_penalty] for s in params], dtype=np.float32)
        frequency = np.array([[s.frequency_penalty] for s in params], dtype=np.float32)
        vals = np.where(generated > 0, vals - (frequency * generated + presence), vals)
    return vals


def _nucleus(ids: np.ndarray, scaled: np.ndarray, weights: np.ndarray, top_p: np.ndarray) -> np.ndarray:
    """Top-p over each row's kept tokens (weights 0 elsewhere): best first (decreasing value,
    then increasing id), a token stays while the mass before it is below top_p of the total
    (sampler._top_p_small)."""
    order = np.lexsort((ids, -scaled), axis=1)
    mass = np.take_along_axis(weights, order, axis=1).astype(np.float64)
    running = np.cumsum(mass, axis=1)
    before = np.concatenate([np.zeros((len(mass), 1)), running[:, :-1]], axis=1)
    kept = np.empty_like(order, dtype=bool)
    np.put_along_axis(kept, order, before < top_p * running[:, -1:], axis=1)
    return kept

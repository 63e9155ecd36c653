"""Token sampling: penalties vectorized over the batch, filters per row on small candidate sets.

Order (HF / vLLM): repetition penalty (prompt + generated, HF semantics), presence and frequency
penalties (generated only, OpenAI semantics), temperature, top-k, top-p, min-p, then one draw
per row from that row's own numpy Generator by inverse CDF. Each row's result depends only on
its own logits, parameters and generator, never on its batch neighbours or position.

Logprobs are not computed here from the transformed distribution: they come from the runner's
raw full-vocabulary logsumexp and top-k (see `token_logprob`).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from helios.engine.api import SamplingParams, TokenLogprob

# Temperatures below this are greedy (argmax); the frontend clamps to a positive minimum, but a
# core may allow tiny values and 1/T would then only amplify float noise.
GREEDY_TEMPERATURE = 1e-5
# Tokens more than this many nats below the best (after temperature) are never candidates: their
# total probability is below V * e^-35 < 1e-10, under float32 resolution of the distribution (and
# -inf logits drop out here too).
CANDIDATE_CUTOFF = 35.0
# Top-k and top-p avoid sorting the vocabulary: candidates are bucketed by distance to the best
# logit into this many equal-width bins spanning the candidates' range (one bincount), whole bins
# are kept or dropped by their counts or mass, and only the bin where the cut falls is
# partitioned or sorted. Spanning the actual range keeps that bin small even when the logits are
# nearly flat (an untrained or very uncertain model).
NUM_BINS = 2048
# The inverse CDF finds the block of this many candidates holding the draw, then scans inside it.
CDF_BLOCK = 1024


class SampleRow(Protocol):
    """What the sampler needs from a sequence (helios.engine.sequence.Sequence provides it)."""

    sampling: SamplingParams
    rng: np.random.Generator

    @property
    def prompt_unique_ids(self) -> np.ndarray: ...

    @property
    def output_ids(self) -> list[int]: ...


class TokenMask(Protocol):
    """A row's output constraint (helios.engine.constraints.RowMask)."""

    forced: int | None  # the only token the row may produce
    allowed: np.ndarray | None  # bool [V]: tokens the row's grammar allows; None: all


def sample(logits: np.ndarray, rows: list[SampleRow], masks: list[TokenMask | None] | None = None) -> np.ndarray:
    """Sample one token per row of `logits` [B, V]; returns int64 [B]. `logits` is not modified.

    Penalties are applied to the whole batch at once; the filters then run per row on that row's
    small candidate set, so a row's result is bit-identical whatever its neighbours are. A row
    whose logits contain NaN or +inf gets -1 (the caller fails that request, not the batch).

    `masks[b]`, when given, constrains row b: a forced token is returned as is; otherwise tokens
    outside `allowed` get -inf before temperature and the filters (a grammar decides what may
    follow, the distribution only ranks what it allows).
    """
    B, V = logits.shape
    # One uniform per row, always drawn, so a generator's stream advances by exactly one per token.
    u = [row.rng.random() for row in rows]
    z = np.array(logits, dtype=np.float32, copy=True)
    apply_penalties(z, rows)
    out = np.empty(B, dtype=np.int64)
    for b, row in enumerate(rows):
        s = row.sampling
        mask = masks[b] if masks is not None else None
        if mask is not None:
            if mask.forced is not None:
                out[b] = mask.forced
                continue
            if mask.allowed is not None:
                apply_mask(z[b], mask.allowed)
        if not np.isfinite(z[b].max()):  # max propagates NaN; -inf alone is a masked token
            out[b] = -1
            continue
        if s.temperature < GREEDY_TEMPERATURE:
            out[b] = int(np.argmax(z[b]))
            continue
        ids, vals = candidates(z[b], s)
        out[b] = ids[_inverse_cdf(vals, u[b])]
    return out


def apply_mask(z: np.ndarray, allowed: np.ndarray) -> None:
    """Disallowed tokens of one row [V] become -inf, in place. A NaN on an allowed token still
    fails the row; NaNs the mask removes do not matter."""
    n = min(z.size, allowed.size)
    z[:n][~allowed[:n]] = -np.inf
    if z.size > n:
        z[n:] = -np.inf


def apply_penalties(z: np.ndarray, rows: list[SampleRow]) -> None:
    """Repetition, presence and frequency penalties, in place on z [B, V], for all rows at once.

    The per-row work is only collecting each row's distinct token ids (O(history), no vocab
    loop); the logits are then updated with one gather/scatter for the whole batch.
    """
    rep_r, rep_ids, rep_p = [], [], []
    out_r, out_ids, out_cnt, pres, freq = [], [], [], [], []
    for b, row in enumerate(rows):
        s = row.sampling
        has_rep = s.repetition_penalty != 1.0
        has_pf = s.presence_penalty != 0.0 or s.frequency_penalty != 0.0
        if not (has_rep or has_pf):
            continue
        ids, counts = np.unique(np.asarray(row.output_ids, dtype=np.int64), return_counts=True)
        if has_rep:
            seen = np.union1d(row.prompt_unique_ids, ids)
            rep_r.append(np.full(seen.size, b))
            rep_ids.append(seen)
            rep_p.append(np.full(seen.size, s.repetition_penalty, dtype=np.float32))
        if has_pf and ids.size:
            out_r.append(np.full(ids.size, b))
            out_ids.append(ids)
            out_cnt.append(counts.astype(np.float32))
            pres.append(np.full(ids.size, s.presence_penalty, dtype=np.float32))
            freq.append(np.full(ids.size, s.frequency_penalty, dtype=np.float32))
    if rep_r:
        r, i, pen = np.concatenate(rep_r), np.concatenate(rep_ids), np.concatenate(rep_p)
        vals = z[r, i]
        # HF: a seen token's logit moves towards "less likely" whatever its sign.
        z[r, i] = np.where(vals > 0, vals / pen, vals * pen)
    if out_r:
        r, i, c = np.concatenate(out_r), np.concatenate(out_ids), np.concatenate(out_cnt)
        # OpenAI: frequency per occurrence, presence once per distinct generated token.
        z[r, i] -= np.concatenate(freq) * c + np.concatenate(pres)


def candidates(z: np.ndarray, s: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """Token ids a row may sample and their temperature-scaled logits: temperature, top-k,
    top-p, min-p in that order (HF semantics: each stage sees the previous stage's survivors)."""
    vals = z / np.float32(s.temperature)
    mx = vals.max()
    near = vals >= mx - np.float32(CANDIDATE_CUTOFF)
    if near.all():
        ids = _arange(vals.size)
    else:
        ids = np.flatnonzero(near)
        vals = vals[ids]
    if 0 < s.top_k < ids.size:
        keep = _top_k(vals, mx, s.top_k)
        ids, vals = ids[keep], vals[keep]
    if s.top_p < 1.0:
        keep = _top_p(ids, vals, mx, s.top_p)
        ids, vals = ids[keep], vals[keep]
    if s.min_p > 0.0:
        # p_i >= min_p * p_max  <=>  z_i >= z_max + log(min_p): no softmax needed.
        keep = np.flatnonzero(vals >= mx + np.float32(np.log(s.min_p)))
        ids, vals = ids[keep], vals[keep]
    return ids, vals


_ARANGE = np.arange(0, dtype=np.int64)


def _arange(n: int) -> np.ndarray:
    """0..n-1, read-only and reused (a fresh vocab-sized arange per row costs page faults)."""
    global _ARANGE
    if _ARANGE.size < n:
        _ARANGE = np.arange(n, dtype=np.int64)
        _ARANGE.flags.writeable = False
    return _ARANGE[:n]


def _bins(vals: np.ndarray, mx: np.float32) -> np.ndarray:
    """Bin of each value, 0 holding the best; NUM_BINS equal bins over [min, max]."""
    span = float(mx - vals.min())
    if span <= 0.0:
        return np.zeros(vals.size, dtype=np.int32)
    scale = np.float32((NUM_BINS - 1) / span)
    return np.minimum((mx - vals) * scale, np.float32(NUM_BINS - 1)).astype(np.int32)


def _top_k(vals: np.ndarray, mx: np.float32, k: int) -> np.ndarray:
    """Positions of the k largest values; ties with the k-th are kept, as in HF and vLLM."""
    bins = _bins(vals, mx)
    # The first bin by which k values have been seen holds the k-th largest.
    b = int(np.searchsorted(np.cumsum(np.bincount(bins)), k))
    head = np.flatnonzero(bins <= b)
    hv = vals[head]
    kth = np.partition(hv, hv.size - k)[hv.size - k]
    return head[hv >= kth]


def _top_p(ids: np.ndarray, vals: np.ndarray, mx: np.float32, top_p: float) -> np.ndarray:
    """Positions of the smallest best-first set whose probability reaches top_p (>= 1 token).

    Best-first is decreasing logit, then increasing token id, so ties are cut deterministically.
    A token is kept while the probability of the tokens before it is below top_p.
    """
    p = np.exp(vals - mx)
    bins = _bins(vals, mx)
    cum = np.cumsum(np.bincount(bins, weights=p))
    target = top_p * cum[-1]
    # Bins before `b` hold less than top_p: all kept. Bins after it: all dropped.
    b = min(int(np.searchsorted(cum, target)), cum.size - 1)
    before = cum[b - 1] if b else 0.0
    band = np.flatnonzero(bins == b)
    # ids ascend along positions, so a stable sort on the value orders ties by increasing id.
    band = band[np.argsort(-vals[band], kind="stable")]
    pb = p[band].astype(np.float64)
    n = int(((before + np.cumsum(pb) - pb) < target).sum())
    if b == 0:
        n = max(n, 1)  # the best token always survives
    return np.concatenate([np.flatnonzero(bins < b), band[:n]])


def _inverse_cdf(vals: np.ndarray, u: float) -> int:
    """Index into `vals` sampled from softmax(vals) with the uniform u in [0, 1)."""
    p = np.exp(vals - vals.max())
    n = p.size
    # Two levels (block sums, then one block) keep this O(n) with cheap float64 accumulation.
    pad = -n % CDF_BLOCK
    blocks = np.cumsum(np.pad(p, (0, pad)).reshape(-1, CDF_BLOCK).sum(axis=1, dtype=np.float64))
    target = u * blocks[-1]
    j = min(int(np.searchsorted(blocks, target, side="right")), blocks.size - 1)
    lo = j * CDF_BLOCK
    inner = np.cumsum(p[lo : lo + CDF_BLOCK], dtype=np.float64) + (blocks[j - 1] if j else 0.0)
    # The first entry above the target: a token with nonzero probability.
    i = lo + int(np.searchsorted(inner, target, side="right"))
    return min(i, n - 1)


# -- logprobs ---------------------------------------------------------------------------------


def token_logprob(
    token_id: int,
    logits: np.ndarray,
    logsumexp: float,
    top_logprobs: np.ndarray,
    top_ids: np.ndarray,
    k: int,
) -> TokenLogprob:
    """Raw-distribution logprob of the chosen token plus its k best natural alternatives.

    `logits` is the row's raw [V] logits; top_* are the runner's K best, decreasing.
    """
    top_ids = np.asarray(top_ids, dtype=np.int64)
    top_lp = np.asarray(top_logprobs, dtype=np.float32)
    # Ties in decreasing logprob are ordered by increasing token id.
    order = np.lexsort((top_ids, -top_lp))
    top_ids, top_lp = top_ids[order], top_lp[order]
    hit = np.nonzero(top_ids == token_id)[0]
    # Report the same number for the chosen token as in the alternatives when it is among them.
    chosen = float(top_lp[hit[0]]) if hit.size else float(logits[token_id]) - float(logsumexp)
    top = [(int(i), float(v)) for i, v in zip(top_ids[:k], top_lp[:k])]
    return TokenLogprob(token_id=int(token_id), logprob=chosen, top=top)

"""Token sampling: penalties vectorized over the batch, filters per row on small candidate sets.

Order (HF / vLLM): repetition penalty (prompt + generated, HF semantics), presence and frequency
penalties (generated only, OpenAI semantics), logit_bias (added), temperature, top-k, top-p, min-p, then one draw
per row from that row's own numpy Generator by inverse CDF. Each row's result depends only on
its own logits, parameters and generator, never on its batch neighbours or position.

Logprobs are not computed here from the transformed distribution: they come from the runner's
raw full-vocabulary logsumexp and top-k (see `token_logprob`).
"""

from __future__ import annotations

from collections.abc import Mapping, Set
from typing import TYPE_CHECKING, Protocol

import numpy as np

from helios.engine.api import PromptLogprob, SamplingParams, TokenLogprob
from helios.engine.top_ids_draw import CANDIDATE_CUTOFF, SMALL_SET, CandidateRows, draw_rows, penalized_row
from helios.kernels import host

if TYPE_CHECKING:
    from helios.engine.runner import PromptScores
    from helios.engine.step_io import StepOutput

# Temperatures below this are greedy (argmax); the frontend clamps to a positive minimum, but a
# core may allow tiny values and 1/T would then only amplify float noise.
GREEDY_TEMPERATURE = 1e-5
# CANDIDATE_CUTOFF (helios.engine.top_ids_draw): tokens more than this many nats below the best
# (after temperature) are never candidates: their total probability is below V * e^-35 < 1e-10,
# under float32 resolution of the distribution (and -inf logits drop out here too).
# Top-k and top-p avoid sorting the vocabulary: candidates are bucketed by distance to the best
# logit into this many equal-width bins spanning the candidates' range (one bincount), whole bins
# are kept or dropped by their counts or mass, and only the bin where the cut falls is
# partitioned or sorted. Spanning the actual range keeps that bin small even when the logits are
# nearly flat (an untrained or very uncertain model).
NUM_BINS = 2048
# The inverse CDF finds the block of this many candidates holding the draw, then scans inside it;
# a set of at most this many is one block, and top-p sorts it instead of binning it. Both are
# what helios.engine.top_ids_draw computes for many rows at once, so its draws equal these.
CDF_BLOCK = SMALL_SET


class SampleRow(Protocol):
    """What the sampler needs from a sequence (helios.engine.sequence.Sequence provides it)."""

    sampling: SamplingParams
    rng: np.random.Generator

    @property
    def prompt_unique_ids(self) -> np.ndarray: ...  # distinct prompt ids, increasing (np.unique)

    @property
    def output_ids(self) -> list[int]: ...

    @property
    def seen_ids(self) -> Set[int]: ...  # prompt and generated ids (the repetition penalty's)

    @property
    def output_counts(self) -> Mapping[int, int]: ...  # generated id -> occurrences


class TokenMask(Protocol):
    """A row's output constraint (helios.engine.constraints.RowMask)."""

    forced: int | None  # the only token the row may produce
    allowed: np.ndarray | None  # bool [V]: tokens the row's grammar allows; None: all


def sample(
    logits: np.ndarray,
    rows: list[SampleRow],
    masks: list[TokenMask | None] | None = None,
    top_ids: np.ndarray | None = None,
    logsumexp: np.ndarray | None = None,
    outside_logit: np.ndarray | None = None,
    at: list[int] | None = None,
) -> np.ndarray:
    """Sample one token per row of `logits` [B, V]; returns int64 [B]. `logits` is not modified.
    `at`: the rows of `logits`, `top_ids`, `logsumexp` and `outside_logit` to sample, in order
    (None: all): a step's outputs are passed whole, and copied only when some rows do not sample
    (a copy of a [8, 151936] block cost ~0.5 ms a step).

    Penalties are applied to the whole batch at once; the filters then run per row on that row's
    small candidate set, so a row's result is bit-identical whatever its neighbours are. A row
    whose logits contain NaN or +inf gets -1 (the caller fails that request, not the batch).

    `masks[b]`, when given, constrains row b: a forced token is returned as is; otherwise tokens
    outside `allowed` get -inf before temperature and the filters (a grammar decides what may
    follow, the distribution only ranks what it allows).

    `top_ids` [B, K], when given, are the ids of each row's K largest raw logits (the fused
    head's candidates, else the step graph's top_ids: StepOutput.sampling_candidates). A row
    with 0 < top_k <= K, no grammar mask and penalties that can only lower logits then samples
    from those K candidates without touching the vocabulary, whenever its top_k survivors
    provably lie among them (see `_top_k_fast`); the result is bit-identical to the full path,
    which every other row takes.

    `logsumexp` [B], when given, is the step graph's fp32 logsumexp of each row's raw logits. A
    NaN or +inf logit makes the in-graph log-softmax NaN, so a finite value certifies the row's
    logits are finite and the fast path skips its own scan of the vocabulary.

    `outside_logit` [B], when given, is each row's largest raw logit outside its top_ids (the
    fused head's): with it, a row whose k-th candidate is above it needs no vocabulary pass even
    when top_k == K.
    """
    if at is not None and not (len(at) == len(logits) and all(i == j for j, i in enumerate(at))):
        logits = logits[at]
        top_ids = None if top_ids is None else top_ids[at]
        logsumexp = None if logsumexp is None else logsumexp[at]
        outside_logit = None if outside_logit is None else outside_logit[at]
    B, V = logits.shape
    # One uniform per row, always drawn, so a generator's stream advances by exactly one per token.
    u = [row.rng.random() for row in rows]
    z: np.ndarray | None = None  # the penalized full-vocabulary copy, made only when a row needs it
    out = np.empty(B, dtype=np.int64)
    drawn = _draw_top_k_rows(logits, rows, masks, top_ids, logsumexp, outside_logit, u, out)
    for b, row in enumerate(rows):
        if drawn[b]:
            continue
        s = row.sampling
        mask = masks[b] if masks is not None else None
        if mask is not None and mask.forced is not None:
            out[b] = mask.forced
            continue
        # A bias can lift a token outside the graph's top ids, so biased rows take the full path.
        if top_ids is not None and not s.logit_bias and (mask is None or mask.allowed is None):
            certified = logsumexp is not None and bool(np.isfinite(logsumexp[b]))
            bound = None if outside_logit is None else outside_logit[b]
            fast = _top_k_fast(logits[b], top_ids[b], row, certified, bound)
            if fast is not None:
                ids, vals = candidates(fast[1], s, fast[0])
                out[b] = ids[_inverse_cdf(vals, u[b])]
                continue
        if z is None:
            z = np.array(logits, dtype=np.float32, copy=True)
            apply_penalties(z, rows)
        if mask is not None and mask.allowed is not None:
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


def sample_outputs(
    out: StepOutput, rows: list[SampleRow], masks: list[TokenMask | None] | None, at: list[int]
) -> np.ndarray:
    """`sample` over output rows `at` of a step: the head's candidates (or the graph's top ids)
    let top-k rows sample without a vocabulary pass."""
    ids, outside = out.sampling_candidates()
    return sample(out.logits, rows, masks, top_ids=ids, logsumexp=out.logsumexp, outside_logit=outside, at=at)


def _draw_top_k_rows(
    logits: np.ndarray,
    rows: list[SampleRow],
    masks: list[TokenMask | None] | None,
    top_ids: np.ndarray | None,
    logsumexp: np.ndarray | None,
    outside_logit: np.ndarray | None,
    u: list[float],
    out: np.ndarray,
) -> list[bool]:
    """Draw every row that can sample from the graph's top ids, all at once (top_ids_draw), into
    `out`; returns which rows were drawn. A row qualifies with finite logits certified by the
    graph's logsumexp, no mask or logit_bias, 0 < top_k <= K, a positive temperature and
    penalties that can only lower a logit."""
    drawn = [False] * len(rows)
    if top_ids is None or logsumexp is None:
        return drawn
    finite = np.isfinite(logsumexp).tolist()
    picked = [
        b
        for b, row in enumerate(rows)
        if finite[b] and (masks is None or masks[b] is None) and _top_ids_suffice(row.sampling, top_ids.shape[1])
    ]
    if not picked:
        return drawn
    batch = CandidateRows(
        logits,
        top_ids,
        picked,
        [rows[b].sampling for b in picked],
        [rows[b].seen_ids for b in picked],
        [rows[b].output_counts for b in picked],
        [u[b] for b in picked],
        None if outside_logit is None else outside_logit[picked],
    )
    tokens, done = draw_rows(batch)
    for b, token, ok in zip(picked, tokens.tolist(), done.tolist()):
        if ok:
            out[b] = token
            drawn[b] = True
    return drawn


def _top_ids_suffice(s: SamplingParams, k_ids: int) -> bool:
    """Whether a row's top-k survivors can be found among the graph's K top ids at all."""
    return (
        0 < s.top_k <= k_ids
        and s.temperature >= GREEDY_TEMPERATURE
        and not s.logit_bias
        and s.repetition_penalty >= 1.0
        and s.presence_penalty >= 0.0
        and s.frequency_penalty >= 0.0
    )


def apply_mask(z: np.ndarray, allowed: np.ndarray) -> None:
    """Disallowed tokens of one row [V] become -inf, in place. A NaN on an allowed token still
    fails the row; NaNs the mask removes do not matter."""
    n = min(z.size, allowed.size)
    z[:n][~allowed[:n]] = -np.inf
    if z.size > n:
        z[n:] = -np.inf


def apply_penalties(z: np.ndarray, rows: list[SampleRow]) -> None:
    """Repetition, presence and frequency penalties, then each row's logit_bias, in place on
    z [B, V], for all rows at once.

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
    for b, row in enumerate(rows):
        bias = row.sampling.logit_bias
        if bias:
            ids = np.fromiter(bias.keys(), dtype=np.int64, count=len(bias))
            z[b, ids] += np.fromiter(bias.values(), dtype=np.float32, count=len(bias))


def candidates(z: np.ndarray, s: SamplingParams, ids: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Token ids a row may sample and their temperature-scaled logits: temperature, top-k,
    top-p, min-p in that order (HF semantics: each stage sees the previous stage's survivors).

    z: the row's penalized logits [V]; or, with `ids` (increasing token ids), only those tokens'
    logits, when they are known to hold every top-k survivor (`_top_k_fast`)."""
    vals = z / np.float32(s.temperature)
    mx = vals.max()
    near = vals >= mx - np.float32(CANDIDATE_CUTOFF)
    if near.all():
        ids = _arange(vals.size) if ids is None else ids
    else:
        keep = np.flatnonzero(near)
        ids = keep if ids is None else ids[keep]
        vals = vals[keep]
    if 0 < s.top_k < ids.size:
        keep = _top_k(vals, mx, s.top_k)
        ids, vals = ids[keep], vals[keep]
    if s.top_p < 1.0:
        keep = _top_p_small(ids, vals, mx, s.top_p) if ids.size <= CDF_BLOCK else _top_p(ids, vals, mx, s.top_p)
        ids, vals = ids[keep], vals[keep]
    if s.min_p > 0.0:
        # p_i >= min_p * p_max  <=>  z_i >= z_max + log(min_p): no softmax needed.
        keep = np.flatnonzero(vals >= mx + np.float32(np.log(s.min_p)))
        ids, vals = ids[keep], vals[keep]
    return ids, vals


def _top_k_fast(
    logits: np.ndarray,
    top_ids: np.ndarray,
    row: SampleRow,
    finite: bool = False,
    outside_logit: np.float32 | None = None,
) -> tuple[np.ndarray, np.ndarray] | None:
    """(ids, penalized logits) of a small token set that holds every top-k survivor of the row,
    found without a full-vocabulary pass when possible; None when the row is not eligible (the
    caller takes the full path): not `_top_ids_suffice`, or non-finite logits.

    Every token's penalized logit is at most its raw logit. Let kth be the k-th largest penalized
    value among the K raw-best tokens: a token outside them survives top-k only if its raw logit
    reaches kth, and that cannot happen when kth is above the largest raw logit outside them
    (`outside_logit`, the fused head's; else the K-th raw logit bounds it) (the usual case: the
    K ids are the set). Otherwise (a penalized token fell below it, or ties) the set is every
    token whose raw logit is >= kth: one comparison over the vocabulary, and the k-th largest over
    that superset is >= kth, so every token left out is strictly below it. Penalties use the same
    float32 operations as `apply_penalties` (top_ids_draw.penalized_row), so values and draws are
    bit-identical to the full path's."""
    s = row.sampling
    if not _top_ids_suffice(s, top_ids.size):
        return None
    if not finite and not np.isfinite(logits.max()):  # NaN/inf anywhere: the full path reports the row
        return None
    ids = np.sort(np.asarray(top_ids, dtype=np.int64))
    vals = penalized_row(logits, ids, s, row.seen_ids, row.output_counts)
    # Bounds every raw logit outside `ids`: the head's exact figure, else the K-th raw logit.
    floor = logits[ids].min() if outside_logit is None else outside_logit
    kth = np.partition(vals, vals.size - s.top_k)[vals.size - s.top_k]
    if kth > floor:
        return ids, vals
    ids = np.flatnonzero(logits >= kth)
    return ids, penalized_row(logits, ids, s, row.seen_ids, row.output_counts)


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
    p = host.exp(vals - mx)
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


def _top_p_small(ids: np.ndarray, vals: np.ndarray, mx: np.float32, top_p: float) -> np.ndarray:
    """`_top_p` for a set of at most CDF_BLOCK tokens: sorted best-first (decreasing logit, then
    increasing id), a token is kept while the float64 mass before it is below top_p of the total."""
    order = np.lexsort((ids, -vals))
    mass = host.exp(vals - mx)[order].astype(np.float64)
    running = np.cumsum(mass)
    before = np.concatenate([np.zeros(1), running[:-1]])
    return np.sort(order[before < top_p * running[-1]])


def _inverse_cdf(vals: np.ndarray, u: float) -> int:
    """Index into `vals` sampled from softmax(vals) with the uniform u in [0, 1)."""
    p = host.exp(vals - vals.max())
    n = p.size
    if n <= CDF_BLOCK:  # one block: the first running sum above u of the total
        running = np.cumsum(p, dtype=np.float64)
        return min(int(np.searchsorted(running, u * running[-1], side="right")), n - 1)
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


def explicit_logprob(
    token_id: int, logits: np.ndarray, logsumexp: float, ids: list[int], values: np.ndarray
) -> TokenLogprob:
    """The chosen token plus caller-chosen ids (api.md logprob_token_ids): `values` are the step
    graph's full-vocabulary logprobs of `ids`, reported in caller order; the chosen token is
    appended when absent."""
    top = [(int(i), float(v)) for i, v in zip(ids, values)]
    chosen = next((v for i, v in top if i == token_id), None)
    if chosen is None:
        chosen = float(logits[token_id]) - float(logsumexp)
        top.append((int(token_id), chosen))
    return TokenLogprob(token_id=int(token_id), logprob=chosen, top=top, explicit=True)


NON_FINITE_LOGPROB = -9999.0  # api.md: how prompt scores report -inf / NaN


def _finite(value: float) -> float:
    return value if np.isfinite(value) else NON_FINITE_LOGPROB


def prompt_logprob_entries(scores: PromptScores, token_ids: list[int], k: int) -> list[PromptLogprob]:
    """api.md prompt entries from the score graph's output: the actual token (`token_ids`, one
    per scored position) with its rank and the k best natural alternatives (decreasing logprob,
    ties by increasing id) with theirs."""
    entries = []
    for token_id, target_lp, rank, top_lp, top_ids in zip(
        token_ids, scores.target_logprobs, scores.target_ranks, scores.top_logprobs, scores.top_ids
    ):
        order = np.lexsort((top_ids, -top_lp))
        top_ids, top_lp = top_ids[order], top_lp[order]
        # Every logprob strictly greater than an alternative's is itself among the alternatives.
        ranks = 1 + np.searchsorted(-top_lp, -top_lp, side="left")
        top = [(int(i), _finite(float(v)), int(r)) for i, v, r in zip(top_ids[:k], top_lp[:k], ranks[:k])]
        entries.append(
            PromptLogprob(token_id=int(token_id), logprob=_finite(float(target_lp)), rank=int(rank), top=top)
        )
    return entries

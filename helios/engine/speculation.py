"""Speculative decoding with history drafts and a learned drafter (api.md speculative execution).

A decode round may carry k drafted tokens after a row's last committed token. The step graph
returns the target's outputs at each of the k+1 positions (manifest 1.7 `logit_positions`), and
the engine commits one position at a time through the ordinary sampler, penalties, stops and
logprobs: position j's token is drawn from the target's distribution given the tokens committed
so far, and the round moves to position j+1 only while that token equals draft j+1. History
drafts are deterministic, so this is speculative rejection sampling against a point-mass draft:
draft d is kept with probability p(d) and, when it is not, the committed token is distributed as
p given not d. Each committed token takes one draw from the request's generator, as without
speculation, so seeded and greedy outputs match the non-speculative ones given the same logits.

Rollback: rejected positions' K/V stay in pool slots past `num_computed_tokens`, which later
steps overwrite; pages are shared only below the computed length, so prefix checkpoints only
ever hold committed tokens. Cores with recurrent state do not speculate (a rejected position
would already have advanced the state).

Drafts come from the request's own tokens (prompt and output): the longest n-gram (up to
`max_ngram`) ending at the last token that occurred earlier proposes what followed it; when the
request has no such match, the outputs of recently finished requests (shared decoded history)
are searched the same way. When history has nothing, a core with a learned drafter (manifest
`drafter`, helios.engine.drafter) proposes the drafter's greedy continuation: deterministic given
the context, so the same point-mass rule keeps the output exact. Depth is adaptive: each request
keeps a running acceptance rate per source, and a round offers the width that maximizes expected
tokens per unit of cost (the target's positions, plus the drafter's own steps for learned drafts);
rounds offer nothing while more rows decode than `max_batch_rows` (a batch that is already
compute-bound gains nothing).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from helios.engine.sequence import Sequence

if TYPE_CHECKING:  # the drafter runs scheduled rows, whose module imports this one
    from helios.engine.drafter import LearnedDrafter

MODES = ("auto", "off")


@dataclass
class SpeculationConfig:
    mode: str = "auto"  # "off": no drafts
    history_drafts: bool = True  # n-gram drafts from the request's tokens and shared history
    learned_drafter: bool = True  # the core's drafter (manifest `drafter`), when it has one
    # A request whose drafter K/V lags its tokens by more than this (a long prompt the drafter has
    # not read, a prefix restored from the host store) drafts from history only: catching up would
    # cost more drafter prefill than its drafts save (on this CPU a 0.5B drafter reads ~1.5k
    # tokens in ~3 s, what 60 decode steps of the 1.5B take; docs/performance.md).
    drafter_catch_up_tokens: int = 256
    max_width: int = 8  # drafts per round at most; a fixed width when adaptive is False
    adaptive: bool = True
    max_batch_rows: int = 2  # more decoding rows than this: rounds carry no drafts
    min_ngram: int = 2
    max_ngram: int = 4
    # Tokens of recently finished outputs every request may draft from (0: its own tokens only).
    shared_history_tokens: int = 1 << 18
    # Step cost of one more position in a round, relative to a one-token decode step: measured on
    # this CPU with the default core at 1.5k tokens of history (a step of 1, 3, 5 and 9 positions:
    # 19.2, 25.4, 35.4 and 47.9 ms; docs/performance.md), so a draft pays only when it is
    # accepted about one time in five or more.
    position_cost: float = 0.2

    def validate(self) -> None:
        for name in (
            "max_width",
            "max_batch_rows",
            "min_ngram",
            "max_ngram",
            "shared_history_tokens",
            "drafter_catch_up_tokens",
        ):
            if isinstance(getattr(self, name), bool) or not isinstance(getattr(self, name), int):
                raise ValueError(f"speculation {name} must be an integer")
        if self.mode not in MODES:
            raise ValueError(f"speculation mode must be one of {', '.join(MODES)}")
        if not 0 <= self.max_width <= 16:
            raise ValueError("speculation max_width must be in 0..16")
        if not 1 <= self.min_ngram <= self.max_ngram <= 16:
            raise ValueError("speculation n-gram sizes must satisfy 1 <= min_ngram <= max_ngram <= 16")
        if self.max_batch_rows < 1:
            raise ValueError("speculation max_batch_rows must be >= 1")
        if self.shared_history_tokens < 0:
            raise ValueError("speculation shared_history_tokens must be >= 0")
        if self.drafter_catch_up_tokens < 0:
            raise ValueError("speculation drafter_catch_up_tokens must be >= 0")

    @property
    def enabled(self) -> bool:
        return self.mode != "off" and (self.history_drafts or self.learned_drafter) and self.max_width > 0


def ngrams(tokens: list[int], lo: int, hi: int, first_end: int = 0) -> Iterator[tuple[tuple[int, ...], int]]:
    """(n-gram, the position after it) for each n-gram of lo..hi tokens that a token follows,
    ending at `first_end` or later."""
    for end in range(max(first_end, lo), len(tokens)):
        for n in range(lo, min(hi, end) + 1):
            yield tuple(tokens[end - n : end]), end


def tails(tokens: list[int], lo: int, hi: int) -> Iterator[tuple[int, ...]]:
    """The text's last hi..lo tokens, longest first (what an index is asked for)."""
    for n in range(hi, lo - 1, -1):
        if len(tokens) >= n:
            yield tuple(tokens[len(tokens) - n :])


class DraftRate:
    """One draft source's running acceptance for one request, and the round width it pays to offer."""

    ACCEPTANCE_WEIGHT = 0.25  # weight of the latest round in the running acceptance rate
    PROBE_EVERY = 16  # rounds without drafts between one-draft probes

    def __init__(
        self, config: SpeculationConfig, draft_cost: float = 0.0, prior: float = 1.0, probe_every: int | None = None
    ):
        self.config = config
        self.draft_cost = draft_cost  # what proposing one draft costs, relative to a one-token step
        self.acceptance = prior  # until measured
        self.idle_rounds = 0
        self.probe_every = self.PROBE_EVERY if probe_every is None else probe_every  # 0: never

    def record(self, offered: int, accepted: int) -> None:
        if offered:
            self.acceptance += self.ACCEPTANCE_WEIGHT * (accepted / offered - self.acceptance)

    def width(self) -> int:
        """The round width with the most expected tokens per unit of step cost."""
        config = self.config
        if not config.adaptive:
            return config.max_width
        best, best_gain, expected = 0, 1.0, 1.0
        for k in range(1, config.max_width + 1):
            expected += self.acceptance**k  # the k-th draft survives only if all before it do
            gain = expected / (1 + (config.position_cost + self.draft_cost) * k)
            if gain > best_gain:
                best, best_gain = k, gain
        if best == 0 and self.probe_every:
            # A rate measured on rejected drafts never rises by itself: probe with one draft now
            # and then, so a request that starts copying later gets its drafts back.
            self.idle_rounds += 1
            if self.idle_rounds >= self.probe_every:
                self.idle_rounds = 0
                return 1
        return best


class HistoryDrafts(DraftRate):
    """One request's n-gram index: for each n-gram, the position after its latest occurrence."""

    def __init__(self, config: SpeculationConfig):
        super().__init__(config)
        self.indexed = 0  # tokens[:indexed] are in the index
        self.follow: dict[tuple[int, ...], int] = {}

    def propose(self, tokens: list[int], width: int) -> list[int]:
        """Up to `width` tokens that followed the longest earlier occurrence of the text's tail."""
        config = self.config
        for gram, end in ngrams(tokens, config.min_ngram, config.max_ngram, self.indexed):
            self.follow[gram] = end  # the latest occurrence wins
        self.indexed = max(self.indexed, len(tokens))
        for gram in tails(tokens, config.min_ngram, config.max_ngram):
            start = self.follow.get(gram)
            if start is not None:
                return tokens[start : start + width]
        return []


class RequestDrafts:
    """A request's draft sources (its history index, the learned drafter's rate) and which one
    the round in flight draws from, so its outcome updates that source's rate."""

    # Acceptance assumed for the learned drafter until measured: history drafts are free to try
    # (1.0), learned ones cost drafter steps, and a 0.5B drafting for the 1.5B agrees on about
    # half the tokens of prose (docs/performance.md), so it starts at one draft per round.
    LEARNED_PRIOR = 0.6
    # The learned drafter does not probe: a probe would first make it read every token written
    # since its last round, ~0.04 of a target step per token for the 0.5B beside the 1.5B, more
    # than one draft can win back on text it does not predict (measured: probes every 16 or 64
    # rounds cost free writing 12% and 6%; docs/performance.md). Once its rate says it does not
    # pay, the request drafts from history only.
    LEARNED_PROBE_EVERY = 0

    def __init__(self, config: SpeculationConfig, drafter_cost: float):
        self.history = HistoryDrafts(config)
        self.learned = DraftRate(config, drafter_cost, self.LEARNED_PRIOR, self.LEARNED_PROBE_EVERY)
        self.source: DraftRate | None = None


class SharedHistory:
    """Outputs of recently finished requests, indexed like a request's own tokens: a request whose
    text has no earlier match of its own can copy what another request wrote (an agent's next
    session re-emitting the file or command the last one produced). Bounded in tokens; the oldest
    output and its index entries go first."""

    def __init__(self, config: SpeculationConfig, capacity_tokens: int):
        self.config = config
        self.capacity_tokens = capacity_tokens
        self.outputs: OrderedDict[int, list[int]] = OrderedDict()  # id -> tokens, oldest first
        self.follow: dict[tuple[int, ...], tuple[int, int]] = {}  # n-gram -> (output id, next position)
        self.tokens = 0
        self.next_id = 0

    def remember(self, tokens: list[int]) -> None:
        lo, hi = self.config.min_ngram, self.config.max_ngram
        if len(tokens) <= lo or len(tokens) > self.capacity_tokens:
            return
        key, self.next_id = self.next_id, self.next_id + 1
        self.outputs[key] = list(tokens)
        self.tokens += len(tokens)
        for gram, end in ngrams(tokens, lo, hi):
            self.follow[gram] = (key, end)
        while self.tokens > self.capacity_tokens:
            old_key, old = self.outputs.popitem(last=False)
            self.tokens -= len(old)
            for gram, _ in ngrams(old, lo, hi):
                if self.follow.get(gram, (None,))[0] == old_key:
                    del self.follow[gram]

    def propose(self, tokens: list[int], width: int) -> list[int]:
        for gram in tails(tokens, self.config.min_ngram, self.config.max_ngram):
            found = self.follow.get(gram)
            if found is not None:
                key, start = found
                return self.outputs[key][start : start + width]
        return []


@dataclass
class RoundCounts:
    """api.md's speculative counters (EngineStats reads them)."""

    rounds: int = 0  # decode rounds, zero-draft ones included
    offered: int = 0  # drafts offered in them
    accepted: int = 0  # drafts committed (the bonus token excluded)
    draft_rounds: int = 0  # rounds that offered at least one draft
    by_width: dict[int, int] = field(default_factory=dict)  # step graphs by their widest round's drafts

    def step(self, widths: list[int], decode_widths: list[int]) -> None:
        """One step graph: each row's drafts, and those of its decode rounds."""
        width = max(widths, default=0)
        self.by_width[width] = self.by_width.get(width, 0) + 1
        self.rounds += len(decode_widths)
        self.offered += sum(decode_widths)
        self.draft_rounds += sum(1 for w in decode_widths if w)


class Speculator:
    """The scheduler's draft planner (plain data): each decode round's history drafts for one
    request, or the width the learned drafter (helios.engine.drafter) is to fill in."""

    def __init__(self, config: SpeculationConfig, learned: LearnedDrafter | None = None):
        config.validate()
        self.config = config
        self.learned = learned
        self.shared = SharedHistory(config, config.shared_history_tokens) if config.shared_history_tokens else None

    def _room(self, seq: Sequence, decoding_rows: int, room: int) -> int:
        """Drafts `seq` may take: none for constrained requests (grammar masks and reasoning
        budgets see one token at a time) or when more than max_batch_rows decode."""
        if decoding_rows > self.config.max_batch_rows or seq.constraint is not None:
            return 0
        if seq.speculation is None:
            cost = self.learned.cost if self.learned is not None else 0.0
            seq.speculation = RequestDrafts(self.config, cost)
        seq.speculation.source = None
        # A draft at or past the last allowed token could never be committed.
        return min(room, seq.stop_checker.max_new_tokens - seq.num_generated - 1)

    def drafts(self, seq: Sequence, decoding_rows: int, room: int) -> list[int]:
        """History drafts for `seq`'s next round (its own tokens first, then shared history)."""
        config = self.config
        if not (config.enabled and config.history_drafts) or (room := self._room(seq, decoding_rows, room)) <= 0:
            return []
        history = seq.speculation.history
        width = min(history.width(), room)
        if width <= 0:
            return []
        drafts = history.propose(seq.token_ids, width)
        if not drafts and self.shared is not None:
            drafts = self.shared.propose(seq.token_ids, width)
        if drafts:
            seq.speculation.source = history
        return drafts

    def learned_width(self, seq: Sequence, decoding_rows: int, room: int) -> int:
        """How many drafts the learned drafter is to propose for `seq` this round (after history
        had none): 0 without one, or when its acceptance or lag says it would not pay."""
        learned = self.learned
        if learned is None or not self.config.enabled or (room := self._room(seq, decoding_rows, room)) <= 0:
            return 0
        rate = seq.speculation.learned
        width = min(rate.width(), room)
        if width <= 0 or not learned.can_draft(seq, width):
            return 0
        seq.speculation.source = rate
        return width

    def remember(self, seq: Sequence) -> None:
        """A finished request's output joins the shared history."""
        if self.shared is not None and seq.num_generated:
            self.shared.remember(seq.output_ids)

    @staticmethod
    def record(seq: Sequence, offered: int, accepted: int) -> None:
        if seq.speculation is not None and seq.speculation.source is not None:
            seq.speculation.source.record(offered, accepted)

"""One request's state inside the engine: tokens, KV page table, progress, sampling, stops.

Progress is a single counter, `num_computed_tokens`: how many of `token_ids` (prompt followed
by generated tokens) have K/V in the pool. A step feeds `token_ids[num_computed:num_computed+n]`
and, when that reaches the last token, samples the next one. A decode is the case n == 1; a
preempted sequence is reset to 0 and simply re-prefills prompt + generated tokens, resuming
exactly where it was (its random generator is not reset).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import numpy as np

from helios.engine.api import CheckpointCandidate, FinishReason, GenerationEvent, GenerationRequest, SamplingParams
from helios.engine.detokenizer import Decoder, IncrementalDetokenizer
from helios.engine.stops import StopChecker


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, holds no pages (new, or preempted)
    RUNNING = "running"  # admitted: holds pages, being prefilled or decoded
    FINISHED = "finished"


class Sequence:
    def __init__(
        self,
        request: GenerationRequest,
        arrival: int,
        stop_checker: StopChecker,
        sink: Callable[[GenerationEvent], None] | None = None,
    ):
        self.request_id = request.request_id
        self.request = request
        self.sampling: SamplingParams = request.sampling
        self.arrival = arrival  # FCFS order; also the preemption order (newest first)
        self.token_ids: list[int] = list(request.prompt_token_ids)
        self.prompt_len = len(self.token_ids)
        self.num_computed_tokens = 0
        self.page_table: list[int] = []
        # Leading page_table columns whose pages went back (before every layer's window); the
        # columns stay, naming a live page of the table, so positions keep their columns.
        self.released_pages = 0
        self.state_slot: int | None = None  # recurrent-state slot while running (cores with state)
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.stop_reason: str | int | list[int] | None = None
        self.stop_checker = stop_checker
        self.sink = sink
        # Own generator: a seeded request samples the same tokens whatever its batch neighbours.
        self.rng = np.random.default_rng(self.sampling.seed)
        self.num_preemptions = 0
        self._prompt_unique: np.ndarray | None = None
        self._seen: set[int] | None = None  # prompt and generated ids, made at the first draw
        self._output_counts: dict[int, int] = {}
        # Prefix checkpoints (helios.engine.prefix_cache): prompt tokens restored at the first
        # admission (what usage reports as cached), and the boundaries still to capture (None
        # until the first admission selects them).
        self.cached_tokens = 0
        self.checkpoint_plan: list[CheckpointCandidate] | None = None
        # Prompt scoring: prompt positions whose entries were emitted (a recompute after
        # preemption scores nothing twice).
        self.prompt_scored = 0
        # Its grammar or forced tokens: a helios.engine.constraints.RowConstraint, or None. Typed
        # Any here and below: those modules read sequences, and this one imports none of them.
        self.constraint: Any = None
        self.host_looked_up = False  # its first admission attempt consulted the host store
        self.speculation: Any = None  # helios.engine.speculation.RequestDrafts, made at its first round
        # Learned drafter (helios.engine.drafter): leading tokens whose drafter K/V its pages hold,
        # and the drafts it fed past them in its last round (valid while they get committed).
        self.drafter_len = 0
        self.drafter_pending: list[int] = []
        # Checkpoints whose leading pages are this sequence's pages: the drafter K/V it reads
        # into them is theirs too (helios.engine.drafter.share_reads).
        self.shared_checkpoints: list[Any] = []  # helios.engine.prefix_cache.Checkpoint

    @classmethod
    def create(
        cls,
        request: GenerationRequest,
        arrival: int,
        tokenizer: Decoder,
        eos_token_ids: list[int],
        context_length: int,
        sink: Callable[[GenerationEvent], None] | None = None,
    ) -> Sequence:
        prompt = request.prompt_token_ids
        # The output budget is bounded by what is left of the context.
        max_new = min(request.sampling.max_tokens, context_length - len(prompt))
        checker = StopChecker(request.sampling, eos_token_ids, max_new, IncrementalDetokenizer(tokenizer, prompt))
        return cls(request, arrival, checker, sink)

    # -- sizes ---------------------------------------------------------------------------------

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        """Only the last sampled token lacks K/V: the next step is a one-token decode."""
        return self.num_uncomputed == 1 and self.num_generated > 0

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def scores_prompt(self) -> bool:
        """Prompt scoring was requested and some prompt position is still unscored."""
        return self.request.prompt_logprobs is not None and self.prompt_scored < self.prompt_len

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def prompt_unique_ids(self) -> np.ndarray:
        """Distinct prompt ids, computed once (repetition penalty needs them every step)."""
        if self._prompt_unique is None:
            unique = np.unique(np.asarray(self.token_ids[: self.prompt_len], dtype=np.int64))
            self._prompt_unique = unique[unique >= 0]  # image tokens carry negative identity ids
        return self._prompt_unique

    @property
    def seen_ids(self) -> set[int]:
        """Prompt and generated ids (what the repetition penalty lowers), kept as tokens come."""
        if self._seen is None:
            self._seen = {t for t in self.token_ids if t >= 0}  # image tokens carry negative ids
        return self._seen

    @property
    def output_counts(self) -> dict[int, int]:
        """Generated id -> how often it was generated (presence and frequency penalties)."""
        return self._output_counts

    def append_token(self, token_id: int) -> None:
        token_id = int(token_id)
        self.token_ids.append(token_id)
        self._output_counts[token_id] = self._output_counts.get(token_id, 0) + 1
        if self._seen is not None:
            self._seen.add(token_id)

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, pages={len(self.page_table)})"
        )

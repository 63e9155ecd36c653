"""Per-request output constraints inside the engine: grammar token masks and reasoning budgets.

A request may carry (helios.engine.api):

- `grammar`: an llguidance grammar (the compiled spec string) that constrains the answer. Its
  token mask applies once reasoning has ended at its delimiter token, so reasoning stays free;
  the frontend builds the grammar with the model's tool-call envelopes as alternatives, so tool
  calls stay available under an output constraint.
- `reasoning`: the reasoning delimiters as token ids and an optional budget. When output starts
  in reasoning and the budget of generated reasoning tokens is reached while reasoning is still
  unambiguously open (no tool opener undecided), the next token is forced to the close token.
  A forced token counts as generated and has no logprob entry.

Masks are computed for the rows that sample in a step on a worker thread while the runner
executes that step (llguidance and onnxruntime both release the GIL), and joined before
sampling. One LLTokenizer is built per tokenizer (about a second) and shared.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import numpy as np
from tokenizers import Tokenizer

from helios.engine.api import GenerationRequest
from helios.engine.sequence import Sequence

log = logging.getLogger("helios.engine")

_TOKENIZERS: dict[tuple[str, int, tuple[int, ...]], llguidance.LLTokenizer] = {}
_TOKENIZERS_LOCK = threading.Lock()


def llg_tokenizer(tokenizer_json: str, vocab_size: int, eos_token_ids: list[int]) -> llguidance.LLTokenizer:
    """The shared llguidance tokenizer of a tokenizer.json (built once per process)."""
    key = (hashlib.sha256(tokenizer_json.encode()).hexdigest(), vocab_size, tuple(eos_token_ids))
    with _TOKENIZERS_LOCK:
        cached = _TOKENIZERS.get(key)
        if cached is None:
            cached = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_token_ids))
            _TOKENIZERS[key] = cached
        return cached


def parser_limits() -> llguidance.LLParserLimits:
    """Bounds on grammar size and per-step work (compile and masks)."""
    return llguidance.LLParserLimits(
        max_grammar_size=200_000,
        step_lexer_fuel=200_000,
        step_max_items=50_000,
        max_lexer_states=100_000,
        initial_lexer_fuel=1_000_000,
    )


def first_line(error: str) -> str:
    """llguidance's error without the parser state dump it appends."""
    text = error.strip()
    return text.splitlines()[0] if text else error


class ConstraintError(Exception):
    """The request's grammar cannot continue (the request fails)."""


MAYBE_OPEN, REASONING, ANSWER, FREE = "maybe_open", "reasoning", "answer", "free"


class RowConstraint:
    """Constraint state of one sequence."""

    def __init__(self, request: GenerationRequest, eos_token_ids: frozenset[int]):
        self.grammar = request.grammar
        self.control = request.reasoning
        self.eos = eos_token_ids
        self.matcher: llguidance.LLMatcher | None = None
        self.reasoning_tokens = 0
        self.budget_cut = False
        c = self.control
        if c is None:
            self.phase = ANSWER
        elif c.starts_open:
            self.phase = REASONING
        elif c.open_token_id is not None:
            self.phase = MAYBE_OPEN
        else:
            self.phase = ANSWER

    @property
    def active(self) -> bool:
        """This step needs the mask worker: a grammar over the answer, or a budget at its cap."""
        c = self.control
        if self.phase == REASONING:
            return c is not None and c.budget is not None and self.reasoning_tokens >= c.budget
        return self.grammar is not None and self.phase != FREE

    def matcher_for(self, tokenizer: llguidance.LLTokenizer) -> llguidance.LLMatcher:
        if self.matcher is None:
            self.matcher = llguidance.LLMatcher(tokenizer, self.grammar, log_level=0, limits=parser_limits())
            if self.matcher.is_error():
                raise ConstraintError(f"the output grammar failed: {first_line(self.matcher.get_error())}")
        return self.matcher

    def force_close(self, num_generated: int, max_new_tokens: int, text: str) -> bool:
        """The budget is reached, reasoning is open, the close token fits, and no tool opener
        is undecided at the end of the text so far."""
        c = self.control
        if (
            c is None
            or self.phase != REASONING
            or c.budget is None
            or c.close_token_id is None
            or self.reasoning_tokens < c.budget
            or num_generated >= max_new_tokens
        ):
            return False
        tail = text[-64:]
        for opener in c.tool_open_texts:
            if any(tail.endswith(opener[:k]) for k in range(1, len(opener) + 1)):
                return False
        return True

    def commit(self, token: int, forced: bool) -> None:
        """`token` was generated (sampled or forced)."""
        c = self.control
        if self.phase == MAYBE_OPEN:
            assert c is not None
            if token == c.open_token_id:
                self.phase = REASONING
                return
            self.phase = ANSWER
        if self.phase == REASONING:
            assert c is not None
            if token == c.close_token_id:
                self.phase = ANSWER
                self.budget_cut = self.budget_cut or forced
            elif token in c.tool_open_ids:
                self.phase = FREE  # a tool call ended reasoning implicitly; the answer is unconstrained
            else:
                self.reasoning_tokens += 1
            return
        if self.phase == ANSWER and self.grammar is not None and token not in self.eos:
            matcher = self.matcher
            if matcher is None:
                return  # nothing was masked yet (cannot happen: masks precede samples)
            if not matcher.consume_token(token):
                raise ConstraintError(f"the output violated its grammar: {first_line(matcher.get_error())}")


@dataclass
class RowMask:
    forced: int | None = None  # the only token this row may produce (a forced close)
    allowed: np.ndarray | None = None  # bool [V], None: unconstrained
    error: str | None = None


class Constraints:
    """Masks for the rows of one engine, computed beside the forward pass."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: list[int]):
        """`tokenizer`: the engine's tokenizer, serialized for the grammar engine on the first grammar."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.eos = frozenset(eos_token_ids)
        self._executor: ThreadPoolExecutor | None = None
        self._llg: llguidance.LLTokenizer | None = None
        self.mask_seconds = 0.0  # wall time spent computing masks (reported by the benchmark)
        self.budget_cuts = 0

    def attach(self, seq: Sequence) -> None:
        request = seq.request
        budget = request.reasoning.budget if request.reasoning is not None else None
        if request.grammar is None and budget is None:
            seq.constraint = None  # nothing to mask or force: no per-step work at all
            return
        seq.constraint = RowConstraint(request, self.eos)

    def _tokenizer(self) -> llguidance.LLTokenizer:
        if self._llg is None:
            self._llg = llg_tokenizer(self.tokenizer.to_str(), self.vocab_size, self.eos_token_ids)
        return self._llg

    def begin(self, seqs: list[Sequence]) -> Future | None:
        """Start computing this step's masks for the rows that will sample (None: no row has
        a constraint). Each row's state is final here: its last token was committed."""
        rows = [(i, seq) for i, seq in enumerate(seqs) if seq.constraint is not None and seq.constraint.active]
        if not rows:
            return None
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="helios-masks")
        texts = {i: seq.stop_checker.detokenizer.text for i, seq in rows}
        limits = {i: (seq.num_generated, seq.stop_checker.max_new_tokens) for i, seq in rows}
        return self._executor.submit(self._masks, rows, texts, limits)

    def _masks(
        self, rows: list[tuple[int, Sequence]], texts: dict[int, str], limits: dict[int, tuple[int, int]]
    ) -> dict[int, RowMask]:
        t0 = time.perf_counter()
        out: dict[int, RowMask] = {}
        for i, seq in rows:
            c: RowConstraint = seq.constraint
            try:
                out[i] = self._mask(c, texts[i], *limits[i])
            except ConstraintError as exc:
                out[i] = RowMask(error=str(exc))
            except Exception as exc:  # llguidance misuse or a bug: fail only this request
                log.exception("grammar mask failed for %s", seq.request_id)
                out[i] = RowMask(error=f"the output grammar failed: {exc}")
        self.mask_seconds += time.perf_counter() - t0
        return out

    def _mask(self, c: RowConstraint, text: str, num_generated: int, max_new: int) -> RowMask:
        if c.force_close(num_generated, max_new, text):
            assert c.control is not None and c.control.close_token_id is not None
            return RowMask(forced=c.control.close_token_id)
        if c.grammar is None or c.phase in (REASONING, FREE):
            return RowMask()
        allowed = self._grammar_mask(c)
        if c.phase == MAYBE_OPEN:
            assert c.control is not None and c.control.open_token_id is not None
            allowed[c.control.open_token_id] = True
        if not allowed.any():
            raise ConstraintError("the output grammar allows no further token")
        return RowMask(allowed=allowed)

    def _grammar_mask(self, c: RowConstraint) -> np.ndarray:
        tokenizer = self._tokenizer()
        matcher = c.matcher_for(tokenizer)
        if matcher.is_error():
            raise ConstraintError(f"the output grammar failed: {first_line(matcher.get_error())}")
        words = (tokenizer.vocab_size + 31) // 32
        bits = np.full(words, -1, dtype=np.int32)
        matcher.unsafe_compute_mask_ptr(bits.ctypes.data, bits.size * 4)
        if matcher.is_error():
            raise ConstraintError(f"the output grammar failed: {first_line(matcher.get_error())}")
        allowed = np.unpackbits(bits.view(np.uint8), bitorder="little").astype(bool)
        if allowed.size < self.vocab_size:
            allowed = np.concatenate([allowed, np.zeros(self.vocab_size - allowed.size, dtype=bool)])
        return allowed[: self.vocab_size]

    def commit(self, seq: Sequence, token: int, forced: bool) -> None:
        c = seq.constraint
        if c is None:
            return
        was_cut = c.budget_cut
        c.commit(token, forced)
        if c.budget_cut and not was_cut:
            self.budget_cuts += 1

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False)

"""When a sequence ends, and which of its text is released.

Per committed token, in this order (the cause is decided at the terminal token, so an EOS or a
stop string landing on the last allowed token reports STOP, not LENGTH):

1. stop_token_ids: the terminating token produces no text and no logprob entry; stop_reason is
   the id. (Checked regardless of ignore_eos, as in vLLM.)
2. EOS ids, unless ignore_eos: same, with stop_reason None. Under ignore_eos an EOS is an
   ordinary token (its text is empty because special tokens are skipped).
3. stop_token_sequences: a token that could still be part of a sequence is held (no text, no
   logprob entry yet). When the generated ids end with a whole sequence, generation stops and
   the held tokens are dropped like a stop token (stop_reason: the sequence); when the match
   fails, they are released in order. A stop id, EOS or the budget releases them too.
4. The token's text goes through the detokenizer and then the stop-string matcher, which holds
   back released text that could still be the start of a stop string. A match truncates the
   text before the stop (or after it with include_stop_str_in_output) and ends with STOP.
5. The output budget (max_tokens, bounded by the remaining context) ends with LENGTH.

Whatever ends a sequence, the token is counted in completion_tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from helios.engine.api import FinishReason, SamplingParams, TokenLogprob
from helios.engine.detokenizer import IncrementalDetokenizer


class StopStringMatcher:
    """Finds string stops across token boundaries in a stream of released text."""

    def __init__(self, stops: list[str], include_stop: bool = False):
        self.stops = [s for s in stops if s]
        self.include_stop = include_stop
        self._held = ""  # released by the detokenizer, not yet by us

    def feed(self, text: str) -> tuple[str, str | None]:
        """Add text; return (text to release, the matched stop string or None).

        After a match the caller must stop feeding: the text past the stop is dropped.
        """
        if not self.stops:
            return text, None
        buf = self._held + text
        # Any occurrence lies entirely inside `buf`: text released earlier had no suffix that
        # could start a stop (otherwise it would have been held), and a complete occurrence
        # would already have matched.
        best: tuple[int, str] | None = None
        for stop in self.stops:
            idx = buf.find(stop)
            if idx >= 0 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is not None:
            idx, stop = best
            self._held = ""
            return buf[: idx + len(stop)] if self.include_stop else buf[:idx], stop
        hold = self._partial_suffix_len(buf)
        self._held = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold], None

    def flush(self) -> str:
        """The sequence ended for another reason: held text can no longer become a stop."""
        held, self._held = self._held, ""
        return held

    def _partial_suffix_len(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of some stop."""
        best = 0
        for stop in self.stops:
            # Only suffixes shorter than the stop can be proper prefixes; scan their start
            # positions for the stop's first character (cheap str.find, no per-char Python).
            lo = max(0, len(buf) - len(stop) + 1)
            i = buf.find(stop[0], lo)
            while i >= 0:
                n = len(buf) - i
                if n <= best:
                    break
                if stop.startswith(buf[i:]):
                    best = n
                    break
                i = buf.find(stop[0], i + 1)
        return best


class TokenSequenceStops:
    """Multi-token stops over the generated ids. Tokens that could still be the start of a stop
    are held back; the caller releases them (text and logprob entries) when the match fails."""

    def __init__(self, sequences: list[list[int]]):
        self.sequences = [tuple(s) for s in sequences if s]
        self.longest = max((len(s) for s in self.sequences), default=0)
        self.held: list[int] = []

    def feed(self, token_id: int) -> tuple[list[int], list[int] | None]:
        """Add a generated token; return (tokens released, in order; the matched sequence or None).
        A match drops the held tokens of that sequence and releases only what preceded it."""
        window = self.held + [token_id]
        for stop in self.sequences:
            if tuple(window[-len(stop) :]) == stop:
                self.held = []
                return window[: len(window) - len(stop)], list(stop)
        keep = 0
        # Any later match starts inside the longest suffix that is a proper prefix of a stop.
        for n in range(min(len(window), self.longest - 1), 0, -1):
            tail = tuple(window[-n:])
            if any(len(stop) > n and stop[:n] == tail for stop in self.sequences):
                keep = n
                break
        self.held = window[len(window) - keep :]
        return window[: len(window) - keep], None

    def take(self) -> list[int]:
        """Generation ends for another reason: the held tokens are ordinary output."""
        held, self.held = self.held, []
        return held


@dataclass
class TokenOutcome:
    text: str  # newly released text
    has_logprob_entry: bool  # False for a terminating EOS / stop token id / stop sequence
    finish_reason: FinishReason | None = None
    stop_reason: str | int | list[int] | None = None
    # How many of the tokens still without released output (held ones first, then this one)
    # are released now; the rest stay held, or are dropped when the sequence finished.
    released: int = 1

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class StopChecker:
    """Per-sequence stop state: owns the detokenizer and the stop-string matcher."""

    def __init__(
        self,
        params: SamplingParams,
        eos_token_ids: list[int],
        max_new_tokens: int,
        detokenizer: IncrementalDetokenizer,
    ):
        self.max_new_tokens = max_new_tokens
        self.stop_token_ids = frozenset(params.stop_token_ids)
        self.eos_token_ids = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        self.detokenizer = detokenizer
        self.matcher = StopStringMatcher(params.stop, params.include_stop_str_in_output)
        # Held tokens bypass the string matcher: the frontend never combines the two kinds.
        if params.stop and params.stop_token_sequences:
            raise ValueError("string stops cannot be combined with token stops")
        self.sequences = TokenSequenceStops(params.stop_token_sequences)
        self._held_entries: list[TokenLogprob | None] = []

    def on_token(self, token_id: int, num_generated: int) -> TokenOutcome:
        """`token_id` was just committed as the `num_generated`-th generated token."""
        if token_id in self.stop_token_ids or token_id in self.eos_token_ids:
            held = self.sequences.take()  # no longer a stop: ordinary output before the end
            reason = token_id if token_id in self.stop_token_ids else None
            return TokenOutcome(self._push(held) + self.finish_text(), False, FinishReason.STOP, reason, len(held))
        released, sequence = self.sequences.feed(token_id)
        if sequence is not None:
            return TokenOutcome(
                self._push(released) + self.finish_text(), False, FinishReason.STOP, sequence, len(released)
            )
        text, matched = self.matcher.feed(self._push(released))
        if matched is not None:
            return TokenOutcome(text, True, FinishReason.STOP, matched, len(released))
        if num_generated >= self.max_new_tokens:
            held = self.sequences.take()
            text += self.matcher.feed(self._push(held))[0]
            tail, matched = self.matcher.feed(self.detokenizer.flush())
            count = len(released) + len(held)
            if matched is not None:
                return TokenOutcome(text + tail, True, FinishReason.STOP, matched, count)
            return TokenOutcome(text + tail + self.matcher.flush(), True, FinishReason.LENGTH, None, count)
        return TokenOutcome(text, True, released=len(released))

    def _push(self, token_ids: list[int]) -> str:
        return "".join(self.detokenizer.push(t) for t in token_ids)

    def entries(self, outcome: TokenOutcome, entry: TokenLogprob | None) -> list[TokenLogprob]:
        """The logprob entries released with this token's outcome (`entry` is the token's own,
        None when it has none): held tokens' entries wait with their text."""
        if not self.sequences.sequences and not self._held_entries:
            return [entry] if entry is not None and outcome.released else []
        pending = self._held_entries + [entry]
        self._held_entries = [] if outcome.finished else pending[outcome.released :]
        return [e for e in pending[: outcome.released] if e is not None]

    def finish_text(self) -> str:
        """Text released because the sequence ends now for a reason other than a stop string
        (EOS, stop token, no room left): nothing held back can become a stop any more."""
        tail, matched = self.matcher.feed(self.detokenizer.flush())
        return tail if matched is not None else tail + self.matcher.flush()

"""Incremental, UTF-8-safe detokenization of generated tokens.

Byte-level tokenizers split characters across tokens (an emoji can be four one-byte tokens), so
decoding a single new token in isolation is wrong, and re-decoding the whole output every step
is quadratic. We keep vLLM's two offsets into the token list:

    ids[prefix_offset:read_offset]  context whose text was already released (decoded again only
                                    so that merges and leading spaces at the seam come out right)
    ids[read_offset:]               tokens whose text is (partly) unreleased

Each push decodes `ids[prefix_offset:]` and releases what it adds beyond the context's text, up
to but excluding a trailing run of U+FFFD (an incomplete UTF-8 sequence that later bytes may
complete). Once nothing is held back the window slides forward, so the work per token stays
bounded by the window, not the output length.
"""

from __future__ import annotations

from typing import Protocol

REPLACEMENT = "\ufffd"
# Prompt tokens used as decoding context for the first generated tokens (as in vLLM): some
# decoders (metaspace / sentencepiece) drop a leading space at the start of a decode.
PROMPT_CONTEXT_TOKENS = 5
# A UTF-8 character is at most 4 bytes. If this many tokens still end in U+FFFD, those bytes are
# genuinely invalid rather than incomplete; release them instead of growing the window forever.
MAX_HELD_TOKENS = 8


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Decoder, prompt_ids: list[int], skip_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_len: int | None = None  # len(decode(ids[prefix:read])), cached per window
        self._released = 0  # chars of the unreleased region already released (partial release)
        self.text = ""  # everything released so far (for tests and debugging)

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def push(self, token_id: int) -> str:
        """Add one generated token; return the newly releasable text (possibly empty)."""
        self._ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """Release everything still held (generation ended), U+FFFD included."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._read_offset == len(self._ids):
            return ""
        if self._prefix_len is None:
            self._prefix_len = len(self._decode(self._ids[self._prefix_offset : self._read_offset]))
        full = self._decode(self._ids[self._prefix_offset :])
        pending = full[self._prefix_len :]
        complete = not pending.endswith(REPLACEMENT)
        held = len(self._ids) - self._read_offset
        if complete or final or held >= MAX_HELD_TOKENS:
            delta = pending[self._released :]
            # Slide the window: the released tokens become the next decode's context.
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            self._prefix_len = None
            self._released = 0
        else:
            # Release the characters before the incomplete tail now: a stop string ending there
            # must be seen at the token that completed it.
            safe = pending.rstrip(REPLACEMENT)
            delta = safe[self._released :] if len(safe) > self._released else ""
            self._released = max(self._released, len(safe))
        self.text += delta
        return delta

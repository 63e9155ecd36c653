"""The core's tokenizer: tokenizer.json (Hugging Face `tokenizers`) plus the manifest's policy.

Text is encoded with the normal special-token policy: added special tokens written in text are
recognized as single ids (as Hugging Face does), and BOS is prepended only when the manifest
says raw prompts get it. Chat prompts are rendered by the template, which writes its own
control tokens, so they are encoded without BOS.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from helios.manifest import Manifest, TokenizerSpec
from helios.neutral.errors import RequestError

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
# Texts longer than this are first counted in pieces of about this size (see _refuse_past_context).
PIECE_CHARS = 1 << 16
# Tokens a cut between two pieces may add or remove (a pre-token split in two).
CUT_MARGIN_TOKENS = 4


def _past_context(limit: int) -> RequestError:
    return RequestError(f"the prompt has more tokens than this model's {limit}-token context")


_WHITESPACE = re.compile(r"\s")


def _pieces(text: str) -> Iterator[str]:
    """`text` in pieces of about PIECE_CHARS, each ending after a whitespace character where
    one comes soon (a piece boundary then falls between pre-tokens)."""
    start = 0
    while start < len(text):
        end = start + PIECE_CHARS
        if end < len(text):
            match = _WHITESPACE.search(text, end, end + 1024)
            end = match.end() if match else end
        yield text[start:end]
        start = end


@lru_cache(maxsize=1)
def gpt2_byte_alphabet() -> dict[int, str]:
    """GPT-2's bytes_to_unicode: raw byte -> the printable character byte-level vocabularies
    spell it with (printable Latin-1 bytes stand for themselves, the rest map past U+0100)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


@lru_cache(maxsize=1)
def gpt2_unicode_to_byte() -> dict[str, int]:
    """The inverse of gpt2_byte_alphabet: printable stand-in character -> raw byte."""
    return {char: b for b, char in gpt2_byte_alphabet().items()}


class Tokenizer:
    """Encode/decode plus per-token strings and exact bytes (for logprob `bytes`)."""

    def __init__(self, tokenizer_json: str, spec: TokenizerSpec, vocab_size: int, max_tokens: int | None = None):
        self._tok = HFTokenizer.from_str(tokenizer_json)
        self.spec = spec
        # The core's context: a longer text is refused (RequestError) before it is tokenized whole.
        self.max_tokens = max_tokens
        # No token covers more characters than its longest vocabulary string (byte-level BPE
        # writes one character per byte; an added token is its content).
        self._max_token_chars = max((len(piece) for piece in self._tok.get_vocab(with_added_tokens=True)), default=1)
        # The prepared output vocabulary may be larger than the tokenizer (padded embeddings);
        # ids in that gap are valid model ids that decode to nothing.
        self.vocab_size = vocab_size
        doc = json.loads(tokenizer_json)
        self._added: dict[int, str] = {}
        self._special: set[int] = set()
        for entry in doc.get("added_tokens") or []:
            self._added[int(entry["id"])] = entry["content"]
            if entry.get("special"):
                self._special.add(int(entry["id"]))
        self._special.update(spec.special_tokens.values())
        self._byte_level = _uses_byte_level(doc)
        self._metaspace = _uses_metaspace(doc)
        self._bytes_cache: dict[int, bytes] = {}
        self._tokenizer_size = self._tok.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_core(cls, core_dir: Path, manifest: Manifest) -> Tokenizer:
        text = (Path(core_dir) / manifest.tokenizer.file).read_text(encoding="utf-8")
        return cls(text, manifest.tokenizer, manifest.architecture.vocab_size, manifest.limits.context_length)

    # -- encoding -------------------------------------------------------------------------

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`; add_bos None follows the manifest (raw-prompt policy)."""
        if self.max_tokens is not None and len(text) > PIECE_CHARS:
            self._refuse_past_context(text)
        # add_special_tokens=False: the post-processor's template is not our BOS policy; added
        # tokens written in the text are still matched either way.
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_bos is None:
            add_bos = self.spec.add_bos
        if add_bos and self.spec.bos_token_id is not None:
            ids = [self.spec.bos_token_id, *ids]
        return ids

    def _refuse_past_context(self, text: str) -> None:
        """Refuse a long text that certainly has more tokens than the context, without tokenizing
        it whole: past max_tokens x the longest token it cannot fit; otherwise count it in pieces
        cut at whitespace (tokenizers holds the GIL for a whole call, so one huge call would stall
        the server) and stop once the count, less a margin for each cut, passes the context."""
        limit = self.max_tokens
        assert limit is not None
        if len(text) > limit * self._max_token_chars:
            raise _past_context(limit)
        count = 0
        for cuts, piece in enumerate(_pieces(text)):
            count += len(self._tok.encode(piece, add_special_tokens=False).ids)
            if count - CUT_MARGIN_TOKENS * cuts > limit:
                raise _past_context(limit)

    def encode_raw_prompt(self, text: str) -> list[int]:
        """A raw completion prompt. Empty text needs a BOS token to start from."""
        ids = self.encode(text)
        if not ids and self.spec.bos_token_id is not None:
            ids = [self.spec.bos_token_id]
        return ids

    # -- decoding -------------------------------------------------------------------------

    def decode(self, ids: list[int], *, skip_special_tokens: bool = False) -> str:
        known = [i for i in ids if 0 <= i < self._tokenizer_size]
        return self._tok.decode(known, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes a token contributes to text (may be partial UTF-8)."""
        cached = self._bytes_cache.get(token_id)
        if cached is None:
            cached = self._compute_bytes(token_id)
            self._bytes_cache[token_id] = cached
        return cached

    def token_string(self, token_id: int) -> str:
        """A JSON-safe display string: the token's bytes with invalid UTF-8 replaced."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special

    def to_json(self) -> str:
        """The tokenizer.json text (what llguidance builds its own tokenizer from)."""
        return self._tok.to_str()

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    @property
    def bos_token(self) -> str | None:
        return self._content(self.spec.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        ids = self.spec.eos_token_ids
        return self._content(ids[0]) if ids else None

    def _content(self, token_id: int | None) -> str | None:
        if token_id is None:
            return None
        if token_id in self._added:
            return self._added[token_id]
        return self._tok.id_to_token(token_id)

    def _compute_bytes(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode("utf-8")
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_level:
            table = gpt2_unicode_to_byte()
            if all(ch in table for ch in piece):
                return bytes(table[ch] for ch in piece)
        match = _BYTE_FALLBACK.match(piece)
        if match:
            return bytes([int(match.group(1), 16)])
        if self._metaspace:
            return piece.replace("\u2581", " ").encode("utf-8")
        return self._tok.decode([token_id], skip_special_tokens=False).encode("utf-8")


def _uses_byte_level(doc: dict) -> bool:
    return _has_type(doc.get("decoder"), "ByteLevel") or _has_type(doc.get("pre_tokenizer"), "ByteLevel")


def _uses_metaspace(doc: dict) -> bool:
    return (
        _has_type(doc.get("decoder"), "Metaspace")
        or _has_type(doc.get("pre_tokenizer"), "Metaspace")
        or _has_type(doc.get("decoder"), "Replace")
    )


def _has_type(node: object, name: str) -> bool:
    if isinstance(node, dict):
        if node.get("type") == name:
            return True
        return any(_has_type(v, name) for v in node.values())
    if isinstance(node, list):
        return any(_has_type(v, name) for v in node)
    return False

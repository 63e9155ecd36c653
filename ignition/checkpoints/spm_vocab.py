"""GGUF SentencePiece vocabularies (`tokenizer.ggml.model == "llama"`: Llama 2, Gemma, Mistral v1)
-> a Hugging Face `tokenizers` document that encodes exactly as llama.cpp's SPM tokenizer does.

llama.cpp tokenizes such a file without merges: it cuts out every control and user-defined token
written in the text, turns spaces into "▁", then repeatedly joins the adjacent pair whose join is
in the vocabulary with the best score (leftmost on a tie) and spells any piece left outside the
vocabulary as <0xNN> byte tokens. A `tokenizers` BPE reproduces that when its merges are every
split of every piece, ranked by the joined piece's score: the same pair wins at every step.
"""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

SPACE_MARK = "\u2581"
# llama.cpp token types (tokenizer.ggml.token_type).
NORMAL = 1
UNKNOWN = 2
CONTROL = 3
USER_DEFINED = 4
BYTE = 6


def _piece_ranks(tokens: list[str], token_types: list[int], scores: list[float]) -> dict[str, tuple[float, int]]:
    """Pieces a merge may produce -> (sort key, id): the best score first, the file's order on a tie."""
    ranks: dict[str, tuple[float, int]] = {}
    for index, (token, kind) in enumerate(zip(tokens, token_types, strict=True)):
        if kind in (NORMAL, USER_DEFINED) and len(token) > 1:
            ranks.setdefault(token, (-scores[index], index))
    return ranks


def derive_merges(tokens: list[str], token_types: list[int], scores: list[float]) -> list[tuple[str, str]]:
    """Every (left, right) split of a piece whose halves are both in the vocabulary, best piece first."""
    vocab = set(tokens)
    ranked: list[tuple[tuple[float, int], int, str, str]] = []
    for piece, rank in _piece_ranks(tokens, token_types, scores).items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((rank, cut, left, right))
    ranked.sort()
    return [(left, right) for _, _, left, right in ranked]


def build_sentencepiece_bpe(
    tokens: list[str], token_types: list[int], scores: list[float], add_space_prefix: bool
) -> Tokenizer:
    """The `tokenizers` equivalent of llama.cpp's SPM tokenizer over this vocabulary."""
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)  # the first id, should a converter ever repeat a spelling
    unknown = next((t for t, kind in zip(tokens, token_types, strict=True) if kind == UNKNOWN), None)
    tokenizer = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=derive_merges(tokens, token_types, scores),
            unk_token=unknown,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    steps = [normalizers.Prepend(SPACE_MARK)] if add_space_prefix else []
    tokenizer.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", SPACE_MARK)])
    decode_steps = [decoders.Replace(SPACE_MARK, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        decode_steps.append(decoders.Strip(" ", 1, 0))
    tokenizer.decoder = decoders.Sequence(decode_steps)

    # Control and user-defined tokens written in the text are cut out whole before anything else,
    # as llama.cpp does; user-defined ones stay ordinary text when decoded.
    def added(kind: int, special: bool) -> list[AddedToken]:
        return [
            AddedToken(token, normalized=False, special=special)
            for token, token_type in zip(tokens, token_types, strict=True)
            if token_type == kind and token
        ]

    tokenizer.add_special_tokens(added(CONTROL, special=True))
    tokenizer.add_tokens(added(USER_DEFINED, special=False))
    return tokenizer

"""GGUF tokenizer metadata (`tokenizer.ggml.*`) -> a Hugging Face `tokenizers` JSON document.

Byte-level BPE vocabularies (`tokenizer.ggml.model == "gpt2"`: Qwen, Llama 3, SmolLM) get the
pre-tokenizer `tokenizer.ggml.pre` names, reproducing llama.cpp's split for it (which is also the
original Hugging Face tokenizer's). SentencePiece vocabularies (`"llama"`: Gemma, Llama 2, Mistral
v1) are built by ignition.checkpoints.spm_vocab.

The document never adds BOS/EOS by itself (no template post-processor): encode with
`add_special_tokens=False` and prepend `bos_token_id` when `add_bos` is true.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import gguf
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from helios.neutral.tokenizer import gpt2_byte_alphabet
from ignition.checkpoints.base import CheckpointError
from ignition.checkpoints.spm_vocab import build_sentencepiece_bpe

# llama.cpp token types (tokenizer.ggml.token_type).
CONTROL = 3
USER_DEFINED = 4

# Qwen2's split, as in its tokenizer.json (digits one at a time, letters with one leading non-letter).
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Llama 3's split (digits in runs of up to three).
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

LLAMA3_PRES = ("llama3", "llama-v3", "llama-bpe", "smaug-bpe")


def _split_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The split llama.cpp applies for `tokenizer.ggml.pre`."""
    if pre in ("qwen2", "deepseek-r1-qwen"):
        return _split_then_bytes(QWEN2_SPLIT)
    if pre in LLAMA3_PRES:
        return _split_then_bytes(LLAMA3_SPLIT)
    if pre in ("smollm", "starcoder"):
        # Every digit alone (llama.cpp's "\p{N}" pass), then GPT-2's regex: SmolLM2's tokenizer.json.
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
            ]
        )
    if pre in ("gpt2", "default"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    raise CheckpointError(f"unsupported GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre)")


def _normalizer(pre: str) -> normalizers.Normalizer | None:
    # Qwen2's tokenizer.json normalizes to NFC before splitting; llama.cpp skips that step.
    return normalizers.NFC() if pre in ("qwen2", "deepseek-r1-qwen") else None


def _byte_spelling(token: str, alphabet: set[str]) -> str:
    """Tokens are stored byte-spelled; respell any that is not (a converter quirk) the same way."""
    if set(token) <= alphabet:
        return token
    spelling = gpt2_byte_alphabet()
    return "".join(spelling[b] for b in token.encode("utf-8"))


@dataclass
class GGUFTokenizer:
    tokenizer_json: str
    chat_template: str | None
    bos_token_id: int | None
    eos_token_ids: list[int]
    pad_token_id: int | None
    add_bos: bool
    special_tokens: dict[str, int] = field(default_factory=dict)  # control tokens: content -> id
    token_count: int = 0  # tokens in the vocabulary (the embedding may have more rows)


def build_byte_level_bpe(tokens: list[str], token_types: list[int], merges: list[str], pre: str) -> Tokenizer:
    alphabet = set(gpt2_byte_alphabet().values())
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        # setdefault: keep the first id if a converter ever wrote a duplicate spelling.
        vocab.setdefault(_byte_spelling(token, alphabet), index)
    pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = _normalizer(pre)
    tokenizer.pre_tokenizer = _pre_tokenizer(pre)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)

    # Control and user-defined tokens are matched whole in raw text, as llama.cpp does. One not
    # spelled in the byte alphabet cannot be added without a new id, so it stays a plain token.
    def added(kind: int, special: bool) -> list[AddedToken]:
        return [
            AddedToken(token, normalized=False, special=special)
            for token, token_type in zip(tokens, token_types, strict=True)
            if token_type == kind and set(token) <= alphabet
        ]

    tokenizer.add_special_tokens(added(CONTROL, special=True))
    tokenizer.add_tokens(added(USER_DEFINED, special=False))
    return tokenizer


def metadata_value(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    """One GGUF metadata value as plain Python (str, int, float, bool, list), or `default`."""
    entry = reader.fields.get(key)
    return default if entry is None else entry.contents()


def tokenizer_from_gguf(reader: gguf.GGUFReader) -> GGUFTokenizer:
    """The tokenizer, chat template and special ids a GGUF file describes."""
    model = metadata_value(reader, "tokenizer.ggml.model")
    if model not in ("gpt2", "llama"):
        raise CheckpointError(
            f"unsupported GGUF tokenizer model {model!r} (tokenizer.ggml.model); flare reads byte-level BPE "
            "('gpt2') and SentencePiece ('llama')"
        )
    tokens: list[str] = metadata_value(reader, "tokenizer.ggml.tokens")
    token_types: list[int] = metadata_value(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(token_types) != len(tokens):
        raise CheckpointError(f"GGUF has {len(tokens)} tokens but {len(token_types)} token types")
    pre = metadata_value(reader, "tokenizer.ggml.pre", "default")
    if model == "llama":
        scores: list[float] = metadata_value(reader, "tokenizer.ggml.scores") or []
        if len(scores) != len(tokens):
            raise CheckpointError(f"GGUF has {len(tokens)} tokens but {len(scores)} scores")
        # llama.cpp's default for SentencePiece: a space before the text, unless the file says not.
        prefix = bool(metadata_value(reader, "tokenizer.ggml.add_space_prefix", True))
        tokenizer = build_sentencepiece_bpe(tokens, token_types, scores, prefix)
    else:
        merges: list[str] = metadata_value(reader, "tokenizer.ggml.merges") or []
        tokenizer = build_byte_level_bpe(tokens, token_types, merges, pre)

    eos_ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        token_id = metadata_value(reader, key)
        if token_id is not None and int(token_id) not in eos_ids:
            eos_ids.append(int(token_id))
    bos = metadata_value(reader, "tokenizer.ggml.bos_token_id")
    pad = metadata_value(reader, "tokenizer.ggml.padding_token_id")
    return GGUFTokenizer(
        tokenizer_json=tokenizer.to_str(),
        chat_template=metadata_value(reader, "tokenizer.chat_template"),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=eos_ids,
        pad_token_id=None if pad is None else int(pad),
        # Without the flag, llama.cpp adds BOS to SentencePiece and Llama 3 style vocabularies.
        add_bos=bool(metadata_value(reader, "tokenizer.ggml.add_bos_token", model == "llama" or pre in LLAMA3_PRES)),
        special_tokens={
            token: i for i, (token, kind) in enumerate(zip(tokens, token_types, strict=True)) if kind == CONTROL
        },
        token_count=len(tokens),
    )

"""Tiny random text checkpoints with a byte-level tokenizer: written by a family's transformers
model classes, for tests, benchmarks and CI that need a checkpoint of a given shape but no real
weights (`ignition.tiny` writes the multimodal ones with the real Qwen tokenizer).

The tokenizer is a byte-level BPE without merges (256 byte tokens, id = byte value) plus the
family's control tokens (ids 256...), so any text round-trips and the family's delimiters are
single tokens. The weights keep transformers' own initialisation: the tiny network stays
contractive and, with tied embeddings, each next-token distribution is peaked as a trained
model's is, which a quantized export's validation needs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from tokenizers.pre_tokenizers import ByteLevel

from helios.neutral.tokenizer import gpt2_unicode_to_byte

# Qwen 3.5's control and markup tokens, in id order after the bytes.
QWEN_SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
]

# Markup the parsers must see in generated text: added tokens that are not special (as Qwen3's
# <think> and <tool_call> are), so the detokenizer keeps them; the rest are control tokens.
MARKUP = {
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
    "<minimax:tool_call>",
    "</minimax:tool_call>",
    "<|channel>",
    "<channel|>",
    "<|tool_call>",
    "<tool_call|>",
    "<|tool>",
    "<tool|>",
    "<|tool_response>",
    "<tool_response|>",
    '<|"|>',
    "<|think|>",
    "<｜DSML｜function_calls>",
    "</｜DSML｜function_calls>",
}


def byte_tokenizer(specials: list[str]) -> str:
    """tokenizer.json of a byte-level BPE with no merges plus `specials` (ids 256...) as added
    tokens: special control tokens, or plain added tokens for MARKUP."""
    alphabet = ByteLevel.alphabet()
    chars = sorted(alphabet, key=gpt2_unicode_to_byte().__getitem__)  # id = byte value, for readability
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(chars)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    for token in specials:  # one at a time: ids follow the list order
        added = AddedToken(token, special=token not in MARKUP, normalized=False)
        if token in MARKUP:
            tokenizer.add_tokens([added])
        else:
            tokenizer.add_special_tokens([added])
    return tokenizer.to_str()


def write_byte_tokenizer(folder: Path, specials: list[str], eos: str) -> None:
    """tokenizer.json and tokenizer_config.json of the byte tokenizer (BOS: the first special)."""
    (folder / "tokenizer.json").write_text(byte_tokenizer(specials))
    tokenizer_config = {"bos_token": specials[0], "eos_token": eos, "add_bos_token": False, "model_max_length": 4096}
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")


def write_text_checkpoint(
    folder: Path,
    config_cls: type,
    model_cls: type,
    specials: list[str],
    eos: str,
    text_config: dict[str, Any],
    seed: int = 0,
    embedding_std: float | None = None,
) -> Path:
    """A tied-embedding text checkpoint of `model_cls` with `text_config` and the byte tokenizer,
    saved as the hub's are (sharded when small); `embedding_std` widens the token table, which
    keeps a wider model's logits peaked."""
    folder = Path(folder)
    eos_id = 256 + specials.index(eos)
    config = config_cls(
        vocab_size=256 + len(specials),
        bos_token_id=256,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        **{**text_config, "tie_word_embeddings": True},
    )
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    if embedding_std is not None:
        with torch.no_grad():
            model.get_input_embeddings().weight.normal_(0.0, embedding_std)
    small = sum(p.numel() for p in model.parameters()) < 10_000_000
    model.save_pretrained(folder, max_shard_size="300KB" if small else "2GB")
    write_byte_tokenizer(folder, specials, eos)
    return folder

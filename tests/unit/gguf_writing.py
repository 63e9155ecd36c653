"""Writing tiny GGUF files as llama.cpp's converter lays them out, with the gguf library itself:
the byte-level BPE vocabulary of a Hugging Face tokenizer.json, and tensors named through
`gguf.TensorNameMap` (the converter's own table)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np


def add_bpe_vocabulary(writer: gguf.GGUFWriter, folder: Path, pre: str, bos: int, eos: int) -> None:
    """tokenizer.ggml.* of a folder's tokenizer.json (tokens by id, control types for specials)."""
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    vocab = dict(tokenizer["model"]["vocab"])
    added = {t["id"]: t for t in tokenizer["added_tokens"]}
    for token_id, entry in added.items():
        vocab[entry["content"]] = token_id
    size = max(vocab.values()) + 1
    tokens = [f"[PAD{i}]" for i in range(size)]
    for text, token_id in vocab.items():
        tokens[token_id] = text
    types = [3 if i in added and added[i]["special"] else 1 for i in range(size)]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]])
    writer.add_bos_token_id(bos)
    writer.add_eos_token_id(eos)


def add_dense_hyperparameters(writer: gguf.GGUFWriter, config: Any) -> None:
    """The `{arch}.*` shape keys of a transformers config (head_dim for keys and values alike;
    a config without one, as llama.cpp's Phi-3 converter writes it: none)."""
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None)
    if head_dim:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)


def add_named_tensors(
    writer: gguf.GGUFWriter, arch: gguf.MODEL_ARCH, layers: int, tensors: dict[str, np.ndarray]
) -> None:
    """Each Hugging Face tensor under the GGUF name TensorNameMap gives it."""
    name_map = gguf.TensorNameMap(arch, layers)
    for name, value in tensors.items():
        gguf_name = name_map.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        writer.add_tensor(gguf_name, np.ascontiguousarray(value))


def finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

"""GGUF files of the configured dense families (qwen3 today): the Hugging Face config their plan
needs, rebuilt from the GGUF metadata, and the tensors named through the gguf library's own
`TensorNameMap` (the table llama.cpp's converter writes them with), never a hand-kept one.

A GGUF tensor name maps to several Hugging Face spellings (one per upstream code base); the one
kept is the name the family's model actually loads, read off the model built on the meta device.
"""

from __future__ import annotations

from typing import Any

import gguf
import numpy as np
import torch
from gguf.quants import dequantize

from ignition.checkpoints.base import CheckpointError
from ignition.checkpoints.tokenizer import metadata_value
from ignition.models import FAMILIES

# GGUF architecture -> (Hugging Face model_type, flare family).
GGUF_FAMILIES = {"qwen3": ("qwen3", "qwen3")}
# GGUF metadata (after "{arch}.") -> Hugging Face config key.
CONFIG_KEYS = {
    "block_count": "num_hidden_layers",
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "rope.freq_base": "rope_theta",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
}


def config_from_gguf(reader: gguf.GGUFReader, arch: str, vocab_size: int, tied: bool) -> dict[str, Any]:
    """The config.json a family planner reads, from the file's `{arch}.*` metadata."""
    if metadata_value(reader, f"{arch}.rope.scaling.type", "none") not in ("none", None):
        raise CheckpointError(f"GGUF {arch} files with rope scaling are not supported yet")
    config: dict[str, Any] = {
        "model_type": GGUF_FAMILIES[arch][0],
        "vocab_size": vocab_size,
        "tie_word_embeddings": tied,
    }
    for key, name in CONFIG_KEYS.items():
        value = metadata_value(reader, f"{arch}.{key}")
        if value is not None:
            config[name] = float(np.float32(value)) if isinstance(value, float) else value
    missing = [name for name in ("num_hidden_layers", "hidden_size", "num_attention_heads") if name not in config]
    if missing:
        raise CheckpointError(f"GGUF {arch} metadata lacks {', '.join(missing)}")
    return config


def loaded_names(family: str, config: dict[str, Any]) -> set[str]:
    """The Hugging Face tensor names (without .weight/.bias) the family's model loads for `config`."""
    model_class = FAMILIES[family]
    arch = model_class.architecture(config)
    with torch.device("meta"):
        model = model_class(arch, model_class.planner(config))
    names = set()
    for name, _ in model.named_parameters():
        stem = name.rsplit(".", 1)[0]
        names.add(stem if stem.startswith("lm_head") else f"model.{stem}")
    return names


def hf_names(arch: str, layers: int, wanted: set[str]) -> dict[str, str]:
    """GGUF tensor stem -> the Hugging Face stem among `wanted`, through gguf.TensorNameMap."""
    name_map = gguf.TensorNameMap(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), layers)
    out: dict[str, str] = {}
    for hf, (_, gguf_name) in name_map.mapping.items():
        if hf in wanted:
            out[gguf_name] = hf
    return out


def configured_tensors(reader: gguf.GGUFReader, arch: str, family: str, config: dict[str, Any], source: str):
    """Every tensor of the file, dequantized to float32, under the name the model loads."""
    names = hf_names(arch, int(config["num_hidden_layers"]), loaded_names(family, config))
    tensors: dict[str, np.ndarray] = {}
    for tensor in reader.tensors:
        stem, _, suffix = tensor.name.rpartition(".")
        if stem not in names:
            raise CheckpointError(f"{source} has a tensor flare does not know: {tensor.name}")
        array = dequantize(tensor.data, tensor.tensor_type)
        if np.may_share_memory(array, tensor.data):
            array = array.copy()
        tensors[f"{names[stem]}.{suffix}"] = array.astype(np.float32, copy=False).reshape(
            [int(n) for n in reversed(tensor.shape)]
        )
    return tensors

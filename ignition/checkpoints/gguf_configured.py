"""GGUF files of the configured dense families (qwen3, gemma2, gemma3, phi3, smollm3): the
Hugging Face config their plan needs, rebuilt from the GGUF metadata, and the tensors named
through the gguf library's own `TensorNameMap` (the table llama.cpp's converter writes them
with), never a hand-kept one.

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
GGUF_FAMILIES = {
    "qwen3": ("qwen3", "qwen3"),
    "gemma2": ("gemma2", "gemma2"),
    "gemma3": ("gemma3_text", "gemma3"),
    "phi3": ("phi3", "phi3"),
    "smollm3": ("smollm3", "smollm3"),
}
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
    "attention.sliding_window": "sliding_window",
}
# llama.cpp's converter stores Gemma's (1 + w) norm weights with the one added in.
NORM_PLUS_ONE = {"gemma2", "gemma3"}
# Families whose q/k rows llama.cpp's converter permutes (its llama-style rotary layout).
PERMUTED = {"smollm3"}
# Projections a family's files fuse (GGUF as its Hugging Face checkpoints) and its model splits on
# load: the name the model loads -> the fused tensor's.
FUSED = {
    "phi3": {
        "self_attn.q_proj": "self_attn.qkv_proj",
        "self_attn.k_proj": "self_attn.qkv_proj",
        "self_attn.v_proj": "self_attn.qkv_proj",
        "mlp.gate_proj": "mlp.gate_up_proj",
        "mlp.up_proj": "mlp.gate_up_proj",
    }
}


def _gemma_scale(config: dict[str, Any], layers_of_27b: int) -> None:
    """llama.cpp's Gemma softmax scale: 1/sqrt(head_dim), but hidden/heads for the 27B models."""
    head_dim = int(config.get("head_dim") or 256)
    is_27b = config["num_hidden_layers"] == layers_of_27b
    config["query_pre_attn_scalar"] = config["hidden_size"] // config["num_attention_heads"] if is_27b else head_dim


def _gemma2_config(reader: gguf.GGUFReader, config: dict[str, Any]) -> None:
    """What llama.cpp's Gemma 2 graph fixes rather than reads: alternating sliding and global
    layers (the first sliding) and the softmax scale; the soft-caps are the file's."""
    config.update(sliding_window_pattern=2, hidden_activation="gelu_pytorch_tanh")
    _gemma_scale(config, layers_of_27b=46)
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        value = metadata_value(reader, f"gemma2.{key}")
        config[key] = float(np.float32(value)) if value is not None else None


def _gemma3_config(reader: gguf.GGUFReader, config: dict[str, Any]) -> None:
    """What llama.cpp's Gemma 3 graph fixes rather than reads: a 10k local rotary base, every
    sixth layer global, the head_dim softmax scale (27B's hidden/heads is the exception), and
    the global layers' linear rotary scaling where the file has one (4B and larger)."""
    config.update(rope_local_base_freq=10000.0, sliding_window_pattern=6, hidden_activation="gelu_pytorch_tanh")
    _gemma_scale(config, layers_of_27b=62)
    kind = metadata_value(reader, "gemma3.rope.scaling.type", "none")
    if kind == "linear":
        config["rope_scaling"] = {
            "rope_type": "linear",
            "factor": float(metadata_value(reader, "gemma3.rope.scaling.factor")),
        }
    elif kind not in ("none", None):
        raise CheckpointError(f"GGUF gemma3 files with {kind!r} rope scaling are not supported")


def _phi3_config(reader: gguf.GGUFReader, config: dict[str, Any]) -> None:
    """Partial rotary from the rotary width, no window where the file writes 0; longrope files
    (their rope_factors_long/short tensors) are refused when those tensors are met."""
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    rotary = metadata_value(reader, "phi3.rope.dimension_count")
    if rotary is not None and int(rotary) != head_dim:
        config["partial_rotary_factor"] = int(rotary) / head_dim
    if not config.get("sliding_window"):
        config.pop("sliding_window", None)
    config["hidden_act"] = "silu"


def _smollm3_config(reader: gguf.GGUFReader, config: dict[str, Any]) -> None:
    """llama.cpp's SmolLM3 graph fixes its NoPE step (every fourth layer unrotated); no key says it."""
    config.update(no_rope_layer_interval=4, hidden_act="silu")


FAMILY_CONFIG = {
    "gemma2": _gemma2_config,
    "gemma3": _gemma3_config,
    "phi3": _phi3_config,
    "smollm3": _smollm3_config,
}
# The architectures whose FAMILY_CONFIG reads the file's rope scaling; any other refuses it.
READS_SCALING = {"gemma3"}


def unpermute_rotary(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation for llama-style models (its converter's `permute`).

    llama.cpp interleaves each head's two rotary halves; Hugging Face keeps them as halves.
    Same as transformers' `_reverse_permute_weights`; works for weights and biases.
    """
    half = weight.shape[0] // n_heads // 2
    return weight.reshape(n_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def config_from_gguf(reader: gguf.GGUFReader, arch: str, vocab_size: int, tied: bool) -> dict[str, Any]:
    """The config.json a family planner reads, from the file's `{arch}.*` metadata."""
    scaled = metadata_value(reader, f"{arch}.rope.scaling.type", "none") not in ("none", None)
    if scaled and arch not in READS_SCALING:
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
    if arch in FAMILY_CONFIG:
        FAMILY_CONFIG[arch](reader, config)
    return config


def loaded_names(family: str, config: dict[str, Any]) -> set[str]:
    """The Hugging Face tensor names (without .weight/.bias) the family's model loads for `config`
    (a fused projection's name where the family's files fuse it)."""
    model_class = FAMILIES[family]
    arch = model_class.architecture(config)
    with torch.device("meta"):
        model = model_class(arch, model_class.planner(config))
    fused = FUSED.get(family, {})
    names = set()
    for name, _ in model.named_parameters():
        stem = name.rsplit(".", 1)[0]
        part = next((p for p in fused if stem.endswith("." + p)), None)
        if part is not None:
            stem = stem[: -len(part)] + fused[part]
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
        if stem.startswith("rope_factors_"):
            raise CheckpointError(f"{source}: longrope scaling ({tensor.name}) is not supported yet")
        if stem not in names:
            raise CheckpointError(f"{source} has a tensor flare does not know: {tensor.name}")
        array = dequantize(tensor.data, tensor.tensor_type)
        if np.may_share_memory(array, tensor.data):
            array = array.copy()
        array = array.astype(np.float32, copy=False).reshape([int(n) for n in reversed(tensor.shape)])
        if arch in NORM_PLUS_ONE and stem.endswith("norm"):
            array = array - np.float32(1.0)
        if arch in PERMUTED and stem.endswith(("attn_q", "attn_k")):
            heads = config["num_attention_heads"] if stem.endswith("attn_q") else config["num_key_value_heads"]
            array = unpermute_rotary(array, int(heads))
        tensors[f"{names[stem]}.{suffix}"] = array
    return tensors

"""Tiny random Hugging Face checkpoints of the real architectures, with the real Qwen tokenizer.

Two layers, hidden 64: fast to export and run, yet real prompts tokenize and the chat template
renders exactly as for Qwen2.5-Coder. The tokenizer is taken once from the 0.5B GGUF and cached
under $FLARE_CACHE/tokenizers, keyed by the GGUF's sha256 and the code that built it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer

from helios.cache_dir import cache_root

TOKENIZER_SOURCE = "qwen2.5-coder-0.5b"

# Geometry shared by both families: head_dim 16 with 4 query heads over 2 KV heads.
TINY = dict(
    num_hidden_layers=2,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)


def qwen_tokenizer_bundle() -> dict:
    """Tokenizer JSON, chat template and special ids of the real Qwen2.5-Coder GGUF (cached)."""
    import ignition.checkpoints.tokenizer as tokenizer_module
    from ignition.checkpoints.packaged import PACKAGED_MODELS

    model = PACKAGED_MODELS[TOKENIZER_SOURCE]
    code = hashlib.sha256(Path(tokenizer_module.__file__).read_bytes()).hexdigest()[:12]
    cached = cache_root() / "tokenizers" / f"{TOKENIZER_SOURCE}-{model.sha256[:12]}-{code}.json"
    if cached.is_file():
        return json.loads(cached.read_text())

    from ignition.checkpoints.gguf import open_gguf
    from ignition.checkpoints.packaged import resolve_packaged

    reader = open_gguf(resolve_packaged(TOKENIZER_SOURCE))
    bundle = dataclasses.asdict(tokenizer_module.tokenizer_from_gguf(reader))
    cached.parent.mkdir(parents=True, exist_ok=True)
    temp = cached.with_name(cached.name + f".{os.getpid()}.tmp")
    temp.write_text(json.dumps(bundle))
    os.replace(temp, cached)  # atomic: parallel test workers never read half a file
    return bundle


def _random_tensors(config: dict, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * 0.02

    def norm_weight(size: int) -> torch.Tensor:
        return 1.0 + normal(size)  # near one, but not exactly, so a dropped norm shows in parity

    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    q_out = config["num_attention_heads"] * config["head_dim"]
    kv_out = config["num_key_value_heads"] * config["head_dim"]
    tensors = {"model.embed_tokens.weight": normal(vocab, hidden), "model.norm.weight": norm_weight(hidden)}
    if not config["tie_word_embeddings"]:
        tensors["lm_head.weight"] = normal(vocab, hidden)
    for i in range(config["num_hidden_layers"]):
        layer = f"model.layers.{i}."
        tensors |= {
            layer + "input_layernorm.weight": norm_weight(hidden),
            layer + "post_attention_layernorm.weight": norm_weight(hidden),
            layer + "self_attn.q_proj.weight": normal(q_out, hidden),
            layer + "self_attn.k_proj.weight": normal(kv_out, hidden),
            layer + "self_attn.v_proj.weight": normal(kv_out, hidden),
            layer + "self_attn.o_proj.weight": normal(hidden, q_out),
            layer + "mlp.gate_proj.weight": normal(inter, hidden),
            layer + "mlp.up_proj.weight": normal(inter, hidden),
            layer + "mlp.down_proj.weight": normal(hidden, inter),
        }
        if config["model_type"] == "qwen2":
            tensors |= {
                layer + "self_attn.q_proj.bias": normal(q_out),
                layer + "self_attn.k_proj.bias": normal(kv_out),
                layer + "self_attn.v_proj.bias": normal(kv_out),
            }
    return tensors


def write_tiny_checkpoint(
    folder: Path,
    family: Literal["qwen2", "llama"],
    seed: int = 0,
    tie_word_embeddings: bool | None = None,
) -> Path:
    """Write a tiny random HF folder into `folder` and return it.

    Ties follow the real checkpoints by default: the Qwen GGUF has its own output.weight (untied),
    SmolLM2 ties its embeddings.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    bundle = qwen_tokenizer_bundle()
    added = json.loads(bundle["tokenizer_json"])["added_tokens"]
    id_to_content = {t["id"]: t["content"] for t in added}
    # 151936: every embedding row of the real model, so any real token id is valid here.
    vocab_size = Tokenizer.from_str(bundle["tokenizer_json"]).get_vocab_size(with_added_tokens=True)

    tied = family == "llama" if tie_word_embeddings is None else tie_word_embeddings
    config = {
        "architectures": ["Qwen2ForCausalLM" if family == "qwen2" else "LlamaForCausalLM"],
        "model_type": family,
        **TINY,
        "vocab_size": vocab_size,
        "hidden_act": "silu",
        "rope_theta": 1000000.0 if family == "qwen2" else 100000.0,
        "rms_norm_eps": 1e-6 if family == "qwen2" else 1e-5,
        "max_position_embeddings": 32768 if family == "qwen2" else 8192,
        "tie_word_embeddings": tied,
        "attention_bias": family == "qwen2",
        "bos_token_id": bundle["bos_token_id"],
        "eos_token_id": bundle["eos_token_ids"][0],
        "torch_dtype": "float32",
    }
    save_file(_random_tensors(config, seed), folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (folder / "tokenizer.json").write_text(bundle["tokenizer_json"])
    tokenizer_config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "bos_token": id_to_content.get(bundle["bos_token_id"]),
        "eos_token": id_to_content.get(bundle["eos_token_ids"][0]),
        "pad_token": id_to_content.get(bundle["pad_token_id"]),
        "add_bos_token": bundle["add_bos"],
        "chat_template": bundle["chat_template"],
        "model_max_length": config["max_position_embeddings"],
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    # As Qwen's own generation_config.json: generation also ends at <|endoftext|>.
    end_of_text = bundle["special_tokens"]["<|endoftext|>"]
    generation = {
        "bos_token_id": bundle["bos_token_id"],
        "pad_token_id": bundle["pad_token_id"],
        "eos_token_id": [*bundle["eos_token_ids"], end_of_text],
    }
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return folder

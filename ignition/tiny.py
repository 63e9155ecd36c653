"""`ignition tiny-checkpoint`: a tiny random checkpoint of a recipe's architecture, written by the
family's transformers reference model itself (vision tower included), with the real Qwen
tokenizer (taken from the packaged default model's GGUF) and the recipe's fallback chat template.

It is for tests, demos and CI on a machine that holds no real multimodal checkpoint: `ignition
export --recipe NAME --checkpoint DIR` compiles it like any Hugging Face checkpoint, and `helios
serve` of the result answers image requests. The weights are seeded (the same command writes
the same files); they are drawn so the network stays contractive and its next-token
distributions peaked (as a trained model's are), which the int4 export's validation needs.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import torch

from ignition.checkpoints.gguf import open_gguf
from ignition.checkpoints.packaged import resolve_packaged
from ignition.checkpoints.tokenizer import tokenizer_from_gguf
from ignition.recipes import Recipe

TOKENIZER_SOURCE = "qwen2.5-coder-0.5b"  # its Qwen2 vocabulary holds the vision tokens

_HYBRID = dict(
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    layer_types=["linear_attention", "full_attention", "linear_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    max_position_embeddings=8192,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
        "mrope_section": [2, 1, 1],
        "mrope_interleaved": True,
    },
)
_VISION = dict(
    depth=2,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    num_position_embeddings=64,
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
    out_hidden_size=64,
)
# The image processor profile: Qwen 3.5's, with the area bounded so a tiny core's images stay
# small (at most 196 image tokens).
_PROFILE = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "size": {"shortest_edge": 4096, "longest_edge": 200_704},
}

# family -> (transformers module, config class, model class, text config)
TINY_FAMILIES: dict[str, tuple[str, str, str, dict[str, Any]]] = {
    "qwen3_5": (
        "transformers.models.qwen3_5",
        "Qwen3_5Config",
        "Qwen3_5ForConditionalGeneration",
        dict(_HYBRID, intermediate_size=96),
    ),
    "qwen3_5_moe": (
        "transformers.models.qwen3_5_moe",
        "Qwen3_5MoeConfig",
        "Qwen3_5MoeForConditionalGeneration",
        dict(
            _HYBRID, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32
        ),
    ),
}


class TinyError(ValueError):
    pass


def reference_module(family: str):
    """The transformers module of a family's reference model (TinyError when there is none, or
    when transformers, the `tiny` extra, is not installed)."""
    if family not in TINY_FAMILIES:
        raise TinyError(f"no tiny checkpoint for the {family!r} family yet (have: {', '.join(TINY_FAMILIES)})")
    try:
        return importlib.import_module(TINY_FAMILIES[family][0])
    except ModuleNotFoundError as exc:
        raise TinyError(
            f"tiny checkpoints are written by transformers' own model classes, which are not "
            f"installed ({exc}): pip install -e '.[tiny]'"
        ) from None


def build_tiny_model(family: str, special_tokens: dict[str, int], vocab_size: int, seed: int = 0) -> torch.nn.Module:
    """The family's transformers model with a tiny seeded config (eval, float32, eager attention)."""
    _, config_name, model_name, text = TINY_FAMILIES[family]
    module = reference_module(family)
    token = special_tokens.__getitem__
    config = getattr(module, config_name)(
        text_config=dict(text, vocab_size=vocab_size, eos_token_id=token("<|im_end|>"), tie_word_embeddings=True),
        vision_config=dict(_VISION),
        image_token_id=token("<|image_pad|>"),
        video_token_id=token("<|video_pad|>"),
        vision_start_token_id=token("<|vision_start|>"),
        vision_end_token_id=token("<|vision_end|>"),
        tie_word_embeddings=True,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(module, model_name)(config).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # transformers' text init, a wider token table (peaked logits) and a livelier tower
        model.get_input_embeddings().weight.normal_(0.0, 0.5, generator=generator)
        for name, param in model.model.visual.named_parameters():
            if param.dim() >= 2:
                param.copy_(torch.randn(param.shape, generator=generator) / param.shape[-1] ** 0.5)
            elif "norm" in name and name.endswith("weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=generator))
            else:
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
    return model


def write_tiny_checkpoint(recipe: Recipe, out: Path, seed: int = 0, gguf_path: Path | None = None) -> Path:
    """Write the tiny checkpoint of `recipe`'s family into `out` (config, sharded safetensors,
    tokenizer, image processor settings); return the folder."""
    if recipe.family not in TINY_FAMILIES:
        raise TinyError(
            f"recipe {recipe.name!r} compiles {recipe.family!r}: tiny checkpoints exist for the "
            f"{', '.join(TINY_FAMILIES)} families (docs/recipes.md)"
        )
    reference_module(recipe.family)  # before fetching the tokenizer's model: fail fast without transformers
    reader = open_gguf(gguf_path or resolve_packaged(TOKENIZER_SOURCE))
    source = tokenizer_from_gguf(reader)
    vocab = _embedding_rows(reader)
    model = build_tiny_model(recipe.family, source.special_tokens, vocab, seed)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, max_shard_size="20MB")
    (out / "tokenizer.json").write_text(source.tokenizer_json)
    tokenizer_config = {
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "add_bos_token": False,
        "model_max_length": model.config.text_config.max_position_embeddings,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    (out / "preprocessor_config.json").write_text(json.dumps(_PROFILE, indent=2) + "\n")
    return out


def _embedding_rows(reader) -> int:
    """Rows of the GGUF's token table: the vocabulary size the model is built with."""
    for tensor in reader.tensors:
        if tensor.name == "token_embd.weight":
            return int(tensor.shape[-1])
    raise TinyError("the tokenizer's GGUF has no token_embd.weight")

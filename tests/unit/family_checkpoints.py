"""Tiny random checkpoints of the recipe families, written by transformers itself.

Each family's reference implementation (transformers 5.24) builds a 2-5 layer model with a small
hidden size and a few experts from a seeded config, and `save_pretrained` writes it as the real
checkpoints are laid out (sharded safetensors with model.safetensors.index.json, per-expert or
fused expert tensors as each family's hub checkpoints have them). Weights
are re-drawn larger than transformers' init (std 0.02 leaves logits nearly flat, which would hide
errors), and biases/norms that init to constants are randomised so dropping one shows.

The tokenizer is ignition.tiny_text's byte-level BPE plus the family's control tokens, so any
text round-trips and the family's delimiters are single tokens. The configs and control tokens
are data, in tests/unit/family_configs.py.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import torch

from ignition.tiny_text import write_byte_tokenizer, write_text_checkpoint
from tests.unit.family_configs import EOS, SPECIALS, TINY_CONFIGS

# family -> (transformers module, config class, causal-LM class); None: the local text-only
# wrapper defined below (transformers ships those models only with their vision towers).
_CLASSES: dict[str, tuple[str, str, str | None]] = {
    "smollm3": ("transformers.models.smollm3", "SmolLM3Config", "SmolLM3ForCausalLM"),
    "gemma3": ("transformers.models.gemma3", "Gemma3TextConfig", "Gemma3ForCausalLM"),
    "gemma2": ("transformers.models.gemma2", "Gemma2Config", "Gemma2ForCausalLM"),
    "mistral": ("transformers.models.mistral", "MistralConfig", "MistralForCausalLM"),
    "phi3": ("transformers.models.phi3", "Phi3Config", "Phi3ForCausalLM"),
    "qwen3": ("transformers.models.qwen3", "Qwen3Config", "Qwen3ForCausalLM"),
    "qwen3_5": ("transformers.models.qwen3_5", "Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
    "qwen3_5_moe": ("transformers.models.qwen3_5_moe", "Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM"),
    "nemotron_h": ("transformers", "NemotronHConfig", "NemotronHForCausalLM"),
    "deepseek_v4": ("transformers", "DeepseekV4Config", "DeepseekV4ForCausalLM"),
    "deepseek_v3": ("transformers.models.deepseek_v3", "DeepseekV3Config", "DeepseekV3ForCausalLM"),
    "mimo_v2_flash": ("transformers.models.mimo_v2_flash", "MiMoV2FlashConfig", "MiMoV2FlashForCausalLM"),
    "gemma4": ("transformers.models.gemma4", "Gemma4TextConfig", "Gemma4ForCausalLM"),
    "step3p7": ("transformers.models.step3p7.configuration_step3p7", "Step3p7TextConfig", None),
    "glm_moe_dsa": ("transformers.models.glm_moe_dsa", "GlmMoeDsaConfig", "GlmMoeDsaForCausalLM"),
    "minimax_m3_vl": ("transformers.models.minimax_m3_vl", "MiniMaxM3VLTextConfig", "MiniMaxM3VLForCausalLM"),
    "muse_spark": ("transformers.models.muse_spark.configuration_muse_spark", "MuseSparkTextConfig", None),
}


def _classes(family: str):
    module_name, config_name, model_name = _CLASSES[family]
    module = importlib.import_module(module_name)
    local = {"step3p7": StepCausalLM, "muse_spark": MuseCausalLM}
    return getattr(module, config_name), getattr(module, model_name) if model_name else local[family]


class StepCausalLM(torch.nn.Module):
    """Step3p7TextModel plus an lm_head: the text path of Step3p7ForConditionalGeneration (which
    transformers ships only with its vision tower). Saved in the hub checkpoints' original layout."""

    def __init__(self, config) -> None:
        super().__init__()
        from transformers.models.step3p7.modeling_step3p7 import Step3p7TextModel

        self.config = config
        self.model = Step3p7TextModel(config)
        self.lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids):
        from types import SimpleNamespace

        return SimpleNamespace(logits=self.lm_head(self.model(input_ids).last_hidden_state))

    def save_pretrained(self, folder: Path) -> None:
        from safetensors.torch import save_file

        tensors = {}
        for name, value in self.state_dict().items():
            for old, new in (
                (".mlp.gate.weight", ".moe.gate.weight"),
                (".mlp.gate.e_score_correction_bias", ".moe.router_bias"),
                (".mlp.experts.down_proj", ".moe.down_proj.weight"),
                (".mlp.shared_experts.", ".share_expert."),
            ):
                name = name.replace(old, new)
            if name.endswith(".mlp.experts.gate_up_proj"):
                inter = value.shape[1] // 2
                base = name.removesuffix(".mlp.experts.gate_up_proj")
                tensors[base + ".moe.gate_proj.weight"] = value[:, :inter].contiguous()
                tensors[base + ".moe.up_proj.weight"] = value[:, inter:].contiguous()
                continue
            tensors[name] = value.contiguous()
        Path(folder).mkdir(parents=True, exist_ok=True)
        save_file(tensors, Path(folder) / "model.safetensors", metadata={"format": "pt"})
        (Path(folder) / "config.json").write_text(self.config.to_json_string())


class MuseCausalLM(torch.nn.Module):
    """MuseSparkTextModel plus an lm_head with MuseSparkForConditionalGeneration's logit path
    (output_multiplier, then the final soft-cap); saved as the multimodal checkpoint lays the text
    model out (`model.language_model.*`, `lm_head.weight`)."""

    def __init__(self, config) -> None:
        super().__init__()
        from transformers.models.muse_spark.modeling_muse_spark import MuseSparkTextModel

        self.config = config
        self.model = MuseSparkTextModel(config)
        self.lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids):
        from types import SimpleNamespace

        logits = self.lm_head(self.model(input_ids).last_hidden_state) * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        return SimpleNamespace(logits=torch.tanh(logits / cap) * cap)

    def save_pretrained(self, folder: Path) -> None:
        from safetensors.torch import save_file

        tensors = {
            (k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k): v.contiguous()
            for k, v in self.state_dict().items()
        }
        Path(folder).mkdir(parents=True, exist_ok=True)
        save_file(tensors, Path(folder) / "model.safetensors", metadata={"format": "pt"})
        (Path(folder) / "config.json").write_text(self.config.to_json_string())


def build_reference(family: str, seed: int = 0, overrides: dict[str, Any] | None = None):
    """The transformers model of a tiny `family` checkpoint (eval, float32, eager attention);
    `overrides` replace TINY_CONFIGS entries (e.g. more experts)."""
    config_cls, model_cls = _classes(family)
    specials = SPECIALS[family]
    vocab = 256 + len(specials)
    eos = 256 + specials.index(EOS[family])
    extra = {"vocab_size_per_layer_input": vocab} if family == "gemma4" else {}
    config = config_cls(
        vocab_size=vocab,
        bos_token_id=256,
        eos_token_id=eos,
        pad_token_id=eos,
        **{**TINY_CONFIGS[family], **(overrides or {})},
        **extra,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    if family in ("step3p7", "muse_spark"):
        model.model.config._attn_implementation = "eager"
    generator = torch.Generator().manual_seed(seed + 1)
    if family == "deepseek_v4":
        randomise_deepseek_v4(model, generator)
        return model
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=generator))
            elif name.endswith(("per_expert_scale", "router.scale")):
                param.copy_(1.0 + 0.3 * torch.randn(param.shape, generator=generator))
            elif name.endswith(("sinks", "residual_gate.gate", "mixer.D")) or "bias" in name:
                param.copy_(0.5 * torch.randn(param.shape, generator=generator))
            elif param.dim() >= 2:
                fan_in = param.shape[-1]
                param.copy_(torch.randn(param.shape, generator=generator) / fan_in**0.5)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.3 * torch.randn(buffer.shape, generator=generator))
            elif name.endswith("layer_scalar"):
                buffer.copy_(1.0 + 0.3 * torch.randn(buffer.shape, generator=generator))
    return model


def randomise_deepseek_v4(model, generator: torch.Generator) -> None:
    """Weights redrawn larger than transformers' init (flat logits would hide errors); the
    hyper-connection (and hyper head) bases and scales, sinks and compressor position biases
    randomised, and a token -> experts table (tid2eid) that routes tokens differently
    (transformers' init leaves all of these constant; some rows name one expert twice)."""
    experts = model.config.n_routed_experts
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.1 * torch.randn(param.shape, generator=generator))
            elif name.endswith(("sinks", "base", "position_bias")):
                param.copy_(0.5 * torch.randn(param.shape, generator=generator))
            elif name.endswith("scale"):
                param.copy_(1 + 0.3 * torch.randn(param.shape, generator=generator))
            elif param.dim() >= 2:
                param.copy_(torch.randn(param.shape, generator=generator) / param.shape[-1] ** 0.5)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.3 * torch.randn(buffer.shape, generator=generator))
            elif name.endswith("tid2eid"):  # some rows name one expert twice
                buffer.copy_(torch.randint(0, experts, buffer.shape, generator=generator))


def write_family_checkpoint(
    folder: Path, family: str, seed: int = 0, overrides: dict[str, Any] | None = None
) -> tuple[Path, Any]:
    """Write the tiny checkpoint of `family` into `folder`; return (folder, reference model)."""
    folder = Path(folder)
    model = build_reference(family, seed, overrides)
    if isinstance(model, torch.nn.Module) and hasattr(model, "can_generate"):
        # Sharded, as the real checkpoints are: model-0000N-of-0000M.safetensors + the index.
        model.save_pretrained(folder, max_shard_size="300KB")
    else:
        model.save_pretrained(folder)
    write_tokenizer_files(folder, family)
    return folder, model


def write_tokenizer_files(folder: Path, family: str) -> None:
    write_byte_tokenizer(folder, SPECIALS[family], EOS[family])


def write_quantizable_checkpoint(
    folder: Path,
    family: str,
    seed: int = 0,
    overrides: dict[str, Any] | None = None,
    embedding_std: float | None = None,
) -> Path:
    """A tiny checkpoint of `family` that a quantized (default int4) export validates.

    write_family_checkpoint's re-drawn weights make a chaotic network: int4 noise on one weight
    changes every later logit, so its int4 export fails validation (KL ~1.4 nats) although the
    engine is right (fp32 parity 3e-5). transformers' own initialisation keeps the tiny network
    contractive, and tied embeddings make each next-token distribution peaked, as a trained
    model's are (int4: KL ~2e-4, top-1 1.0 on the validation prompt)."""
    config_cls, model_cls = _classes(family)
    text_config = {**TINY_CONFIGS[family], **(overrides or {})}
    return write_text_checkpoint(
        folder, config_cls, model_cls, SPECIALS[family], EOS[family], text_config, seed, embedding_std
    )

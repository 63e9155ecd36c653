"""Model families: one module per family (its plan, its model class, whatever only it needs) over
the shared blocks of ignition/models/blocks. `build_model` picks the class from
`Architecture.family`.

Adding a family = one module whose model class subclasses ConfiguredLM (or DecoderLM, or
StepModel for a step model of its own) plus one line in `FAMILIES` (docs/recipes.md).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from helios.manifest import Architecture, StateLayout
from ignition.models import (
    deepseek_v3,
    deepseek_v4,
    gemma2,
    gemma3,
    gemma4,
    glm_moe_dsa,
    llama,
    mimo_v2_flash,
    minimax_m3,
    mistral,
    muse_spark,
    nemotron_h,
    phi3,
    qwen2,
    qwen3,
    qwen3_5,
    smollm3,
    step3p7,
)
from ignition.models.base import TOP_K, FamilyError, StepModel, logprob_stats
from ignition.models.configured import ConfiguredLM
from ignition.models.decoder import DecoderLM

# The registry: flare family name -> its model class.
FAMILIES: dict[str, type[StepModel]] = {
    model.family: model
    for model in (
        qwen2.Qwen2ForCausalLM,
        llama.LlamaForCausalLM,
        deepseek_v3.DeepseekV3LM,
        mimo_v2_flash.MiMoV2FlashLM,
        gemma4.Gemma4LM,
        step3p7.Step3p7LM,
        muse_spark.MuseSparkLM,
        glm_moe_dsa.GlmMoeDsaLM,
        minimax_m3.MiniMaxM3LM,
        qwen3.Qwen3LM,
        mistral.MistralLM,
        gemma2.Gemma2LM,
        gemma3.Gemma3LM,
        smollm3.SmolLM3LM,
        phi3.Phi3LM,
        qwen3_5.Qwen35LM,
        qwen3_5.Qwen35MoeLM,
        nemotron_h.NemotronHLM,
        deepseek_v4.DeepseekV4LM,
    )
}

# Hugging Face model_type -> flare family. Multimodal wrappers compile their text model (their
# `text_config`); vision/audio towers are not part of the text step graph.
MODEL_TYPES: dict[str, str] = {model_type: name for name, model in FAMILIES.items() for model_type in model.model_types}

# Families recipes name whose architecture the exporter cannot compile yet, with what is missing.
# `ignition export` refuses them up front with this text (docs/recipes.md has the details).
PLANNED: dict[str, str] = {}
PLANNED_MODEL_TYPES: dict[str, str] = {}


def architecture(family: str, config: dict[str, Any]) -> Architecture:
    """The manifest Architecture of a family's config.json (the pool geometry is the widest layer's)."""
    return FAMILIES[family].architecture(config)


def cache_layout(family: str, config: dict[str, Any], num_layers: int) -> tuple[int, StateLayout | None]:
    """(layers with K/V rows in the pool, the recurrent state layout or None) of a checkpoint's
    family and config: every layer and no state for the attention-only families."""
    if family not in FAMILIES:
        return num_layers, None
    return FAMILIES[family].cache_layout(config, num_layers)


def attention_window(family: str, config: dict[str, Any]) -> int | None:
    """The window every attending layer of the checkpoint keeps to (None: some layer reads the
    whole history, or the family is not a registered model class)."""
    if family not in FAMILIES:
        return None
    return FAMILIES[family].attention_window(config)


def logit_postprocessing(family: str, config: dict[str, Any]) -> str | None:
    """What a family does to its logits after the lm_head, from the config alone (None: nothing).

    The prompt-scoring graph is the bare lm_head, so such a family cannot score prompts: export
    refuses --prompt-logprobs before any tensor is read."""
    if family not in FAMILIES:
        return None
    return FAMILIES[family].logit_postprocessing(config)


def build_model(arch: Architecture, config: dict[str, Any], tensors: dict[str, np.ndarray]) -> StepModel:
    """A float32 eval-mode model holding a checkpoint's weights."""
    if arch.family in PLANNED:
        raise ValueError(f"the {arch.family!r} family cannot be compiled yet: missing {PLANNED[arch.family]}")
    if arch.family not in FAMILIES:
        raise ValueError(f"unknown model family {arch.family!r}; known: {sorted(FAMILIES)}")
    return FAMILIES[arch.family].build(arch, config, tensors)


__all__ = [
    "FAMILIES",
    "MODEL_TYPES",
    "PLANNED",
    "PLANNED_MODEL_TYPES",
    "TOP_K",
    "ConfiguredLM",
    "DecoderLM",
    "FamilyError",
    "architecture",
    "build_model",
    "cache_layout",
    "logit_postprocessing",
    "logprob_stats",
]

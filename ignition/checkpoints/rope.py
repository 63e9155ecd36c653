"""A dense checkpoint's RoPE scaling, read as transformers' rope utilities read it (the config
reader itself is ignition.models.rope_config, which the family planners share).

Hugging Face configs spell it as `rope_scaling` (`type` or `rope_type`) or, in transformers 5,
`rope_parameters`; GGUF files as `{arch}.rope.scaling.*` keys, and Llama 3 GGUFs as a
`rope_freqs` tensor of per-frequency factors.
"""

from __future__ import annotations

from typing import Any

from helios.manifest import RopeScaling
from ignition.checkpoints.base import CheckpointError
from ignition.models.blocks.rotary import yarn_mscale
from ignition.models.rope_config import RopeConfigError
from ignition.models.rope_config import rope_scaling_from_config as read_config_scaling


def rope_scaling_from_config(config: dict[str, Any], source: str) -> RopeScaling | None:
    """The scaling a config.json declares (None: plain rotary); CheckpointError naming `source`
    where flare cannot serve it."""
    try:
        return read_config_scaling(config)
    except RopeConfigError as exc:
        raise CheckpointError(f"{source}: {exc}") from None


def rope_scaling_from_gguf(kind: str, factor: float, original: int | None, freq_factors: Any) -> RopeScaling | None:
    """A GGUF's `rope.scaling.type` / `.factor` / `.original_context_length`, or its `rope_freqs`
    tensor (Llama 3: the factors llama3 scaling divides each frequency by)."""
    if freq_factors is not None:
        return RopeScaling(kind="factors", freq_factors=[float(x) for x in freq_factors])
    if kind in ("none", ""):
        return None
    if kind == "linear":
        return RopeScaling(kind="linear", factor=factor)
    if kind == "yarn":
        return RopeScaling(
            kind="yarn",
            factor=factor,
            original_max_position_embeddings=original,
            beta_fast=32.0,
            beta_slow=1.0,
            attention_factor=yarn_mscale(factor),
        )
    raise CheckpointError(f"GGUF rope scaling {kind!r} is not supported (none, linear, yarn or rope_freqs)")

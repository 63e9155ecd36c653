"""A dense checkpoint's RoPE scaling, read as transformers' rope utilities read it, and the
context it reaches.

Hugging Face configs spell it as `rope_scaling` (`type` or `rope_type`) or, in transformers 5,
`rope_parameters`; GGUF files as `{arch}.rope.scaling.*` keys, and Llama 3 GGUFs as a
`rope_freqs` tensor of per-frequency factors.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from helios.manifest import RopeScaling
from ignition.checkpoints.base import CheckpointError

# Kinds served; transformers' others (longrope, su) are refused with this list.
CONFIG_KINDS = ("linear", "dynamic", "yarn", "llama3")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """transformers' get_mscale."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_scaling_from_config(config: dict[str, Any], source: str) -> RopeScaling | None:
    """The scaling a config.json declares (None: plain rotary). Refuses kinds flare cannot serve."""
    params = dict(config.get("rope_parameters") or {})
    legacy = dict(config.get("rope_scaling") or {})
    params.update(legacy)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default" or kind is None:
        return None
    if kind not in CONFIG_KINDS:
        raise CheckpointError(
            f"{source}: rope scaling {kind!r} is not supported (flare serves {', '.join(CONFIG_KINDS)})"
        )
    original = params.get("original_max_position_embeddings")
    factor = params.get("factor")
    try:
        if kind == "yarn":
            return _yarn(params, config, original, factor)
        if factor is None:
            raise KeyError("factor")
        if kind == "llama3":
            scaling = RopeScaling(
                kind="llama3",
                factor=float(factor),
                original_max_position_embeddings=int(params["original_max_position_embeddings"]),
                low_freq_factor=float(params["low_freq_factor"]),
                high_freq_factor=float(params["high_freq_factor"]),
            )
            scaling.freq_factors = llama3_freq_factors(scaling, head_dim(config), rope_theta(config))
            return scaling
        return RopeScaling(
            kind=kind, factor=float(factor), original_max_position_embeddings=int(original) if original else None
        )
    except KeyError as exc:
        raise CheckpointError(f"{source}: {kind} rope scaling needs {exc.args[0]}") from None


def _yarn(params: dict[str, Any], config: dict[str, Any], original: Any, factor: Any) -> RopeScaling:
    """transformers' _compute_yarn_parameters: a missing factor is the context ratio; a missing
    attention factor follows from mscale and mscale_all_dim, or from the factor alone."""
    original = int(original or config["max_position_embeddings"])
    factor = float(factor if factor is not None else config["max_position_embeddings"] / original)
    attention = params.get("attention_factor")
    if attention is None:
        mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all:
            attention = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
        else:
            attention = yarn_mscale(factor)
    return RopeScaling(
        kind="yarn",
        factor=factor,
        original_max_position_embeddings=original,
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        attention_factor=float(attention),
        truncate=bool(params.get("truncate", True)),
    )


def head_dim(config: dict[str, Any]) -> int:
    return int(config.get("head_dim") or int(config["hidden_size"]) // int(config["num_attention_heads"]))


def rope_theta(config: dict[str, Any]) -> float:
    return float(config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta") or 10000.0)


def llama3_freq_factors(scaling: RopeScaling, dim: int, theta: float) -> list[float]:
    """transformers' _compute_llama3_parameters as per-frequency divisors of the plain rotary
    (what llama.cpp writes as rope_freqs): long wavelengths divided by the factor, short ones
    kept, the band between blended; float32 as transformers computes it."""
    assert scaling.low_freq_factor and scaling.high_freq_factor and scaling.original_max_position_embeddings
    factor, low, high = scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor
    original = scaling.original_max_position_embeddings
    base = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    wavelen = 2 * math.pi / base
    scaled = torch.where(wavelen > original / low, base / factor, base)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < original / high) * ~(wavelen > original / low)
    target = torch.where(medium, smoothed, scaled)
    return (base.double() / target.double()).tolist()


def scaled_context(native: int, scaling: RopeScaling | None) -> int:
    """The context a checkpoint reaches with its scaling, as vLLM derives max_model_len: linear
    stretches max_position_embeddings by the factor, YaRN the original context; llama3 and
    per-frequency factors already declare theirs; dynamic NTK stays at its original context."""
    if scaling is None or scaling.freq_factors is not None or scaling.kind == "dynamic":
        return native  # dynamic: see ignition.models.blocks.rotary.scaled_inv_freq
    base = scaling.original_max_position_embeddings if scaling.kind == "yarn" else native
    return max(native, int((base or native) * scaling.factor))


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

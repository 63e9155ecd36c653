"""RoPE scaling as a Hugging Face config declares it (`rope_scaling` with `type` or `rope_type`,
or transformers 5's `rope_parameters`), read as transformers' rope utilities read it: the
frequencies' kind and parameters (helios.manifest.RopeScaling) every rotary of the models is
computed from. Checkpoint readers and family planners share it."""

from __future__ import annotations

import math
from typing import Any

import torch

from helios.manifest import RopeScaling
from ignition.models.blocks.rotary import yarn_attention_factor


class RopeConfigError(ValueError):
    pass


# Kinds served; transformers' others are refused with this list.
CONFIG_KINDS = ("linear", "dynamic", "yarn", "llama3", "longrope")


def rope_scaling_from_config(config: dict[str, Any]) -> RopeScaling | None:
    """The scaling a config.json declares (None: plain rotary). Refuses kinds flare cannot serve."""
    params = dict(config.get("rope_parameters") or {})
    legacy = dict(config.get("rope_scaling") or {})
    params.update(legacy)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default" or kind is None:
        return None
    if kind not in CONFIG_KINDS:
        raise RopeConfigError(f"rope scaling {kind!r} is not supported (flare serves {', '.join(CONFIG_KINDS)})")
    original = params.get("original_max_position_embeddings")
    factor = params.get("factor")
    try:
        if kind == "yarn":
            return _yarn(params, config, original, factor)
        if kind == "longrope":
            return _longrope(params, config)
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
            scaling.freq_factors = llama3_freq_factors(scaling, rotary_width(config), rope_theta(config))
            return scaling
        return RopeScaling(
            kind=kind, factor=float(factor), original_max_position_embeddings=int(original) if original else None
        )
    except KeyError as exc:
        raise RopeConfigError(f"{kind} rope scaling needs {exc.args[0]}") from None


def _yarn(params: dict[str, Any], config: dict[str, Any], original: Any, factor: Any) -> RopeScaling:
    """transformers' _compute_yarn_parameters: a missing factor is the context ratio; a missing
    attention factor follows from mscale and mscale_all_dim, or from the factor alone."""
    original = int(original or config["max_position_embeddings"])
    factor = float(factor if factor is not None else config["max_position_embeddings"] / original)
    attention = params.get("attention_factor")
    if attention is None:
        attention = yarn_attention_factor(factor, params.get("mscale"), params.get("mscale_all_dim"))
    return RopeScaling(
        kind="yarn",
        factor=factor,
        original_max_position_embeddings=original,
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        attention_factor=float(attention),
        truncate=bool(params.get("truncate", True)),
    )


def _longrope(params: dict[str, Any], config: dict[str, Any]) -> RopeScaling:
    """transformers' _compute_longrope_parameters with its long factors: a checkpoint whose
    context exceeds the original one is served past it, and transformers switches to the long
    factors as soon as a sequence does (llama.cpp takes them whenever its context is longer than
    the original, as a core's is). The attention factor follows from the context ratio."""
    original = int(params.get("original_max_position_embeddings") or config["original_max_position_embeddings"])
    native = int(config["max_position_embeddings"])
    factor = float(params.get("factor") or native / original)
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    chosen = params["long_factor"] if native > original else params["short_factor"]
    return RopeScaling(
        kind="longrope",
        factor=factor,
        original_max_position_embeddings=original,
        attention_factor=float(attention),
        freq_factors=[float(x) for x in chosen],
    )


def head_dim(config: dict[str, Any]) -> int:
    return int(config.get("head_dim") or int(config["hidden_size"]) // int(config["num_attention_heads"]))


def rotary_width(config: dict[str, Any]) -> int:
    """The rotating dims of a head (transformers' rope utilities: head_dim * partial_rotary_factor)."""
    partial = config.get("partial_rotary_factor") or (config.get("rope_parameters") or {}).get("partial_rotary_factor")
    return int(head_dim(config) * float(partial or 1.0))


def rope_theta(config: dict[str, Any]) -> float:
    return float(config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta") or 10000.0)


def llama3_freq_factors(scaling: RopeScaling, dim: int, theta: float) -> list[float]:
    """transformers' _compute_llama3_parameters as per-frequency divisors of the plain rotary
    (what llama.cpp writes as rope_freqs): long wavelengths divided by the factor, short ones
    kept, the band between blended; float32 as transformers computes it."""
    assert scaling.low_freq_factor and scaling.high_freq_factor and scaling.original_max_position_embeddings
    factor, low, high = scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor
    original = scaling.original_max_position_embeddings
    # On the CPU even where a model is being built on the meta device: these are numbers.
    base = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
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

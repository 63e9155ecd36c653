"""Rotary position embeddings: frequency variants (default, YaRN, proportional) and the three
ways heads are rotated (rotate-half, interleaved pairs written de-interleaved, interleaved pairs
kept interleaved). Frequencies are computed, never loaded."""

from __future__ import annotations

import math

import torch
from torch import nn

from helios.manifest import RopeScaling


class Rotary(nn.Module):
    """Rotate-half rotary as cos/sin tables over positions (what onnxruntime's RotaryEmbedding
    and the fused pool attention take), plus the Hugging Face formulation from inv_freq for the
    reference path: two independent implementations checked against each other."""

    def __init__(self, head_dim: int, theta: float, max_positions: int, scaling: RopeScaling | None = None) -> None:
        super().__init__()
        self.head_dim, self.theta, self.max_positions, self.scaling = head_dim, theta, max_positions, scaling
        # cos/sin scale (YaRN's attention factor): q.k grows by its square, as in transformers.
        self.attention_factor = scaling.attention_factor if scaling is not None else 1.0
        self.register_buffer("inv_freq", torch.empty(head_dim // 2), persistent=False)
        self.register_buffer("cos_cache", torch.empty(max_positions, head_dim // 2), persistent=False)
        self.register_buffer("sin_cache", torch.empty(max_positions, head_dim // 2), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.scaling is None:
            # In float64 then rounded: the tables are exact to fp32.
            exponent = torch.arange(0, self.head_dim, 2, dtype=torch.float64) / self.head_dim
            inv_freq = 1.0 / (self.theta**exponent)
        else:  # transformers' float32 frequencies, so scaled positions rotate as its reference does
            inv_freq = scaled_inv_freq(self.scaling, self.head_dim, self.theta).double()
        angles = torch.arange(self.max_positions, dtype=torch.float64).unsqueeze(1) * inv_freq
        self.inv_freq = inv_freq.float()
        self.cos_cache = (angles.cos() * self.attention_factor).float()
        self.sin_cache = (angles.sin() * self.attention_factor).float()

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [...] -> cos, sin [..., 1, head_dim] (reference path)."""
        freqs = positions.to(torch.float32).unsqueeze(-1) * self.inv_freq
        emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(-2)
        return emb.cos() * self.attention_factor, emb.sin() * self.attention_factor

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def default_inv_freq(dim: int, theta: float) -> torch.Tensor:
    if not dim:
        return torch.zeros(0)
    # As transformers computes it (float32 exponent), so positions rotate identically.
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def proportional_inv_freq(dim: int, theta: float, partial: float) -> torch.Tensor:
    """transformers' _compute_proportional_rope_parameters: the leading `partial` fraction of the
    frequencies as usual (over the full width), zero past it."""
    angles = int(partial * dim // 2)
    rotated = 1.0 / (theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / dim))
    return torch.cat([rotated, torch.zeros(dim // 2 - angles)])


def yarn_inv_freq(
    dim: int, theta: float, factor: float, beta_fast: float, beta_slow: float, original: int, truncate: bool
) -> torch.Tensor:
    """transformers' _compute_yarn_parameters frequencies: interpolated (divided by factor) below
    the correction range, extrapolated above it, linearly blended inside."""

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """transformers' get_mscale."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_factor(factor: float, mscale: float | None, mscale_all: float | None) -> float:
    """YaRN's cos/sin scale when the config gives no attention_factor."""
    if mscale and mscale_all:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
    return yarn_mscale(factor)


def inv_freq(
    kind: str,
    dim: int,
    theta: float,
    partial: float = 1.0,
    yarn: tuple = (),
    factor: float = 1.0,
    freq_factors: tuple = (),
) -> torch.Tensor:
    """Frequencies [dim/2] of a rotary kind: "default", "linear" (divided by `factor`),
    "proportional" (zero past `partial`), "yarn" (yarn = (factor, beta_fast, beta_slow,
    original_max_positions, truncate)) or "factors" (each divided by its own factor)."""
    if not dim:  # a layer without rotary (NoPE)
        return torch.zeros(0)
    if kind == "factors":
        assert len(freq_factors) == dim // 2, f"{len(freq_factors)} rotary factors for {dim} dims"
        return (default_inv_freq(dim, theta).double() / torch.tensor(freq_factors, dtype=torch.float64)).float()
    if kind == "yarn":
        return yarn_inv_freq(dim, theta, *yarn)
    if kind == "proportional":
        return proportional_inv_freq(dim, theta, partial)
    if kind == "linear":
        return default_inv_freq(dim, theta) / factor
    return default_inv_freq(dim, theta)


def scaled_inv_freq(scaling: RopeScaling, dim: int, theta: float) -> torch.Tensor:
    """Frequencies [dim/2] of a scaled rotary, as transformers computes them (float32).

    "dynamic" is the plain rotary: transformers rescales it only for a forward pass longer than
    the original context, by that pass's length, which no fixed table can follow; export keeps
    such a core's context at the original one (ignition.checkpoints.rope.scaled_context)."""
    base = default_inv_freq(dim, theta)
    if scaling.freq_factors is not None:  # per-frequency divisors, computed by the checkpoint reader
        assert len(scaling.freq_factors) == dim // 2
        return (base.double() / torch.tensor(scaling.freq_factors, dtype=torch.float64)).float()
    if scaling.kind == "linear":
        return base / scaling.factor
    if scaling.kind == "yarn":
        assert scaling.original_max_position_embeddings is not None
        return yarn_inv_freq(
            dim,
            theta,
            scaling.factor,
            scaling.beta_fast or 32.0,
            scaling.beta_slow or 1.0,
            scaling.original_max_position_embeddings,
            scaling.truncate,
        )
    return base  # dynamic


def rotate(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], interleave: bool) -> torch.Tensor:
    """Rotary on x [B, L, heads, rot] with cos/sin [B, L, 1, rot/2] of its positions (HF
    formulations: rotate-half, or interleaved pairs whose output is written de-interleaved)."""
    cos, sin = cos_sin
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def rotate_leading(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], interleave: bool) -> torch.Tensor:
    """`rotate` on the leading 2 * cos.shape[-1] dims of x; the rest pass through."""
    rot = 2 * cos_sin[0].shape[-1]
    if rot == x.shape[-1]:
        return rotate(x, cos_sin, interleave)
    return torch.cat([rotate(x[..., :rot], cos_sin, interleave), x[..., rot:]], dim=-1)


def rotate_trailing_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved rotary on the trailing 2 * cos.shape[-1] dims of x, pairs kept interleaved;
    cos/sin broadcast against x[..., :half]."""
    rot = 2 * cos.shape[-1]
    nope, rope = x[..., : x.shape[-1] - rot], x[..., x.shape[-1] - rot :]
    pairs = rope.reshape(*rope.shape[:-1], rot // 2, 2)
    x1, x2 = pairs[..., 0], pairs[..., 1]
    out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).reshape(rope.shape)
    return torch.cat([nope, out], dim=-1)

"""The one RMSNorm of every family."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """x / rms(x), times `weight` (+ `offset`: 1 for the "(1 + w)" norms), or unscaled when not
    weighted.

    fusable: written as x / sqrt(mean(x^2) + eps), the pattern onnxruntime fuses into
    SimplifiedLayerNormalization (the fused-kernel decoder's form); otherwise x * rsqrt(...), as
    transformers writes it. The two differ in the last bits (both within parity); the decoder
    and the configured families' per-step norms use the fusable form (one graph node each)."""

    def __init__(self, dim: int, eps: float, weighted: bool = True, offset: float = 0.0, fusable: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.weighted = weighted
        self.offset = offset
        self.fusable = fusable
        if weighted:
            self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fusable:
            out = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        else:
            out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if not self.weighted:
            return out
        return out * (self.weight + self.offset) if self.offset else out * self.weight

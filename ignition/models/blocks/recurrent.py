"""Recurrent token mixers: layers whose history is a fixed-size per-sequence state, not K/V rows.

The contract (docs/architecture.md, "Recurrent state"): a mixer has a `kind` (the manifest's
`state.layers[].kind`), a `state_size` (floats per sequence) and

    forward(x [B, L, H], state [B, state_size], valid [B, L]) -> (y [B, L, H], new_state [B, state_size])

`state` is the state after the row's history (zeros for a fresh sequence: ConfiguredLM zeroes the
rows with history 0 before calling the mixer). `valid` marks the row's new tokens; it is a prefix
of each row (right padding), given as bool or float 0/1. Padded positions must not change the
state: `new_state[b]` is the state after the row's last valid token. Outputs at padded positions
are never read.

The recurrence over the step's L tokens is `torch._higher_order_ops.scan.scan` with L first: the
dynamo ONNX exporter turns it into an ONNX `Scan` with a dynamic trip count (decode runs one
iteration). Helpers here are shared by the mixers (gated DeltaNet below; Mamba-2 in mamba2.py):
`masked_causal_conv` (depthwise causal conv1d over [conv state, new inputs] with the new conv
state = the last K-1 valid inputs) and `valid_mask`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._higher_order_ops.scan import scan

from ignition.models.blocks.loading import TensorLoader
from ignition.models.blocks.mamba2 import Mamba2Mixer, Mamba2Spec
from ignition.models.blocks.norms import RMSNorm


class RecurrentMixer(nn.Module):
    """Base class of the recurrent mixers ConfiguredLM drives (see the module docstring)."""

    kind: str = ""
    state_size: int = 0

    def forward(self, x: torch.Tensor, state: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError


def valid_mask(valid: torch.Tensor) -> torch.Tensor:
    """`valid` [B, L] as float32 0/1."""
    return valid.to(torch.float32)


def masked_causal_conv(
    x: torch.Tensor,  # [B, L, C] new inputs
    conv_state: torch.Tensor,  # [B, K-1, C] the last K-1 inputs before them (zeros when fresh)
    weight: torch.Tensor,  # [C, K] depthwise kernel (HF Conv1d weight [C, 1, K] squeezed)
    bias: torch.Tensor | None,  # [C]
    valid: torch.Tensor,  # [B, L] prefix mask
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv1d of the new inputs continuing from `conv_state` -> (out [B, L, C]
    before any activation, new conv state [B, K-1, C] = the last K-1 inputs up to the row's last
    valid one). Outputs at valid positions never read padded inputs (the conv is causal)."""
    batch, length, channels = x.shape
    kernel = weight.shape[-1]
    full = torch.cat([conv_state, x], dim=1)  # [B, K-1+L, C]
    out = F.conv1d(full.transpose(1, 2), weight.unsqueeze(1), bias, groups=channels).transpose(1, 2)  # [B, L, C]
    # Row b's valid inputs end at index K-2+n_b of `full`; its last K-1 are n_b .. n_b+K-2.
    count = valid.to(torch.int64).sum(-1)  # [B]
    index = count.unsqueeze(1) + torch.arange(kernel - 1).unsqueeze(0)  # [B, K-1]
    index = index.unsqueeze(-1).expand(batch, kernel - 1, channels)
    return out, torch.gather(full, 1, index)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _delta_step(state: torch.Tensor, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """One gated delta-rule token: state [B, H, dk, dv]; q, k [B, H, dk]; v [B, H, dv]; decay, beta [B, H]."""
    q, k, v, decay, beta = inputs
    state = state * decay.unsqueeze(-1).unsqueeze(-1)
    memory = (state * k.unsqueeze(-1)).sum(dim=-2)  # [B, H, dv]
    delta = (v - memory) * beta.unsqueeze(-1)
    state = state + k.unsqueeze(-1) * delta.unsqueeze(-2)
    return state, (state * q.unsqueeze(-1)).sum(dim=-2)


def gated_delta_rule(
    q: torch.Tensor,  # [B, L, H, dk] (normalised and scaled)
    k: torch.Tensor,  # [B, L, H, dk]
    v: torch.Tensor,  # [B, L, H, dv]
    g: torch.Tensor,  # [B, L, H] log decay (<= 0)
    beta: torch.Tensor,  # [B, L, H]
    state: torch.Tensor,  # [B, H, dk, dv]
    valid: torch.Tensor,  # [B, L] float 0/1
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over L tokens as one scan (decay 1 and update 0 at padded steps)
    -> (out [B, L, H, dv], final state)."""
    mask = valid.unsqueeze(-1)
    decay = torch.exp(g * mask)
    beta = beta * mask
    xs = tuple(t.transpose(0, 1).contiguous() for t in (q, k, v, decay, beta))  # L first
    # The carry must match the init's layout exactly (a view of the state row is strided).
    final, out = scan(_delta_step, state.clone(memory_format=torch.contiguous_format), xs)
    return out.transpose(0, 1), final


class GatedDeltaNet(RecurrentMixer):
    """Gated DeltaNet (as transformers' hybrid linear-attention decoders write it): in_proj_qkv -> causal depthwise
    conv1d (kernel K, SiLU) -> q, k, v heads; beta = sigmoid(in_proj_b); g = -exp(A_log) *
    softplus(in_proj_a + dt_bias); L2-normalised q/k (q scaled by dk^-0.5), each k head serving
    H_v / H_k value heads; the gated delta rule; norm(o) * silu(in_proj_z(x)); out_proj.

    State per sequence: the conv state [K-1, conv_dim], then the recurrent state [H_v, dk, dv]."""

    kind = "gated_deltanet"

    def __init__(
        self, hidden: int, key_heads: int, value_heads: int, key_dim: int, value_dim: int, kernel: int, eps: float
    ) -> None:
        super().__init__()
        self.key_heads, self.value_heads, self.key_dim, self.value_dim = key_heads, value_heads, key_dim, value_dim
        self.kernel = kernel
        self.conv_dim = 2 * key_heads * key_dim + value_heads * value_dim
        self.conv_size = (kernel - 1) * self.conv_dim
        self.state_size = self.conv_size + value_heads * key_dim * value_dim
        self.in_proj_qkv = nn.Linear(hidden, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden, value_heads * value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden, value_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden, value_heads, bias=False)
        self.conv_weight = nn.Parameter(torch.zeros(self.conv_dim, kernel))
        self.dt_bias = nn.Parameter(torch.ones(value_heads))
        self.A_log = nn.Parameter(torch.zeros(value_heads))
        self.norm = RMSNorm(value_dim, eps)
        self.out_proj = nn.Linear(value_heads * value_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor, state: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch, length, _ = x.shape
        hk, hv, dk, dv = self.key_heads, self.value_heads, self.key_dim, self.value_dim
        valid = valid_mask(valid)
        conv_state = state[:, : self.conv_size].reshape(batch, self.kernel - 1, self.conv_dim)
        recurrent = state[:, self.conv_size :].reshape(batch, hv, dk, dv)
        mixed, new_conv = masked_causal_conv(self.in_proj_qkv(x), conv_state, self.conv_weight, None, valid)
        mixed = F.silu(mixed)
        q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
        q = q.reshape(batch, length, hk, dk)
        k = k.reshape(batch, length, hk, dk)
        v = v.reshape(batch, length, hv, dv)
        if hv != hk:
            q = q.repeat_interleave(hv // hk, dim=2)
            k = k.repeat_interleave(hv // hk, dim=2)
        q = _l2norm(q) * (dk**-0.5)
        k = _l2norm(k)
        beta = torch.sigmoid(self.in_proj_b(x))
        g = -torch.exp(self.A_log) * F.softplus(self.in_proj_a(x) + self.dt_bias)
        out, recurrent = gated_delta_rule(q, k, v, g, beta, recurrent, valid)
        z = self.in_proj_z(x).reshape(batch, length, hv, dv)
        out = (self.norm(out) * F.silu(z)).reshape(batch, length, hv * dv)
        new_state = torch.cat([new_conv.reshape(batch, -1), recurrent.reshape(batch, -1)], dim=-1)
        return self.out_proj(out), new_state

    def load(self, loader: TensorLoader, prefix: str) -> None:
        for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"):
            loader.linear(getattr(self, name), prefix + name)
        conv = loader.take(prefix + "conv1d.weight").reshape(self.conv_dim, self.kernel).contiguous()
        loader.put(self, "conv_weight", conv)
        loader.put(self, "dt_bias", loader.take(prefix + "dt_bias"))
        loader.put(self, "A_log", loader.take(prefix + "A_log"))
        loader.norm(self.norm, prefix + "norm")


@dataclass(frozen=True)
class MixerSpec:
    """How ConfiguredLM builds a recurrent kind from its LayerPlan (`plan.mixer` holds the kind's
    own settings) and how large its state row is (known before the module exists: the manifest's
    state layout is written from the config)."""

    build: Callable[[Any, int, float], RecurrentMixer]  # (LayerPlan, hidden, eps) -> mixer
    state_size: Callable[[Any, int], int]  # (LayerPlan, hidden) -> floats per sequence


def _deltanet(plan: Any, hidden: int, eps: float) -> GatedDeltaNet:
    m = plan.mixer
    return GatedDeltaNet(hidden, m["key_heads"], m["value_heads"], m["key_dim"], m["value_dim"], m["kernel"], eps)


def _deltanet_state(plan: Any, hidden: int) -> int:
    m = plan.mixer
    conv_dim = 2 * m["key_heads"] * m["key_dim"] + m["value_heads"] * m["value_dim"]
    return (m["kernel"] - 1) * conv_dim + m["value_heads"] * m["key_dim"] * m["value_dim"]


def _mamba2(plan: Any, hidden: int, eps: float) -> RecurrentMixer:
    """The Mamba-2 mixer (mamba2.py); plan.mixer holds its Mamba2Spec fields."""
    return Mamba2Mixer(Mamba2Spec(**plan.mixer))


def _mamba2_state(plan: Any, hidden: int) -> int:
    return Mamba2Spec(**plan.mixer).state_size


# Recurrent kinds ConfiguredLM knows (LayerPlan.kind). Another mixer registers itself here.
MIXERS: dict[str, MixerSpec] = {
    "gated_deltanet": MixerSpec(_deltanet, _deltanet_state),
    "mamba2": MixerSpec(_mamba2, _mamba2_state),
}

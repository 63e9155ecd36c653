"""The Mamba-2 mixer as a recurrent mixer of the step graph.

Contract (shared by every recurrent mixer):

    forward(x [B, L, hidden], state [B, state_size], valid [B, L] float 0/1 or bool)
        -> (y [B, L, hidden], new_state [B, state_size])

`state` is each sequence's whole recurrent state flattened to float32, zeros for a fresh sequence.
Rows are right-padded: positions with valid == 0 leave the state untouched (their dt is forced
to 0, so the SSM decays by exp(0) = 1 and takes no input, and the conv state is rebuilt from each
row's last conv_kernel - 1 *valid* inputs). y at padded positions is finite but meaningless.

State layout, in order inside the flat vector (K = conv_kernel, I = heads * head_dim,
G = n_groups, N = d_state, conv_dim = I + 2 * G * N):

    conv  [K - 1, conv_dim]      the last K - 1 inputs of the depthwise conv, oldest first; the
                                 channels are in_proj's xBC slice as is: x [I], B [G*N], C [G*N]
    ssm   [heads, head_dim, N]   the SSM state h (y_t = C_t . h_t + D * x_t); head j reads
                                 B/C group j // (heads / G)

    state_size = (K - 1) * conv_dim + heads * head_dim * N

Math (transformers' hybrid Mamba-2 mixer, torch path): in_proj -> z [I], xBC [conv_dim],
dt [heads]; xBC = silu(causal depthwise conv1d(xBC)); dt = max(softplus(dt + dt_bias),
time_step_min); per head h_t = exp(dt * A) h_{t-1} + dt * x_t B_t^T with A = -exp(A_log);
y_t = C_t h_t + D x_t; y = rms_norm_grouped(y * silu(z)) * norm.weight (gate applied *before*
the norm, groups of I / G channels); out_proj(y).

The recurrence is a `scan` over L (exported as one ONNX Scan node): one step per token, so a
decode step (L = 1) costs one state update, and nothing [L, ..., N]-sized is materialised.
Export it under torch.no_grad() (the dynamo exporter cannot lower a scan traced with autograd).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch._higher_order_ops.scan import scan


@dataclass(frozen=True)
class Mamba2Spec:
    hidden: int
    heads: int
    head_dim: int
    d_state: int
    n_groups: int
    conv_kernel: int
    time_step_min: float  # dt floor after softplus (transformers 5.24: config.time_step_min)
    eps: float  # gated RMSNorm epsilon (config.layer_norm_epsilon)
    conv_bias: bool  # config.use_conv_bias
    proj_bias: bool  # in_proj / out_proj bias (config.use_bias)

    @property
    def intermediate(self) -> int:
        return self.heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.intermediate + 2 * self.n_groups * self.d_state

    @property
    def conv_state_size(self) -> int:
        return (self.conv_kernel - 1) * self.conv_dim

    @property
    def state_size(self) -> int:
        return self.conv_state_size + self.heads * self.head_dim * self.d_state


class GatedRMSNorm(nn.Module):
    """rms_norm(x * silu(gate)) * weight, the RMS taken over groups of `group` channels."""

    def __init__(self, dim: int, group: int, eps: float) -> None:
        super().__init__()
        self.group = group
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        x = x * F.silu(gate)
        grouped = x.reshape(*x.shape[:-1], x.shape[-1] // self.group, self.group)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        return grouped.reshape(x.shape) * self.weight


def _ssm_step(h: torch.Tensor, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """One token: h [B, G, R, P, N] (R = heads per group), decay [B, G, R], dtx [B, G, R, P],
    b and c [B, G, N] -> (next h, y [B, G, R, P])."""
    decay, dtx, b, c = inputs
    h = h * decay[..., None, None] + dtx[..., None] * b[:, :, None, None, :]
    y = (h * c[:, :, None, None, :]).sum(-1)
    return h, y


class Mamba2Mixer(nn.Module):
    """Parameters are named as the checkpoint's `...mixer.*` tensors (see `load_mamba2`)."""

    kind = "mamba2"

    def __init__(self, spec: Mamba2Spec) -> None:
        super().__init__()
        self.spec = spec
        self.state_size = spec.state_size
        s = spec
        # conv1d holds the checkpoint's [conv_dim, 1, K] depthwise kernel; forward applies it by hand
        self.in_proj = nn.Linear(s.hidden, s.intermediate + s.conv_dim + s.heads, bias=s.proj_bias)
        self.conv1d = nn.Conv1d(s.conv_dim, s.conv_dim, s.conv_kernel, groups=s.conv_dim, bias=s.conv_bias)
        self.dt_bias = nn.Parameter(torch.zeros(s.heads))
        self.A_log = nn.Parameter(torch.zeros(s.heads))
        self.D = nn.Parameter(torch.ones(s.heads))
        self.norm = GatedRMSNorm(s.intermediate, s.intermediate // s.n_groups, s.eps)
        self.out_proj = nn.Linear(s.intermediate, s.hidden, bias=s.proj_bias)

    def forward(self, x: torch.Tensor, state: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.spec
        batch, length = x.shape[0], x.shape[1]
        k1, groups, reps, n = s.conv_kernel - 1, s.n_groups, s.heads // s.n_groups, s.d_state
        valid = valid.to(x.dtype)  # bool or float 0/1
        conv_state = state[:, : s.conv_state_size].reshape(batch, k1, s.conv_dim)
        h0 = state[:, s.conv_state_size :].reshape(batch, groups, reps, s.head_dim, n).contiguous()

        z, xbc, dt = self.in_proj(x).split([s.intermediate, s.conv_dim, s.heads], dim=-1)

        # causal depthwise conv over (previous K-1 inputs ++ this call's inputs), as K shifted
        # multiply-adds (onnxruntime's grouped Conv measured ~25x slower at decode, L = 1)
        window = torch.cat([conv_state, xbc], dim=1)  # [B, K-1+L, conv_dim]
        weight = self.conv1d.weight[:, 0, :]  # [conv_dim, K]
        conv = window[:, 0:length] * weight[:, 0]
        for k in range(1, s.conv_kernel):
            conv = conv + window[:, k : k + length] * weight[:, k]
        if self.conv1d.bias is not None:
            conv = conv + self.conv1d.bias
        xbc = F.silu(conv)  # [B, L, conv_dim]
        # the new conv state: window[n_valid : n_valid + K-1] of each row
        n_valid = valid.sum(1).to(torch.int64)
        index = (n_valid[:, None] + torch.arange(k1, dtype=torch.int64))[:, :, None].expand(batch, k1, s.conv_dim)
        new_conv = torch.gather(window, 1, index)

        xs, b, c = xbc.split([s.intermediate, groups * n, groups * n], dim=-1)
        dt = F.softplus(dt + self.dt_bias).clamp(min=s.time_step_min) * valid[..., None]  # [B, L, heads]
        decay = torch.exp(dt * -torch.exp(self.A_log))
        xs = xs.reshape(batch, length, s.heads, s.head_dim)
        dtx = xs * dt[..., None]

        # scan over L: the time axis first (scan wants contiguous carries and inputs)
        steps = tuple(
            t.transpose(0, 1).contiguous()
            for t in (
                decay.reshape(batch, length, groups, reps),
                dtx.reshape(batch, length, groups, reps, s.head_dim),
                b.reshape(batch, length, groups, n),
                c.reshape(batch, length, groups, n),
            )
        )
        h, ys = scan(_ssm_step, h0, steps)
        y = ys.transpose(0, 1).reshape(batch, length, s.heads, s.head_dim) + xs * self.D[:, None]
        y = self.norm(y.reshape(batch, length, s.intermediate), z)
        new_state = torch.cat([new_conv.reshape(batch, -1), h.reshape(batch, -1)], dim=1)
        return self.out_proj(y), new_state


def load_mamba2(mixer: Mamba2Mixer, tensors: dict[str, np.ndarray], prefix: str) -> list[str]:
    """Set the mixer's parameters from `{prefix}{in_proj.weight, conv1d.weight, conv1d.bias, dt_bias,
    A_log, D, norm.weight, out_proj.weight}` (conv1d.bias only with conv_bias, in_proj.bias and
    out_proj.bias only with proj_bias), e.g. prefix "backbone.layers.3.mixer."; the mixer may be
    built on the meta device. Returns the tensor names used."""
    used = []
    for name, param in list(mixer.named_parameters()):
        key = prefix + name
        value = torch.from_numpy(np.array(tensors[key], dtype=np.float32, order="C"))
        if tuple(value.shape) != tuple(param.shape):
            raise ValueError(f"{key}: checkpoint shape {tuple(value.shape)} != {tuple(param.shape)}")
        owner, _, attr = name.rpartition(".")
        setattr(mixer.get_submodule(owner), attr, nn.Parameter(value, requires_grad=False))
        used.append(key)
    return used

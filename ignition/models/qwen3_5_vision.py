"""The Qwen 3.5 vision tower as a prepared vision graph: patches of one image in, its image-token
features out (docs/architecture.md, "Images").

transformers' Qwen3_5VisionModel: a Conv3d patch embedding (here one matmul over the flattened
patch, the same sum), a learned square position table bilinearly resampled to the image's grid,
axial 2D rotary over the (row, col) of each patch, pre-LayerNorm blocks with full attention over
the image's patches and a GELU(tanh) MLP, then the merger (LayerNorm, merge_size^2 neighbouring
patches concatenated, two linears around an exact GELU).

The grid-dependent index work (which table entries and weights each patch resamples, each patch's
row and column) is integer bookkeeping helios does in numpy (helios/neutral/images.py); the
graph takes it as inputs, so one graph serves every image size.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

PREFIX = "model.visual."


class VisionBlock(nn.Module):
    def __init__(self, dim: int, heads: int, intermediate: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.fc1 = nn.Linear(dim, intermediate)
        self.fc2 = nn.Linear(intermediate, dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        patches, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).reshape(patches, 3, self.heads, dim // self.heads).unbind(1)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # [heads, P, D]
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(dim // self.heads)
        out = torch.matmul(torch.softmax(scores, dim=-1), v).transpose(0, 1).reshape(patches, dim)
        x = x + self.proj(out)
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x)), approximate="tanh"))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary over the whole head: x [P, heads, D], cos/sin [P, D]."""
    half = x.shape[-1] // 2
    turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.unsqueeze(1) + turned * sin.unsqueeze(1)


class Qwen35VisionTower(nn.Module):
    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        dim, self.heads = int(config["hidden_size"]), int(config["num_heads"])
        self.merge = int(config.get("spatial_merge_size", 2))
        self.patch_size = int(config.get("patch_size", 16))
        self.temporal = int(config.get("temporal_patch_size", 2))
        channels = int(config.get("in_channels", 3))
        if config.get("hidden_act", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            raise ValueError(f"vision hidden_act {config.get('hidden_act')!r} is not supported")
        self.patch_embed = nn.Linear(channels * self.temporal * self.patch_size**2, dim)
        self.pos_embed = nn.Embedding(int(config["num_position_embeddings"]), dim)
        self.position_grid = int(int(config["num_position_embeddings"]) ** 0.5)
        theta = float((config.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        spatial = dim // self.heads // 2
        self.register_buffer("inv_freq", 1.0 / theta ** (torch.arange(0, spatial, 2, dtype=torch.float32) / spatial))
        intermediate = int(config["intermediate_size"])
        self.blocks = nn.ModuleList(VisionBlock(dim, self.heads, intermediate) for _ in range(int(config["depth"])))
        merged = dim * self.merge**2
        self.merger_norm = nn.LayerNorm(dim, eps=1e-6)
        self.merger_fc1 = nn.Linear(merged, merged)
        self.merger_fc2 = nn.Linear(merged, int(config["out_hidden_size"]))

    def forward(
        self,
        patches: torch.Tensor,  # [P, C*T*ps*ps] float32, merge-block order
        patch_rows_cols: torch.Tensor,  # [P, 2] int64: each patch's (row, col) in the image grid
        table_ids: torch.Tensor,  # [P, 4] int64: position-table entries each patch resamples
        table_weights: torch.Tensor,  # [P, 4] float32: their bilinear weights
    ) -> torch.Tensor:
        """Image-token features [P / merge^2, out_hidden]."""
        x = self.patch_embed(patches)
        x = x + (self.pos_embed(table_ids) * table_weights.unsqueeze(-1)).sum(1)
        freqs = patch_rows_cols.to(torch.float32).unsqueeze(-1) * self.inv_freq  # [P, 2, D/4]
        freqs = freqs.reshape(freqs.shape[0], -1)  # (row freqs, col freqs)
        angles = torch.cat([freqs, freqs], dim=-1)
        cos, sin = angles.cos(), angles.sin()
        for block in self.blocks:
            x = block(x, cos, sin)
        x = self.merger_norm(x).reshape(-1, x.shape[-1] * self.merge**2)
        return self.merger_fc2(F.gelu(self.merger_fc1(x)))

    def load(self, tensors: dict[str, np.ndarray]) -> None:
        """Take the checkpoint's `model.visual.*` tensors (every one must be used)."""
        used: set[str] = set()

        def take(name: str) -> torch.Tensor:
            used.add(PREFIX + name)
            return torch.from_numpy(np.array(tensors[PREFIX + name], dtype=np.float32))

        def linear(module: nn.Linear, name: str) -> None:
            module.weight.data = take(name + ".weight").reshape(module.weight.shape)
            module.bias.data = take(name + ".bias")

        def norm(module: nn.LayerNorm, name: str) -> None:
            module.weight.data, module.bias.data = take(name + ".weight"), take(name + ".bias")

        linear(self.patch_embed, "patch_embed.proj")  # the Conv3d kernel, flattened in patch order
        self.pos_embed.weight.data = take("pos_embed.weight")
        for i, block in enumerate(self.blocks):
            p = f"blocks.{i}."
            norm(block.norm1, p + "norm1")
            norm(block.norm2, p + "norm2")
            linear(block.qkv, p + "attn.qkv")
            linear(block.proj, p + "attn.proj")
            linear(block.fc1, p + "mlp.linear_fc1")
            linear(block.fc2, p + "mlp.linear_fc2")
        norm(self.merger_norm, "merger.norm")
        linear(self.merger_fc1, "merger.linear_fc1")
        linear(self.merger_fc2, "merger.linear_fc2")
        left = sorted(n for n in tensors if n.startswith(PREFIX) and n not in used)
        if left:
            raise ValueError(f"vision tensors not used by the vision graph: {left[:5]}")


def vision_tensors(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The checkpoint's vision-tower tensors under `model.visual.` (also found as `visual.*`)."""
    out = {}
    for name, value in tensors.items():
        for prefix in (PREFIX, "visual.", "model.vision_tower."):
            if name.startswith(prefix):
                out[PREFIX + name[len(prefix) :]] = value
    return out


def build_vision_tower(config: dict[str, Any], tensors: dict[str, np.ndarray]) -> Qwen35VisionTower | None:
    """The checkpoint's vision tower, or None when it has none (a text-only checkpoint)."""
    vision = config.get("vision_config")
    found = vision_tensors(tensors)
    if not isinstance(vision, dict) or not found:
        return None
    tower = Qwen35VisionTower(vision)
    tower.load(found)
    return tower.eval().requires_grad_(False)

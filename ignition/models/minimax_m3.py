"""MiniMax M3 (text): GQA with (1 + w) QK and layer norms and partial rotary; sparse layers add a
block-sparse lightning indexer; clamped SwiGLU-alpha MLPs and sigmoid experts (routed scaling on
the experts' sum, shared experts).

The indexer: per indexer head, normed and rotated query . key scores max-pooled over blocks of
`index_block` key positions (block = position // index_block); the query's own block and
`index_local - 1` before it always win; each query keeps its `index_blocks` best blocks that hold
any visible key. Attention head h uses indexer head h // (heads / index heads). The indexer key is
cached as one extra K "head" after the real ones."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ignition.models.base import FamilyError
from ignition.models.blocks.attention import GQAttention
from ignition.models.blocks.indexer import kth_best
from ignition.models.blocks.loading import TensorLoader
from ignition.models.blocks.mlp import GLU, MoEPlan
from ignition.models.blocks.norms import RMSNorm
from ignition.models.configured import ConfiguredLM
from ignition.models.plans import LayerPlan, ModelPlan, default_rope


@dataclass(frozen=True)
class AlphaGLU(GLU):
    """Clamp first (gate <= limit, |up| <= limit), then (up + 1) * gate * sigmoid(alpha * gate)."""

    alpha: float = 1.702
    limit: float = 7.0

    def unit(self) -> tuple[str, float, float]:
        return "alpha", self.limit, self.alpha


@dataclass
class BlockSparseLayerPlan(LayerPlan):
    sparse: bool = False  # the layer runs the block indexer
    index_heads: int = 0
    index_head_dim: int = 0
    index_block: int = 0  # keys per block
    index_blocks: int = 0  # selected blocks per query
    index_local: int = 0  # always-kept local blocks

    def cache_dims(self) -> tuple[int, int]:
        if self.sparse:  # the indexer key is one more K "head" after the real ones
            return self.num_kv_heads + 1, max(self.head_dim, self.v_head_dim, self.index_head_dim)
        return super().cache_dims()


def plan_minimax_m3(cfg: dict[str, Any]) -> ModelPlan:
    n = int(cfg["num_hidden_layers"])
    layer_types = list(cfg.get("layer_types") or ["full_attention"] * n)
    unknown = sorted(set(layer_types) - {"full_attention", "minimax_m3_sparse"})
    if unknown:
        raise FamilyError(f"minimax_m3_vl layer types {unknown} are not supported")
    mlp_types = list(cfg.get("mlp_layer_types") or ["sparse"] * n)
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    # As transformers builds it from config.json: partial rotary only through rope_parameters.
    theta, partial = default_rope(cfg)
    rotary = int(head_dim * partial)
    glu = AlphaGLU(alpha=float(cfg.get("swiglu_alpha", 1.702)), limit=float(cfg.get("swiglu_limit", 7.0)))
    index_dim = int(cfg.get("index_head_dim") or 0)
    if "minimax_m3_sparse" in layer_types and index_dim < rotary:
        raise FamilyError("an index_head_dim narrower than the rotary width is not supported")
    layers = []
    for i in range(n):
        moe = None
        if mlp_types[i] == "sparse":
            moe = MoEPlan(
                num_experts=int(cfg["num_local_experts"]),
                top_k=int(cfg["num_experts_per_tok"]),
                intermediate=int(cfg["intermediate_size"]),
                correction_bias=True,
                norm_eps=0.0,
                scaling=float(cfg.get("routed_scaling_factor", 1.0)),
                scale_output=True,
                shared_intermediate=int(cfg.get("shared_intermediate_size") or 0),
                glu=glu,
                shared_glu=glu,
            )
        layers.append(
            BlockSparseLayerPlan(
                kind="gqa",
                num_heads=int(cfg["num_attention_heads"]),
                num_kv_heads=int(cfg["num_key_value_heads"]),
                head_dim=head_dim,
                v_head_dim=head_dim,
                rotary_dim=rotary,
                rope_theta=theta,
                qk_norm=True,
                norm_offset=1.0,
                o_bias=False,
                intermediate=int(cfg.get("dense_intermediate_size") or 0),
                glu=glu,
                moe=moe,
                sparse=layer_types[i] == "minimax_m3_sparse",
                index_heads=int(cfg.get("index_n_heads") or 0),
                index_head_dim=index_dim,
                index_block=int(cfg.get("index_block_size") or 0),
                index_blocks=int(cfg.get("index_topk_blocks") or 0),
                index_local=int(cfg.get("index_local_blocks") or 0),
            )
        )
    eps = float(cfg.get("rms_norm_eps", 1e-6))
    return ModelPlan(layers=layers, rms_norm_eps=eps, head_norm_eps=eps, final_norm_offset=1.0)


class BlockIndexer(nn.Module):
    def __init__(self, plan: BlockSparseLayerPlan, hidden: int, eps: float) -> None:
        super().__init__()
        self.plan = plan
        self.q_proj = nn.Linear(hidden, plan.index_heads * plan.index_head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, plan.index_head_dim, bias=False)
        self.q_norm = RMSNorm(plan.index_head_dim, eps, offset=plan.norm_offset)
        self.k_norm = RMSNorm(plan.index_head_dim, eps, offset=plan.norm_offset)

    def key(self, x: torch.Tensor, rotate, step) -> torch.Tensor:
        batch, length, _ = x.shape
        return rotate(self.k_norm(self.k_proj(x).reshape(batch, length, 1, -1)), step)

    def select(self, x, rotate, step, k_new, k_past, visible) -> torch.Tensor:
        """The keys each attention head sees [B, G, rep, L, T]."""
        p = self.plan
        batch, length, _ = x.shape
        q = rotate(self.q_norm(self.q_proj(x).reshape(batch, length, p.index_heads, p.index_head_dim)), step)
        keys = torch.cat([k_past, k_new.squeeze(2)], dim=1)  # [B, T, d]
        total = keys.shape[1]
        scores = torch.einsum("blnd,btd->bnlt", q, keys)
        scores = scores.masked_fill(~visible.unsqueeze(1), float("-inf"))
        key_pos = torch.cat([torch.arange(total - length).unsqueeze(0).expand(batch, -1), step.positions], dim=1)
        key_block = (key_pos // p.index_block).reshape(batch, 1, 1, total).expand(batch, p.index_heads, length, total)
        blocks = (total + p.index_block - 1) // p.index_block  # positions < T, so block ids < this
        pooled = torch.full((batch, p.index_heads, length, blocks), float("-inf"))
        pooled = pooled.scatter_reduce(-1, key_block, scores, reduce="amax", include_self=True)
        q_block = step.positions // p.index_block  # [B, L]
        for i in range(p.index_local):
            local = (q_block - i).clamp(min=0).reshape(batch, 1, length, 1).expand(batch, p.index_heads, length, 1)
            pooled = pooled.scatter(-1, local, float("inf"))
        chosen = (pooled >= kth_best(pooled, p.index_blocks)) & (pooled > float("-inf"))  # [B, n, L, blocks]
        keep = torch.gather(chosen, -1, key_block) & visible.unsqueeze(1)  # [B, n, L, T]
        groups = p.num_kv_heads
        rep = p.num_heads // groups
        per_head = keep.repeat_interleave(p.num_heads // p.index_heads, dim=1)  # [B, H, L, T]
        return per_head.reshape(batch, groups, rep, length, total)

    def load(self, loader: TensorLoader, prefix: str) -> None:
        loader.linear(self.q_proj, prefix + "q_proj")
        loader.linear(self.k_proj, prefix + "k_proj")
        loader.norm(self.q_norm, prefix + "q_norm")
        loader.norm(self.k_norm, prefix + "k_norm")


class BlockSparseAttention(GQAttention):
    def __init__(self, plan: BlockSparseLayerPlan, hidden: int, eps: float) -> None:
        super().__init__(plan, hidden, eps)
        if plan.sparse:
            self.indexer = BlockIndexer(plan, hidden, eps)

    def select(self, x, step, past_k, k, visible):
        p = self.plan
        if not p.sparse:
            return visible, k
        k_index = self.indexer.key(x, self.rotate, step)  # [B, L, 1, d]
        past_index = past_k[:, p.num_kv_heads, :, : p.index_head_dim]  # [B, S, d]
        visible = self.indexer.select(x, self.rotate, step, k_index, past_index, visible)
        width = max(p.head_dim, p.index_head_dim)  # cache the indexer key as K "head" num_kv_heads
        cached = torch.cat([F.pad(k, (0, width - p.head_dim)), F.pad(k_index, (0, width - p.index_head_dim))], dim=2)
        return visible, cached

    def load(self, loader: TensorLoader, prefix: str) -> None:
        super().load(loader, prefix)
        if self.plan.sparse:
            self.indexer.load(loader, prefix + "indexer.")


class MiniMaxM3LM(ConfiguredLM):
    family = "minimax_m3_vl"
    model_types = ("minimax_m3_vl", "minimax_m3_vl_text")
    attention = BlockSparseAttention
    planner = staticmethod(plan_minimax_m3)

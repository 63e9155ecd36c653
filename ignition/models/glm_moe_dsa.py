"""GLM-5: DeepSeek-V3-style MLA + experts with DeepSeek sparse attention (DSA). An indexer (its
query from the MLA query latent, LayerNorm'd keys with interleaved rotary on the leading rope
dims) ranks every visible key and each query keeps its top `index_topk`; "full" layers run their
own indexer (its keys cached after the latent in the V slot), "shared" layers reuse the last
full layer's selection."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ignition.models.base import FamilyError
from ignition.models.blocks.attention import MLAttention
from ignition.models.blocks.indexer import lightning_select
from ignition.models.blocks.loading import TensorLoader
from ignition.models.blocks.rotary import rotate_leading
from ignition.models.configured import ConfiguredLM
from ignition.models.deepseek_v3 import plan_deepseek_v3
from ignition.models.plans import LayerPlan, ModelPlan


@dataclass
class DSALayerPlan(LayerPlan):
    indexer: str = "full"  # "full" | "shared"
    index_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0

    def cache_dims(self) -> tuple[int, int]:
        index = self.index_head_dim if self.indexer == "full" else 0
        return 1, self.kv_lora_rank + max(self.rotary_dim, index)


def plan_glm_moe_dsa(cfg: dict[str, Any]) -> ModelPlan:
    n = int(cfg["num_hidden_layers"])
    layer_types = list(cfg.get("layer_types") or ["indexed_attention"] * n)
    if set(layer_types) - {"indexed_attention"}:
        raise FamilyError(f"glm_moe_dsa layer types {sorted(set(layer_types))} are not supported yet")
    indexers = list(cfg.get("indexer_types") or ["full"] * n)
    if indexers and indexers[0] != "full":
        raise FamilyError("the first glm_moe_dsa layer must run its own indexer")
    mlp_types = list(cfg.get("mlp_layer_types") or [])
    dense = mlp_types.index("sparse") if "sparse" in mlp_types else n
    if mlp_types != ["dense"] * dense + ["sparse"] * (n - dense):
        raise FamilyError("glm_moe_dsa expects dense layers first, then sparse ones")
    plan = plan_deepseek_v3({**cfg, "first_k_dense_replace": dense, "rope_interleave": True}, DSALayerPlan)
    for layer, kind in zip(plan.layers, indexers):
        layer.indexer = kind
        layer.index_heads = int(cfg["index_n_heads"])
        layer.index_head_dim = int(cfg["index_head_dim"])
        layer.index_topk = int(cfg["index_topk"])
    return plan


class Indexer(nn.Module):
    """Index score of key t for query i: sum_h w_h(x_i) * relu(q_ih . k_t) / sqrt(d) (w scaled by
    heads^-0.5), q = wq_b(query latent), k = LayerNorm(wk(x)), both with interleaved rotary on
    their leading rope dims."""

    def __init__(self, plan: DSALayerPlan, hidden: int) -> None:
        super().__init__()
        self.wq_b = nn.Linear(plan.q_lora_rank, plan.index_heads * plan.index_head_dim, bias=False)
        self.wk = nn.Linear(hidden, plan.index_head_dim, bias=False)
        self.k_norm = nn.LayerNorm(plan.index_head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(hidden, plan.index_heads, bias=False)

    def key(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return rotate_leading(self.k_norm(self.wk(x)).unsqueeze(2), cos_sin, True)

    def select(self, x, q_resid, cos_sin, k_new, k_past, visible, plan: DSALayerPlan) -> torch.Tensor:
        batch, length, _ = x.shape
        q = self.wq_b(q_resid).reshape(batch, length, plan.index_heads, plan.index_head_dim)
        q = rotate_leading(q, cos_sin, True)
        keys = torch.cat([k_past, k_new.squeeze(2)], dim=1)  # [B, S+L, d]
        weights = self.weights_proj(x) * plan.index_heads**-0.5
        return lightning_select(q, keys, weights, visible, plan.index_topk)

    def load(self, loader: TensorLoader, prefix: str) -> None:
        for name in ("wq_b", "wk", "weights_proj"):
            loader.linear(getattr(self, name), prefix + name)
        loader.put(self.k_norm, "weight", loader.take(prefix + "k_norm.weight"))
        loader.put(self.k_norm, "bias", loader.take(prefix + "k_norm.bias"))


class DSAttention(MLAttention):
    def __init__(self, plan: DSALayerPlan, hidden: int, eps: float) -> None:
        super().__init__(plan, hidden, eps)
        if plan.indexer == "full":
            self.indexer = Indexer(plan, hidden)

    def select(self, x, q_resid, cos_sin, past_v, visible, step, c):
        p = self.plan
        if p.indexer == "shared":
            return step.selection, c
        k_index = self.indexer.key(x, cos_sin)  # [B, L, 1, d]
        past_index = past_v[:, 0, :, p.kv_lora_rank : p.kv_lora_rank + p.index_head_dim]  # [B, S, d]
        step.selection = self.indexer.select(x, q_resid, cos_sin, k_index, past_index, visible, p)
        return step.selection, torch.cat([c, k_index], dim=-1)

    def load(self, loader: TensorLoader, prefix: str) -> None:
        super().load(loader, prefix)
        if self.plan.indexer == "full":
            self.indexer.load(loader, prefix + "indexer.")


class GlmMoeDsaLM(ConfiguredLM):
    family = "glm_moe_dsa"
    model_types = ("glm_moe_dsa",)
    attention = DSAttention
    planner = staticmethod(plan_glm_moe_dsa)

"""Sparse-attention selection shared by the indexers: a lightning index (per-head ReLU scores
weighted per query) and a static top-k by threshold."""

from __future__ import annotations

import torch


def kth_best(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The k-th largest value of each row of scores [..., T] as [..., 1], over scores padded with
    -inf: a static k, so rows with fewer than k finite scores keep every one of them."""
    pad = torch.full((*scores.shape[:-1], k), float("-inf"))
    return torch.cat([scores, pad], dim=-1).topk(k, dim=-1)[0][..., -1:]


def lightning_select(
    q: torch.Tensor,  # [B, L, heads, d] indexer queries
    keys: torch.Tensor,  # [B, T, d] indexer keys
    weights: torch.Tensor,  # [B, L, heads] per-query head weights
    visible: torch.Tensor,  # [B, L, T] bool
    top_k: int,
) -> torch.Tensor:
    """visible & (key among the query's top_k by sum_h w_h relu(q_h . k) / sqrt(d)). Selection is by
    threshold (keys scoring at least the k-th best), which equals top-k except for exact ties."""
    scores = torch.relu(torch.einsum("blhd,btd->blht", q, keys) * q.shape[-1] ** -0.5)
    index = torch.einsum("blh,blht->blt", weights, scores).masked_fill(~visible, float("-inf"))
    return visible & (index >= kth_best(index, top_k))

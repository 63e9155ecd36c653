"""Config-driven decoders for the recipe families beyond llama-style (docs/recipes.md).

One module, `ConfiguredLM`, built from a per-layer description (`LayerPlan`) that a family
adapter (ignition/models/families.py) derives from the checkpoint's Hugging Face config. It
implements the same step-graph contract as `common.DecoderLM` (docs/architecture.md) with:

- attention kinds: grouped-query attention (`gqa`) with optional QK norms, partial rotary,
  per-layer rotary theta, sliding windows, attention sinks, value scaling and score
  soft-capping; and multi-head latent attention (`mla`, DeepSeek V2/V3), run in its absorbed
  form so the paged pool holds the compressed latent (one KV "head" of kv_lora_rank + rope
  dims), not per-head keys and values;
- MLPs: SwiGLU, or a routed mixture of experts (sigmoid or softmax scores, optional score
  correction bias, group-limited top-k, normalisation, scaling, shared experts), routed in-graph;
  non-gated squared-ReLU MLPs and experts (Nemotron-H, `PlainMLP` / `UngatedMoE`);
- recurrent layers (`RecurrentLayer` around a recurrent.MIXERS mixer: gated DeltaNet, Mamba-2)
  and single-mixer layers (`SingleLayer`, style "single": x + mixer(norm(x)) with attention
  alone or, kind "ffn", a feed-forward block alone; Nemotron-H);
- MTP heads are not part of the step graph: the loader keeps their tensors aside
  (`mtp_tensors`) and the exporter writes them into the core for later speculative decoding.

The paged pool keeps the contract's uniform geometry [layers*2*P, page_tokens, kv_heads,
head_dim]: its kv_heads/head_dim are the largest any layer needs, and a layer with fewer heads
or narrower heads uses the leading part of each slot (the rest stays zero).

Everything is plain torch ops (no onnxruntime contrib kernels): windows, sinks, soft-caps and
unequal K/V widths are outside what GroupQueryAttention's fused path is validated for here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from helios.manifest import Architecture
from ignition.models.common import logprob_stats
from ignition.models.recurrent import MIXERS, RecurrentMixer


@dataclass
class MoEPlan:
    num_experts: int
    top_k: int
    intermediate: int
    scoring: str = "sigmoid"  # "sigmoid" | "softmax"
    correction_bias: bool = False  # e_score_correction_bias added for the choice only
    n_group: int = 1
    topk_group: int = 1
    norm_topk: bool = True
    scaling: float = 1.0
    shared_intermediate: int = 0  # 0: no shared expert
    norm_eps: float = 1e-20  # added to the top-k weight sum when renormalising
    limit: float = 0.0  # clamp of the experts' SwiGLU (Step: silu(gate) <= limit, |up| <= limit); 0: none
    shared_limit: float = 0.0
    scale_after: bool = False  # routed scaling applied to the experts' sum (Step) rather than the weights
    act: str = "silu"
    glu_alpha: float = 0.0
    shared_gate: bool = False  # sigmoid(shared_expert_gate(x)) scales the shared expert (Qwen3.5 MoE)
    gated: bool = True  # False: non-gated experts down(act(up(x))) and shared expert (Nemotron-H, act "relu2")
    latent: int = 0  # non-gated experts run in this width between fc1/fc2_latent_proj (Nemotron-H); 0: hidden
    bias: bool = False  # non-gated shared expert and latent projections carry biases (Nemotron-H mlp_bias)


@dataclass
class LayerPlan:
    # "gqa" | "mla" | "ffn" (a feed-forward block alone: no attention, no K/V rows, no state;
    # style "single") | a recurrent mixer kind (recurrent.MIXERS: "gated_deltanet", "mamba2", ...)
    kind: str
    num_heads: int
    num_kv_heads: int  # gqa; mla uses 1 latent "head"
    head_dim: int  # gqa: q/k width per head; mla: qk_nope + qk_rope
    v_head_dim: int
    rotary_dim: int  # dims of each q/k head that rotate (mla: qk_rope_head_dim)
    rope_theta: float
    rope_interleave: bool = False
    window: int | None = None  # sliding window: query q sees keys k with q - k < window
    sinks: bool = False
    qk_norm: str = "none"  # "none" | "head" (per-head RMSNorm on q and k)
    scale: float = 0.0  # softmax scale; 0: 1/sqrt(head_dim)
    value_scale: float = 1.0
    softcap: float = 0.0  # attention score soft-cap (0: none)
    attention_bias: bool = False
    rope_kind: str = "default"  # "default" | "proportional" (Gemma 4 global: zero frequencies past the factor) | "yarn"
    rope_partial: float = 1.0  # proportional rope's rotating fraction
    # YaRN (DeepSeek V3 / Kimi K2): (factor, beta_fast, beta_slow, original_max_positions, truncate)
    # and the cos/sin attention factor it implies.
    rope_yarn: tuple = ()
    rope_attention: float = 1.0
    q_norm_weighted: bool = True  # qk_norm "head": per-head RMSNorm with a weight (else unscaled)
    q_scale: float = 1.0  # multiplier on the normed query (Muse Spark's qk_scale_factor)
    v_norm: bool = False  # unscaled RMSNorm on values (Gemma 4)
    k_eq_v: bool = False  # values are the raw key projection (Gemma 4 global layers, no v_proj)
    # sigmoid output gate: "" | "full" (gate_proj, Muse Spark) | "head" (g_proj, Step) | "query" (q_proj
    # yields [query, gate] per head, Qwen3.5)
    out_gate: str = ""
    norm_offset: float = 0.0  # 1.0: every RMSNorm of the layer scales by (1 + w) (Step 3.5/3.7)
    o_bias: bool = True  # o_proj carries a bias when attention_bias does (not MiMo's)
    mlp_limit: float = 0.0  # clamp of the dense SwiGLU (Step); 0: none
    o_norm: bool = False  # unscaled RMSNorm on each head's output before the gate (Muse Spark)
    kv_source: int | None = None  # read another layer's cache (Gemma 4 KV-shared layers)
    act: str = "silu"  # MLP activation: "silu" | "gelu_tanh"
    # mla only
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    # DeepSeek sparse attention (GLM-5): an indexer picks each query's top `index_topk` keys;
    # "full" layers run their own (its keys cached after the latent in the V slot), "shared" layers
    # reuse the last full layer's selection.
    indexer: str = ""  # "" | "full" | "shared" (MLA) | "block" (MiniMax M3 block-sparse, GQA)
    index_block: int = 0  # block indexer: keys per block, selected blocks, always-kept local blocks
    index_blocks: int = 0
    index_local: int = 0
    glu_alpha: float = 0.0  # act "oai": (clamp(up) + 1) * g * sigmoid(alpha * g), g = clamp(gate) (MiniMax M3)
    index_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    # mlp
    intermediate: int = 0  # dense SwiGLU width (used when moe is None)
    moe: MoEPlan | None = None
    # "pre" (pre-norm residual) | "gemma4" (sandwich norms, PLE, parallel MoE) | "muse" | "single"
    # (x + mixer(norm(x)) with one mixer: attention alone, or kind "ffn"; Nemotron-H)
    style: str = "pre"
    mlp_bias: bool = False  # dense non-gated MLP biases (act "relu2", Nemotron-H)
    mixer: dict = field(default_factory=dict)  # a recurrent kind's own settings (recurrent.MIXERS)

    @property
    def recurrent(self) -> bool:
        """The layer keeps per-sequence recurrent state instead of K/V rows in the pool."""
        return self.kind in MIXERS

    @property
    def attends(self) -> bool:
        """The layer attends over its history, so it has K/V rows in the pool."""
        return self.kind in ("gqa", "mla")

    def cache_dims(self) -> tuple[int, int]:
        """(kv heads, head width) this layer needs in the pool."""
        if self.kind == "mla":
            index = self.index_head_dim if self.indexer == "full" else 0
            return 1, self.kv_lora_rank + max(self.rotary_dim, index)
        if self.indexer == "block":  # the indexer key is one more K "head" after the real ones
            return self.num_kv_heads + 1, max(self.head_dim, self.v_head_dim, self.index_head_dim)
        return self.num_kv_heads, max(self.head_dim, self.v_head_dim)


@dataclass
class ModelPlan:
    layers: list[LayerPlan]
    rms_norm_eps: float
    head_norm_eps: float = 1e-6  # the q_a/kv_a latent norms of MLA and QK norms
    final_softcap: float = 0.0
    mtp_layers: int = 0
    embed_scale: float = 1.0  # Gemma: embeddings times sqrt(hidden)
    ple_dim: int = 0  # Gemma 4 per-layer input embeddings width (0: none)
    ple_vocab: int = 0
    final_norm_offset: float = 0.0  # 1.0: the final norm scales by (1 + w)
    embed_norm: bool = False  # unscaled RMSNorm on the embeddings (Muse Spark)
    logit_multiplier: float = 1.0  # logits times this before the soft-cap (Muse Spark output_multiplier)
    extra: dict = field(default_factory=dict)


def plan_cache_dims(plan: ModelPlan) -> tuple[int, int]:
    dims = [layer.cache_dims() for layer in plan.layers if layer.attends]
    return max(h for h, _ in dims), max(d for _, d in dims)


def kv_layer_indices(plan: ModelPlan) -> list[int]:
    """The layers with K/V rows in the pool, in order: pool layer j is model layer kv[j] (recurrent
    and feed-forward-only layers have none, so the pool of a hybrid model holds only its attention
    layers)."""
    return [i for i, layer in enumerate(plan.layers) if layer.attends]


def state_layers(plan: ModelPlan, hidden: int) -> list[tuple[int, str, int, int]]:
    """(layer, kind, offset, size) of every recurrent layer's slice of a sequence's state row."""
    out, offset = [], 0
    for i, layer in enumerate(plan.layers):
        if layer.recurrent:
            size = MIXERS[layer.kind].state_size(layer, hidden)
            out.append((i, layer.kind, offset, size))
            offset += size
    return out


class RMSNorm(nn.Module):
    """x / rms(x) times `weight` (+ `offset`: 1 for the (1 + w) "centered" norms of Step/Muse), or
    unscaled when not weighted."""

    def __init__(self, dim: int, eps: float, weighted: bool = True, offset: float = 0.0) -> None:
        super().__init__()
        self.eps = eps
        self.weighted = weighted
        self.offset = offset
        if weighted:
            self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if not self.weighted:
            return out
        return out * (self.weight + self.offset) if self.offset else out * self.weight


def rotate(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], interleave: bool) -> torch.Tensor:
    """Rotary on x [B, L, heads, rot] with cos/sin [B, L, 1, rot/2] of its positions (HF
    formulations: rotate-half, or DeepSeek's interleaved pairs, whose output HF writes
    de-interleaved; q and k alike)."""
    cos, sin = cos_sin
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def attend(
    q: torch.Tensor,  # [B, L, H, Dk]
    k: torch.Tensor,  # [B, L, G, Dk] new keys
    v: torch.Tensor,  # [B, L, G, Dv]
    past_k: torch.Tensor,  # [B, G, S, Dk] history (pool pages, in order)
    past_v: torch.Tensor,  # [B, G, S, Dv]
    visible: torch.Tensor,  # [B, L, S+L] bool: StepState.visible
    scale: float,
    sinks: torch.Tensor | None = None,  # [H]
    softcap: float = 0.0,
) -> torch.Tensor:
    """Causal attention of each row's new tokens over its history and themselves -> [B, L, H, Dv].

    Query head h uses KV head h // (H/G) (HF order). Padded query rows see at least new key 0
    (themselves or earlier), so no row is all-masked."""
    batch, length, heads, dim = q.shape
    groups = k.shape[2]
    rep = heads // groups
    keys = torch.cat([past_k, k.transpose(1, 2)], dim=2)  # [B, G, S+L, Dk]
    values = torch.cat([past_v, v.transpose(1, 2)], dim=2)
    qg = q.reshape(batch, length, groups, rep, dim).permute(0, 2, 3, 1, 4)  # [B, G, rep, L, Dk]
    scores = torch.matmul(qg, keys.unsqueeze(2).transpose(-1, -2)) * scale  # [B, G, rep, L, S+L]
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    mask = visible[:, None, None] if visible.dim() == 3 else visible  # [B, L, T] or [B, G, rep, L, T]
    scores = scores.masked_fill(~mask, torch.finfo(torch.float32).min)
    if sinks is not None:
        sink = sinks.reshape(1, groups, rep, 1, 1).expand(batch, groups, rep, length, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, values.unsqueeze(2))  # [B, G, rep, L, Dv]
    return out.permute(0, 3, 1, 2, 4).reshape(batch, length, heads, values.shape[-1])


class GQAttention(nn.Module):
    def __init__(self, plan: LayerPlan, hidden: int, eps: float) -> None:
        super().__init__()
        self.plan = plan
        h, g = plan.num_heads, plan.num_kv_heads
        shared = plan.kv_source is not None
        width = 2 if plan.out_gate == "query" else 1
        self.q_proj = nn.Linear(hidden, h * plan.head_dim * width, bias=plan.attention_bias)
        if not shared:
            self.k_proj = nn.Linear(hidden, g * plan.head_dim, bias=plan.attention_bias)
            if not plan.k_eq_v:
                self.v_proj = nn.Linear(hidden, g * plan.v_head_dim, bias=plan.attention_bias)
        self.o_proj = nn.Linear(h * plan.v_head_dim, hidden, bias=plan.attention_bias and plan.o_bias)
        if plan.qk_norm == "head":
            self.q_norm = RMSNorm(plan.head_dim, eps, plan.q_norm_weighted, plan.norm_offset)
            if not shared:
                self.k_norm = RMSNorm(plan.head_dim, eps, plan.q_norm_weighted, plan.norm_offset)
        if plan.v_norm:
            self.v_norm = RMSNorm(plan.v_head_dim, eps, weighted=False)
        if plan.out_gate == "full":
            self.gate_proj = nn.Linear(hidden, h * plan.v_head_dim, bias=False)
        elif plan.out_gate == "head":
            self.g_proj = nn.Linear(hidden, h, bias=False)
        if plan.o_norm:
            self.o_norm = RMSNorm(plan.v_head_dim, eps, weighted=False)
        if plan.sinks:
            self.sinks = nn.Parameter(torch.zeros(h))
        if plan.indexer == "block":
            self.indexer = BlockIndexer(plan, hidden, eps)
        self.register_buffer("inv_freq", layer_inv_freq(plan), persistent=False)

    def _rotate(self, t: torch.Tensor, step: StepState) -> torch.Tensor:
        p, r = self.plan, self.plan.rotary_dim
        if not r:
            return t
        cos_sin = step.cos_sin(p, self.inv_freq)
        if r == t.shape[-1]:
            return rotate(t, cos_sin, p.rope_interleave)
        return torch.cat([rotate(t[..., :r], cos_sin, p.rope_interleave), t[..., r:]], dim=-1)

    def forward(self, x, step, past_k, past_v, shared=None):  # noqa: ANN001, ANN201
        p = self.plan
        batch, length, _ = x.shape
        gate = None
        if p.out_gate == "query":  # per head: head_dim query dims, then head_dim gate dims
            q, gate = self.q_proj(x).reshape(batch, length, p.num_heads, 2 * p.head_dim).chunk(2, dim=-1)
            gate = gate.reshape(batch, length, -1)
        else:
            q = self.q_proj(x).reshape(batch, length, p.num_heads, p.head_dim)
        if p.qk_norm == "head":
            q = self.q_norm(q)
        q = self._rotate(q * p.q_scale if p.q_scale != 1.0 else q, step)
        if shared is not None:  # a KV-shared layer: the source layer's new keys and values
            k, v = shared
        else:
            k = self.k_proj(x).reshape(batch, length, p.num_kv_heads, p.head_dim)
            v = k if p.k_eq_v else self.v_proj(x).reshape(batch, length, p.num_kv_heads, p.v_head_dim)
            if p.qk_norm == "head":
                k = self.k_norm(k)
            k = self._rotate(k, step)
            if p.v_norm:
                v = self.v_norm(v)
            if p.value_scale != 1.0:
                v = v * p.value_scale
        visible = step.visible(past_k.shape[2], p.window)
        if p.indexer == "block":
            k_index = self.indexer.key(x, self._rotate, step)  # [B, L, 1, d]
            past_index = past_k[:, p.num_kv_heads, :, : p.index_head_dim]  # [B, S, d]
            visible = self.indexer.select(x, self._rotate, step, k_index, past_index, visible)
        past_k = past_k[:, : p.num_kv_heads, :, : p.head_dim]
        past_v = past_v[:, : p.num_kv_heads, :, : p.v_head_dim]
        scale = p.scale or 1.0 / math.sqrt(p.head_dim)
        sinks = self.sinks if p.sinks else None
        out = attend(q, k, v, past_k, past_v, visible, scale, sinks, p.softcap)
        if p.o_norm:
            out = self.o_norm(out)
        if p.out_gate == "head":
            out = out * torch.sigmoid(self.g_proj(x)).unsqueeze(-1)
        out = out.reshape(batch, length, -1)
        if p.out_gate == "full":
            out = out * torch.sigmoid(self.gate_proj(x))
        elif gate is not None:
            out = out * torch.sigmoid(gate)
        if p.indexer == "block":  # cache the indexer key as K "head" num_kv_heads
            width = max(p.head_dim, p.index_head_dim)
            k = torch.cat([F.pad(k, (0, width - p.head_dim)), F.pad(k_index, (0, width - p.index_head_dim))], dim=2)
        return self.o_proj(out), k, v


class MLAttention(nn.Module):
    """DeepSeek multi-head latent attention, absorbed: scores and values in the latent space.

    q_nope . k_nope = q_nope . (W_UK c) = (W_UK^T q_nope) . c, and o = W_UV (sum p c), so the
    pool stores only c = kv_a_layernorm(latent) and the shared rotary key (as K = [c, k_pe],
    V = [c]); the result equals the expanded form up to float rounding."""

    def __init__(self, plan: LayerPlan, hidden: int, eps: float) -> None:
        super().__init__()
        self.plan = plan
        h, rope, nope, rank = plan.num_heads, plan.rotary_dim, plan.qk_nope_head_dim, plan.kv_lora_rank
        if plan.q_lora_rank:
            self.q_a_proj = nn.Linear(hidden, plan.q_lora_rank, bias=plan.attention_bias)
            self.q_a_layernorm = RMSNorm(plan.q_lora_rank, eps)
            self.q_b_proj = nn.Linear(plan.q_lora_rank, h * (nope + rope), bias=False)
        else:
            self.q_proj = nn.Linear(hidden, h * (nope + rope), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, rank + rope, bias=plan.attention_bias)
        self.kv_a_layernorm = RMSNorm(rank, eps)
        self.kv_b_proj = nn.Linear(rank, h * (nope + plan.v_head_dim), bias=False)
        self.o_proj = nn.Linear(h * plan.v_head_dim, hidden, bias=plan.attention_bias)
        self.register_buffer("inv_freq", layer_inv_freq(plan), persistent=False)
        if plan.indexer == "full":
            self.indexer = Indexer(plan, hidden)

    def forward(self, x, step, past_k, past_v, shared=None):  # noqa: ANN001, ANN201
        p = self.plan
        batch, length, _ = x.shape
        h, rope, nope, rank = p.num_heads, p.rotary_dim, p.qk_nope_head_dim, p.kv_lora_rank
        q_resid = self.q_a_layernorm(self.q_a_proj(x)) if p.q_lora_rank else None
        q = self.q_b_proj(q_resid) if p.q_lora_rank else self.q_proj(x)
        q = q.reshape(batch, length, h, nope + rope)
        q_nope, q_pe = q.split([nope, rope], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([rank, rope], dim=-1)
        c = self.kv_a_layernorm(latent).unsqueeze(2)  # [B, L, 1, rank]
        cos_sin = step.cos_sin(p, self.inv_freq)
        q_pe = rotate(q_pe, cos_sin, p.rope_interleave)
        k_pe = rotate(k_pe.unsqueeze(2), cos_sin, p.rope_interleave)
        w = self.kv_b_proj.weight.reshape(h, nope + p.v_head_dim, rank)
        w_uk, w_uv = w[:, :nope], w[:, nope:]  # [h, nope, rank], [h, v, rank]
        q_lat = torch.einsum("blhn,hnr->blhr", q_nope, w_uk)
        query = torch.cat([q_lat, q_pe], dim=-1)
        key = torch.cat([c, k_pe], dim=-1)  # [B, L, 1, rank+rope]
        scale = p.scale or 1.0 / math.sqrt(nope + rope)
        visible = step.visible(past_k.shape[2], None)
        value = c
        if p.indexer == "full":
            k_index = self.indexer.key(x, cos_sin, p.rope_interleave)  # [B, L, 1, d]
            past_index = past_v[:, 0, :, rank : rank + p.index_head_dim]  # [B, S, d]
            visible = self.indexer.select(x, q_resid, cos_sin, k_index, past_index, visible, p)
            step.dsa_selection = visible
            value = torch.cat([c, k_index], dim=-1)
        elif p.indexer == "shared":
            visible = step.dsa_selection
        past_k, past_v = past_k[:, :1, :, : rank + rope], past_v[:, :1, :, :rank]
        out = attend(query, key, c, past_k, past_v, visible, scale)  # [B, L, h, rank]
        out = torch.einsum("blhr,hvr->blhv", out, w_uv)
        return self.o_proj(out.reshape(batch, length, -1)), key, value


class BlockIndexer(nn.Module):
    """MiniMax M3 lightning indexer: per indexer head, query . key scores (normed, rotary on the
    leading dims) max-pooled over key blocks of `index_block` positions (block = position //
    index_block); the query's own block and `index_local - 1` before it always win; each query
    keeps its `index_blocks` best blocks that hold any visible key. Attention head h uses indexer
    head h // (heads / index heads)."""

    def __init__(self, plan: LayerPlan, hidden: int, eps: float) -> None:
        super().__init__()
        self.plan = plan
        self.q_proj = nn.Linear(hidden, plan.index_heads * plan.index_head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, plan.index_head_dim, bias=False)
        self.q_norm = RMSNorm(plan.index_head_dim, eps, offset=plan.norm_offset)
        self.k_norm = RMSNorm(plan.index_head_dim, eps, offset=plan.norm_offset)

    def key(self, x: torch.Tensor, rotate_fn, step) -> torch.Tensor:  # noqa: ANN001
        batch, length, _ = x.shape
        return rotate_fn(self.k_norm(self.k_proj(x).reshape(batch, length, 1, -1)), step)

    def select(self, x, rotate_fn, step, k_new, k_past, visible) -> torch.Tensor:  # noqa: ANN001
        p = self.plan
        batch, length, _ = x.shape
        q = rotate_fn(self.q_norm(self.q_proj(x).reshape(batch, length, p.index_heads, p.index_head_dim)), step)
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
        pad = torch.full((batch, p.index_heads, length, p.index_blocks), float("-inf"))
        kth = torch.cat([pooled, pad], dim=-1).topk(p.index_blocks, dim=-1)[0][..., -1:]
        chosen = (pooled >= kth) & (pooled > float("-inf"))  # [B, n, L, blocks]
        keep = torch.gather(chosen, -1, key_block) & visible.unsqueeze(1)  # [B, n, L, T]
        groups = p.num_kv_heads
        rep = p.num_heads // groups
        per_head = keep.repeat_interleave(p.num_heads // p.index_heads, dim=1)  # [B, H, L, T]
        return per_head.reshape(batch, groups, rep, length, total)


class Indexer(nn.Module):
    """GLM-5 / DeepSeek-V3.2 sparse-attention indexer: index score of key t for query i is
    sum_h w_h(x_i) * relu(q_ih . k_t) / sqrt(d) (w scaled by heads^-0.5), q from the MLA query
    latent, k = LayerNorm(wk(x)) with interleaved rotary on its leading rope dims. Each query keeps
    its top `index_topk` visible keys (all of them while fewer are visible)."""

    def __init__(self, plan: LayerPlan, hidden: int) -> None:
        super().__init__()
        self.wq_b = nn.Linear(plan.q_lora_rank, plan.index_heads * plan.index_head_dim, bias=False)
        self.wk = nn.Linear(hidden, plan.index_head_dim, bias=False)
        self.k_norm = nn.LayerNorm(plan.index_head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(hidden, plan.index_heads, bias=False)

    @staticmethod
    def _rope(t: torch.Tensor, cos_sin, interleave: bool, rope: int) -> torch.Tensor:  # noqa: ANN001
        return torch.cat([rotate(t[..., :rope], cos_sin, interleave), t[..., rope:]], dim=-1)

    def key(self, x: torch.Tensor, cos_sin, interleave: bool) -> torch.Tensor:  # noqa: ANN001
        k = self.k_norm(self.wk(x)).unsqueeze(2)
        return self._rope(k, cos_sin, True, cos_sin[0].shape[-1] * 2)

    def select(self, x, q_resid, cos_sin, k_new, k_past, visible, plan: LayerPlan) -> torch.Tensor:  # noqa: ANN001
        batch, length, _ = x.shape
        q = self.wq_b(q_resid).reshape(batch, length, plan.index_heads, plan.index_head_dim)
        q = self._rope(q, cos_sin, True, cos_sin[0].shape[-1] * 2)
        keys = torch.cat([k_past, k_new.squeeze(2)], dim=1)  # [B, S+L, d]
        scores = torch.relu(torch.einsum("blnd,btd->blnt", q, keys) * plan.index_head_dim**-0.5)
        weights = self.weights_proj(x) * plan.index_heads**-0.5
        index = torch.einsum("bln,blnt->blt", weights, scores)
        index = index.masked_fill(~visible, float("-inf"))
        # The k-th largest score (a static k over scores padded with -inf, so short histories
        # keep every visible key); keys scoring at least that are selected.
        pad = torch.full((batch, length, plan.index_topk), float("-inf"))
        kth = torch.cat([index, pad], dim=-1).topk(plan.index_topk, dim=-1)[0][..., -1:]
        return visible & (index >= kth)


def activation(name: str, x: torch.Tensor) -> torch.Tensor:
    if name == "silu":
        return F.silu(x)
    if name == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if name == "relu2":  # squared ReLU (Nemotron-H)
        return torch.square(F.relu(x))
    raise ValueError(f"unknown activation {name!r}")


class SwiGLU(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int, act: str = "silu", limit: float = 0.0, alpha: float = 0.0) -> None:
        super().__init__()
        self.act = act
        self.limit = limit
        self.alpha = alpha
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(glu(self.act, self.gate_proj(x), self.up_proj(x), self.limit, self.alpha))


class PlainMLP(nn.Module):
    """Non-gated MLP: down(act(up(x))) (Nemotron-H's squared-ReLU layers and shared expert)."""

    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool = False) -> None:
        super().__init__()
        self.act = act
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(activation(self.act, self.up_proj(x)))


def glu(act: str, gate: torch.Tensor, up: torch.Tensor, limit: float = 0.0, alpha: float = 0.0) -> torch.Tensor:
    if act == "oai":  # MiniMax M3: clamp first, then (up + 1) * g * sigmoid(alpha * g)
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
        return (up + 1.0) * (gate * torch.sigmoid(gate * alpha))
    gate = activation(act, gate)
    if limit:  # Step's clamped SwiGLU
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return gate * up


class MoE(nn.Module):
    """Routed experts computed densely and combined with the sparse routing weights: exact, and
    one einsum per projection in the graph (a gather-by-expert decode path is future work)."""

    def __init__(self, plan: MoEPlan, hidden: int) -> None:
        super().__init__()
        self.plan = plan
        e, i = plan.num_experts, plan.intermediate
        self.gate_weight = nn.Parameter(torch.zeros(e, hidden))
        if plan.correction_bias:
            self.correction_bias = nn.Parameter(torch.zeros(e))
        self.experts_gate = nn.Parameter(torch.zeros(e, i, hidden))
        self.experts_up = nn.Parameter(torch.zeros(e, i, hidden))
        self.experts_down = nn.Parameter(torch.zeros(e, hidden, i))
        if plan.shared_intermediate:
            self.shared_experts = SwiGLU(hidden, plan.shared_intermediate, plan.act, plan.shared_limit, plan.glu_alpha)
        if plan.shared_gate:
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        p = self.plan
        logits = x @ self.gate_weight.t()
        scores = logits.sigmoid() if p.scoring == "sigmoid" else logits.softmax(-1)
        choice = scores + self.correction_bias if p.correction_bias else scores
        if p.n_group > 1:
            n = choice.shape[0]
            grouped = choice.reshape(n, p.n_group, p.num_experts // p.n_group)
            group_scores = grouped.topk(2, dim=-1)[0].sum(-1)
            group_idx = group_scores.topk(p.topk_group, dim=-1)[1]
            keep = torch.zeros_like(group_scores).scatter(1, group_idx, 1.0) > 0
            keep = keep.unsqueeze(-1).expand_as(grouped).reshape(n, p.num_experts)
            choice = choice.masked_fill(~keep, float("-inf"))
        idx = choice.topk(p.top_k, dim=-1)[1]
        weights = scores.gather(1, idx)
        if p.norm_topk:
            weights = weights / (weights.sum(-1, keepdim=True) + p.norm_eps)
        return idx, weights if p.scale_after else weights * p.scaling

    def experts(self, flat: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, act: str = "silu") -> torch.Tensor:
        dense = torch.zeros(flat.shape[0], self.plan.num_experts).scatter(1, idx, weights)  # [N, E]
        gate = torch.einsum("nh,eih->eni", flat, self.experts_gate)
        up = torch.einsum("nh,eih->eni", flat, self.experts_up)
        act = self.plan.act if act == "silu" else act
        down = torch.einsum("eni,ehi->enh", glu(act, gate, up, self.plan.limit, self.plan.glu_alpha), self.experts_down)
        out = (down * dense.t().unsqueeze(-1)).sum(0)
        return out * self.plan.scaling if self.plan.scale_after else out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        idx, weights = self.route(flat)
        out = self.experts(flat, idx, weights)
        if self.plan.shared_intermediate:
            shared = self.shared_experts(flat)
            if self.plan.shared_gate:
                shared = torch.sigmoid(self.shared_expert_gate(flat)) * shared
            out = out + shared
        return out.reshape(shape)


class UngatedMoE(MoE):
    """Nemotron-H's expert block: routed as MoE.route (sigmoid, correction bias for the choice,
    group-limited top-k, renormalised, scaled) on the full hidden state; non-gated experts
    down(act(up(h))), computed densely like MoE's, where h is the input or, with a latent width,
    fc1_latent_proj(input) (the weighted sum then goes through fc2_latent_proj); plus a non-gated
    shared expert on the input."""

    def __init__(self, plan: MoEPlan, hidden: int) -> None:
        nn.Module.__init__(self)
        self.plan = plan
        e, i, width = plan.num_experts, plan.intermediate, plan.latent or hidden
        self.gate_weight = nn.Parameter(torch.zeros(e, hidden))
        if plan.correction_bias:
            self.correction_bias = nn.Parameter(torch.zeros(e))
        self.experts_up = nn.Parameter(torch.zeros(e, i, width))
        self.experts_down = nn.Parameter(torch.zeros(e, width, i))
        if plan.latent:
            self.fc1_latent_proj = nn.Linear(hidden, plan.latent, bias=plan.bias)
            self.fc2_latent_proj = nn.Linear(plan.latent, hidden, bias=plan.bias)
        if plan.shared_intermediate:
            self.shared_experts = PlainMLP(hidden, plan.shared_intermediate, plan.act, plan.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        idx, weights = self.route(flat)
        h = self.fc1_latent_proj(flat) if self.plan.latent else flat
        dense = torch.zeros(flat.shape[0], self.plan.num_experts).scatter(1, idx, weights)  # [N, E]
        up = activation(self.plan.act, torch.einsum("nh,eih->eni", h, self.experts_up))
        down = torch.einsum("eni,ehi->enh", up, self.experts_down)
        out = (down * dense.t().unsqueeze(-1)).sum(0)
        if self.plan.latent:
            out = self.fc2_latent_proj(out)
        if self.plan.shared_intermediate:
            out = out + self.shared_experts(flat)
        return out.reshape(shape)


class GemmaMoE(MoE):
    """Gemma 4's expert block: router on the unscaled-normed residual (times a learned scale and
    hidden^-0.5), softmax, top-k renormalised, per-expert scales; GELU-tanh experts."""

    def __init__(self, plan: MoEPlan, hidden: int, eps: float) -> None:
        super().__init__(plan, hidden)
        self.router_norm = RMSNorm(hidden, eps, weighted=False)
        self.router_scale = nn.Parameter(torch.ones(hidden))
        self.per_expert_scale = nn.Parameter(torch.ones(plan.num_experts))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.router_norm(x) * self.router_scale * (x.shape[-1] ** -0.5)
        probs = torch.softmax(h @ self.gate_weight.t(), dim=-1)
        weights, idx = probs.topk(self.plan.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        return idx, weights * self.per_expert_scale[idx]


class Layer(nn.Module):
    """Pre-norm residual block (llama / DeepSeek / MiMo)."""

    def __init__(self, plan: LayerPlan, hidden: int, eps: float, head_eps: float) -> None:
        super().__init__()
        self.plan = plan
        self.input_layernorm = RMSNorm(hidden, eps, offset=plan.norm_offset)
        self.post_attention_layernorm = RMSNorm(hidden, eps, offset=plan.norm_offset)
        self.self_attn = (MLAttention if plan.kind == "mla" else GQAttention)(plan, hidden, head_eps)
        self.mlp = MoE(plan.moe, hidden) if plan.moe else SwiGLU(hidden, plan.intermediate, plan.act, plan.mlp_limit, plan.glu_alpha)

    def forward(self, x, step, past_k, past_v, shared=None, per_layer_input=None):  # noqa: ANN001, ANN201
        attn, k, v = self.self_attn(self.input_layernorm(x), step, past_k, past_v, shared)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), k, v


class SingleLayer(nn.Module):
    """x + mixer(norm(x)) with exactly one mixer (Nemotron-H's "*", "-" and "E" layers): attention
    (kind "gqa"), or (kind "ffn") a feed-forward block alone: a non-gated or gated dense MLP, or
    experts. Feed-forward layers have no K/V rows and no state."""

    def __init__(self, plan: LayerPlan, hidden: int, eps: float, head_eps: float) -> None:
        super().__init__()
        self.plan = plan
        self.input_layernorm = RMSNorm(hidden, eps, offset=plan.norm_offset)
        if plan.kind == "ffn":
            if plan.moe is not None:
                self.mlp = MoE(plan.moe, hidden) if plan.moe.gated else UngatedMoE(plan.moe, hidden)
            elif plan.act == "relu2":
                self.mlp = PlainMLP(hidden, plan.intermediate, plan.act, plan.mlp_bias)
            else:
                self.mlp = SwiGLU(hidden, plan.intermediate, plan.act, plan.mlp_limit, plan.glu_alpha)
        elif plan.kind == "gqa":
            self.self_attn = GQAttention(plan, hidden, head_eps)
        else:
            raise ValueError(f"single-mixer layers take kind 'gqa' or 'ffn', not {plan.kind!r}")

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.input_layernorm(x))

    def forward(self, x, step, past_k, past_v, shared=None, per_layer_input=None):  # noqa: ANN001, ANN201
        attn, k, v = self.self_attn(self.input_layernorm(x), step, past_k, past_v, shared)
        return x + attn, k, v


class RecurrentLayer(nn.Module):
    """Pre-norm residual block around a recurrent mixer (Qwen3.5 linear-attention layers), with
    an optional MLP (none when the plan has neither experts nor an intermediate width)."""

    def __init__(self, plan: LayerPlan, hidden: int, eps: float) -> None:
        super().__init__()
        self.plan = plan
        self.input_layernorm = RMSNorm(hidden, eps, offset=plan.norm_offset)
        self.mixer: RecurrentMixer = MIXERS[plan.kind].build(plan, hidden, eps)
        self.has_mlp = bool(plan.moe or plan.intermediate)
        if self.has_mlp:
            self.post_attention_layernorm = RMSNorm(hidden, eps, offset=plan.norm_offset)
            self.mlp = MoE(plan.moe, hidden) if plan.moe else SwiGLU(hidden, plan.intermediate, plan.act, plan.mlp_limit)

    def forward(self, x, state, valid):  # noqa: ANN001, ANN201
        h, new_state = self.mixer(self.input_layernorm(x), state, valid)
        x = x + h
        if self.has_mlp:
            x = x + self.mlp(self.post_attention_layernorm(x))
        return x, new_state


class Gemma4Layer(nn.Module):
    """Gemma 4: sandwich norms around attention and the MLP, an optional expert block in parallel
    with the dense MLP, an optional per-layer input (PLE) and a per-layer output scalar."""

    def __init__(self, plan: LayerPlan, hidden: int, eps: float, ple_dim: int) -> None:
        super().__init__()
        self.plan = plan
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps)
        self.self_attn = GQAttention(plan, hidden, eps)
        self.mlp = SwiGLU(hidden, plan.intermediate, plan.act)
        if plan.moe:
            self.moe = GemmaMoE(plan.moe, hidden, eps)
            self.post_feedforward_layernorm_1 = RMSNorm(hidden, eps)
            self.post_feedforward_layernorm_2 = RMSNorm(hidden, eps)
            self.pre_feedforward_layernorm_2 = RMSNorm(hidden, eps)
        if ple_dim:
            self.per_layer_input_gate = nn.Linear(hidden, ple_dim, bias=False)
            self.per_layer_projection = nn.Linear(ple_dim, hidden, bias=False)
            self.post_per_layer_input_norm = RMSNorm(hidden, eps)
        self.layer_scalar = nn.Parameter(torch.ones(1))

    def forward(self, x, step, past_k, past_v, shared=None, per_layer_input=None):  # noqa: ANN001, ANN201
        attn, k, v = self.self_attn(self.input_layernorm(x), step, past_k, past_v, shared)
        x = x + self.post_attention_layernorm(attn)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        if self.plan.moe:
            flat = x.reshape(-1, x.shape[-1])
            idx, weights = self.moe.route(flat)
            experts = self.moe.experts(self.pre_feedforward_layernorm_2(flat), idx, weights, self.plan.act)
            h = self.post_feedforward_layernorm_1(h) + self.post_feedforward_layernorm_2(experts.reshape(x.shape))
        x = x + self.post_feedforward_layernorm(h)
        if per_layer_input is not None:
            g = activation(self.plan.act, self.per_layer_input_gate(x)) * per_layer_input
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(g))
        return x * self.layer_scalar, k, v


class InputScaledRMSNorm(nn.Module):
    """Muse Spark: rms_norm(x * (1 + w)) (the scale before the norm)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * (1.0 + self.weight)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class ResidualGate(nn.Module):
    """Muse Spark: alpha * residual + beta * h with beta = sigmoid(g / T) and
    alpha = sqrt(max(sigmoid(-g / T) * (1 + beta), 1e-3))."""

    def __init__(self, hidden: int, temperature: float) -> None:
        super().__init__()
        self.temperature = temperature
        self.gate = nn.Parameter(torch.zeros(hidden))

    def forward(self, residual: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        w = self.gate / self.temperature
        beta = torch.sigmoid(w)
        alpha = torch.sqrt(torch.clamp(torch.sigmoid(-w) * (1.0 + beta), min=1e-3))
        return alpha * residual + beta * h


class MuseMoE(MoE):
    """Muse Spark's expert block: sigmoid router (logits x output_multiplier, bias for the choice,
    weights renormalised then scaled) on the layer input; experts run in a projected width
    (pre_expert_proj -> (1 + w) norm -> experts, each output input-scale-normed -> weighted sum ->
    post_expert_proj)."""

    def __init__(self, plan: MoEPlan, hidden: int, moe_hidden: int, eps: float, post_eps: float, multiplier: float) -> None:
        super().__init__(plan, moe_hidden)
        self.gate_weight = nn.Parameter(torch.zeros(plan.num_experts, hidden))
        self.multiplier = multiplier
        self.pre_expert_proj = nn.Linear(hidden, moe_hidden, bias=False)
        self.pre_expert_norm = RMSNorm(moe_hidden, eps, offset=1.0)
        self.post_expert_norm = InputScaledRMSNorm(moe_hidden, post_eps)
        self.post_expert_proj = nn.Linear(moe_hidden, hidden, bias=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = torch.sigmoid((x @ self.gate_weight.t()) * self.multiplier)
        idx = (scores + self.correction_bias).topk(self.plan.top_k, dim=-1)[1]
        weights = scores.gather(1, idx)
        weights = weights / (weights.sum(-1, keepdim=True) + self.plan.norm_eps)
        return idx, weights * self.plan.scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        idx, weights = self.route(flat)
        h = self.pre_expert_norm(self.pre_expert_proj(flat))
        dense = torch.zeros(flat.shape[0], self.plan.num_experts).scatter(1, idx, weights)  # [N, E]
        gate = torch.einsum("nh,eih->eni", h, self.experts_gate)
        up = torch.einsum("nh,eih->eni", h, self.experts_up)
        down = self.post_expert_norm(torch.einsum("eni,ehi->enh", F.silu(gate) * up, self.experts_down))
        out = (down * dense.t().unsqueeze(-1)).sum(0)
        return self.post_expert_proj(out).reshape(shape)


class MuseLayer(nn.Module):
    """Muse Spark: (1 + w) pre-norms, unscaled post-norms / input-scaled post-FFN norm, and learned
    residual gates instead of plain residual adds."""

    def __init__(self, plan: LayerPlan, hidden: int, eps: float, extra: dict) -> None:
        super().__init__()
        self.plan = plan
        post_eps = extra["post_norm_eps"]
        self.input_layernorm = RMSNorm(hidden, eps, offset=1.0)
        self.self_attn = GQAttention(plan, hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, post_eps, weighted=False)
        self.post_attention_residual_gate = ResidualGate(hidden, extra["residual_gate_temperature"])
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps, offset=1.0)
        if plan.moe:
            self.mlp = MuseMoE(plan.moe, hidden, extra["moe_hidden_size"], eps, post_eps, extra["output_multiplier"])
        else:
            self.mlp = SwiGLU(hidden, plan.intermediate, plan.act)
        self.post_feedforward_layernorm = InputScaledRMSNorm(hidden, post_eps)
        self.post_feedforward_residual_gate = ResidualGate(hidden, extra["residual_gate_temperature"])

    def forward(self, x, step, past_k, past_v, shared=None, per_layer_input=None):  # noqa: ANN001, ANN201
        attn, k, v = self.self_attn(self.input_layernorm(x), step, past_k, past_v, shared)
        x = self.post_attention_residual_gate(x, self.post_attention_layernorm(attn))
        h = self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return self.post_feedforward_residual_gate(x, h), k, v


def _inv_freq(rotary_dim: int, theta: float) -> torch.Tensor:
    if not rotary_dim:
        return torch.zeros(0)
    # As transformers computes it (float32 exponent), so positions rotate identically.
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))


def yarn_inv_freq(dim: int, theta: float, factor: float, beta_fast: float, beta_slow: float, original: int,
                  truncate: bool) -> torch.Tensor:
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


def layer_inv_freq(plan: LayerPlan) -> torch.Tensor:
    """Rotary frequencies of a layer (computed, never loaded)."""
    if plan.rope_kind == "yarn":
        return yarn_inv_freq(plan.rotary_dim, plan.rope_theta, *plan.rope_yarn)
    if plan.rope_kind == "proportional":  # transformers' _compute_proportional_rope_parameters
        dim = plan.rotary_dim
        angles = int(plan.rope_partial * dim // 2)
        rotated = 1.0 / (plan.rope_theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / dim))
        return torch.cat([rotated, torch.zeros(dim // 2 - angles)])
    return _inv_freq(plan.rotary_dim, plan.rope_theta)


class StepState:
    """Per-step inputs every layer shares, with the rotary tables and visibility masks built once
    per step (per rotary kind / window), not once per layer: fewer graph nodes, faster export."""

    def __init__(self, positions: torch.Tensor, history_lens: torch.Tensor) -> None:
        self.positions = positions
        self.history_lens = history_lens
        self._cos_sin: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._visible: dict[int | None, torch.Tensor] = {}

    def cos_sin(self, plan: LayerPlan, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        key = (plan.rope_kind, plan.rotary_dim, plan.rope_theta, plan.rope_partial, plan.rope_yarn)
        if key not in self._cos_sin:
            freqs = self.positions.to(torch.float32).unsqueeze(-1) * inv_freq  # [B, L, rot/2]
            cos, sin = freqs.cos().unsqueeze(2), freqs.sin().unsqueeze(2)
            if plan.rope_attention != 1.0:  # YaRN's attention factor scales cos and sin
                cos, sin = cos * plan.rope_attention, sin * plan.rope_attention
            self._cos_sin[key] = cos, sin
        return self._cos_sin[key]

    def visible(self, hist: int, window: int | None) -> torch.Tensor:
        """[B, L, S+L] bool: history slot j (position j) is visible to new token i iff
        j < history_lens[b]; new key i' iff i' <= i; and, with a window, q - k < window."""
        if window not in self._visible:
            batch, length = self.positions.shape
            hist_ok = torch.arange(hist).unsqueeze(0) < self.history_lens.unsqueeze(1)  # [B, S]
            idx = torch.arange(length)
            causal = (idx.unsqueeze(0) <= idx.unsqueeze(1)).unsqueeze(0).expand(batch, length, length)
            visible = torch.cat([hist_ok.unsqueeze(1).expand(batch, length, hist), causal], dim=-1)
            if window is not None:
                key_pos = torch.cat([torch.arange(hist).unsqueeze(0).expand(batch, hist), self.positions], dim=1)
                visible = visible & ((self.positions.unsqueeze(2) - key_pos.unsqueeze(1)) < window)
            self._visible[window] = visible
        return self._visible[window]


class ConfiguredLM(nn.Module):
    """The step graph for a `ModelPlan` (same inputs and outputs as common.DecoderLM).

    A plan with recurrent layers (LayerPlan.recurrent) gives a state-bearing graph: two more
    inputs, `state_pool` [S, W] and `state_slots` [B], and one more output, `new_state` [B, W]
    (docs/architecture.md, "Recurrent state"). The paged pool then holds only the attention
    layers (`kv_layers`), in order."""

    def __init__(self, arch: Architecture, plan: ModelPlan) -> None:
        super().__init__()
        self.arch = arch
        self.plan = plan
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(
            RecurrentLayer(p, arch.hidden_size, plan.rms_norm_eps)
            if p.recurrent
            else SingleLayer(p, arch.hidden_size, plan.rms_norm_eps, plan.head_norm_eps)
            if p.style == "single"
            else Gemma4Layer(p, arch.hidden_size, plan.rms_norm_eps, plan.ple_dim)
            if p.style == "gemma4"
            else MuseLayer(p, arch.hidden_size, plan.rms_norm_eps, plan.extra)
            if p.style == "muse"
            else Layer(p, arch.hidden_size, plan.rms_norm_eps, plan.head_norm_eps)
            for p in plan.layers
        )
        self.kv_layers = kv_layer_indices(plan)
        self._kv_index = {layer: j for j, layer in enumerate(self.kv_layers)}
        self.state_layout = state_layers(plan, arch.hidden_size)
        self.state_width = sum(size for _, _, _, size in self.state_layout)
        if plan.embed_norm:
            self.embed_norm = RMSNorm(arch.hidden_size, plan.rms_norm_eps, weighted=False)
        if plan.ple_dim:  # Gemma 4 per-layer inputs: a token table and a projection of the embedding
            n = len(plan.layers)
            self.embed_tokens_per_layer = nn.Embedding(plan.ple_vocab, n * plan.ple_dim)
            self.per_layer_model_projection = nn.Linear(arch.hidden_size, n * plan.ple_dim, bias=False)
            self.per_layer_projection_norm = RMSNorm(plan.ple_dim, plan.rms_norm_eps)
        self.norm = RMSNorm(arch.hidden_size, plan.rms_norm_eps, offset=plan.final_norm_offset)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self.mtp_tensors: dict[str, np.ndarray] = {}

    def _history(self, kv_pool, block_tables, layer: int):  # noqa: ANN001, ANN202
        batch, pages = block_tables.shape
        num_pages = kv_pool.shape[0] // (2 * len(self.kv_layers))
        _, tokens, heads, dim = kv_pool.shape
        j = self._kv_index[layer]
        out = []
        for kind in (0, 1):
            rows = (2 * j + kind) * num_pages + block_tables.reshape(-1)
            kv = torch.index_select(kv_pool, 0, rows).reshape(batch, pages * tokens, heads, dim)
            out.append(kv.transpose(1, 2))
        return out

    def hidden_states(self, input_ids, positions, history_lens, block_tables, kv_pool, query_lens=None, state=None):  # noqa: ANN001, ANN201
        """Final-normed hidden states [B, L, H], the attention layers' new (k, v) padded to the pool,
        and the recurrent layers' new state [B, W] (None without recurrent layers).

        state: [B, W] each row's state after its history (zeros for none given); query_lens: valid
        new tokens per row (all L when None)."""
        heads, dim = self.arch.num_kv_heads, self.arch.head_dim
        plan = self.plan
        x = self.embed_tokens(input_ids)
        if plan.embed_scale != 1.0:
            x = x * torch.tensor(plan.embed_scale, dtype=torch.float32)
        if plan.embed_norm:
            x = self.embed_norm(x)
        per_layer = None
        if plan.ple_dim:
            n = len(plan.layers)
            tokens = self.embed_tokens_per_layer(input_ids) * torch.tensor(plan.ple_dim**0.5, dtype=torch.float32)
            tokens = tokens.reshape(*input_ids.shape, n, plan.ple_dim)
            context = self.per_layer_model_projection(x) * (self.arch.hidden_size**-0.5)
            context = self.per_layer_projection_norm(context.reshape(*input_ids.shape, n, plan.ple_dim))
            per_layer = (context + tokens) * (2.0**-0.5)
        step = StepState(positions, history_lens)
        new_kv, produced, new_state = [], {}, []
        valid = None
        if self.state_width:
            batch, length = input_ids.shape
            if state is None:
                state = torch.zeros(batch, self.state_width)
            if query_lens is None:
                valid = torch.ones(batch, length, dtype=torch.bool)
            else:
                valid = torch.arange(length).unsqueeze(0) < query_lens.unsqueeze(1)
        slices = {layer: (offset, size) for layer, _, offset, size in self.state_layout}
        for i, layer in enumerate(self.layers):
            if i in slices:
                offset, size = slices[i]
                x, s = layer(x, state[:, offset : offset + size], valid)
                new_state.append(s)
                continue
            if not layer.plan.attends:  # a feed-forward block alone (Nemotron-H "-" / "E" layers)
                x = layer.feed_forward(x)
                continue
            source = layer.plan.kv_source
            past_k, past_v = self._history(kv_pool, block_tables, i if source is None else source)
            shared = produced[source] if source is not None else None
            ple = per_layer[:, :, i] if per_layer is not None else None
            x, k, v = layer(x, step, past_k, past_v, shared, ple)
            produced[i] = (k, v)
            for t in (k, v):
                pad = (0, dim - t.shape[-1], 0, heads - t.shape[-2])
                new_kv.append(F.pad(t, pad) if any(pad) else t)
        return self.norm(x), new_kv, (torch.cat(new_state, dim=-1) if new_state else None)

    def logits_of(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(h)
        if self.plan.logit_multiplier != 1.0:
            logits = logits * self.plan.logit_multiplier
        if self.plan.final_softcap:
            logits = torch.tanh(logits / self.plan.final_softcap) * self.plan.final_softcap
        return logits

    def forward(self, input_ids, positions, history_lens, query_lens, block_tables, kv_pool, logprob_token_ids,  # noqa: ANN001, ANN201
                state_pool=None, state_slots=None):  # fmt: skip
        state = None
        if self.state_width:
            # Each row continues its slot's state; a row without history starts from zeros, so a
            # fresh slot needs no zeroing (and stale contents, even non-finite ones, never leak).
            gathered = torch.index_select(state_pool, 0, state_slots)
            state = torch.where((history_lens > 0).unsqueeze(1), gathered, torch.zeros_like(gathered))
        normed, new_kv, new_state = self.hidden_states(
            input_ids, positions, history_lens, block_tables, kv_pool, query_lens, state
        )
        batch, length, hidden = normed.shape
        last = (query_lens - 1).view(-1, 1, 1).expand(-1, 1, hidden)
        logits = self.logits_of(torch.gather(normed, 1, last).squeeze(1))
        logprobs, lse, top_logprobs, top_ids = logprob_stats(logits)
        token_logprobs = torch.gather(logprobs, 1, logprob_token_ids)
        kv = torch.stack(new_kv, dim=0).reshape(
            len(self.kv_layers), 2, batch, length, self.arch.num_kv_heads, self.arch.head_dim
        )
        if new_state is not None:
            return logits, lse, top_logprobs, top_ids, token_logprobs, kv, normed, new_state
        return logits, lse, top_logprobs, top_ids, token_logprobs, kv, normed

    @torch.no_grad()
    def reference(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits [T, V] of one whole sequence as a single prefill over an empty pool."""
        length = ids.shape[0]
        pool = torch.zeros(2 * len(self.kv_layers), 1, self.arch.num_kv_heads, self.arch.head_dim)
        normed, _, _ = self.hidden_states(
            ids.unsqueeze(0), torch.arange(length).unsqueeze(0), torch.zeros(1, dtype=torch.int64),
            torch.zeros(1, 1, dtype=torch.int64), pool,
        )  # fmt: skip
        return self.logits_of(normed[0])

"""The pre-norm GQA + fused-SwiGLU decoder on onnxruntime's fused kernels, shared by the families
whose checkpoints fit it exactly, written to export as a clean ONNX step graph.

Everything here is plain torch (no transformers): the same module runs
- `forward(...)`: the paged "step" contract of docs/architecture.md (what gets exported), and
- `reference(ids)`: a plain causal full-sequence forward with no paging, used only to check the
  paged path (parity), so it is deliberately written differently (repeat KV heads, triu mask).

Export notes (why the code looks the way it does):
- The hot ops (add+RMSNorm, rotary, paged GQA attention) go through ignition.models.ops, which
  exports them as onnxruntime's fused contrib kernels (or as plain ops, see ops.py).
- Q/K/V and gate/up are fused projections (one matmul each, one MatMulNBits when quantized).
- Logits are computed only at each row's last valid token: the lm_head (the biggest matmul in a
  small model) runs on B rows, not B*L.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from helios.manifest import Architecture
from ignition.models import ops
from ignition.models.base import StepModel
from ignition.models.blocks.loading import TensorLoader, check_fully_loaded
from ignition.models.blocks.norms import RMSNorm
from ignition.models.blocks.rotary import Rotary


class StepContext:
    """Per-step inputs every layer shares."""

    def __init__(
        self,
        num_layers: int,
        positions: torch.Tensor,
        history_lens: torch.Tensor,
        query_lens: torch.Tensor,
        block_tables: torch.Tensor,
        kv_pool: torch.Tensor,
    ) -> None:
        self.num_layers = num_layers
        self.positions = positions
        self.history_lens = history_lens
        self.query_lens = query_lens
        self.block_tables = block_tables
        self.kv_pool = kv_pool


class Attention(nn.Module):
    def __init__(self, arch: Architecture, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = arch.num_heads
        self.num_kv_heads = arch.num_kv_heads
        self.head_dim = arch.head_dim
        self.group = arch.num_heads // arch.num_kv_heads
        self.q_width = arch.num_heads * arch.head_dim
        self.kv_width = arch.num_kv_heads * arch.head_dim
        # One fused projection: a single large matmul beats three small ones, and it is one
        # MatMulNBits after quantization.
        self.qkv_proj = nn.Linear(arch.hidden_size, self.q_width + 2 * self.kv_width, bias=arch.attention_bias)
        self.o_proj = nn.Linear(self.q_width, arch.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, ctx: StepContext, rotary: Rotary):
        """Paged step attention: (output [B, L, H], new k, new v [B, L, kvh*D], k rotated)."""
        # Rotary, the layer's pool pages and causal GQA in one op (ai.flare.PagedAttention in the
        # exported graph: the pages are read in place).
        out, k, v = ops.pool_attention(
            self.qkv_proj(x),
            ctx.positions,
            rotary.cos_cache,
            rotary.sin_cache,
            ctx.kv_pool,
            ctx.block_tables,
            ctx.history_lens,
            ctx.query_lens,
            self.layer,
            ctx.num_layers,
            self.num_heads,
            self.num_kv_heads,
        )
        return self.o_proj(out), k, v

    def reference(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Plain causal attention over one whole sequence x [1, T, H] (no paging, repeated KV)."""
        _, length, _ = x.shape
        q, k, v = self.qkv_proj(x).split([self.q_width, self.kv_width, self.kv_width], dim=-1)
        q = Rotary.apply(q.reshape(1, length, self.num_heads, self.head_dim), cos, sin)
        k = Rotary.apply(k.reshape(1, length, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.reshape(1, length, self.num_kv_heads, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [1, heads, T, D]
        k = k.repeat_interleave(self.group, dim=1)
        v = v.repeat_interleave(self.group, dim=1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
        future = torch.ones(length, length, dtype=torch.bool).triu(1)
        probs = scores.masked_fill(future, float("-inf")).softmax(-1)
        return self.o_proj((probs @ v).transpose(1, 2).reshape(1, length, -1))


class FusedSwiGLU(nn.Module):
    """SwiGLU with gate and up fused into one projection."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, arch: Architecture, layer: int) -> None:
        super().__init__()
        self.eps = arch.rms_norm_eps
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, fusable=True)
        self.self_attn = Attention(arch, layer)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, fusable=True)
        self.mlp = FusedSwiGLU(arch.hidden_size, arch.intermediate_size)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, ctx: StepContext, rotary: Rotary):
        """nano-vllm style residual stream: x is the previous block's output (not yet added),
        residual the running sum, so each norm is one fused add+norm."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = ops.add_rms_norm(x, residual, self.input_layernorm.weight, self.eps)
        attn, k, v = self.self_attn(h, ctx, rotary)
        h, residual = ops.add_rms_norm(attn, residual, self.post_attention_layernorm.weight, self.eps)
        return self.mlp(h), residual, k, v

    def reference(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn.reference(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))

    def load(self, loader: TensorLoader, p: str) -> None:
        """Hugging Face names, fusing q/k/v and gate/up."""
        attn, mlp = self.self_attn, self.mlp
        loader.put(attn.qkv_proj, "weight", loader.take(*(p + f"self_attn.{n}_proj.weight" for n in "qkv")))
        if attn.qkv_proj.bias is not None:
            loader.put(attn.qkv_proj, "bias", loader.take(*(p + f"self_attn.{n}_proj.bias" for n in "qkv")))
        loader.put(attn.o_proj, "weight", loader.take(p + "self_attn.o_proj.weight"))
        loader.put(mlp.gate_up_proj, "weight", loader.take(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"))
        loader.put(mlp.down_proj, "weight", loader.take(p + "mlp.down_proj.weight"))
        loader.put(self.input_layernorm, "weight", loader.take(p + "input_layernorm.weight"))
        loader.put(self.post_attention_layernorm, "weight", loader.take(p + "post_attention_layernorm.weight"))


class DecoderLM(StepModel):
    """The fused-kernel decoder implementing the step-graph contract. A family subclasses it to say
    which checkpoints it takes (which attention biases they carry)."""

    def __init__(self, arch: Architecture) -> None:
        super().__init__()
        self.arch = arch
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch, i) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, fusable=True)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self.rotary = Rotary(arch.head_dim, arch.rope_theta, arch.max_position_embeddings, arch.rope_scaling)

    @classmethod
    def build(cls, arch: Architecture, config: dict[str, Any], tensors: dict[str, np.ndarray]) -> DecoderLM:
        """q/k/v and gate/up fused. Built on the meta device (no random init, no allocation):
        load_hf_tensors then swaps in the checkpoint tensors and checks that none is left on meta."""
        if arch.num_heads % arch.num_kv_heads:
            raise ValueError(f"num_heads {arch.num_heads} is not a multiple of num_kv_heads {arch.num_kv_heads}")
        with torch.device("meta"):
            model = cls(arch)
        model.rotary.reset_parameters()  # the rotary table is computed on CPU, not loaded
        model.load_hf_tensors(tensors)
        return model.eval().requires_grad_(False)

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, L] int64
        positions: torch.Tensor,  # [B, L] int64
        history_lens: torch.Tensor,  # [B] int64
        query_lens: torch.Tensor,  # [B] int64
        block_tables: torch.Tensor,  # [B, M] int64
        kv_pool: torch.Tensor,  # [layers*2*P, page_tokens, kvh, D] float32
        logprob_token_ids: torch.Tensor,  # [B, E] int64: caller-chosen ids to score
        logit_rows: torch.Tensor | None = None,  # [N] int64: the row of each output position
        logit_positions: torch.Tensor | None = None,  # [N] int64: its position in the row
    ) -> tuple[torch.Tensor, ...]:
        """The step graph: (logits [N,V], logsumexp [N], top_logprobs [N,K], top_ids [N,K],
        token_logprobs [N,E], new_kv [layers, 2, B, L, kvh, D], hidden [B, L, H])."""
        ctx = StepContext(self.arch.num_layers, positions, history_lens, query_lens, block_tables, kv_pool)
        x, residual = self.embed_tokens(input_ids), None
        new_kv = []
        for layer in self.layers:
            x, residual, k, v = layer(x, residual, ctx, self.rotary)
            new_kv += [k, v]
        # The final norm runs on every position (it is per-token and cheap): `hidden` is what
        # the prompt-scoring head (ignition.export.score) multiplies by the lm_head. Only each
        # row's last valid token goes through the lm_head here.
        batch, length, _ = x.shape
        normed, _ = ops.add_rms_norm(x, residual, self.norm.weight, self.arch.rms_norm_eps)
        outputs = self.step_outputs(normed, query_lens, logprob_token_ids, logit_rows, logit_positions)
        # One concat for every layer's K/V, then one small transpose into the contract layout.
        kv = torch.cat(new_kv, dim=-1).reshape(
            batch, length, self.arch.num_layers, 2, self.arch.num_kv_heads, self.arch.head_dim
        )
        return *outputs, kv.permute(2, 3, 0, 1, 4, 5), normed

    @torch.no_grad()
    def reference(self, ids: torch.Tensor) -> torch.Tensor:
        """Causal full-sequence forward of one sequence ids [T] -> logits [T, V] (no paging)."""
        cos, sin = self.rotary.cos_sin(torch.arange(ids.shape[0]).unsqueeze(0))
        x = self.embed_tokens(ids.unsqueeze(0))
        for layer in self.layers:
            x = layer.reference(x, cos, sin)
        return self.lm_head(self.norm(x))[0]

    def load_hf_tensors(self, tensors: dict[str, np.ndarray]) -> None:
        """Take Hugging Face-named tensors. Every parameter must be set and every checkpoint
        tensor used (a silent leftover is a naming bug)."""
        # Parameters share the checkpoint's numpy memory where it allows (no copy), so the model
        # can be built on the meta device without allocating anything.
        loader = TensorLoader(tensors, copy=False)
        loader.put(self.embed_tokens, "weight", loader.take("model.embed_tokens.weight"))
        for i, layer in enumerate(self.layers):
            layer.load(loader, f"model.layers.{i}.")
        loader.put(self.norm, "weight", loader.take("model.norm.weight"))
        loader.lm_head(self)
        check_fully_loaded(self, tensors, loader.used)

"""Building blocks shared by every decoder family, written to export as a clean ONNX step graph.

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

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from helios.manifest import Architecture
from ignition.models import ops

TOP_K = 20  # natural alternatives the step graph returns (manifest Logprobs.max_top_logprobs)


def logprob_stats(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw-distribution statistics of logits [N, V] in fp32: (log-softmax [N, V], logsumexp [N],
    the TOP_K best logprobs [N, K] (decreasing; ONNX TopK breaks ties by lower id) and their ids).
    Shared by the step graph and the prompt-scoring head so both report identical numbers."""
    # onnxruntime's LogSoftmax is vectorized; its ReduceLogSumExp over a 152k vocabulary is
    # ~6x slower. logsumexp = max logit - max logprob (both at the top-1 id): exact to fp32.
    logprobs = torch.log_softmax(logits, dim=-1)
    top_logprobs, top_ids = torch.topk(logprobs, TOP_K, dim=-1)
    lse = torch.gather(logits, 1, top_ids[:, :1]).squeeze(1) - top_logprobs[:, 0]
    return logprobs, lse, top_logprobs, top_ids


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x / sqrt(...) (not * rsqrt) is the pattern onnxruntime fuses into
        # SimplifiedLayerNormalization; every other norm is the fused add_rms_norm op.
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Rotary(nn.Module):
    """Non-interleaved ("rotate half") rotary embedding, the Hugging Face llama/qwen2 layout.

    The step graph looks positions up in cos/sin tables (what onnxruntime's RotaryEmbedding
    takes); the reference path computes them from inv_freq the way HF does, so the two are
    independent implementations checked against each other.
    """

    def __init__(self, head_dim: int, theta: float, max_positions: int) -> None:
        super().__init__()
        self.head_dim, self.theta, self.max_positions = head_dim, theta, max_positions
        self.register_buffer("inv_freq", torch.empty(head_dim // 2), persistent=False)
        self.register_buffer("cos_cache", torch.empty(max_positions, head_dim // 2), persistent=False)
        self.register_buffer("sin_cache", torch.empty(max_positions, head_dim // 2), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # Computed (never loaded), in float64 then rounded: the tables are exact to fp32.
        exponent = torch.arange(0, self.head_dim, 2, dtype=torch.float64) / self.head_dim
        inv_freq = 1.0 / (self.theta**exponent)
        angles = torch.arange(self.max_positions, dtype=torch.float64).unsqueeze(1) * inv_freq
        self.inv_freq = inv_freq.float()
        self.cos_cache = angles.cos().float()
        self.sin_cache = angles.sin().float()

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [...] -> cos, sin [..., 1, head_dim] (HF formulation, reference path)."""
        freqs = positions.to(torch.float32).unsqueeze(-1) * self.inv_freq
        emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(-2)
        return emb.cos(), emb.sin()

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


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
            self.qkv_proj(x), ctx.positions, rotary.cos_cache, rotary.sin_cache, ctx.kv_pool, ctx.block_tables,
            ctx.history_lens, ctx.query_lens, self.layer, ctx.num_layers, self.num_heads, self.num_kv_heads,
        )  # fmt: skip
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


class MLP(nn.Module):
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
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = Attention(arch, layer)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = MLP(arch.hidden_size, arch.intermediate_size)

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


class DecoderLM(nn.Module):
    """A llama-style decoder implementing the step-graph contract. Families subclass it only to
    say how checkpoint tensors map onto it (see qwen2.py, llama.py)."""

    def __init__(self, arch: Architecture) -> None:
        super().__init__()
        self.arch = arch
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch, i) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self.rotary = Rotary(arch.head_dim, arch.rope_theta, arch.max_position_embeddings)

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, L] int64
        positions: torch.Tensor,  # [B, L] int64
        history_lens: torch.Tensor,  # [B] int64
        query_lens: torch.Tensor,  # [B] int64
        block_tables: torch.Tensor,  # [B, M] int64
        kv_pool: torch.Tensor,  # [layers*2*P, page_tokens, kvh, D] float32
        logprob_token_ids: torch.Tensor,  # [B, E] int64: caller-chosen ids to score
    ) -> tuple[torch.Tensor, ...]:
        """The step graph: (logits [B,V], logsumexp [B], top_logprobs [B,K], top_ids [B,K],
        token_logprobs [B,E], new_kv [layers, 2, B, L, kvh, D], hidden [B, L, H])."""
        ctx = StepContext(self.arch.num_layers, positions, history_lens, query_lens, block_tables, kv_pool)
        x, residual = self.embed_tokens(input_ids), None
        new_kv = []
        for layer in self.layers:
            x, residual, k, v = layer(x, residual, ctx, self.rotary)
            new_kv += [k, v]
        # The final norm runs on every position (it is per-token and cheap): `hidden` is what
        # the prompt-scoring head (ignition.export.score) multiplies by the lm_head. Only each
        # row's last valid token goes through the lm_head here.
        batch, length, hidden = x.shape
        normed, _ = ops.add_rms_norm(x, residual, self.norm.weight, self.arch.rms_norm_eps)
        last = (query_lens - 1).view(-1, 1, 1).expand(-1, 1, hidden)
        logits = self.lm_head(torch.gather(normed, 1, last).squeeze(1))
        logprobs, lse, top_logprobs, top_ids = logprob_stats(logits)
        # Explicit ids: gathered from the full-vocabulary log-softmax (api.md logprob_token_ids).
        token_logprobs = torch.gather(logprobs, 1, logprob_token_ids)
        # One concat for every layer's K/V, then one small transpose into the contract layout.
        kv = torch.cat(new_kv, dim=-1).reshape(
            batch, length, self.arch.num_layers, 2, self.arch.num_kv_heads, self.arch.head_dim
        )
        return logits, lse, top_logprobs, top_ids, token_logprobs, kv.permute(2, 3, 0, 1, 4, 5), normed

    @torch.no_grad()
    def reference(self, ids: torch.Tensor) -> torch.Tensor:
        """Causal full-sequence forward of one sequence ids [T] -> logits [T, V] (no paging)."""
        cos, sin = self.rotary.cos_sin(torch.arange(ids.shape[0]).unsqueeze(0))
        x = self.embed_tokens(ids.unsqueeze(0))
        for layer in self.layers:
            x = layer.reference(x, cos, sin)
        return self.lm_head(self.norm(x))[0]

    # -- loading -----------------------------------------------------------------------------

    def load_hf_tensors(self, tensors: dict[str, np.ndarray]) -> None:
        """Take Hugging Face-named tensors, fusing q/k/v and gate/up. Every parameter must be set
        and every checkpoint tensor used (a silent leftover is a naming bug)."""
        # Parameters share the checkpoint's numpy memory where it allows (no copy), so the model
        # can be built on the meta device without allocating anything.
        loader = TensorLoader(tensors, copy=False)
        take, put, used = loader.take, loader.put, loader.used

        put(self.embed_tokens, "weight", take("model.embed_tokens.weight"))
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            put(attn.qkv_proj, "weight", take(*(p + f"self_attn.{n}_proj.weight" for n in "qkv")))
            if attn.qkv_proj.bias is not None:
                put(attn.qkv_proj, "bias", take(*(p + f"self_attn.{n}_proj.bias" for n in "qkv")))
            put(attn.o_proj, "weight", take(p + "self_attn.o_proj.weight"))
            put(mlp.gate_up_proj, "weight", take(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"))
            put(mlp.down_proj, "weight", take(p + "mlp.down_proj.weight"))
            put(layer.input_layernorm, "weight", take(p + "input_layernorm.weight"))
            put(layer.post_attention_layernorm, "weight", take(p + "post_attention_layernorm.weight"))
        put(self.norm, "weight", take("model.norm.weight"))
        load_lm_head(self, tensors, take, put)
        check_fully_loaded(self, tensors, used)


class TensorLoader:
    """Sets module parameters from Hugging Face-named checkpoint tensors and records which names
    were used (for `check_fully_loaded`). `take` of several names concatenates them (fused
    projections); `put` swaps a parameter for the tensor after checking its shape."""

    def __init__(self, tensors: dict[str, np.ndarray], copy: bool = True) -> None:
        self.tensors = tensors
        self.copy = copy  # False: share the numpy memory when it is C-contiguous and writable
        self.used: set[str] = set()

    def take(self, *names: str) -> torch.Tensor:
        parts = []
        for name in names:
            if name not in self.tensors:
                raise KeyError(f"checkpoint has no tensor {name!r}")
            self.used.add(name)
            array = np.asarray(self.tensors[name], dtype=np.float32)
            if self.copy or not (array.flags.c_contiguous and array.flags.writeable):
                array = np.array(array, dtype=np.float32, order="C")
            parts.append(torch.from_numpy(array))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def put(self, module: nn.Module, attr: str, value: torch.Tensor) -> None:
        param = getattr(module, attr)
        if tuple(param.shape) != tuple(value.shape):
            raise ValueError(
                f"{attr} of {type(module).__name__}: checkpoint shape {tuple(value.shape)} != {tuple(param.shape)}"
            )
        setattr(module, attr, nn.Parameter(value, requires_grad=False))

    def linear(self, module: nn.Linear, name: str) -> None:
        """`name`.weight, and `name`.bias when the module has one."""
        self.put(module, "weight", self.take(name + ".weight"))
        if module.bias is not None:
            self.put(module, "bias", self.take(name + ".bias"))


def load_lm_head(model: nn.Module, tensors: dict[str, np.ndarray], take, put) -> None:  # noqa: ANN001
    """The checkpoint's lm_head.weight, or the token embedding when the architecture ties them."""
    if "lm_head.weight" in tensors:
        put(model.lm_head, "weight", take("lm_head.weight"))
    elif model.arch.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    else:
        raise KeyError("checkpoint has no lm_head.weight and the architecture is not tied")


def check_fully_loaded(model: nn.Module, tensors: dict[str, np.ndarray], used: set[str]) -> None:
    """Every checkpoint tensor used and every parameter set: a silent leftover is a naming bug.
    Precomputed rotary tables some writers store are recomputed in-graph, never loaded."""
    leftover = sorted(n for n in set(tensors) - used if not n.endswith("rotary_emb.inv_freq"))
    if leftover:
        raise ValueError(f"checkpoint tensors not used by the {model.arch.family} model: {leftover[:5]}")
    meta = [n for n, t in model.state_dict().items() if t.is_meta]
    if meta:
        raise ValueError(f"parameters not set from the checkpoint: {meta[:5]}")

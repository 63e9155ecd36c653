"""DeepSeek-V4 (transformers `deepseek_v4`) as a step graph over the paged KV pool.

The architecture (transformers 5.24 `modeling_deepseek_v4.py`):
- shared-KV MQA (one K=V head, interleaved partial rotary on the trailing dims, per-head sinks),
  over a sliding window of `sliding_window` tokens on every layer;
- compressed attention layers add compressed KV entries, one per window of `m` tokens:
  HCA ("heavily compressed", non-overlapping windows) and CSA ("compressed sparse": entry w mixes
  window w-1's first series with window w's second one, and a lightning indexer keeps each
  query's top `index_topk` entries);
- hyper-connections (`hc_mult` residual streams mixed by Sinkhorn-normalised weights, collapsed
  by a hyper head before the final norm), grouped low-rank output projection, and hash-routed
  (token id -> experts table) or top-k routed MoE with clamped SwiGLU and a shared expert.

Stateless paging. transformers keeps a compressor cache (buffered tokens, emitted entries, the
overlap slice). Here every compressed entry is a deterministic function of per-token projections
of its window (and of the previous window for CSA), so the pool stores, per layer and token, a
vector of "channels" and each step recomputes the entries from the gathered history plus the new
tokens (O(T) per step; the reference emits them once):

  sliding layers  [kv (D)]                                  kv: normed, rotated K=V
  HCA layers      [kv (D) | ckv (D) | cgate (D)]            compressor projections (raw gate)
  CSA layers      [kv (D) | ckv (2D) | cgate (2D) | ikv (2Di) | igate (2Di)]   + the indexer's

The pool keeps the contract's uniform geometry: head_dim = D and kv_heads = ceil(widest / 2D);
a token's channels fill K's heads then V's heads of its slot (the rest stays zero). A query at
position p sees history/new keys at positions j <= p with p - j < sliding_window, and compressed
entry w iff its window is complete, (w + 1) * m <= p + 1 (transformers' causal threshold); the
entry carries rotary position w * m. A buffered (incomplete) window is simply not visible yet.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from helios.manifest import Architecture
from ignition.models.base import FamilyError, StepModel
from ignition.models.blocks.loading import TensorLoader, check_fully_loaded
from ignition.models.blocks.norms import RMSNorm
from ignition.models.blocks.rotary import default_inv_freq, yarn_attention_factor, yarn_inv_freq
from ignition.models.deepseek_v4_layers import CSA, HCA, SLIDING, HyperHead, Layer, V4Plan, V4Step

_RATIO_TYPES = {0: SLIDING, 4: CSA, 128: HCA}  # legacy per-layer `compress_ratios`


def plan_of(config: dict[str, Any]) -> V4Plan:
    """A V4Plan from a config.json dict (its `text_config` when nested), with the legacy keys
    DeepseekV4Config.__post_init__ folds in (compress_ratios, compress_rate_csa/hca,
    num_hash_layers, qk_rope_head_dim, flat rope_parameters / rope_scaling)."""
    inner = config.get("text_config")
    cfg = inner if isinstance(inner, dict) and inner else config
    n = int(cfg.get("num_hidden_layers", 43))
    rates = {CSA: 4, HCA: 128, **(cfg.get("compress_rates") or {})}
    rates[CSA] = int(cfg.get("compress_rate_csa") or rates[CSA])
    rates[HCA] = int(cfg.get("compress_rate_hca") or rates[HCA])
    layer_types = cfg.get("layer_types")
    if layer_types is None and cfg.get("compress_ratios") is not None:
        layer_types = [_RATIO_TYPES[int(r)] for r in cfg["compress_ratios"]]
    if layer_types is None:
        layer_types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    mlp_types = cfg.get("mlp_layer_types")
    if mlp_types is None:
        hashed = int(cfg.get("num_hash_layers", 3))
        mlp_types = ["hash_moe"] * min(n, hashed) + ["moe"] * max(0, n - hashed)
    head_dim = int(cfg.get("head_dim", 512))
    partial = cfg.get("partial_rotary_factor")
    if partial is None:
        partial = cfg["qk_rope_head_dim"] / head_dim if cfg.get("qk_rope_head_dim") else 64 / 512
    rope = cfg.get("rope_parameters") or {}
    if isinstance(rope.get("compress"), dict):
        compress = dict(rope["compress"])
        main_theta = float(rope.get("main", {}).get("rope_theta", cfg.get("rope_theta", 10000.0)))
    else:
        flat = {**(cfg.get("rope_scaling") or {}), **rope}
        compress = {k: v for k, v in flat.items() if k not in ("main", "compress")}
        compress["rope_theta"] = float(cfg.get("compress_rope_theta", 160000.0))
        compress["rope_type"] = compress.get("rope_type", compress.get("type", "default"))
        if compress["rope_type"] == "yarn":
            compress.setdefault("attention_factor", 1.0)
        main_theta = float(cfg.get("rope_theta", 10000.0))
    scoring = cfg.get("scoring_func", "sqrtsoftplus")
    if scoring != "sqrtsoftplus":
        raise ValueError(f"deepseek_v4 router scoring {scoring!r} is not supported (only sqrtsoftplus)")
    if int(cfg.get("num_key_value_heads", 1)) != 1:
        raise ValueError("deepseek_v4 attention is shared-KV MQA: num_key_value_heads must be 1")
    return V4Plan(
        vocab_size=int(cfg["vocab_size"]),
        hidden=int(cfg["hidden_size"]),
        num_heads=int(cfg.get("num_attention_heads", 64)),
        head_dim=head_dim,
        rope_dim=int(head_dim * partial),
        q_lora_rank=int(cfg.get("q_lora_rank", 1024)),
        o_groups=int(cfg.get("o_groups", 8)),
        o_lora_rank=int(cfg.get("o_lora_rank", 1024)),
        eps=float(cfg.get("rms_norm_eps", 1e-6)),
        window=int(cfg.get("sliding_window", 128)),
        hc_mult=int(cfg.get("hc_mult", 4)),
        hc_iters=int(cfg.get("hc_sinkhorn_iters", 20)),
        hc_eps=float(cfg.get("hc_eps", 1e-6)),
        layer_types=list(layer_types[:n]),
        mlp_types=list(mlp_types[:n]),
        rates=rates,
        index_heads=int(cfg.get("index_n_heads", 64)),
        index_dim=int(cfg.get("index_head_dim", 128)),
        index_topk=int(cfg.get("index_topk", 512)),
        num_experts=int(cfg.get("n_routed_experts", 256)),
        top_k=int(cfg.get("num_experts_per_tok", 6)),
        moe_intermediate=int(cfg.get("moe_intermediate_size", 2048)),
        routed_scaling=float(cfg.get("routed_scaling_factor", 1.5)),
        swiglu_limit=float(cfg.get("swiglu_limit", 10.0)),
        main_theta=main_theta,
        compress_rope=compress,
        max_positions=int(cfg.get("max_position_embeddings") or 4096),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )


def architecture_of(plan: V4Plan) -> Architecture:
    """The manifest Architecture; num_kv_heads/head_dim are the pool geometry (plan.cache_dims)."""
    kv_heads, head_dim = plan.cache_dims()
    return Architecture(
        family="deepseek_v4",
        num_layers=len(plan.layer_types),
        hidden_size=plan.hidden,
        intermediate_size=plan.moe_intermediate,
        num_heads=plan.num_heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=plan.vocab_size,
        rope_theta=plan.main_theta,
        rms_norm_eps=plan.eps,
        max_position_embeddings=plan.max_positions,
        tie_word_embeddings=plan.tie_word_embeddings,
        attention_bias=False,
    )


# -- rotary ---------------------------------------------------------------------------------------


def inv_freq_of(plan: V4Plan, kind: str) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rope_dim/2], cos/sin scale) of the "main" (sliding layers) or
    "compress" (CSA/HCA layers, their compressors and indexer) rotary, as transformers computes them."""
    dim = plan.rope_dim
    if kind == "main":
        theta, params = plan.main_theta, {"rope_type": "default"}
    else:
        params = plan.compress_rope
        theta = float(params["rope_theta"])
    if params.get("rope_type", "default") == "default":
        return default_inv_freq(dim, theta), 1.0
    if params["rope_type"] != "yarn":
        raise ValueError(f"deepseek_v4 rope type {params['rope_type']!r} is not supported (default or yarn)")
    factor = float(params["factor"])
    inv = yarn_inv_freq(
        dim,
        theta,
        factor,
        float(params.get("beta_fast") or 32),
        float(params.get("beta_slow") or 1),
        int(params["original_max_position_embeddings"]),
        True,
    )
    attention = params.get("attention_factor")
    if attention is None:
        attention = yarn_attention_factor(factor, params.get("mscale"), params.get("mscale_all_dim"))
    return inv, float(attention)


# -- the model ------------------------------------------------------------------------------------


class DeepseekV4LM(StepModel):
    """The step graph of docs/architecture.md for DeepSeek-V4 (same I/O as ConfiguredLM)."""

    family = "deepseek_v4"
    model_types = ("deepseek_v4",)

    @classmethod
    def architecture(cls, config: dict[str, Any]) -> Architecture:
        """Stateless over the paged pool: every layer has K/V rows."""
        try:
            plan = plan_of(config)
            inv_freq_of(plan, "compress")  # refuses unsupported rotary before any tensor is read
        except ValueError as exc:
            raise FamilyError(str(exc)) from None
        return architecture_of(plan)

    @classmethod
    def build(cls, arch: Architecture, config: dict[str, Any], tensors: dict[str, np.ndarray]) -> DeepseekV4LM:
        return build_deepseek_v4(config, tensors)

    def __init__(self, plan: V4Plan) -> None:
        super().__init__()
        self.plan = plan
        self.arch = architecture_of(plan)
        self.embed_tokens = nn.Embedding(plan.vocab_size, plan.hidden)
        self.layers = nn.ModuleList(Layer(plan, i) for i in range(len(plan.layer_types)))
        self.hc_head = HyperHead(plan)
        self.norm = RMSNorm(plan.hidden, plan.eps)
        self.lm_head = nn.Linear(plan.hidden, plan.vocab_size, bias=False)
        self.mtp_tensors: dict[str, np.ndarray] = {}
        self.reset_rotary()

    def reset_rotary(self) -> None:
        """Rotary frequencies (computed, never loaded; also after building on the meta device)."""
        for kind in ("main", "compress"):
            inv, scale = inv_freq_of(self.plan, kind)
            self.register_buffer(f"{kind}_inv_freq", inv, persistent=False)
            setattr(self, f"{kind}_rope_scale", scale)

    def cos_sin(self, kind: str, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(torch.float32).unsqueeze(-1) * getattr(self, f"{kind}_inv_freq")
        scale = getattr(self, f"{kind}_rope_scale")
        cos, sin = freqs.cos(), freqs.sin()
        return (cos * scale, sin * scale) if scale != 1.0 else (cos, sin)

    def _history(self, kv_pool: torch.Tensor, block_tables: torch.Tensor, layer: int) -> torch.Tensor:
        """Layer's pool slots of each row's pages as per-token channels [B, M*page_tokens, 2*kvh*D]."""
        batch, pages = block_tables.shape
        num_pages = kv_pool.shape[0] // (2 * len(self.layers))
        _, tokens, heads, dim = kv_pool.shape
        parts = []
        for kind in (0, 1):
            rows = (2 * layer + kind) * num_pages + block_tables.reshape(-1)
            parts.append(torch.index_select(kv_pool, 0, rows).reshape(batch, pages * tokens, heads * dim))
        return torch.cat(parts, dim=-1)

    def hidden_states(self, input_ids, positions, history_lens, block_tables, kv_pool):
        """Final-normed hidden states [B, L, H] and new_kv [layers, 2, B, L, kvh, D]."""
        batch, length = input_ids.shape
        kv_heads, head_dim = self.arch.num_kv_heads, self.arch.head_dim
        step = V4Step(self.plan.window, self.cos_sin, positions, history_lens, block_tables.shape[1] * kv_pool.shape[1])
        x = self.embed_tokens(input_ids)
        streams = x.unsqueeze(2).expand(-1, -1, self.plan.hc_mult, -1)
        new_kv = []
        for i, layer in enumerate(self.layers):
            streams, new = layer(streams, input_ids, step, self._history(kv_pool, block_tables, i))
            new = F.pad(new, (0, 2 * kv_heads * head_dim - new.shape[-1]))
            new_kv.append(new.reshape(batch, length, 2, kv_heads, head_dim).permute(2, 0, 1, 3, 4))
        return self.norm(self.hc_head(streams)), torch.stack(new_kv, dim=0)

    def forward(
        self,
        input_ids,
        positions,
        history_lens,
        query_lens,
        block_tables,
        kv_pool,
        logprob_token_ids,
        logit_rows=None,
        logit_positions=None,
    ):
        normed, new_kv = self.hidden_states(input_ids, positions, history_lens, block_tables, kv_pool)
        outputs = self.step_outputs(normed, query_lens, logprob_token_ids, logit_rows, logit_positions)
        return *outputs, new_kv, normed

    @torch.no_grad()
    def reference(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits [T, V] of one whole sequence as a single prefill over an empty pool."""
        length = ids.shape[0]
        pool = torch.zeros(2 * self.arch.num_layers, 1, self.arch.num_kv_heads, self.arch.head_dim)
        normed, _ = self.hidden_states(
            ids.unsqueeze(0),
            torch.arange(length).unsqueeze(0),
            torch.zeros(1, dtype=torch.int64),
            torch.zeros(1, 1, dtype=torch.int64),
            pool,
        )
        return self.lm_head(normed[0])


# -- loading --------------------------------------------------------------------------------------

# transformers' deepseek_v4 conversion renames (conversion_mapping.py), applied in order to names
# without the "model." prefix: the original checkpoint layout (which save_pretrained writes back)
# -> transformers module names. Names already in transformers form pass through unchanged.
_RENAMES = [
    (re.compile(a), b)
    for a, b in (
        (r"\.attn\.", ".self_attn."),
        (r"\.ffn\.", ".mlp."),
        (r"\.indexer\.compressor\.", ".compressor.indexer."),
        (r"^embed\.weight", "embed_tokens.weight"),
        (r"^head\.weight", "lm_head.weight"),
        (r"^hc_head_fn", "hc_head.hc_fn"),
        (r"^hc_head_base", "hc_head.hc_base"),
        (r"^hc_head_scale", "hc_head.hc_scale"),
        (r"\.attn_norm\.", ".input_layernorm."),
        (r"\.ffn_norm\.", ".post_attention_layernorm."),
        (r"\.hc_attn_fn", ".attn_hc.fn"),
        (r"\.hc_attn_base", ".attn_hc.base"),
        (r"\.hc_attn_scale", ".attn_hc.scale"),
        (r"\.hc_ffn_fn", ".ffn_hc.fn"),
        (r"\.hc_ffn_base", ".ffn_hc.base"),
        (r"\.hc_ffn_scale", ".ffn_hc.scale"),
        (r"\.attn_sink", ".sinks"),
        (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
        (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."),
        (r"\.norm\.", ".kv_norm."),
        (r"\.ape", ".position_bias"),
        (r"\.wq_a\.", ".q_a_proj."),
        (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."),
        (r"\.wkv\.", ".kv_proj."),
        (r"\.wgate\.", ".gate_proj."),
        (r"\.wo_a\.", ".o_a_proj."),
        (r"\.wo_b\.", ".o_b_proj."),
        (r"\.q_norm\.", ".q_a_norm."),
        (r"\.gate\.bias", ".gate.e_score_correction_bias"),
        (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
        (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
        (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
        # per-expert w1 (gate), w3 (up), w2 (down): the layout the shared experts loader reads
        (r"\.experts\.(\d+)\.w1\.", r".experts.\1.gate_proj."),
        (r"\.experts\.(\d+)\.w3\.", r".experts.\1.up_proj."),
        (r"\.experts\.(\d+)\.w2\.", r".experts.\1.down_proj."),
    )
]


def hf_name(name: str) -> str:
    """A checkpoint tensor name as transformers' module name, without the "model." prefix."""
    name = name.removeprefix("model.")
    for pattern, target in _RENAMES:
        name = pattern.sub(target, name)
    return name


def load_deepseek_v4(model: DeepseekV4LM, tensors: dict[str, np.ndarray]) -> None:
    """Set every parameter from the checkpoint's tensors (original DeepSeek names as
    save_pretrained writes them, or transformers' module names); MTP tensors (`mtp.*`, or layers
    past the decoder's) go to model.mtp_tensors; every other tensor must be used."""
    n = len(model.layers)
    names: dict[str, str] = {}  # transformers' name -> the checkpoint's
    for original in tensors:
        mtp = re.match(r"^(model\.)?(mtp\.|layers\.(\d+)\.)", original)
        if mtp and (mtp.group(2) == "mtp." or int(mtp.group(3)) >= n):
            model.mtp_tensors[original] = np.asarray(tensors[original])
        else:
            names[hf_name(original)] = original
    loader = TensorLoader({name: tensors[original] for name, original in names.items()})
    loader.put(model.embed_tokens, "weight", loader.take("embed_tokens.weight"))
    for i, layer in enumerate(model.layers):
        layer.load(loader, f"layers.{i}.")
    for attr in ("fn", "base", "scale"):
        loader.put(model.hc_head, attr, loader.take(f"hc_head.hc_{attr}"))
    loader.norm(model.norm, "norm")
    loader.lm_head(model)
    check_fully_loaded(model, tensors, {names[name] for name in loader.used} | set(model.mtp_tensors))


def build_deepseek_v4(config: dict[str, Any], tensors: dict[str, np.ndarray]) -> DeepseekV4LM:
    """A float32 eval-mode DeepseekV4LM from a config.json dict and the checkpoint's tensors
    (built on the meta device, then every parameter swapped for its checkpoint tensor)."""
    with torch.device("meta"):
        model = DeepseekV4LM(plan_of(config))
    model.reset_rotary()
    load_deepseek_v4(model, tensors)
    return model.eval().requires_grad_(False)

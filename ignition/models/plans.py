"""The plans configured step models are built from: a family module derives a `ModelPlan` (one
`LayerPlan` per layer) from the checkpoint's Hugging Face config, before any tensor is read (the
exporter sizes the pool and the state from it). Families extend both dataclasses with what only
they need. Also the config helpers several planners share."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from helios.manifest import RopeScaling
from ignition.models.base import FamilyError
from ignition.models.blocks.mlp import GLU, MoEPlan
from ignition.models.blocks.recurrent import MIXERS
from ignition.models.rope_config import RopeConfigError, rope_scaling_from_config


@dataclass
class LayerPlan:
    # "gqa" | "mla" | "ffn" (a feed-forward block alone: no attention, no K/V rows, no state) |
    # a recurrent mixer kind (recurrent.MIXERS: "gated_deltanet", "mamba2", ...)
    kind: str
    num_heads: int
    num_kv_heads: int  # gqa; mla uses 1 latent "head"
    head_dim: int  # gqa: q/k width per head; mla: qk_nope + qk_rope
    v_head_dim: int
    rotary_dim: int  # dims of each q/k head that rotate (mla: qk_rope_head_dim)
    rope_theta: float
    rope_interleave: bool = False
    # "default" | "linear" (frequencies divided by rope_factor) | "proportional" (zero frequencies
    # past rope_partial) | "yarn" | "factors" (each frequency divided by its rope_freq_factors entry)
    rope_kind: str = "default"
    rope_partial: float = 1.0  # proportional rope's rotating fraction
    rope_factor: float = 1.0  # linear rope's position interpolation factor
    # YaRN: (factor, beta_fast, beta_slow, original_max_positions, truncate) and the cos/sin
    # attention factor it implies.
    rope_yarn: tuple = ()
    rope_attention: float = 1.0
    rope_freq_factors: tuple = ()
    window: int | None = None  # sliding window: query q sees keys k with q - k < window
    attn_softcap: float = 0.0  # scores -> cap * tanh(scores / cap) before the mask; 0: none
    sinks: bool = False
    qk_norm: bool = False  # per-head RMSNorm on q and k
    scale: float = 0.0  # softmax scale; 0: 1/sqrt(head_dim)
    attention_bias: bool = False
    o_bias: bool = True  # o_proj carries a bias when attention_bias does
    # sigmoid output gate: "" | "full" (gate_proj, per element) | "head" (g_proj, per head) |
    # "query" (q_proj yields [query, gate] per head)
    out_gate: str = ""
    norm_offset: float = 0.0  # 1.0: every RMSNorm of the layer scales by (1 + w)
    kv_source: int | None = None  # KV sharing: reuse this earlier layer's cache and new keys/values
    # mla only
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    # mlp: experts, else a dense gated MLP of `intermediate` width (none when 0, recurrent layers)
    intermediate: int = 0
    glu: GLU = GLU()
    moe: MoEPlan | None = None
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
            return 1, self.kv_lora_rank + self.rotary_dim
        return self.num_kv_heads, max(self.head_dim, self.v_head_dim)


@dataclass
class ModelPlan:
    layers: list[LayerPlan]
    rms_norm_eps: float
    head_norm_eps: float = 1e-6  # the q_a/kv_a latent norms of MLA and QK norms
    final_softcap: float = 0.0
    embed_scale: float = 1.0  # embeddings times this
    final_norm_offset: float = 0.0  # 1.0: the final norm scales by (1 + w)
    logit_multiplier: float = 1.0  # logits times this before the soft-cap
    # The config's RoPE scaling where the family's rotary follows it (scaled_rope): the manifest
    # records it and the served context is the one it reaches.
    rope_scaling: RopeScaling | None = None

    def cache_dims(self) -> tuple[int, int]:
        dims = [layer.cache_dims() for layer in self.layers if layer.attends]
        return max(h for h, _ in dims), max(d for _, d in dims)

    def kv_layers(self) -> list[int]:
        """The layers with K/V rows in the pool, in order: pool layer j is model layer kv[j]
        (recurrent and feed-forward-only layers have none)."""
        return [i for i, layer in enumerate(self.layers) if layer.attends]

    def state_layers(self, hidden: int) -> list[tuple[int, str, int, int]]:
        """(layer, kind, offset, size) of every recurrent layer's slice of a sequence's state row."""
        out, offset = [], 0
        for i, layer in enumerate(self.layers):
            if layer.recurrent:
                size = MIXERS[layer.kind].state_size(layer, hidden)
                out.append((i, layer.kind, offset, size))
                offset += size
        return out


# -- config helpers the planners share ---------------------------------------------------------------


def rotary_base(cfg: dict[str, Any], layer_type: str | None = None) -> tuple[float, float]:
    """(theta, partial_rotary_factor) of a layer type, whatever its scaling."""
    rope = cfg.get("rope_parameters") or {}
    if layer_type is not None and isinstance(rope.get(layer_type), dict):
        rope = rope[layer_type]
    theta = float(rope.get("rope_theta") or cfg.get("rope_theta") or 10000.0)
    return theta, float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor")) or 1.0)


def default_rope(cfg: dict[str, Any], layer_type: str | None = None) -> tuple[float, float]:
    """(theta, partial_rotary_factor) for a layer type; non-default rope types are refused."""
    rope = cfg.get("rope_parameters") or {}
    if layer_type is not None and isinstance(rope.get(layer_type), dict):
        rope = rope[layer_type]
    scaling = cfg.get("rope_scaling") or {}
    for params in (rope, scaling):
        kind = params.get("rope_type", params.get("type", "default"))
        if kind != "default":
            raise FamilyError(f"rope type {kind!r} is not supported yet (only default rotary)")
    return rotary_base(cfg, layer_type)


def config_scaling(cfg: dict[str, Any]) -> RopeScaling | None:
    """The RoPE scaling a config declares (None: plain rotary); FamilyError where flare has none."""
    try:
        return rope_scaling_from_config(cfg)
    except RopeConfigError as exc:
        raise FamilyError(str(exc)) from None


def scaled_rope(cfg: dict[str, Any]) -> dict[str, Any]:
    """The LayerPlan rotary fields of the config's RoPE scaling, as transformers computes it:
    linear divides the frequencies, YaRN blends them and scales cos/sin by its attention factor,
    per-frequency scaling divides each by its own factor. Dynamic NTK is the plain rotary up to
    the original context, which is where export keeps such a core (rope_config.scaled_context)."""
    scaling = config_scaling(cfg)
    if scaling is None or scaling.kind == "dynamic":
        return {}
    if scaling.kind == "linear":
        return {"rope_kind": "linear", "rope_factor": scaling.factor}
    if scaling.kind == "yarn":
        yarn = (
            scaling.factor,
            scaling.beta_fast,
            scaling.beta_slow,
            scaling.original_max_position_embeddings,
            scaling.truncate,
        )
        return {"rope_kind": "yarn", "rope_yarn": yarn, "rope_attention": scaling.attention_factor}
    assert scaling.freq_factors is not None  # per-frequency divisors
    return {
        "rope_kind": "factors",
        "rope_freq_factors": tuple(scaling.freq_factors),
        "rope_attention": scaling.attention_factor,
    }


def dense_gqa_layer(cfg: dict[str, Any], **overrides: Any) -> LayerPlan:
    """A plain dense layer of a config: GQA with plain rotary over its head width (or the
    config's partial fraction), no output bias, a SwiGLU MLP of `intermediate_size`; `overrides`
    set whatever else the family's layers carry (QK norms, a window, no rotary). Its rotary
    follows the config's RoPE scaling (scaled_rope)."""
    theta, partial = rotary_base(cfg)
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    fields: dict[str, Any] = dict(
        kind="gqa",
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        v_head_dim=head_dim,
        rotary_dim=int(head_dim * partial),
        rope_theta=theta,
        **scaled_rope(cfg),
        attention_bias=bool(cfg.get("attention_bias", False)),
        o_bias=False,
        intermediate=int(cfg["intermediate_size"]),
    )
    return LayerPlan(**{**fields, **overrides})


def per_layer_overrides(cfg: dict[str, Any], i: int) -> dict[str, Any]:
    """Layer i's entry of a config's `per_layer_config` (keys are layer indices), else {}."""
    for key, values in (cfg.get("per_layer_config") or {}).items():
        if str(key).isdigit() and int(key) == i:
            return values
    return {}


def grouped_sigmoid_moe(cfg: dict[str, Any], experts: int, shared_intermediate: int = 0) -> MoEPlan:
    """Sigmoid scores, correction bias for the choice, group-limited top-k, renormalised, scaled:
    the routing configs spell with `n_group`, `topk_group`, `norm_topk_prob`, `routed_scaling_factor`."""
    return MoEPlan(
        num_experts=experts,
        top_k=int(cfg["num_experts_per_tok"]),
        intermediate=int(cfg["moe_intermediate_size"]),
        scoring="sigmoid",
        correction_bias=True,
        n_group=int(cfg.get("n_group") or 1),
        topk_group=int(cfg.get("topk_group") or 1),
        norm_topk=bool(cfg.get("norm_topk_prob", True)),
        scaling=float(cfg.get("routed_scaling_factor") or 1.0),
        shared_intermediate=shared_intermediate,
    )

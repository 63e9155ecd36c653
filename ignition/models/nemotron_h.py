"""Nemotron-H: every layer is `x + mixer(rms_norm(x))` with exactly one mixer, chosen per layer by
`hybrid_override_pattern` (checkpoints' config.json) or `layers_block_type` (transformers):

    "M" mamba      Mamba-2 mixer (blocks/mamba2.py; recurrent state)
    "*" attention  GQA attention, no rotary / no positional encoding at all, no QK norm, no biases
    "-" mlp        down_proj(relu(up_proj(x)) ** 2), no gate (feed-forward only: no K/V, no state)
    "E" moe        sigmoid group-routed non-gated relu^2 experts (optionally in a latent width
                   between fc1/fc2_latent_proj; the router sees the full hidden state) + a relu^2
                   shared expert on the layer input

Plain RMSNorms with eps `layer_norm_epsilon`.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from ignition.models.base import FamilyError
from ignition.models.blocks.attention import GQAttention
from ignition.models.blocks.loading import TensorLoader, check_fully_loaded
from ignition.models.blocks.mamba2 import Mamba2Spec, load_mamba2
from ignition.models.blocks.mlp import Experts, MoE, MoEPlan, PlainMLP
from ignition.models.blocks.norms import RMSNorm
from ignition.models.configured import ConfiguredLM, RecurrentLayer
from ignition.models.plans import LayerPlan, ModelPlan

PATTERN_KINDS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
BLOCK_TYPE_KINDS = {"linear_attention": "mamba", "full_attention": "attention", "mlp": "mlp", "moe": "moe"}
# older config.json spellings that transformers' NemotronHConfig still accepts
_ALIASES = {
    "n_groups": "mamba_n_groups",
    "conv_kernel": "mamba_d_conv",
    "time_step_min": "mamba_dt_min",
    "use_conv_bias": "mamba_conv_bias",
}


def layer_kinds(config: dict[str, Any]) -> list[str]:
    """One of "mamba" / "attention" / "mlp" / "moe" per decoder layer."""
    types = config.get("layers_block_type") or config.get("layer_types")
    if types:
        return [BLOCK_TYPE_KINDS[t] for t in types]
    return [PATTERN_KINDS[ch] for ch in config["hybrid_override_pattern"]]


def _get(config: dict[str, Any], key: str, default: Any) -> Any:
    if key in config:
        return config[key]
    return config.get(_ALIASES.get(key, key), default)


def mamba2_spec(config: dict[str, Any]) -> Mamba2Spec:
    """The mixer's dimensions from a Nemotron-H config.json (defaults: transformers' NemotronHConfig)."""
    act = config.get("mamba_hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"Mamba-2 mixer activation {act!r} is not supported (only silu)")
    return Mamba2Spec(
        hidden=int(config["hidden_size"]),
        heads=int(config.get("mamba_num_heads", 128)),
        head_dim=int(config.get("mamba_head_dim", 64)),
        d_state=int(config.get("ssm_state_size", 128)),
        n_groups=int(_get(config, "n_groups", 8)),
        conv_kernel=int(_get(config, "conv_kernel", 4)),
        time_step_min=float(_get(config, "time_step_min", 0.001)),
        eps=float(config.get("layer_norm_epsilon", 1e-5)),
        conv_bias=bool(_get(config, "use_conv_bias", True)),
        proj_bias=bool(config.get("use_bias", False)),
    )


@dataclass
class NemotronMoEPlan(MoEPlan):
    latent: int = 0  # the experts' width between fc1/fc2_latent_proj; 0: hidden
    bias: bool = False  # the shared expert and latent projections carry biases (mlp_bias)


@dataclass
class NemotronLayerPlan(LayerPlan):
    mlp_bias: bool = False  # the "-" MLP's biases


def plan_nemotron_h(cfg: dict[str, Any]) -> ModelPlan:
    """transformers 5.24 `nemotron_h`: one LayerPlan per pattern entry: kind "mamba2", "gqa" (NoPE:
    rotary_dim 0, scale head_dim^-0.5) or "ffn" (a squared-ReLU MLP or experts alone)."""
    try:
        kinds = layer_kinds(cfg)
        spec = mamba2_spec(cfg) if "mamba" in kinds else None
    except (KeyError, ValueError) as exc:
        raise FamilyError(f"nemotron_h: {exc}") from None
    if "attention" not in kinds:
        raise FamilyError("nemotron_h without attention layers is not supported (the paged pool needs one)")
    act = cfg.get("mlp_hidden_act", "relu2")
    if act != "relu2" and ({"mlp", "moe"} & set(kinds)):
        raise FamilyError(f"nemotron_h MLP activation {act!r} is not supported (only relu2)")
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    bias = bool(cfg.get("mlp_bias", False))
    moe = None
    if "moe" in kinds:
        experts = int(cfg.get("n_routed_experts") or cfg.get("num_local_experts") or 8)
        n_group = int(cfg.get("n_group") or 1)
        if experts % n_group:
            raise FamilyError("nemotron_h n_routed_experts must be a multiple of n_group")
        moe = NemotronMoEPlan(
            num_experts=experts,
            top_k=int(cfg.get("num_experts_per_tok") or 2),
            intermediate=int(cfg.get("moe_intermediate_size") or 7688),
            scoring="sigmoid",
            correction_bias=True,
            n_group=n_group,
            topk_group=int(cfg.get("topk_group") or 1),
            norm_topk=bool(cfg.get("norm_topk_prob", True)),
            scaling=float(cfg.get("routed_scaling_factor") or 1.0),
            shared_intermediate=int(cfg.get("moe_shared_expert_intermediate_size") or 7688),
            latent=int(cfg.get("moe_latent_size") or 0),
            bias=bias,
        )
    mixer = dataclasses.asdict(spec) if spec is not None else {}
    layers = []
    for kind in kinds:
        layers.append(
            NemotronLayerPlan(
                kind={"mamba": "mamba2", "attention": "gqa"}.get(kind, "ffn"),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=head_dim,
                v_head_dim=head_dim,
                rotary_dim=0,
                rope_theta=10000.0,
                scale=head_dim**-0.5,
                intermediate=int(cfg.get("intermediate_size") or 0) if kind == "mlp" else 0,
                moe=moe if kind == "moe" else None,
                mlp_bias=bias,
                mixer=dict(mixer) if kind == "mamba" else {},
            )
        )
    return ModelPlan(layers=layers, rms_norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)))


class NemotronMoE(MoE):
    """Non-gated relu^2 experts, in the latent width when set, and a non-gated shared expert."""

    def __init__(self, plan: NemotronMoEPlan, hidden: int) -> None:
        super().__init__(plan, hidden, plan.latent or hidden)
        self.experts = Experts(plan.num_experts, plan.intermediate, plan.latent or hidden, None, "relu2")
        if plan.latent:
            self.fc1_latent_proj = nn.Linear(hidden, plan.latent, bias=plan.bias)
            self.fc2_latent_proj = nn.Linear(plan.latent, hidden, bias=plan.bias)
        if plan.shared_intermediate:
            self.shared_experts = PlainMLP(hidden, plan.shared_intermediate, "relu2", plan.bias)

    def expert_input(self, flat: torch.Tensor) -> torch.Tensor:
        return self.fc1_latent_proj(flat) if self.plan.latent else flat

    def expert_output(self, out: torch.Tensor) -> torch.Tensor:
        return self.fc2_latent_proj(out) if self.plan.latent else out

    def load(self, loader: TensorLoader, prefix: str) -> None:
        super().load(loader, prefix)
        if self.plan.latent:
            loader.linear(self.fc1_latent_proj, prefix + "fc1_latent_proj")
            loader.linear(self.fc2_latent_proj, prefix + "fc2_latent_proj")


class SingleMixerLayer(nn.Module):
    """x + mixer(norm(x)) with attention (kind "gqa") or (kind "ffn") a feed-forward block alone."""

    def __init__(self, plan: NemotronLayerPlan, hidden: int, eps: float, head_eps: float) -> None:
        super().__init__()
        self.plan = plan
        self.input_layernorm = RMSNorm(hidden, eps)
        if plan.kind == "gqa":
            self.self_attn = GQAttention(plan, hidden, head_eps)
        elif plan.moe is not None:
            self.mlp = NemotronMoE(plan.moe, hidden)
        else:
            self.mlp = PlainMLP(hidden, plan.intermediate, "relu2", plan.mlp_bias)

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.input_layernorm(x))

    def forward(self, x, step, past_k, past_v, shared=None, per_layer_input=None):
        attn, k, v = self.self_attn(self.input_layernorm(x), step, past_k, past_v, shared)
        return x + attn, k, v


class NemotronHLM(ConfiguredLM):
    family = "nemotron_h"
    model_types = ("nemotron_h",)
    planner = staticmethod(plan_nemotron_h)

    def make_layer(self, plan: LayerPlan) -> nn.Module:
        if plan.recurrent:
            return RecurrentLayer(plan, self.arch.hidden_size, self.plan.rms_norm_eps)
        return SingleMixerLayer(plan, self.arch.hidden_size, self.plan.rms_norm_eps, self.plan.head_norm_eps)

    def load(self, tensors: dict[str, np.ndarray]) -> None:
        """Its names as its checkpoints and transformers' save_pretrained write them:
        `backbone.embeddings.weight`, `backbone.layers.N.norm.weight`, `backbone.layers.N.mixer.*`,
        `backbone.norm_f.weight`, `lm_head.weight` (transformers' own module names, `model.*`, are
        accepted too). Experts per expert (`mixer.experts.E.{up,down}_proj.weight`) or stacked
        (`mixer.experts.{up,down}_proj` [E, ...]). `mtp.*` tensors are kept aside."""
        renamed = {
            ("backbone." + name.removeprefix("model.") if name.startswith("model.") else name): name for name in tensors
        }
        loader = TensorLoader({new: tensors[old] for new, old in renamed.items()})
        loader.put(self.embed_tokens, "weight", loader.take("backbone.embeddings.weight"))
        for i, layer in enumerate(self.layers):
            p, kind = f"backbone.layers.{i}.", layer.plan.kind
            loader.norm(layer.input_layernorm, p + "norm")
            if kind == "mamba2":
                loader.used.update(load_mamba2(layer.mixer, loader.tensors, p + "mixer."))
            else:
                (layer.self_attn if kind == "gqa" else layer.mlp).load(loader, p + "mixer.")
        loader.put(self.norm, "weight", loader.take("backbone.norm_f.weight"))
        loader.lm_head(self)
        for name in set(loader.tensors) - loader.used:  # multi-token prediction heads: kept for speculative decoding
            if re.match(r"^(backbone\.)?mtp\.", name):
                self.mtp_tensors[renamed[name]] = np.asarray(loader.tensors[name])
                loader.used.add(name)
        check_fully_loaded(self, loader.tensors, loader.used)

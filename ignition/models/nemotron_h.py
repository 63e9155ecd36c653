"""Nemotron-H config helpers: the per-layer block pattern and the Mamba-2 mixer's dimensions.

A Nemotron-H layer is `x + mixer(rms_norm(x))` with exactly one mixer, chosen per layer by
`hybrid_override_pattern` (checkpoints' config.json) or `layers_block_type` (transformers):

    "M" mamba      Mamba-2 mixer (ignition.models.mamba2)
    "*" attention  GQA attention, no rotary / no positional encoding at all, no biases
    "-" mlp        down_proj(relu(up_proj(x)) ** 2), no gate
    "E" moe        sigmoid-routed non-gated relu^2 experts + a relu^2 shared expert
"""

from __future__ import annotations

from typing import Any

from ignition.models.mamba2 import Mamba2Spec

PATTERN_KINDS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
BLOCK_TYPE_KINDS = {"linear_attention": "mamba", "full_attention": "attention", "mlp": "mlp", "moe": "moe"}
# older config.json spellings that transformers' NemotronHConfig still accepts
_ALIASES = {"n_groups": "mamba_n_groups", "conv_kernel": "mamba_d_conv", "time_step_min": "mamba_dt_min",
            "use_conv_bias": "mamba_conv_bias"}  # fmt: skip


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

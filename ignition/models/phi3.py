"""Phi-3 and Phi-4 (model_type "phi3"): Llama-style GQA and SwiGLU layers whose checkpoints fuse
the q/k/v projections into one `qkv_proj` and gate/up into one `gate_up_proj` (split here on
load), partial rotary where the config has it (Phi-4-mini), and a sliding window on every layer
where the config sets one (Phi-3-mini: 2047), and `longrope` scaling (Phi-3.5, Phi-4-mini, the
128k releases) with its long factors (ignition/models/rope_config.py)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ignition.models.base import FamilyError
from ignition.models.configured import ConfiguredLM
from ignition.models.plans import ModelPlan, config_scaling, dense_gqa_layer


def plan_phi3(cfg: dict[str, Any]) -> ModelPlan:
    if cfg.get("hidden_act", "silu") != "silu":
        raise FamilyError("only SiLU MLPs are supported")
    scaling = config_scaling(cfg)
    if scaling is not None and scaling.kind != "longrope":  # what transformers' Phi3Config accepts
        raise FamilyError(f"Phi-3 with {scaling.kind} rope scaling is not a configuration transformers runs")
    window = int(cfg["sliding_window"]) if cfg.get("sliding_window") else None
    return ModelPlan(
        layers=[dense_gqa_layer(cfg, window=window) for _ in range(int(cfg["num_hidden_layers"]))],
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        rope_scaling=scaling,
    )


def split_fused(tensors: dict[str, np.ndarray], q_rows: int, kv_rows: int) -> dict[str, np.ndarray]:
    """qkv_proj -> q/k/v_proj rows and gate_up_proj -> gate/up_proj halves (gate first, as
    Phi3MLP chunks them); every other tensor as it is."""
    out: dict[str, np.ndarray] = {}
    for name, value in tensors.items():
        if ".self_attn.qkv_proj." in name:
            if value.shape[0] != q_rows + 2 * kv_rows:
                raise FamilyError(f"{name} has {value.shape[0]} rows, not q {q_rows} + k/v 2 x {kv_rows}")
            for part, rows in zip("qkv", np.split(value, [q_rows, q_rows + kv_rows]), strict=True):
                out[name.replace(".qkv_proj.", f".{part}_proj.")] = rows
        elif ".mlp.gate_up_proj." in name:
            gate, up = np.split(value, 2)
            out[name.replace(".gate_up_proj.", ".gate_proj.")] = gate
            out[name.replace(".gate_up_proj.", ".up_proj.")] = up
        else:
            out[name] = value
    return out


class Phi3LM(ConfiguredLM):
    family = "phi3"
    model_types = ("phi3",)
    planner = staticmethod(plan_phi3)

    def load(self, tensors: dict[str, np.ndarray]) -> None:
        first = self.plan.layers[0]
        q_rows, kv_rows = first.num_heads * first.head_dim, first.num_kv_heads * first.head_dim
        super().load(split_fused(tensors, q_rows, kv_rows))

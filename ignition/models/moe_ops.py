"""Routed experts as one op: a plain-torch meaning and a fused ONNX form (like ops.py's).

    experts(h, idx, weights, up, down, gate, kind, unit, limit, alpha)
        -> [N, W]: sum_j weights[n, j] * down_e(glu(h_n)), e = idx[n, j]; glu(x) = the gated unit
           of (gate_e x, up_e x) (`gated`: act(g) * u or a clamped variant), or act(up_e x)
           without gate

Eager torch (the export's reference) computes every expert densely and weighs the outputs with a
scatter-add of the routing weights (exact; a row naming one expert twice gets it twice). Inside
`ops.fused_export()` the model calls the custom op instead and TRANSLATIONS lowers it to flare's
ai.flare.MoE (helios/kernels/moe_kernels.cc), which reads only the routed experts' weights;
helios rewrites it back into this dense chain where flare's kernels cannot run
(helios/kernels/moe.py). Export validation checks the two agree.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ignition.models import ops

ACTIVATIONS = ("silu", "gelu_tanh", "relu2")
# Gated units (act(gate) * up and the families' clamped variants), with a limit L and Minimax's alpha.
UNITS = ("glu", "clamp_after", "clamp_before", "alpha")


def activation(name: str, x: torch.Tensor) -> torch.Tensor:
    """The activations experts and MLPs use (ACTIVATIONS, which flare's MoE kernel also has)."""
    if name == "silu":
        return F.silu(x)
    if name == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if name == "relu2":  # squared ReLU
        return torch.square(F.relu(x))
    raise ValueError(f"unknown activation {name!r}")


def gated(kind: str, unit: str, limit: float, alpha: float, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The gated units (UNITS) that flare's MoE kernels compute too:
    glu: act(g) * u; clamp_after: min(act(g), L) * clamp(u, -L, L) (Step);
    clamp_before: act(min(g, L)) * clamp(u, -L, L) (DeepSeek V4);
    alpha: (clamp(u, -L, L) + 1) * g' * sigmoid(alpha g'), g' = min(g, L) (MiniMax M3)."""
    if unit == "glu":
        return activation(kind, gate) * up
    up = up.clamp(min=-limit, max=limit)
    if unit == "clamp_after":
        return activation(kind, gate).clamp(max=limit) * up
    if unit == "clamp_before":
        return activation(kind, gate.clamp(max=limit)) * up
    if unit == "alpha":
        gate = gate.clamp(max=limit)
        return (up + 1.0) * (gate * torch.sigmoid(gate * alpha))
    raise ValueError(f"unknown gated unit {unit!r}")


def experts_ref(h: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                gate: torch.Tensor | None, kind: str, unit: str = "glu", limit: float = 0.0,
                alpha: float = 0.0) -> torch.Tensor:
    """h [N, W], idx/weights [N, k], up/gate [E, I, W], down [E, W, I] -> [N, W], every expert
    computed; `kind` one of ACTIVATIONS, (unit, limit, alpha) the gated unit (`gated`)."""
    upped = torch.einsum("nh,eih->eni", h, up)
    if gate is None:
        glu = activation(kind, upped)
    else:
        glu = gated(kind, unit, limit, alpha, torch.einsum("nh,eih->eni", h, gate), upped)
    outputs = torch.einsum("eni,ehi->enh", glu, down)
    dense = torch.zeros(h.shape[0], up.shape[0], dtype=weights.dtype).scatter_add(1, idx, weights)  # [N, E]
    return (outputs * dense.t().unsqueeze(-1)).sum(0)


@torch.library.custom_op("flare::experts", mutates_args=())
def _experts_op(h: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                gate: torch.Tensor | None, kind: str, unit: str, limit: float, alpha: float) -> torch.Tensor:
    return experts_ref(h, idx, weights, up, down, gate, kind, unit, limit, alpha).contiguous()


@_experts_op.register_fake
def _(h, idx, weights, up, down, gate, kind, unit, limit, alpha):
    return h.new_empty(h.shape)


def experts(h, idx, weights, up, down, gate, kind: str, unit: str = "glu", limit: float = 0.0, alpha: float = 0.0):
    """What the model calls: the custom op inside `ops.fused_export()`, the plain math otherwise."""
    fn = _experts_op if ops._FUSED else experts_ref
    return fn(h, idx, weights, up, down, gate, kind, unit, limit, alpha)


@functools.cache
def _flare():
    """The ai.flare opset with the schema of flare's MoE (helios/kernels/moe_kernels.cc)."""
    import onnx
    import onnxscript

    if not onnx.defs.has("MoE", "ai.flare"):
        param = onnx.defs.OpSchema.FormalParameter
        optional = onnx.defs.OpSchema.FormalParameterOption.Optional
        attr = onnx.defs.OpSchema.Attribute
        onnx.defs.register_schema(
            onnx.defs.OpSchema(
                "MoE", "ai.flare", 1,
                inputs=[param("h", "T"), param("idx", "I"), param("weights", "T"), param("up", "T"),
                        param("down", "T"), param("gate", "T", param_option=optional)],
                outputs=[param("out", "T")],
                type_constraints=[("T", ["tensor(float)"], ""), ("I", ["tensor(int64)"], "")],
                attributes=[attr("activation", onnx.defs.OpSchema.AttrType.STRING, "", required=True),
                            attr("unit", onnx.defs.OpSchema.AttrType.STRING, "", required=False),
                            attr("limit", onnx.defs.OpSchema.AttrType.FLOAT, "", required=False),
                            attr("alpha", onnx.defs.OpSchema.AttrType.FLOAT, "", required=False),
                            attr("top_k", onnx.defs.OpSchema.AttrType.INT, "", required=False)],
            )
        )  # fmt: skip
    return onnxscript.values.Opset("ai.flare", 1)


def _experts_onnx(h, idx, weights, up, down, gate, kind: str, unit: str, limit: float, alpha: float):
    # top_k (experts per row) is informational: decode_weight_bytes counts top_k / E of the experts.
    k = idx.shape[1] if idx.shape is not None else None
    extra = {"top_k": int(k)} if isinstance(k, int) else {}
    if unit != "glu":
        extra |= {"unit": unit, "limit": float(limit), "alpha": float(alpha)}
    if gate is None:
        return _flare().MoE(h, idx, weights, up, down, activation=kind, **extra)
    return _flare().MoE(h, idx, weights, up, down, gate, activation=kind, **extra)


TRANSLATIONS = {torch.ops.flare.experts.default: _experts_onnx}

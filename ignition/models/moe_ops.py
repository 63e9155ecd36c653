"""Routed experts as one op: a plain-torch meaning and a fused ONNX form (like ops.py's).

    experts(h, idx, weights, up, down, gate, kind)
        -> [N, W]: sum_j weights[n, j] * down_e(glu(h_n)), e = idx[n, j]; glu(x) = act(gate_e x) *
           up_e x, or act(up_e x) without gate

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


def activation(name: str, x: torch.Tensor) -> torch.Tensor:
    """The activations experts and MLPs use (ACTIVATIONS, which flare's MoE kernel also has)."""
    if name == "silu":
        return F.silu(x)
    if name == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if name == "relu2":  # squared ReLU
        return torch.square(F.relu(x))
    raise ValueError(f"unknown activation {name!r}")


def experts_ref(h: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                gate: torch.Tensor | None, kind: str) -> torch.Tensor:
    """h [N, W], idx/weights [N, k], up/gate [E, I, W], down [E, W, I] -> [N, W], every expert
    computed; `kind` one of ACTIVATIONS."""
    upped = torch.einsum("nh,eih->eni", h, up)
    if gate is None:
        glu = activation(kind, upped)
    else:
        glu = activation(kind, torch.einsum("nh,eih->eni", h, gate)) * upped
    outputs = torch.einsum("eni,ehi->enh", glu, down)
    dense = torch.zeros(h.shape[0], up.shape[0], dtype=weights.dtype).scatter_add(1, idx, weights)  # [N, E]
    return (outputs * dense.t().unsqueeze(-1)).sum(0)


@torch.library.custom_op("flare::experts", mutates_args=())
def _experts_op(h: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                gate: torch.Tensor | None, kind: str) -> torch.Tensor:
    return experts_ref(h, idx, weights, up, down, gate, kind).contiguous()


@_experts_op.register_fake
def _(h, idx, weights, up, down, gate, kind):
    return h.new_empty(h.shape)


def experts(h, idx, weights, up, down, gate, kind: str):
    """What the model calls: the custom op inside `ops.fused_export()`, the plain math otherwise."""
    fn = _experts_op if ops._FUSED else experts_ref
    return fn(h, idx, weights, up, down, gate, kind)


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
                            attr("top_k", onnx.defs.OpSchema.AttrType.INT, "", required=False)],
            )
        )  # fmt: skip
    return onnxscript.values.Opset("ai.flare", 1)


def _experts_onnx(h, idx, weights, up, down, gate, kind: str):
    # top_k (experts per row) is informational: decode_weight_bytes counts top_k / E of the experts.
    k = idx.shape[1] if idx.shape is not None else None
    extra = {"top_k": int(k)} if isinstance(k, int) else {}
    if gate is None:
        return _flare().MoE(h, idx, weights, up, down, activation=kind, **extra)
    return _flare().MoE(h, idx, weights, up, down, gate, activation=kind, **extra)


TRANSLATIONS = {torch.ops.flare.experts.default: _experts_onnx}

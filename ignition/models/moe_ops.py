"""Routed experts as one op: its plain-torch meaning (experts_ref, in helios.kernels.torch_ops
beside the other op schemas) and its fused ONNX form (like ops.py's).

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

from helios.kernels.torch_ops import ACTIVATIONS, UNITS, activation, experts_op, experts_ref, gated  # noqa: F401 (re-exported for the family modules)
from ignition.models import ops


def experts(h, idx, weights, up, down, gate, kind: str, unit: str = "glu", limit: float = 0.0, alpha: float = 0.0):
    """What the model calls: the custom op inside `ops.fused_export()`, the plain math otherwise."""
    fn = experts_op if ops.fused() else experts_ref
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
                "MoE",
                "ai.flare",
                1,
                inputs=[
                    param("h", "T"),
                    param("idx", "I"),
                    param("weights", "T"),
                    param("up", "T"),
                    param("down", "T"),
                    param("gate", "T", param_option=optional),
                ],
                outputs=[param("out", "T")],
                type_constraints=[("T", ["tensor(float)"], ""), ("I", ["tensor(int64)"], "")],
                attributes=[
                    attr("activation", onnx.defs.OpSchema.AttrType.STRING, "", required=True),
                    attr("unit", onnx.defs.OpSchema.AttrType.STRING, "", required=False),
                    attr("limit", onnx.defs.OpSchema.AttrType.FLOAT, "", required=False),
                    attr("alpha", onnx.defs.OpSchema.AttrType.FLOAT, "", required=False),
                    attr("top_k", onnx.defs.OpSchema.AttrType.INT, "", required=False),
                ],
            )
        )
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

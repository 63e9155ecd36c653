"""Pre-quantized Hugging Face checkpoints (config.json `quantization_config`): GPTQ and AWQ int4 /
int8 and FP8 (HF's block-scaled `fp8`, compressed-tensors' per-tensor or per-channel
`float-quantized`), each linear unpacked to the float weight its published layout stands for.

The export then quantizes those weights at its own precision; the manifest's
`source_quantization` records where they came from (e.g. "gptq-int4-g128").

Layouts (in x out is the math orientation; Hugging Face weights are out x in):
- GPTQ: `qweight` int32 [in * bits / 32, out], values packed along `in`, low bits first;
  `qzeros` int32 [groups, out * bits / 32] packed along `out`; `scales` [groups, out]; `g_idx`
  [in] (a row's group, any order under act-order). The v1 format stores each zero less one.
- AWQ (GEMM): `qweight` int32 [in, out * bits / 32] packed along `out` in the interleaved order
  0, 2, 4, 6, 1, 3, 5, 7; `qzeros` [in / group, out * bits / 32] the same; `scales` [in / group, out].
- FP8: `weight` float8_e4m3fn [out, in] with `weight_scale_inv` [out / b0, in / b1] block scales
  (`fp8`) or `weight_scale` [1] / [out, 1] (compressed-tensors); the weight times its scale.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ignition.checkpoints.base import CheckpointError

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble k of a packed word holds column AWQ_ORDER[k]
METHODS = ("gptq", "awq", "fp8", "compressed-tensors")


def _unpack(packed: torch.Tensor, bits: int, axis: int) -> torch.Tensor:
    """int32 words -> their 32 / bits unsigned fields (low bits first), laid out along `axis`."""
    per_word = 32 // bits
    shifts = torch.arange(per_word, dtype=torch.int64) * bits
    words = packed.to(torch.int64) & 0xFFFFFFFF  # the words as unsigned
    fields = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., word, field]
    if axis == 0:  # rows packed: [words, cols, fields] -> [words * fields, cols]
        return fields.permute(0, 2, 1).reshape(-1, packed.shape[1])
    return fields.reshape(packed.shape[0], -1)


def _gptq(tensors: dict[str, torch.Tensor], prefix: str, qconfig: dict[str, Any]) -> np.ndarray:
    bits = int(qconfig.get("bits", 4))
    q = _unpack(tensors[prefix + "qweight"], bits, axis=0)  # [in, out]
    zeros = _unpack(tensors[prefix + "qzeros"], bits, axis=1)  # [groups, out]
    if str(qconfig.get("checkpoint_format", "gptq")) != "gptq_v2":
        zeros = zeros + 1  # v1 stores zero - 1
    scales = tensors[prefix + "scales"].to(torch.float32)
    rows = q.shape[0]
    g_idx = tensors.get(prefix + "g_idx")
    if g_idx is None:
        group = int(qconfig.get("group_size", 128))
        g_idx = torch.arange(rows) // (rows if group <= 0 else group)
    g_idx = g_idx.to(torch.int64)
    weight = (q - zeros[g_idx]).to(torch.float32) * scales[g_idx]
    return weight.T.contiguous().numpy()


def _awq(tensors: dict[str, torch.Tensor], prefix: str, qconfig: dict[str, Any]) -> np.ndarray:
    bits = int(qconfig.get("bits", 4))
    if bits != 4:
        raise CheckpointError(f"AWQ with {bits} bits is not supported (4-bit only)")
    if str(qconfig.get("version", "gemm")).lower() != "gemm":
        raise CheckpointError(f"AWQ version {qconfig.get('version')!r} is not supported (GEMM layout only)")
    order = torch.tensor(AWQ_ORDER)

    def columns(packed: torch.Tensor) -> torch.Tensor:
        fields = _unpack(packed, bits, axis=1).reshape(packed.shape[0], -1, 8)
        out = torch.empty_like(fields)
        out[:, :, order] = fields  # field k goes to column AWQ_ORDER[k] of its group of eight
        return out.reshape(packed.shape[0], -1)

    q = columns(tensors[prefix + "qweight"])  # [in, out]
    zeros = columns(tensors[prefix + "qzeros"])  # [groups, out]
    if not qconfig.get("zero_point", True):
        zeros = torch.full_like(zeros, 1 << (bits - 1))
    scales = tensors[prefix + "scales"].to(torch.float32)
    group = q.shape[0] // scales.shape[0]
    g_idx = torch.arange(q.shape[0]) // group
    weight = (q - zeros[g_idx]).to(torch.float32) * scales[g_idx]
    return weight.T.contiguous().numpy()


def _fp8(tensors: dict[str, torch.Tensor], prefix: str, qconfig: dict[str, Any]) -> np.ndarray:
    weight = tensors[prefix + "weight"].to(torch.float32)
    if prefix + "weight_scale_inv" in tensors:  # block scales (HF fp8, DeepSeek style)
        scale = tensors[prefix + "weight_scale_inv"].to(torch.float32)
        b0, b1 = (int(n) for n in qconfig.get("weight_block_size") or (128, 128))
        scale = scale.repeat_interleave(b0, 0)[: weight.shape[0]].repeat_interleave(b1, 1)[:, : weight.shape[1]]
    else:
        scale = tensors[prefix + "weight_scale"].to(torch.float32)
        scale = scale.reshape(-1, 1) if scale.numel() == weight.shape[0] else scale.reshape(())
    return (weight * scale).numpy()


SUFFIXES = {
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "awq": ("qweight", "qzeros", "scales"),
    "fp8": ("weight", "weight_scale_inv", "weight_scale", "input_scale"),
}


def describe(qconfig: dict[str, Any]) -> str:
    """What the manifest's source_quantization says, e.g. "gptq-int4-g128", "fp8-e4m3"."""
    method = _method(qconfig)
    if method == "fp8":
        return "fp8-e4m3"
    group = int(qconfig.get("group_size", qconfig.get("q_group_size", 128)))
    return f"{method}-int{int(qconfig.get('bits', qconfig.get('w_bit', 4)))}-g{group}"


def _method(qconfig: dict[str, Any]) -> str:
    method = str(qconfig.get("quant_method", "")).lower()
    if method not in METHODS:
        raise CheckpointError(
            f"quantization_config method {method!r} is not supported (flare reads {', '.join(METHODS)})"
        )
    if method == "compressed-tensors":
        if qconfig.get("format") not in ("float-quantized", "naive-quantized") or any(
            (group.get("weights") or {}).get("type") != "float"
            for group in (qconfig.get("config_groups") or {}).values()
        ):
            raise CheckpointError("compressed-tensors checkpoints are read only in their FP8 float-quantized form")
        return "fp8"
    return method


def dequantize(tensors: dict[str, torch.Tensor], qconfig: dict[str, Any]) -> dict[str, np.ndarray]:
    """Every tensor as float32 numpy under its Hugging Face name, each quantized linear unpacked."""
    method = _method(qconfig)
    if method == "awq":
        qconfig = {**qconfig, "bits": qconfig.get("bits", qconfig.get("w_bit", 4))}
        qconfig["group_size"] = qconfig.get("group_size", qconfig.get("q_group_size", 128))
    unpack = {"gptq": _gptq, "awq": _awq, "fp8": _fp8}[method]
    # A quantized linear's prefix ("model.layers.0.self_attn.q_proj."): its packed ints, or its
    # e4m3 weight.
    marker = "qweight" if method in ("gptq", "awq") else "weight"
    prefixes = {
        name[: -len(marker)]
        for name, value in tensors.items()
        if name.endswith("." + marker) and (method != "fp8" or value.dtype == torch.float8_e4m3fn)
    }
    if not prefixes:
        raise CheckpointError(f"config.json declares {method} quantization but no tensor is quantized")
    out: dict[str, np.ndarray] = {}
    used: set[str] = set()
    for prefix in sorted(prefixes):
        try:
            out[prefix + "weight"] = unpack(tensors, prefix, qconfig)
        except (KeyError, RuntimeError, ValueError) as exc:
            raise CheckpointError(f"{prefix}: not a {method} layout flare reads ({exc})") from None
        used.update(prefix + suffix for suffix in SUFFIXES[method])
    for name, value in tensors.items():
        if name not in used:
            out[name] = value.to(torch.float32).numpy()
    return out

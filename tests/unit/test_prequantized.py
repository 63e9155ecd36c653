"""Pre-quantized checkpoints (issue 40, item 4): tiny GPTQ, AWQ and FP8 folders quantized here in
the formats' published layouts read back as exactly the weights their integers and scales stand
for, export, and record where they came from; unsupported methods are refused by name.

The packing below is written out element by element from the layouts' descriptions, separately
from ignition/checkpoints/prequantized.py's vectorised unpacking."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from helios.manifest import Manifest
from ignition.checkpoints.base import CheckpointError
from ignition.checkpoints.load import load_checkpoint
from ignition.export.pipeline import ExportOptions, export_core
from ignition.recipes import load_recipe
from tests.unit.tiny_checkpoints import write_tiny_checkpoint

AWQ_PUBLISHED_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GROUP = 32


def pack_along_rows(q: np.ndarray, bits: int = 4) -> np.ndarray:
    """GPTQ qweight: [in, out] -> int32 [in * bits / 32, out], row j*per + k in bits k*bits.."""
    per = 32 // bits
    words = np.zeros((q.shape[0] // per, q.shape[1]), dtype=np.uint64)
    for j in range(words.shape[0]):
        for k in range(per):
            words[j] |= q[j * per + k].astype(np.uint64) << np.uint64(bits * k)
    return words.astype(np.uint32).view(np.int32)


def pack_along_columns(q: np.ndarray, order: list[int], bits: int = 4) -> np.ndarray:
    """[rows, out] -> int32 [rows, out * bits / 32]; field k of word c holds column c*per + order[k]."""
    per = 32 // bits
    words = np.zeros((q.shape[0], q.shape[1] // per), dtype=np.uint64)
    for c in range(words.shape[1]):
        for k in range(per):
            words[:, c] |= q[:, c * per + order[k]].astype(np.uint64) << np.uint64(bits * k)
    return words.astype(np.uint32).view(np.int32)


def gptq_linear(weight: np.ndarray, rng: np.random.Generator) -> tuple[dict[str, torch.Tensor], np.ndarray]:
    """Symmetric 4-bit GPTQ (v1) with act-order: rows assigned to groups through a permutation."""
    w = weight.T  # [in, out]
    rows = w.shape[0]
    g_idx = np.argsort(rng.permutation(rows)) // GROUP  # act-order: groups follow a permutation
    groups = rows // GROUP
    scales = np.zeros((groups, w.shape[1]), dtype=np.float16)
    for g in range(groups):
        scales[g] = (np.abs(w[g_idx == g]).max(axis=0) / 7).astype(np.float16)
    s = scales.astype(np.float32)[g_idx]
    q = np.clip(np.round(w / s) + 8, 0, 15).astype(np.int64)
    zeros = np.full((groups, w.shape[1]), 8 - 1)  # v1 stores zero - 1
    reference = (s * (q - 8)).T
    tensors = {
        "qweight": pack_along_rows(q),
        "qzeros": pack_along_columns(zeros, list(range(8))),
        "scales": scales,
        "g_idx": g_idx.astype(np.int32),
    }
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in tensors.items()}, reference


def awq_linear(weight: np.ndarray, rng: np.random.Generator) -> tuple[dict[str, torch.Tensor], np.ndarray]:
    """Asymmetric 4-bit AWQ (GEMM): per-group min/max zero points, columns interleaved."""
    w = weight.T
    groups = w.shape[0] // GROUP
    g = w.reshape(groups, GROUP, -1)
    low, high = g.min(axis=1), g.max(axis=1)
    scales = ((high - low) / 15).astype(np.float16)
    s = scales.astype(np.float32)
    zeros = np.clip(np.round(-low / s), 0, 15).astype(np.int64)
    q = np.clip(np.round(g / s[:, None]) + zeros[:, None], 0, 15).astype(np.int64)
    reference = ((q - zeros[:, None]) * s[:, None]).reshape(w.shape).T
    tensors = {
        "qweight": pack_along_columns(q.reshape(w.shape), AWQ_PUBLISHED_ORDER),
        "qzeros": pack_along_columns(zeros, AWQ_PUBLISHED_ORDER),
        "scales": scales,
    }
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in tensors.items()}, reference


def fp8_linear(weight: np.ndarray, block: bool) -> tuple[dict[str, torch.Tensor], np.ndarray]:
    """e4m3 weights with 32 x 32 block scales (HF fp8) or one per-tensor scale (compressed-tensors)."""
    w = torch.from_numpy(weight)
    if block:
        blocks = w.reshape(w.shape[0] // 32, 32, w.shape[1] // 32, 32).abs().amax(dim=(1, 3)) / 448
        full = blocks.repeat_interleave(32, 0).repeat_interleave(32, 1)
        q = (w / full).to(torch.float8_e4m3fn)
        return {"weight": q, "weight_scale_inv": blocks}, (q.to(torch.float32) * full).numpy()
    scale = w.abs().max() / 448
    q = (w / scale).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale": scale.reshape(1)}, (q.to(torch.float32) * scale).numpy()


QUANT_CONFIGS = {
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": True, "sym": True},
    "awq": {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"},
    "fp8": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32]},
    "compressed-tensors": {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"group_0": {"weights": {"type": "float", "num_bits": 8, "strategy": "tensor"}}},
    },
}
DESCRIBED = {"gptq": "gptq-int4-g32", "awq": "awq-int4-g32", "fp8": "fp8-e4m3", "compressed-tensors": "fp8-e4m3"}


def write_quantized(folder: Path, method: str) -> dict[str, np.ndarray]:
    """Turn a tiny qwen2 folder's linears into `method`'s layout; return the reference weights."""
    source = load_file(folder / "model.safetensors")
    rng = np.random.default_rng(11)
    out: dict[str, torch.Tensor] = {}
    reference: dict[str, np.ndarray] = {}
    for name, tensor in source.items():
        prefix, _, leaf = name.rpartition(".")
        if leaf != "weight" or prefix.rsplit(".", 1)[-1] not in LINEARS:
            out[name] = tensor
            continue
        weight = tensor.numpy()
        if method == "gptq":
            parts, ref = gptq_linear(weight, rng)
        elif method == "awq":
            parts, ref = awq_linear(weight, rng)
        else:
            parts, ref = fp8_linear(weight, block=method == "fp8")
        out |= {f"{prefix}.{key}": value for key, value in parts.items()}
        reference[name] = ref.astype(np.float32)
    save_file(out, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = QUANT_CONFIGS[method]
    (folder / "config.json").write_text(json.dumps(config))
    return reference


@pytest.mark.parametrize("method", sorted(QUANT_CONFIGS))
def test_prequantized_weights_read_as_their_reference_and_export(tmp_path, method):
    folder = write_tiny_checkpoint(tmp_path / method, "qwen2")
    plain = load_file(folder / "model.safetensors")
    reference = write_quantized(folder, method)

    checkpoint = load_checkpoint(str(folder))
    assert checkpoint.source_quantization == DESCRIBED[method]
    assert sorted(checkpoint.tensors) == sorted(plain)
    for name, value in reference.items():
        np.testing.assert_array_equal(checkpoint.tensors[name], value, err_msg=name)
        # The layouts' quantization error, not garbage: within a few grid steps of the original.
        assert np.abs(value - plain[name].numpy()).max() < 0.25 * np.abs(plain[name].numpy()).max()
    for name in set(plain) - set(reference):  # embeddings, norms, biases: as stored
        np.testing.assert_array_equal(checkpoint.tensors[name], plain[name].numpy())

    out = tmp_path / "core"
    export_core(ExportOptions(recipe=load_recipe("qwen25_coder"), checkpoint=str(folder), out=out, precision="fp32"))
    identity = Manifest.load(out).identity
    assert (identity.source_format, identity.source_quantization) == ("safetensors", DESCRIBED[method])


def test_unsupported_quantization_is_refused_by_name(tmp_path):
    folder = write_tiny_checkpoint(tmp_path / "bnb", "qwen2")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="'bitsandbytes' is not supported"):
        load_checkpoint(str(folder))


def _dequantized_matmul(model) -> np.ndarray:
    """The [K, N] weight the graph's one MatMulNBits stands for (symmetric 4-bit)."""
    from onnx import helper as onnx_helper
    from onnx import numpy_helper

    node = next(n for n in model.graph.node if n.op_type == "MatMulNBits")
    attrs = {a.name: onnx_helper.get_attribute_value(a) for a in node.attribute}
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    packed, scales = inits[node.input[1]], inits[node.input[2]].reshape(attrs["N"], -1)
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(attrs["N"], scales.shape[1], -1).astype(np.int64)
    return ((codes - 8) * scales[..., None]).reshape(attrs["N"], attrs["K"]).T


@pytest.mark.parametrize("source_grid", [False, True])
def test_symmetric_groups_stay_exact_at_int4(source_grid):
    """A symmetric GPTQ weight (groups of 128 along K, fp16 scales, codes -8..7) through the int4
    quantizer: with the source grid kept every weight dequantizes to itself bit for bit; without
    it onnxruntime's absmax / -8 scale rounds most groups a second time."""
    import onnx
    from onnx import TensorProto, numpy_helper
    from onnx import helper as onnx_helper

    from ignition.export.quantize import QuantSettings, quantize_weights

    rng = np.random.default_rng(2)
    k, n = 256, 8
    codes = rng.integers(-8, 8, size=(k, n))
    scales = (rng.uniform(0.001, 0.02, size=(k // 128, n))).astype(np.float16).astype(np.float32)
    weight = (codes * np.repeat(scales, 128, axis=0)).astype(np.float32)
    graph = onnx_helper.make_graph(
        [onnx_helper.make_node("MatMul", ["x", "w"], ["y"], name="proj")],
        "g",
        [onnx_helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])],
        [onnx_helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])],
        [numpy_helper.from_array(weight, "w")],
    )
    model = onnx_helper.make_model(graph, opset_imports=[onnx_helper.make_opsetid("", 17)])
    settings = QuantSettings(bits=4, block_size=64, accuracy_level=4, lm_head_bits=None, embedding_bits=None)
    quantize_weights(model, settings, source_grid=source_grid)
    onnx.checker.check_model(model)
    exact = _dequantized_matmul(model) == weight
    if source_grid:
        assert exact.all()
    else:
        assert not exact.all()

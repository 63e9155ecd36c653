"""The Mamba-2 recurrent mixer against transformers' own NemotronHMamba2Mixer (random weights)."""

from __future__ import annotations

import math
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from transformers import DynamicCache, NemotronHConfig
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer

from ignition.models.blocks.mamba2 import Mamba2Mixer, load_mamba2
from ignition.models.nemotron_h import layer_kinds, mamba2_spec

PREFIX = "backbone.layers.0.mixer."
# (n_groups, heads, extra config): one group with a conv bias and no projection biases; two groups with
# projection biases and no conv bias
CONFIGS = {
    "g1": (1, 4, {}),
    "g2_bias": (2, 8, {"use_bias": True, "use_conv_bias": False}),
}


def tiny_config(name: str) -> NemotronHConfig:
    groups, heads, extra = CONFIGS[name]
    return NemotronHConfig(
        vocab_size=32,
        hidden_size=64,
        layers_block_type=["linear_attention"],
        mamba_num_heads=heads,
        mamba_head_dim=16,
        ssm_state_size=16,
        n_groups=groups,
        conv_kernel=4,
        chunk_size=8,
        **extra,
    )


def build(name: str, seed: int = 0, clamp_head: bool = False) -> tuple[NemotronHMamba2Mixer, Mamba2Mixer]:
    """The reference mixer with random weights, and ours loaded from its checkpoint-named tensors.
    clamp_head: head 0's dt_bias so low that softplus(dt) < time_step_min, so the dt clamp matters."""
    cfg = tiny_config(name)
    torch.manual_seed(seed)
    ref = NemotronHMamba2Mixer(cfg, layer_idx=0).eval()
    with torch.no_grad():
        ref.dt_bias.uniform_(-4.0, 0.5)
        ref.A_log.uniform_(math.log(0.5), math.log(4.0))
        ref.D.normal_()
        ref.norm.weight.normal_(1.0, 0.2)
        for param in (ref.conv1d.bias, ref.in_proj.bias, ref.out_proj.bias):
            if param is not None:
                param.normal_(0.0, 0.1)
        if clamp_head:
            ref.dt_bias[0] = -12.0
    tensors = {PREFIX + k: v.numpy() for k, v in ref.state_dict().items()}
    with torch.device("meta"):  # as the exporter builds models: no init, every parameter loaded
        ours = Mamba2Mixer(mamba2_spec(cfg.to_dict())).eval()
    assert sorted(load_mamba2(ours, tensors, PREFIX)) == sorted(tensors)
    assert not any(p.is_meta for p in ours.parameters())
    return ref, ours


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def zero_state(ours: Mamba2Mixer, batch: int = 1) -> torch.Tensor:
    return torch.zeros(batch, ours.state_size)


def ones(batch: int, length: int) -> torch.Tensor:
    return torch.ones(batch, length)


def reference_state(ref: NemotronHMamba2Mixer, cache: DynamicCache) -> torch.Tensor:
    """The reference cache as our flat state: conv [K-1, conv_dim] (its last K-1 inputs), ssm."""
    conv = cache.get_conv_state(0, state_idx=0)[:, :, 1:].transpose(1, 2)  # [B, conv_dim, K] -> [B, K-1, conv_dim]
    ssm = cache.get_recurrent_state(0, state_idx=0)
    return torch.cat([conv.reshape(conv.shape[0], -1), ssm.reshape(ssm.shape[0], -1)], dim=1)


@pytest.mark.parametrize("name", sorted(CONFIGS))
@torch.no_grad()
def test_full_sequence_matches_reference(name: str) -> None:
    ref, ours = build(name, clamp_head=True)
    assert ours.kind == "mamba2"
    x = torch.randn(1, 37, 64)
    y, state = ours(x, zero_state(ours), ones(1, 37))
    assert rel(y, ref(x)) < 1e-4
    spec = ours.spec
    assert ours.state_size == 3 * spec.conv_dim + spec.heads * 16 * 16
    cache = DynamicCache(config=ref.config)
    ref(x, cache=cache)
    assert rel(state, reference_state(ref, cache)) < 1e-4


@pytest.mark.parametrize("name", sorted(CONFIGS))
@torch.no_grad()
def test_chunked_threads_state(name: str) -> None:
    ref, ours = build(name, seed=1)
    x = torch.randn(1, 17, 64)
    full, full_state = ours(x, zero_state(ours), ones(1, 17))
    state, outs, ref_outs, pos = zero_state(ours), [], [], 0
    cache = DynamicCache(config=ref.config)
    for n in (5, 3, 1, 1, 7):  # L = 1 chunks take the reference's single-token decode path
        y, state = ours(x[:, pos : pos + n], state, ones(1, n))
        outs.append(y)
        ref_outs.append(ref(x[:, pos : pos + n], cache=cache))
        pos += n
    assert rel(torch.cat(outs, 1), full) < 1e-5
    assert rel(state, full_state) < 1e-5
    assert rel(torch.cat(outs, 1), torch.cat(ref_outs, 1)) < 1e-4
    assert rel(state, reference_state(ref, cache)) < 1e-4


@torch.no_grad()
def test_padded_batch_matches_rows() -> None:
    _, ours = build("g2_bias", seed=2, clamp_head=True)
    lengths, width = (9, 2, 0), 9
    states = torch.randn(3, ours.state_size) * 0.5  # sequences already under way
    x = torch.randn(3, width, 64) * 3.0  # padded positions hold garbage, not zeros
    valid = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]  # bool is accepted too
    y, new_state = ours(x, states, valid)
    assert torch.isfinite(y).all()
    for row, n in enumerate(lengths):
        if n == 0:  # nothing valid: the state is untouched
            assert torch.equal(new_state[row], states[row])
            continue
        y_row, state_row = ours(x[row : row + 1, :n], states[row : row + 1], ones(1, n))
        assert rel(y[row : row + 1, :n], y_row) < 1e-5
        assert rel(new_state[row : row + 1], state_row) < 1e-5


@torch.no_grad()
def test_onnx_export_matches_torch(tmp_path) -> None:
    _, ours = build("g2_bias", seed=3)
    batch, length = torch.export.Dim("B", min=1), torch.export.Dim("L", min=1)
    sample = (torch.randn(2, 5, 64), torch.randn(2, ours.state_size), ones(2, 5))
    path = tmp_path / "mamba2.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            ours,
            sample,
            input_names=["x", "state", "valid"],
            output_names=["y", "new_state"],
            dynamic_shapes=({0: batch, 1: length}, {0: batch}, {0: batch, 1: length}),
            opset_version=18,
            dynamo=True,
            optimize=True,
            verbose=False,
        )
    program.save(str(path))
    proto = onnx.load(str(path))
    assert not proto.functions
    bodies = [a.g for node in proto.graph.node for a in node.attribute if a.type == onnx.AttributeProto.GRAPH]
    nodes = [*proto.graph.node, *(n for body in bodies for n in body.node)]
    assert {n.domain for n in nodes} == {""}  # standard ONNX only: no custom or contrib ops
    assert [n.op_type for n in proto.graph.node].count("Scan") == 1
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for b, n, last_row in ((1, 1, 1), (2, 1, 0), (2, 7, 4), (2, 33, 20)):  # last_row: its valid tokens
        x, state = torch.randn(b, n, 64), torch.randn(b, ours.state_size) * 0.5
        valid = ones(b, n)
        valid[-1, last_row:] = 0.0
        y, new_state = ours(x, state, valid)
        got_y, got_state = session.run(None, {"x": x.numpy(), "state": state.numpy(), "valid": valid.numpy()})
        assert rel(torch.from_numpy(got_y), y) < 1e-4
        assert rel(torch.from_numpy(got_state), new_state) < 1e-4


def test_config_helpers() -> None:
    assert layer_kinds(tiny_config("g1").to_dict()) == ["mamba"]
    config = {
        "hidden_size": 64,
        "hybrid_override_pattern": "M-*E",
        "mamba_n_groups": 2,
        "mamba_d_conv": 3,
        "mamba_dt_min": 0.01,
        "mamba_conv_bias": False,
        "use_bias": True,
    }
    assert layer_kinds(config) == ["mamba", "mlp", "attention", "moe"]
    spec = mamba2_spec(config)
    got = (spec.n_groups, spec.conv_kernel, spec.time_step_min, spec.conv_bias, spec.proj_bias)
    assert got == (2, 3, 0.01, False, True)
    assert spec.state_size == 2 * (128 * 64 + 2 * 2 * 128) + 128 * 64 * 128
    with pytest.raises(ValueError, match="only silu"):
        mamba2_spec({**config, "mamba_hidden_act": "gelu"})


def test_load_checks_shapes() -> None:
    ref, ours = build("g1")
    tensors = {PREFIX + k: v.numpy() for k, v in ref.state_dict().items()}
    tensors[PREFIX + "D"] = np.zeros(5, np.float32)
    with pytest.raises(ValueError, match=r"mixer\.D: checkpoint shape \(5,\) != \(4,\)"):
        load_mamba2(ours, tensors, PREFIX)

"""RoPE scaling on the dense families (linear, dynamic, YaRN, llama3, GGUF rope_freqs), against
transformers: the frequencies and attention factor of its rope utilities, the tiny model's logits
at positions past the original context, the served context each scaling reaches, and an fp32
export whose engine validates against that reference."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from ignition.checkpoints.base import CheckpointError
from ignition.checkpoints.load import load_checkpoint
from ignition.checkpoints.rope import rope_scaling_from_config, rope_scaling_from_gguf
from ignition.models.blocks.rotary import scaled_inv_freq
from ignition.models.decoder import DecoderLM
from ignition.models.rope_config import scaled_context
from tests.unit.gguf_writing import add_bpe_vocabulary, add_named_tensors, finish
from tests.unit.tiny_checkpoints import write_tiny_checkpoint

ORIGINAL = 48  # a short "pretraining" context, so a test prompt runs well past it
SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
    "yarn-mscale": {
        "rope_type": "yarn",
        "factor": 8.0,
        "original_max_position_embeddings": ORIGINAL,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
        "beta_fast": 16,
    },
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": ORIGINAL,
    },
}


def scaled_folder(tmp_path: Path, name: str) -> Path:
    """A tiny llama folder whose config carries SCALINGS[name] (the legacy `rope_scaling` key)."""
    folder = write_tiny_checkpoint(tmp_path / name, "llama")
    config = json.loads((folder / "config.json").read_text())
    config["rope_scaling"] = SCALINGS[name]
    config["max_position_embeddings"] = ORIGINAL if name != "llama3" else ORIGINAL * 8
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def hf_model(folder: Path):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()


@pytest.mark.parametrize("name", sorted(SCALINGS))
def test_frequencies_and_attention_factor_equal_transformers(tmp_path, name):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    folder = scaled_folder(tmp_path, name)
    config = json.loads((folder / "config.json").read_text())
    scaling = rope_scaling_from_config(config, name)
    assert scaling is not None
    hf = LlamaConfig(**config)
    dim = config["hidden_size"] // config["num_attention_heads"]
    kind = hf.rope_parameters["rope_type"]
    expected, attention = ROPE_INIT_FUNCTIONS[kind](hf, "cpu") if kind != "default" else (None, 1.0)
    ours = scaled_inv_freq(scaling, dim, float(config["rope_theta"]))
    # Exact, but llama3's band, which the reader stores as per-frequency divisors (one rounding).
    torch.testing.assert_close(ours, expected.float(), rtol=1e-6 if kind == "llama3" else 0, atol=0)
    assert scaling.attention_factor == pytest.approx(attention, rel=1e-12)


@pytest.mark.parametrize("name", sorted(SCALINGS))
def test_logits_past_the_original_context_equal_transformers(tmp_path, name):
    folder = scaled_folder(tmp_path, name)
    checkpoint = load_checkpoint(str(folder))
    arch = checkpoint.architecture
    model = DecoderLM.build(arch, {}, checkpoint.tensors)
    length = min(arch.max_position_embeddings, 3 * ORIGINAL) if name != "dynamic" else ORIGINAL
    ids = torch.from_numpy(np.random.default_rng(3).integers(0, 5000, length))
    ours = model.reference(ids)
    with torch.no_grad():
        theirs = hf_model(folder)(ids.unsqueeze(0)).logits[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=2e-4)
    # And the fused cos/sin tables the step graph reads agree with the reference frequencies.
    cos, sin = model.rotary.cos_sin(torch.arange(length))
    torch.testing.assert_close(cos[..., 0, : arch.head_dim // 2], model.rotary.cos_cache[:length], atol=1e-5, rtol=0)
    torch.testing.assert_close(sin[..., 0, : arch.head_dim // 2], model.rotary.sin_cache[:length], atol=1e-5, rtol=0)


def test_served_context_follows_the_scaling():
    native = 32768
    yarn = rope_scaling_from_config(
        {"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": native}}, "qwen"
    )
    assert scaled_context(native, yarn) == 4 * native  # Qwen2.5's documented 128k setting
    linear = rope_scaling_from_config({"rope_scaling": {"type": "linear", "factor": 2.0}}, "m")
    assert scaled_context(4096, linear) == 8192
    shape = {"hidden_size": 64, "num_attention_heads": 4, "rope_theta": 500000.0}
    for kind in ("dynamic", "llama3"):
        scaling = rope_scaling_from_config({**shape, "rope_scaling": {**SCALINGS[kind]}}, "m")
        assert scaled_context(8192, scaling) == 8192
    assert rope_scaling_from_config({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, "m") is None


def test_unsupported_or_incomplete_scaling_is_refused():
    with pytest.raises(CheckpointError, match="longrope"):
        rope_scaling_from_config({"rope_scaling": {"type": "longrope", "short_factor": [1.0]}}, "phi")
    with pytest.raises(CheckpointError, match="llama3 rope scaling needs"):
        rope_scaling_from_config({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "m")
    with pytest.raises(CheckpointError, match="GGUF rope scaling"):
        rope_scaling_from_gguf("longrope", 1.0, None, None)


def test_gguf_rope_freqs_divide_the_frequencies_as_llama3_does():
    """llama.cpp writes a Llama 3 checkpoint's scaling as rope_freqs: factors whose quotient is
    transformers' llama3 frequencies."""
    dim, theta = 16, 500000.0
    llama3 = rope_scaling_from_config(
        {
            "rope_scaling": SCALINGS["llama3"],
            "head_dim": dim,
            "hidden_size": 64,
            "num_attention_heads": 4,
            "rope_theta": theta,
        },
        "m",
    )
    target = scaled_inv_freq(llama3, dim, theta)
    base = scaled_inv_freq(rope_scaling_from_gguf("linear", 1.0, None, None), dim, theta)
    factors = (base / target).numpy()
    from_gguf = rope_scaling_from_gguf("none", 1.0, None, factors)
    torch.testing.assert_close(scaled_inv_freq(from_gguf, dim, theta), target, rtol=1e-6, atol=0)


def test_llama3_export_validates_against_the_reference(tmp_path):
    """A scaled tiny llama through the whole exporter at fp32: validation compares the ONNX
    engine's prefill and paged decode with the torch reference proven above."""
    from helios.manifest import Manifest
    from ignition.export.pipeline import ExportOptions, export_core
    from ignition.recipes import load_recipe

    folder = scaled_folder(tmp_path, "llama3")
    out = tmp_path / "core"
    export_core(ExportOptions(recipe=load_recipe("smollm2"), checkpoint=str(folder), out=out, precision="fp32"))
    manifest = Manifest.load(out)
    assert manifest.architecture.rope_scaling is not None
    assert manifest.architecture.rope_scaling.kind == "llama3"
    assert manifest.limits.context_length == ORIGINAL * 8
    assert manifest.parity is not None and manifest.parity.top1_agreement == 1.0


def llama_cpp_rope_factors(config: dict) -> np.ndarray:
    """What llama.cpp's converter writes as a Llama 3 checkpoint's rope_freqs (its own formula:
    1 for high frequencies, the factor for low ones, a blend between)."""
    params = config["rope_scaling"]
    dim = config["hidden_size"] // config["num_attention_heads"]
    base = float(config["rope_theta"])
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old = params["original_max_position_embeddings"]
    factors = []
    for freq in 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim)):
        wavelen = 2 * np.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def write_llama3_gguf(folder: Path, path: Path) -> None:
    """A Llama 3 style GGUF of a tiny HF llama folder, written with the gguf library as llama.cpp's
    converter lays it out: permuted q/k rows, rope_freqs, a llama-bpe byte-level BPE vocabulary."""
    import gguf
    from safetensors.numpy import load_file

    config = json.loads((folder / "config.json").read_text())
    tensors = load_file(folder / "model.safetensors")
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_rope_dimension_count(config["hidden_size"] // heads)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    add_bpe_vocabulary(writer, folder, "llama-bpe", config["bos_token_id"], config["eos_token_id"])

    def permute(w: np.ndarray, n_head: int) -> np.ndarray:  # llama.cpp's convert_hf_to_gguf permute
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    for name in list(tensors):
        if name.endswith("self_attn.q_proj.weight"):
            tensors[name] = permute(tensors[name], heads)
        elif name.endswith("self_attn.k_proj.weight"):
            tensors[name] = permute(tensors[name], kv_heads)
    writer.add_tensor("rope_freqs.weight", llama_cpp_rope_factors(config))
    add_named_tensors(writer, gguf.MODEL_ARCH.LLAMA, config["num_hidden_layers"], tensors)
    finish(writer)


def test_llama3_gguf_with_rope_freqs_reads_back_equal_and_matches_transformers(tmp_path):
    folder = scaled_folder(tmp_path, "llama3")
    path = tmp_path / "tiny-llama3.gguf"
    write_llama3_gguf(folder, path)
    from_gguf = load_checkpoint(str(path))
    from_folder = load_checkpoint(str(folder))
    scaling = from_gguf.architecture.rope_scaling
    assert scaling is not None and scaling.kind == "factors"
    assert from_gguf.architecture.max_position_embeddings == from_folder.architecture.max_position_embeddings
    assert sorted(from_gguf.tensors) == sorted(from_folder.tensors)
    for name, tensor in from_folder.tensors.items():
        np.testing.assert_array_equal(from_gguf.tensors[name], tensor, err_msg=name)
    arch = from_gguf.architecture
    torch.testing.assert_close(
        scaled_inv_freq(scaling, arch.head_dim, arch.rope_theta),
        scaled_inv_freq(from_folder.architecture.rope_scaling, arch.head_dim, arch.rope_theta),
        rtol=1e-6,
        atol=0,
    )
    ids = torch.from_numpy(np.random.default_rng(4).integers(0, 5000, 3 * ORIGINAL))
    ours = DecoderLM.build(arch, {}, from_gguf.tensors).reference(ids)
    with torch.no_grad():
        theirs = hf_model(folder)(ids.unsqueeze(0)).logits[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=2e-4)


CONFIGURED = ("qwen3", "mistral", "smollm3")  # Phi3Config itself takes longrope alone


@pytest.mark.parametrize("name", ["linear", "dynamic", "yarn-mscale", "llama3"])
@pytest.mark.parametrize("family", CONFIGURED)
def test_configured_families_follow_the_scaling_past_the_original_context(tmp_path, family, name):
    """The dense families users bring (Qwen3's documented YaRN included) rotate as transformers'
    own classes do at positions past the original context (SmolLM3's NoPE layers stay unrotated)."""
    from ignition.models import FAMILIES
    from tests.unit.family_checkpoints import write_family_checkpoint

    theta = 1000000.0 if family == "qwen3" else 10000.0
    rope = {"rope_theta": theta, **SCALINGS[name]}
    native = ORIGINAL * 8 if name == "llama3" else ORIGINAL
    overrides = {"rope_parameters": rope, "max_position_embeddings": native, "sliding_window": None}
    folder, reference = write_family_checkpoint(tmp_path / family, family, overrides=overrides)
    checkpoint = load_checkpoint(str(folder))
    arch = checkpoint.architecture
    assert arch.rope_scaling is not None and arch.rope_scaling.kind == name.split("-")[0]
    model = FAMILIES[family].build(arch, checkpoint.model_config, checkpoint.tensors)
    length = min(arch.max_position_embeddings, 3 * ORIGINAL) if name != "dynamic" else ORIGINAL
    ids = torch.from_numpy(np.random.default_rng(3).integers(0, 250, length))
    ours = model.reference(ids)
    with torch.no_grad():
        theirs = reference(ids.unsqueeze(0)).logits[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=2e-4)


def test_qwen3_yarn_export_validates_and_reaches_the_scaled_context(tmp_path):
    """Qwen3 with YaRN through the whole exporter at fp32: the manifest records the scaling, the
    served context is the one YaRN reaches, and validation compares the ONNX engine with the
    torch reference proven above."""
    from helios.manifest import Manifest
    from ignition.export.pipeline import ExportOptions, export_core
    from ignition.recipes import load_recipe
    from tests.unit.family_checkpoints import write_family_checkpoint

    rope = {"rope_theta": 1000000.0, **SCALINGS["yarn"]}
    overrides = {"rope_parameters": rope, "max_position_embeddings": ORIGINAL}
    folder, _ = write_family_checkpoint(tmp_path / "qwen3", "qwen3", overrides=overrides)
    out = tmp_path / "core"
    export_core(ExportOptions(recipe=load_recipe("qwen3"), checkpoint=str(folder), out=out, precision="fp32"))
    manifest = Manifest.load(out)
    assert manifest.architecture.rope_scaling is not None and manifest.architecture.rope_scaling.kind == "yarn"
    assert manifest.limits.context_length == ORIGINAL * 4
    assert manifest.parity is not None and manifest.parity.top1_agreement == 1.0


def test_phi3_longrope_follows_transformers_past_the_original_context(tmp_path):
    """Phi-3.5 / Phi-4-mini's longrope (partial rotary here, as Phi-4-mini's): past the original
    context transformers rotates with the long factors and scales cos/sin by its attention
    factor; the core always does (it is served past the original context)."""
    from ignition.models import FAMILIES
    from tests.unit.family_checkpoints import TINY_CONFIGS, write_family_checkpoint

    rotary = int(16 * 0.5) // 2  # head_dim 16, partial_rotary_factor 0.5: 4 frequencies
    rope = {
        **TINY_CONFIGS["phi3"]["rope_parameters"],
        "rope_type": "longrope",
        "short_factor": [1.0, 1.1, 1.3, 1.6],
        "long_factor": [1.0, 2.5, 6.0, 11.0][:rotary],
        "original_max_position_embeddings": ORIGINAL,
    }
    overrides = {
        "rope_parameters": rope,
        "max_position_embeddings": 4 * ORIGINAL,
        "original_max_position_embeddings": ORIGINAL,  # Phi3Config copies it into rope_parameters
        "sliding_window": None,
    }
    folder, reference = write_family_checkpoint(tmp_path / "phi3", "phi3", overrides=overrides)
    checkpoint = load_checkpoint(str(folder))
    arch = checkpoint.architecture
    assert arch.rope_scaling is not None and arch.rope_scaling.kind == "longrope"
    assert arch.rope_scaling.freq_factors == rope["long_factor"] and arch.max_position_embeddings == 4 * ORIGINAL
    model = FAMILIES["phi3"].build(arch, checkpoint.model_config, checkpoint.tensors)
    ids = torch.from_numpy(np.random.default_rng(3).integers(0, 250, 3 * ORIGINAL))
    ours = model.reference(ids)
    with torch.no_grad():
        theirs = reference(ids.unsqueeze(0)).logits[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=2e-4)
    # And through the exporter (the pool kernel's cos/sin carry the attention factor).
    from helios.manifest import Manifest
    from ignition.export.pipeline import ExportOptions, export_core
    from ignition.recipes import load_recipe

    out = tmp_path / "core"
    export_core(ExportOptions(recipe=load_recipe("phi3"), checkpoint=str(folder), out=out, precision="fp32"))
    manifest = Manifest.load(out)
    assert manifest.architecture.rope_scaling is not None and manifest.architecture.rope_scaling.kind == "longrope"
    assert manifest.parity is not None and manifest.parity.top1_agreement == 1.0

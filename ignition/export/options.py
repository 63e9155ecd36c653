"""What an export is asked for (ExportOptions, the CLI's flags), how it reports progress and how it fails."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from helios.kernels import kv_dtype
from ignition.recipes import Recipe

Progress = Callable[[str, str], None]  # (stage, detail)


class ExportError(RuntimeError):
    pass


TARGETS = ("cpu", "cuda")


def parse_targets(text: str) -> tuple[str, ...]:
    """--target's comma-separated engines, in TARGETS order; "cpu" is always among them (the ONNX
    graph is what export validates first and what the score graph and drafter build on)."""
    named = {part.strip() for part in text.split(",") if part.strip()}
    unknown = sorted(named - set(TARGETS))
    if unknown or not named:
        raise ExportError(
            f"unknown --target {', '.join(unknown) or repr(text)} (choose from {', '.join(TARGETS)}, comma-separated)"
        )
    return tuple(t for t in TARGETS if t in named or t == "cpu")


def parse_kv_dtype(text: str) -> str:
    """--kv-dtype: auto, bf16, fp16 or fp32 (the full names too), as the manifest spells it."""
    try:
        return kv_dtype.canonical(text)
    except ValueError as exc:
        raise ExportError(f"--kv-dtype: {exc}") from None


@dataclass
class ExportOptions:
    recipe: Recipe
    checkpoint: str  # packaged name, .gguf file or Hugging Face folder
    out: Path
    precision: str = "int4"
    prompt_logprobs: bool = False
    force: bool = False
    cache: bool = True  # reuse/populate the export cache ($FLARE_CACHE/export)
    context_length: int | None = None  # narrows the checkpoint's native context (--context-length)
    drafter: str | None = None  # a smaller checkpoint with the same tokenizer, compiled in (--drafter)
    # Engines to write (--target): "cpu" (the ONNX step graph, always written: validation, the
    # score graph and the drafter build on it) and "cuda" (the torch step program beside it).
    targets: tuple[str, ...] = ("cpu",)
    torch_dtype: str = "bfloat16"  # the torch program's weights (--torch-dtype)
    kv_dtype: str = "auto"  # the KV pool type helios serves with by default (--kv-dtype; manifest limits)

"""Shared fixtures: real cores (tiny random and the real default model) and live servers."""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from helios.cache_dir import cache_root
from helios.launcher import HeliosProcess

# Triton kernels run on CPU tensors only under the interpreter, and @triton.jit picks it when it
# decorates, triton.language's own helpers included: whichever test module first imports
# transformers (which imports triton) fixes that for the whole run, so it is set before any.
if not Path("/dev/nvidia0").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parent.parent
CACHE = cache_root()
# flare's kernel library is built once per machine; tests that point FLARE_CACHE at a scratch
# folder (and the processes they start) keep using the one build.
os.environ.setdefault("FLARE_KERNEL_CACHE", str(CACHE / "kernels"))


def code_digest() -> str:
    """Hash of everything that shapes an exported core, so a cached core never outlives its code."""
    h = hashlib.sha256()
    for folder in ("ignition", "recipes"):
        for path in sorted((REPO / folder).rglob("*")):
            if path.is_file() and path.suffix in {".py", ".toml", ".jinja"}:
                h.update(path.relative_to(REPO).as_posix().encode())
                h.update(path.read_bytes())
    h.update((REPO / "helios" / "manifest.py").read_bytes())
    for path in sorted((REPO / "helios" / "kernels").glob("*")):  # the int4 layout, the kernels
        if path.suffix in {".py", ".cc", ".h"}:
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


def export(
    recipe: str,
    checkpoint: str,
    out: Path,
    precision: str,
    force: bool = False,
    prompt_logprobs: bool = False,
    targets: tuple[str, ...] = ("cpu",),
    torch_dtype: str = "bfloat16",
) -> Path:
    from ignition.export.pipeline import ExportOptions, export_core
    from ignition.recipes import load_recipe

    export_core(
        ExportOptions(
            recipe=load_recipe(recipe),
            checkpoint=checkpoint,
            out=out,
            precision=precision,
            force=force,
            prompt_logprobs=prompt_logprobs,
            targets=targets,
            torch_dtype=torch_dtype,
        )
    )
    return out


@pytest.fixture(scope="session")
def tiny_checkpoint_dir(tmp_path_factory) -> Path:
    from tests.unit.tiny_checkpoints import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2")


@pytest.fixture(scope="session")
def tiny_core(tmp_path_factory, tiny_checkpoint_dir) -> Path:
    """A real fp32 core exported from a tiny random qwen2 checkpoint with the real Qwen tokenizer,
    with the prompt-scoring graph (--prompt-logprobs) and an fp32 torch step program beside the
    ONNX graph (--target cpu,cuda --torch-dtype float32), which `--engine torch` serves on CPU torch."""
    return export(
        "qwen25_coder",
        str(tiny_checkpoint_dir),
        tmp_path_factory.mktemp("cores") / "tiny",
        "fp32",
        prompt_logprobs=True,
        targets=("cpu", "cuda"),
        torch_dtype="float32",
    )


THINK_TOKENS = {151667: "<think>", 151668: "</think>"}  # Qwen3's ids for its reasoning delimiters


def add_think_tokens(tokenizer_json: str) -> str:
    """The Qwen2.5 tokenizer extended the way Qwen3's is: <think> and </think> as single added
    (non-special) tokens in two of its reserved rows."""
    import json

    doc = json.loads(tokenizer_json)
    vocab = doc["model"]["vocab"]
    for token_id, text in THINK_TOKENS.items():
        old = next(k for k, v in vocab.items() if v == token_id)
        del vocab[old]
        vocab[text] = token_id
        doc["added_tokens"].append(
            {
                "id": token_id,
                "content": text,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": False,
            }
        )
    return json.dumps(doc)


@pytest.fixture(scope="session")
def tiny_think_core(tmp_path_factory) -> Path:
    """A tiny random qwen2 core with Qwen3-style reasoning: tests/data/qwen3_tiny.toml (reasoning
    "qwen3", tool "hermes"), <think>/</think> as single tokens, and a template that opens
    reasoning in the generation prompt unless enable_thinking is false."""
    from tests.unit.tiny_checkpoints import write_tiny_checkpoint

    folder = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-think"), "qwen2")
    tokenizer = folder / "tokenizer.json"
    tokenizer.write_text(add_think_tokens(tokenizer.read_text()))
    (folder / "chat_template.jinja").write_text((REPO / "tests" / "data" / "qwen3_tiny.jinja").read_text())
    out = tmp_path_factory.mktemp("cores") / "tiny-think"
    return export(str(REPO / "tests" / "data" / "qwen3_tiny.toml"), str(folder), out, "fp32")


@pytest.fixture(scope="session")
def default_core() -> Path:
    """The real default core (Qwen2.5-Coder-0.5B, int4), exported once and cached by code digest."""
    target = CACHE / "cores" / f"qwen25_coder-int4-{code_digest()}"
    if not (target / "core.json").is_file():
        for stale in (CACHE / "cores").glob("qwen25_coder-int4-*"):
            if stale != target:
                shutil.rmtree(stale, ignore_errors=True)
        # force: a concurrent run of the same code may have exported the same digest meanwhile.
        export("qwen25_coder", "qwen2.5-coder-0.5b", target, "int4", force=True)
    return target


@pytest.fixture(scope="session")
def tiny_server(tiny_core) -> Iterator[HeliosProcess]:
    server = HeliosProcess(tiny_core)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tiny_torch_server(tiny_core) -> Iterator[HeliosProcess]:
    """The tiny core served by its torch step program on CPU torch (what a GPU serves, minus graphs)."""
    server = HeliosProcess(tiny_core, "--engine", "torch")
    yield server
    server.stop()


# The keyed tiny server: authentication on, few admission slots and a small body limit, so the
# transport rules (401, 429, 413) are reachable quickly.
TINY_API_KEY = "tiny-serving-key"
TINY_ADMISSION_SLOTS = 4
TINY_MAX_BODY_BYTES = 1 << 20


@pytest.fixture(scope="session")
def tiny_keyed_server(tiny_core, tmp_path_factory) -> Iterator[HeliosProcess]:
    folder = tmp_path_factory.mktemp("keyed")
    (folder / "key").write_text(TINY_API_KEY + "\n")
    (folder / "helios.toml").write_text(
        f"[server]\nhttp_admission_slots = {TINY_ADMISSION_SLOTS}\nmax_body_bytes = {TINY_MAX_BODY_BYTES}\n"
    )
    server = HeliosProcess(tiny_core, "--api-key-file", str(folder / "key"), "--config", str(folder / "helios.toml"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def default_server(default_core) -> Iterator[HeliosProcess]:
    server = HeliosProcess(default_core)
    yield server
    server.stop()

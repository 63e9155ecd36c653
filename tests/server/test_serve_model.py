"""`helios serve MODEL` from a checkpoint: the recipe inferred from the checkpoint's metadata, the
core compiled once into the flare cache with its stages shown, reused on the second start; bad
inputs are one-line errors with exit code 2."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from helios.launcher import HeliosProcess
from tests.unit.tiny_checkpoints import write_tiny_checkpoint


def serve_fails(model: str, env: dict[str, str] | None = None, *args: str) -> str:
    """Run `helios serve MODEL` expecting a refusal; its one error line."""
    result = subprocess.run(
        [sys.executable, "-m", "helios.cli", "serve", model, "--port", "1", *args],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    return lines[0]


def test_missing_path(tmp_path):
    assert "no such file or folder" in serve_fails(str(tmp_path / "nothing.gguf"))


def test_corrupt_gguf(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + random.Random(5).randbytes(64))
    assert "broken.gguf" in serve_fails(str(bad))
    text = tmp_path / "notes.gguf"
    text.write_text("not a model")
    assert "GGUF" in serve_fails(str(text))


def test_unknown_architecture_names_what_is_supported(tmp_path):
    folder = tmp_path / "bert"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "bert"}))
    (folder / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    line = serve_fails(str(folder))
    assert "'bert'" in line and "supported architectures:" in line and "qwen2" in line and "llama" in line


def test_folder_without_weights(tmp_path):
    folder = tmp_path / "empty"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert "no .safetensors weights" in serve_fails(str(folder))
    other = tmp_path / "plain"
    other.mkdir()
    assert "neither a core" in serve_fails(str(other))


def test_hub_id_missing_from_the_cache(tmp_path):
    line = serve_fails("someorg/missing-model", {"HF_HUB_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"})
    assert "someorg/missing-model" in line and "--download" in line


def test_unknown_recipe(tmp_path):
    folder = write_tiny_checkpoint(tmp_path / "tiny", "llama")
    assert "recipe" in serve_fails(str(folder), None, "--recipe", "no-such-recipe")


@pytest.fixture()
def scratch_cache(tmp_path) -> dict[str, str]:
    """A private flare cache (the compiled kernels stay shared, see tests/conftest.py)."""
    return {"FLARE_CACHE": str(tmp_path / "flare-cache")}


def compiled_cores(env: dict[str, str]) -> list[Path]:
    auto = Path(env["FLARE_CACHE"]) / "cores" / "auto"
    return sorted(p for p in auto.iterdir() if (p / "core.json").is_file())


def chat_round_trip(server: HeliosProcess) -> dict:
    response = httpx.post(
        server.url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    return response.json()


def test_hugging_face_folder_of_another_family_serves_in_one_command(tmp_path, scratch_cache):
    """A tiny llama folder: recipe inferred (smollm2, the llama recipe), compiled with its stages
    shown, served; the second start finds the compiled core and shows no stage."""
    folder = write_tiny_checkpoint(tmp_path / "tiny-llama", "llama")
    # Its authors' sampling: the inferred recipe takes it (top_p beyond the recipe's range widens it).
    (folder / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 0.9, "top_p": 0.03}))
    first = HeliosProcess(folder, "--precision", "fp32", env=scratch_cache, timeout=600)
    try:
        output = first.output()
        assert "recipe smollm2 (llama), inferred from the checkpoint" in output
        for stage in ("digest", "read", "convert", "quantize", "validate", "write"):
            assert f"✓ {stage}" in output, output
        card = httpx.get(first.url + "/v1/models").json()["data"][0]
        assert card["root"] == folder.name
        defaults, ranges = card["flare"]["sampling_defaults"], card["flare"]["sampling_ranges"]
        assert (defaults["temperature"], defaults["top_p"]) == (0.9, 0.03)
        assert ranges["top_p"]["min"] == 0.03
        assert chat_round_trip(first)["usage"]["completion_tokens"] >= 1
    finally:
        first.stop()
    cores = compiled_cores(scratch_cache)
    assert len(cores) == 1
    second = HeliosProcess(folder, "--precision", "fp32", env=scratch_cache)
    try:
        assert "✓" not in second.output()
        assert chat_round_trip(second)["choices"][0]["message"]["role"] == "assistant"
    finally:
        second.stop()
    assert compiled_cores(scratch_cache) == cores


def test_hub_id_follows_refs_main_in_the_hugging_face_cache(tmp_path, scratch_cache):
    """ORG/NAME resolves through huggingface_hub's cache lookup: the snapshot refs/main names, not
    whichever snapshot folder is newest."""
    repo = tmp_path / "hub" / "models--tinyorg--tiny-llama"
    current, stale = "a" * 40, "b" * 40
    write_tiny_checkpoint(repo / "snapshots" / current, "llama")
    (repo / "snapshots" / stale).mkdir()
    (repo / "snapshots" / stale / "config.json").write_text(json.dumps({"model_type": "bert"}))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(current)
    env = {**scratch_cache, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    server = HeliosProcess("tinyorg/tiny-llama", "--precision", "fp32", env=env, timeout=600)
    try:
        assert "recipe smollm2 (llama)" in server.output()
        card = httpx.get(server.url + "/v1/models").json()["data"][0]
        assert (card["id"], card["root"]) == ("tinyorg/tiny-llama", current)  # served under the id asked for
    finally:
        server.stop()

"""Recipes validate before any work; the manifest round-trips and guards what helios loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from helios.manifest import Manifest, ManifestError
from ignition.cli import app
from ignition.recipes import RecipeError, available_recipes, load_recipe


def test_shipped_recipes_load():
    assert {"qwen25_coder", "smollm2"} <= set(available_recipes())
    qwen = load_recipe("qwen25_coder")
    assert qwen.family == "qwen2"
    assert qwen.default_checkpoint == "qwen2.5-coder-0.5b"
    d = qwen.sampling_defaults
    assert (d.temperature, d.top_p, d.top_k, d.repetition_penalty) == (0.7, 0.8, 20, 1.05)
    for key, bounds in qwen.sampling_ranges.items():
        assert bounds.min <= getattr(d, key) <= bounds.max


def test_unknown_recipe_names_the_known_ones():
    with pytest.raises(RecipeError, match="unknown recipe 'nope'.*qwen25_coder"):
        load_recipe("nope")


def test_default_outside_its_range_is_rejected(tmp_path: Path):
    text = (load_recipe("qwen25_coder").path).read_text().replace("temperature = 0.7", "temperature = 3.0")
    bad = tmp_path / "bad.toml"
    bad.write_text(text)
    with pytest.raises(RecipeError, match="temperature=3.0 lies outside"):
        load_recipe(str(bad))


def test_unknown_family_is_rejected(tmp_path: Path):
    text = (load_recipe("qwen25_coder").path).read_text().replace('family = "qwen2"', 'family = "mamba9"')
    bad = tmp_path / "bad.toml"
    bad.write_text(text)
    with pytest.raises(RecipeError, match="family 'mamba9' is not supported"):
        load_recipe(str(bad))


def test_cli_unknown_recipe_exits_with_a_clear_error(tmp_path: Path):
    result = CliRunner().invoke(app, ["export", "--recipe", "nope", "--out", str(tmp_path / "c")])
    assert result.exit_code == 2
    assert "unknown recipe 'nope'" in result.output
    assert not (tmp_path / "c").exists()


def test_cli_rejects_architecture_mismatch_before_work(tmp_path: Path):
    from tests.unit.tiny_checkpoints import write_tiny_checkpoint

    llama = write_tiny_checkpoint(tmp_path / "llama", "llama")
    result = CliRunner().invoke(
        app, ["export", "--recipe", "qwen25_coder", "--checkpoint", str(llama), "--out", str(tmp_path / "c")]
    )
    assert result.exit_code == 2
    assert "is a 'llama' model but recipe 'qwen25_coder' compiles 'qwen2'" in " ".join(result.output.split())
    assert not (tmp_path / "c").exists()


def test_manifest_round_trip_and_guards(tiny_core: Path, tmp_path: Path):
    manifest = Manifest.load(tiny_core)
    assert Manifest.from_dict(json.loads(manifest.to_json())) == manifest
    assert manifest.files, "every core file is listed with its digest"

    copy = tmp_path / "core"
    copy.mkdir()
    for path in tiny_core.iterdir():
        (copy / path.name).write_bytes(path.read_bytes())

    data = json.loads((copy / "core.json").read_text())
    (copy / "core.json").write_text(json.dumps({**data, "format_version": "2.0"}))
    with pytest.raises(ManifestError, match="format version '2.0'"):
        Manifest.load(copy)

    (copy / "core.json").write_text(json.dumps(data))
    (copy / "tokenizer.json").write_text("{}")
    with pytest.raises(ManifestError, match="tokenizer.json does not match its digest"):
        Manifest.load(copy)

    (copy / "tokenizer.json").unlink()
    with pytest.raises(ManifestError, match="tokenizer.json is missing"):
        Manifest.load(copy)

    del data["limits"]
    (copy / "core.json").write_text(json.dumps(data))
    with pytest.raises(ManifestError, match="core.limits is missing"):
        Manifest.load(copy, verify_files=False)

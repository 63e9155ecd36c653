"""`ignition export --recipe NAME` finds the recipe's checkpoint in the local Hugging Face cache.

The design card's first command, `ignition export --recipe qwen38 --prompt-logprobs` then
`helios serve cores/qwen38`, runs exactly as typed in a folder whose HF cache holds a (tiny,
transformers-written) Qwen3.8 checkpoint: found by the recipe's hub id, offline.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from helios.launcher import HeliosProcess
from ignition.checkpoints.base import CheckpointError
from ignition.checkpoints.hub_cache import find_snapshot, hub_cache_dirs, resolve_recipe_checkpoint
from ignition.cli import app
from ignition.recipes import RecipeError, load_recipe
from tests.conftest import REPO
from tests.unit.family_checkpoints import write_quantizable_checkpoint

QWEN38_ID = "Qwen/Qwen3.8-Flash-Next"


def snapshot_dir(cache: Path, repo_id: str, revision: str) -> Path:
    return cache / ("models--" + repo_id.replace("/", "--")) / "snapshots" / revision


def put_snapshot(source: Path, cache: Path, repo_id: str, revision: str, mtime: float) -> Path:
    """Lay `source` out as the hub does: blobs by content, snapshot entries as links to them."""
    blobs = cache / ("models--" + repo_id.replace("/", "--")) / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    snapshot = snapshot_dir(cache, repo_id, revision)
    snapshot.mkdir(parents=True)
    for path in sorted(source.iterdir()):
        blob = blobs / f"{revision}-{path.name}"
        shutil.copyfile(path, blob)
        (snapshot / path.name).symlink_to(os.path.relpath(blob, snapshot))
    os.utime(snapshot, (mtime, mtime))
    return snapshot


@pytest.fixture(scope="module")
def qwen38_checkpoint(tmp_path_factory) -> Path:
    return write_quantizable_checkpoint(tmp_path_factory.mktemp("qwen38-ckpt"), "qwen3_5_moe")


@pytest.fixture(scope="module")
def export_cache(tmp_path_factory) -> Path:
    """One FLARE_CACHE for this module's exports of the same snapshot: the second reuses the
    first's traced graph (the export cache keys it by content), as on a user's machine."""
    return tmp_path_factory.mktemp("flare-cache")


@pytest.fixture()
def hub_cache(tmp_path, monkeypatch, qwen38_checkpoint) -> Path:
    """An HF cache with a complete (older) and an incomplete (newer) snapshot of Qwen3.8."""
    cache = tmp_path / "hf-hub"
    now = time.time()
    good = put_snapshot(qwen38_checkpoint, cache, QWEN38_ID, "a" * 40, now - 100)
    broken = put_snapshot(qwen38_checkpoint, cache, QWEN38_ID, "b" * 40, now)
    shard = sorted(broken.glob("model-*.safetensors"))[0]
    (broken / shard.name).resolve().unlink()  # a dangling link: that shard's download never finished
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    assert good.is_dir()
    return cache


def test_cache_locations_follow_the_hub_environment(tmp_path, monkeypatch):
    for name in ("HF_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert hub_cache_dirs() == [tmp_path / ".cache" / "huggingface" / "hub"]
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hub_cache_dirs() == [tmp_path / "xdg" / "huggingface" / "hub"]
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert hub_cache_dirs() == [tmp_path / "hf" / "hub"]
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert hub_cache_dirs() == [tmp_path / "hub"]


def test_the_newest_complete_snapshot_is_found_and_an_incomplete_one_skipped(hub_cache):
    found = find_snapshot([QWEN38_ID])
    assert found == snapshot_dir(hub_cache, QWEN38_ID, "a" * 40)
    # Once the newer snapshot is complete too, it wins.
    newer = snapshot_dir(hub_cache, QWEN38_ID, "b" * 40)
    for link in newer.iterdir():
        if not link.exists():
            shutil.copyfile(found / link.name, link.resolve())
    assert find_snapshot([QWEN38_ID]) == newer
    # A snapshot without config.json is not a checkpoint.
    (newer / "config.json").unlink()
    assert find_snapshot([QWEN38_ID]) == found


def test_the_recipe_resolves_packaged_then_cached(hub_cache):
    recipe = load_recipe("qwen38")
    assert recipe.hub_ids == [QWEN38_ID]
    assert resolve_recipe_checkpoint(recipe.name, recipe.default_checkpoint, recipe.hub_ids) == str(
        snapshot_dir(hub_cache, QWEN38_ID, "a" * 40)
    )
    coder = load_recipe("qwen25_coder")  # a packaged default wins over any cache
    assert resolve_recipe_checkpoint(coder.name, coder.default_checkpoint, coder.hub_ids) == "qwen2.5-coder-0.5b"


def test_hub_ids_must_be_repository_ids(tmp_path):
    text = (REPO / "recipes" / "qwen38.toml").read_text().replace(f'hub_ids = ["{QWEN38_ID}"]', 'hub_ids = ["qwen38"]')
    (tmp_path / "bad.toml").write_text(text)
    (tmp_path / "templates").symlink_to(REPO / "recipes" / "templates")
    with pytest.raises(RecipeError, match="ORG/NAME"):
        load_recipe(str(tmp_path / "bad.toml"))


def test_nothing_found_names_the_ids_and_folders_and_does_no_work(tmp_path, monkeypatch):
    cache = tmp_path / "empty-hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError) as caught:
        resolve_recipe_checkpoint("qwen38", "", [QWEN38_ID])
    message = str(caught.value)
    assert QWEN38_ID in message and str(cache / "models--Qwen--Qwen3.8-Flash-Next" / "snapshots") in message
    assert "--checkpoint DIR" in message and "FILE.gguf" in message
    result = CliRunner().invoke(app, ["export", "--recipe", "qwen38", "--prompt-logprobs"])
    assert result.exit_code == 2
    assert "Qwen/Qwen3.8-Flash-Next" in result.output and "empty-hub" in result.output
    assert not (tmp_path / "cores").exists()


def test_export_by_recipe_name_is_offline_and_writes_cores_recipe(hub_cache, export_cache, tmp_path, monkeypatch):
    """In-process, with every socket connection refused: the default --out, the printed serve
    line, and a second export to the same place refused without --force."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FLARE_CACHE", str(export_cache))

    def no_network(self, address):
        if self.family in (socket.AF_INET, socket.AF_INET6):
            raise AssertionError(f"export opened a network connection to {address}")
        return real_connect(self, address)

    real_connect = socket.socket.connect
    monkeypatch.setattr(socket.socket, "connect", no_network)
    result = CliRunner().invoke(app, ["export", "--recipe", "qwen38", "--precision", "fp32"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "cores" / "qwen38" / "core.json").is_file()
    assert "helios serve cores/qwen38" in result.output
    again = CliRunner().invoke(app, ["export", "--recipe", "qwen38", "--precision", "fp32"])
    assert again.exit_code == 2 and "--force" in again.output


def test_the_design_card_commands_work_as_typed(hub_cache, export_cache, tmp_path):
    """`ignition export --recipe qwen38 --prompt-logprobs`, then `helios serve cores/qwen38`, in a
    folder of the user's: the real CLI processes, the default precision, a chat round trip."""
    env = {**os.environ, "HF_HUB_CACHE": str(hub_cache), "FLARE_CACHE": str(export_cache)}
    exported = subprocess.run(
        [sys.executable, "-m", "ignition.cli", "export", "--recipe", "qwen38", "--prompt-logprobs"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert exported.returncode == 0, exported.stdout + exported.stderr
    assert "helios serve cores/qwen38" in exported.stdout + exported.stderr
    server = HeliosProcess(Path("cores/qwen38"), cwd=tmp_path)
    try:
        card = httpx.get(server.url + "/v1/models").json()["data"][0]
        assert card["id"] == "Qwen3.8-Flash-Next"
        reply = httpx.post(
            server.url + "/v1/chat/completions",
            timeout=120,
            json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] >= 1
        scored = httpx.post(
            server.url + "/v1/completions",
            timeout=120,
            json={"prompt": "Hello there", "max_tokens": 0, "echo": True, "logprobs": 1},
        )
        assert scored.status_code == 200, scored.text
    finally:
        server.stop()

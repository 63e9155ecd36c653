"""Find a recipe's checkpoint in the local Hugging Face cache, offline.

A user of vLLM or transformers who already downloaded `ORG/NAME` has it under
`<hub cache>/models--ORG--NAME/snapshots/<revision>/`. This module only reads that folder
layout: it imports no hub client and opens no connection.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ignition.checkpoints.base import CheckpointError

WEIGHT_INDEXES = ("model.safetensors.index.json",)
SINGLE_WEIGHTS = ("model.safetensors",)


def hub_cache_dirs() -> list[Path]:
    """Where transformers would look, in its order: $HF_HUB_CACHE, else $HF_HOME/hub, else
    $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return [Path(os.environ["HF_HUB_CACHE"]).expanduser()]
    if os.environ.get("HF_HOME"):
        return [Path(os.environ["HF_HOME"]).expanduser() / "hub"]
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return [base / "huggingface" / "hub"]


def repo_folder(cache: Path, repo_id: str) -> Path:
    return cache / ("models--" + repo_id.replace("/", "--"))


def snapshot_complete(folder: Path) -> bool:
    """config.json is there and so is every weight file the index lists (a download that was
    interrupted leaves the index but not every shard; a dangling blob link counts as missing)."""
    if not (folder / "config.json").is_file():
        return False
    for index_name in WEIGHT_INDEXES:
        index = folder / index_name
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text()).get("weight_map", {})
            except (OSError, ValueError):
                return False
            files = set(weight_map.values()) if isinstance(weight_map, dict) else set()
            return bool(files) and all((folder / name).is_file() for name in files)
    return any((folder / name).is_file() for name in SINGLE_WEIGHTS)


def find_snapshot(repo_ids: list[str], caches: list[Path] | None = None) -> Path | None:
    """The newest complete snapshot of the first repo id that has one, or None."""
    for repo_id in repo_ids:
        for cache in caches if caches is not None else hub_cache_dirs():
            snapshots = repo_folder(cache, repo_id) / "snapshots"
            if not snapshots.is_dir():
                continue
            newest_first = sorted(snapshots.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True)
            for snapshot in newest_first:
                if snapshot.is_dir() and snapshot_complete(snapshot):
                    return snapshot
    return None


def resolve_recipe_checkpoint(recipe_name: str, packaged: str, repo_ids: list[str]) -> str:
    """The checkpoint spec a recipe exports without --checkpoint: its packaged model, else the
    newest complete snapshot of one of its hub ids in the local cache; else a CheckpointError
    naming the ids, the folders searched and the two ways forward."""
    if packaged:
        return packaged
    found = find_snapshot(repo_ids)
    if found is not None:
        return str(found)
    caches = hub_cache_dirs()
    if not repo_ids:
        raise CheckpointError(
            f"recipe {recipe_name!r} has no packaged checkpoint and names no hub repository: "
            "pass --checkpoint DIR (a Hugging Face model folder) or --checkpoint FILE.gguf"
        )
    searched = "\n".join(f"  {repo_folder(cache, repo_id)}/snapshots/" for repo_id in repo_ids for cache in caches)
    ids = ", ".join(repo_ids)
    folder_hint = repo_folder(caches[0], repo_ids[0])
    raise CheckpointError(
        f"recipe {recipe_name!r} has no packaged checkpoint, and no complete snapshot of {ids} "
        f"(config.json and every weight file its index lists) is in the local Hugging Face cache.\n"
        f"Searched (from HF_HUB_CACHE / HF_HOME / the default cache):\n{searched}\n"
        "Either:\n"
        "  - pass the checkpoint: --checkpoint DIR (a Hugging Face model folder) or --checkpoint FILE.gguf, or\n"
        f"  - put a snapshot of {repo_ids[0]} in the cache (e.g. `hf download {repo_ids[0]}` on a machine with "
        f"access, then copy {folder_hint} here, or set HF_HUB_CACHE to where it is)."
    )

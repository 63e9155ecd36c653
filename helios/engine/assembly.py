"""How the engine's parts are built from a core's manifest and its runner: the prefix cache's
host store and recurrent-state callbacks, the speculator and its learned drafter (helios.engine.engine
wires them)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from helios.engine.drafter import LearnedDrafter
from helios.engine.host_store import HostStore, HostStoreConfig, core_identity, page_callbacks
from helios.engine.runner import Runner
from helios.engine.speculation import SpeculationConfig, Speculator
from helios.manifest import Manifest


def speculator_for(core_dir: Path, manifest: Manifest, runner: Any, config: SpeculationConfig | None) -> Speculator | None:
    """History drafts and the core's learned drafter, where the step graph can verify drafts and
    no recurrent state must roll back; None when neither source is on."""
    config = config or SpeculationConfig()
    if not config.enabled or manifest.state is not None or not getattr(runner, "can_verify", False):
        return None
    learned = None
    if config.learned_drafter and manifest.drafter is not None and isinstance(runner, Runner):
        learned = LearnedDrafter.load(core_dir, manifest, runner, config.drafter_catch_up_tokens)
    if learned is None and not config.history_drafts:
        return None
    return Speculator(config, learned)


def page_copier(runner: Any, speculator: Speculator | None) -> Callable[[int, int], None] | None:
    """The prefix cache's page copy: the target's pool, and the learned drafter's beside it."""
    copy = getattr(runner, "copy_page", None)
    learned = speculator.learned if speculator is not None else None
    if copy is None or learned is None:
        return copy

    def both(src: int, dst: int) -> None:
        copy(src, dst)
        learned.copy_page(src, dst)

    return both


def host_store_arguments(manifest: Manifest, runner: Any, config: HostStoreConfig | None) -> dict[str, Any]:
    """PrefixCache arguments for the host prefix store (none without a config or page access)."""
    callbacks = page_callbacks(runner)
    if config is None or not callbacks or (config.dram_bytes <= 0 and config.directory is None):
        return {}
    store = HostStore(core_identity(manifest), config, manifest.kv.page_tokens, kv_page_bytes(manifest))
    return {"host": store, **callbacks}


def kv_page_bytes(manifest: Manifest) -> int:
    kv = manifest.kv
    return kv.num_layers * 2 * kv.page_tokens * kv.kv_heads * kv.head_dim * 4


def state_snapshot_arguments(manifest: Manifest, runner: Any) -> dict[str, Any]:
    """PrefixCache arguments for a core with recurrent state: snapshots of the runner's slots."""
    if manifest.state is None:
        return {}
    pool = getattr(runner, "state_pool", None)
    if pool is None:
        return {"recurrent_state": True}  # no slots to snapshot: checkpoints are refused

    def write(slot: int, state: np.ndarray) -> None:
        pool[slot] = state

    return {"recurrent_state": True, "read_state": lambda slot: pool[slot], "write_state": write,
            "state_bytes": pool.shape[1] * pool.itemsize}  # fmt: skip

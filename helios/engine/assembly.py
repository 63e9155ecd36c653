"""How the engine's parts are built from a core's manifest and its runner: the prefix cache's
host store and recurrent-state callbacks, and the speculator (helios.engine.engine wires them)."""

from __future__ import annotations

from typing import Any

import numpy as np

from helios.engine.host_store import HostStore, HostStoreConfig, core_identity, page_callbacks
from helios.engine.speculation import SpeculationConfig, Speculator
from helios.manifest import Manifest


def speculator_for(manifest: Manifest, runner: Any, config: SpeculationConfig | None) -> Speculator | None:
    """History drafts where the step graph can verify them and no recurrent state must roll back."""
    config = config or SpeculationConfig()
    if not config.enabled or manifest.state is not None or not getattr(runner, "can_verify", False):
        return None
    return Speculator(config)


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

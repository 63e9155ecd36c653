"""What a cluster serves: one core, its server settings, the replica count and routing policy.

Plain data: `helios cluster serve` builds it from its options, Ray ships it to every deployment,
and `helios cluster scale` reads it back from the running frontend.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from helios.manifest import Manifest
from helios.transport.config import ServerConfig

APP_NAME = "helios"
FRONTEND = "Frontend"
ENGINES = "EngineReplica"
POLICIES = ("affinity", "power-of-two")


@dataclass
class ClusterSpec:
    core: Path
    replicas: int = 2
    threads: int | None = None  # engine threads (and Ray CPUs) per replica [default: cores / replicas]
    kv_pages: int | None = None
    policy: str = "affinity"  # or "power-of-two": Ray Serve's default, for comparison
    address: str | None = None  # join this Ray cluster instead of starting one
    settings: ServerConfig = field(default_factory=ServerConfig)  # the [server] table and options

    @property
    def replica_capacity(self) -> int:
        """Requests one replica's engine runs at once: past it, affinity spills to another."""
        return self.settings.max_concurrency or Manifest.load(self.core).limits.max_concurrency

    @property
    def replica_threads(self) -> int:
        return self.threads or max(1, (os.cpu_count() or 1) // max(1, self.replicas))

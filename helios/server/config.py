"""Serving configuration: the `[server]` table of a TOML file, then CLI overrides.

    [server]
    host = "127.0.0.1"
    port = 8000
    api_key = ""                  # empty: authentication off; --api-key-file overrides it
    max_body_bytes = 33554432     # bound on encoded and decoded request bodies
    max_concurrency = 8           # engine active sequences (default: the core's limit)
    http_admission_slots = 256    # generated choices admitted at once (429 beyond)
    queue_size = 64               # engine-pending requests before 503 (default: unbounded)
    thinking_token_budget = 4096  # default reasoning cap; needs a core with reasoning syntax
    frontend_workers = 4          # threads for decompression, templating and tokenization
    prefix_cache = true           # reuse KV prefix checkpoints across requests
    checkpoint_storage_fraction = 0.5    # most of the KV pool that checkpoints may own
    checkpoint_work_allowance_us = 5000  # predicted capture copy work allowed per request
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from helios.server.bodies import DEFAULT_MAX_BODY_BYTES

DEFAULT_ADMISSION_SLOTS = 256
DEFAULT_FRONTEND_WORKERS = 4
_INT32_MAX = (1 << 31) - 1


class ConfigError(ValueError):
    """A configuration file or option helios cannot use."""


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str = ""
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_concurrency: int | None = None
    http_admission_slots: int = DEFAULT_ADMISSION_SLOTS
    queue_size: int | None = None
    thinking_token_budget: int | None = None
    frontend_workers: int = DEFAULT_FRONTEND_WORKERS
    prefix_cache: bool = True
    checkpoint_storage_fraction: float = 0.5
    checkpoint_work_allowance_us: int = 5000

    @classmethod
    def load(cls, path: Path) -> "ServerConfig":
        try:
            data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path} is not valid TOML: {exc}") from None
        unknown_tables = sorted(set(data) - {"server"})
        if unknown_tables:
            raise ConfigError(f"{path}: unknown table(s) {', '.join(unknown_tables)}; helios reads [server]")
        return cls.from_table(data.get("server", {}), where=f"{path} [server]")

    @classmethod
    def from_table(cls, table: dict[str, Any], where: str = "[server]") -> "ServerConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(table) - known)
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}")
        config = cls(**table)
        config.validate(where)
        return config

    def validate(self, where: str = "config") -> None:
        def positive(name: str, value: Any, upper: int | None = None) -> None:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1 or (upper and value > upper):
                raise ConfigError(f"{where}: {name} must be a positive integer" + (f" up to {upper}" if upper else ""))

        if not isinstance(self.host, str) or not self.host:
            raise ConfigError(f"{where}: host must be a nonempty string")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ConfigError(f"{where}: port must be an integer 0..65535")
        if not isinstance(self.api_key, str):
            raise ConfigError(f"{where}: api_key must be a string")
        positive("max_body_bytes", self.max_body_bytes)
        positive("http_admission_slots", self.http_admission_slots)
        positive("frontend_workers", self.frontend_workers)
        if self.max_concurrency is not None:
            positive("max_concurrency", self.max_concurrency)
        if self.queue_size is not None:
            positive("queue_size", self.queue_size)
        if self.thinking_token_budget is not None:
            positive("thinking_token_budget", self.thinking_token_budget, _INT32_MAX)
        if not isinstance(self.prefix_cache, bool):
            raise ConfigError(f"{where}: prefix_cache must be true or false")
        fraction = self.checkpoint_storage_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction <= 1:
            raise ConfigError(f"{where}: checkpoint_storage_fraction must be a number in [0, 1]")
        allowance = self.checkpoint_work_allowance_us
        if isinstance(allowance, bool) or not isinstance(allowance, int) or allowance < 0:
            raise ConfigError(f"{where}: checkpoint_work_allowance_us must be a nonnegative integer")

    def prefix_cache_config(self):  # noqa: ANN201 - helios.engine.prefix_cache.PrefixCacheConfig
        from helios.engine.prefix_cache import PrefixCacheConfig

        return PrefixCacheConfig(enabled=self.prefix_cache, storage_fraction=float(self.checkpoint_storage_fraction),
                                 work_allowance_ns=self.checkpoint_work_allowance_us * 1000)


def read_api_key_file(path: Path) -> str:
    """The key is the file's content without surrounding whitespace (a trailing newline is common)."""
    try:
        return Path(path).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ConfigError(f"cannot read API key file {path}: {exc}") from None

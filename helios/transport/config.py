"""Serving configuration: the `[server]` table of a TOML file, then CLI overrides.

[server]
host = "127.0.0.1"
port = 8000
api_key = ""                  # empty: authentication off; --api-key-file overrides it
max_body_bytes = 33554432     # bound on encoded and decoded request bodies
max_concurrency = 8           # engine active sequences (default: the core's limit)
kv_dtype = "auto"             # KV pool type: auto, bf16, fp16, fp32 (default: the core's, limits.kv_dtype)
http_admission_slots = 256    # generated choices admitted at once (429 beyond)
queue_size = 64               # engine-pending requests before 503 (default: 4 x max_concurrency)
queue_timeout_s = 120         # longest wait for a first batch slot before a 503 (0: no deadline)
drain_timeout_s = 30          # on SIGTERM: how long in-flight requests may finish
header_timeout_s = 30         # request headers (and an idle keep-alive) must arrive within this
body_timeout_s = 60           # a request body must arrive within this
max_json_elements = 262144    # values and keys in a body (default: max(body/128, 4 x context))
max_json_depth = 64           # nesting of a body
thinking_token_budget = 4096  # default reasoning cap; needs a core with reasoning syntax
frontend_workers = 4          # threads for templating and tokenization (bodies have their own)
prefix_cache = true           # reuse KV prefix checkpoints across requests
checkpoint_storage_fraction = 0.5    # most of the KV pool that checkpoints may own
checkpoint_work_allowance_us = 5000  # predicted capture copy work allowed per request
speculation = "auto"          # drafts verified in the step graph; "off" disables them
speculation_history_drafts = true   # n-gram drafts from the request and recent outputs
speculation_learned_drafter = true  # the core's learned drafter (ignition export --drafter)
speculation_drafter_catch_up_tokens = 256  # a request whose drafter lags more drafts from history
speculation_max_width = 8     # drafts per decode round at most
speculation_adaptive = true   # false: always the full width when drafts are found
speculation_max_batch_rows = 2  # more decoding requests than this: no drafts
speculation_shared_history_tokens = 262144  # finished outputs all requests draft from (0: off)
log_level = "info"            # debug, info (the access log), warning, error, critical
log_format = "text"           # text or json (one object per line)
allowed_origins = []          # CORS: origins browsers may call from ("*": any); empty: CORS off
served_model_names = []       # names the model answers to; the first is every response's `model`
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from helios.engine.host_store import RESTORE_POLICIES, HostStoreConfig, default_dram_bytes
from helios.engine.prefix_cache import PrefixCacheConfig
from helios.engine.speculation import SpeculationConfig
from helios.kernels.kv_dtype import CHOICES, KV_DTYPES
from helios.neutral.thinking import INT32_MAX
from helios.transport.bodies import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES, JsonLimits
from helios.transport.logs import LOG_FORMATS, LOG_LEVELS

KV_DTYPE_SPELLINGS = (*CHOICES, *KV_DTYPES)
DEFAULT_ADMISSION_SLOTS = 256
DEFAULT_FRONTEND_WORKERS = 4
DEFAULT_QUEUE_PER_SEQUENCE = 4  # default queue_size: this many waiting requests per batch slot
DEFAULT_QUEUE_TIMEOUT_S = 120.0
DEFAULT_DRAIN_TIMEOUT_S = 30.0
DEFAULT_HEADER_TIMEOUT_S = 30.0
DEFAULT_MAX_JSON_DEPTH = JsonLimits.max_depth


class ConfigError(ValueError):
    """A configuration file or option helios cannot use."""


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str = ""
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_concurrency: int | None = None
    kv_dtype: str | None = None  # None: the core's default (manifest limits.kv_dtype)
    http_admission_slots: int = DEFAULT_ADMISSION_SLOTS
    queue_size: int | None = None
    queue_timeout_s: float = DEFAULT_QUEUE_TIMEOUT_S
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    max_json_elements: int | None = None
    max_json_depth: int = DEFAULT_MAX_JSON_DEPTH
    thinking_token_budget: int | None = None
    frontend_workers: int = DEFAULT_FRONTEND_WORKERS
    prefix_cache: bool = True
    checkpoint_storage_fraction: float = 0.5
    checkpoint_work_allowance_us: int = 5000
    # Host prefix store (helios.engine.host_store): the DRAM tier (None: a quarter of available
    # memory, at most 8 GiB; 0: off) and the disk tier (on with a directory).
    host_store_dram_gb: float | None = None
    host_store_dir: str | None = None
    host_store_disk_gb: float = 16.0
    host_store_restore: str = "predicted"  # or "always" (helios.engine.host_store.HostStoreConfig)
    # Speculative decoding (helios.engine.speculation.SpeculationConfig).
    speculation: str = "auto"
    speculation_history_drafts: bool = True
    speculation_learned_drafter: bool = True
    speculation_drafter_catch_up_tokens: int = 256
    speculation_max_width: int = 8
    speculation_adaptive: bool = True
    speculation_max_batch_rows: int = 2
    speculation_shared_history_tokens: int = 1 << 18
    log_level: str = "info"
    log_format: str = "text"
    allowed_origins: list[str] = field(default_factory=list)
    served_model_names: list[str] = field(default_factory=list)

    @classmethod
    def load(cls, path: Path) -> ServerConfig:
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
    def from_table(cls, table: dict[str, Any], where: str = "[server]") -> ServerConfig:
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
        if self.kv_dtype is not None and self.kv_dtype not in KV_DTYPE_SPELLINGS:
            raise ConfigError(f"{where}: kv_dtype must be one of {', '.join(KV_DTYPE_SPELLINGS)}")
        if self.queue_size is not None:
            positive("queue_size", self.queue_size)
        if self.max_json_elements is not None:
            positive("max_json_elements", self.max_json_elements)
        positive("max_json_depth", self.max_json_depth)
        for name in ("queue_timeout_s", "drain_timeout_s", "header_timeout_s", "body_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1e6:
                raise ConfigError(f"{where}: {name} must be a number of seconds (0 or more)")
        for name in ("header_timeout_s", "body_timeout_s"):
            if getattr(self, name) == 0:
                raise ConfigError(f"{where}: {name} must be more than 0 seconds")
        if self.thinking_token_budget is not None:
            positive("thinking_token_budget", self.thinking_token_budget, INT32_MAX)
        if not isinstance(self.prefix_cache, bool):
            raise ConfigError(f"{where}: prefix_cache must be true or false")
        fraction = self.checkpoint_storage_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction <= 1:
            raise ConfigError(f"{where}: checkpoint_storage_fraction must be a number in [0, 1]")
        allowance = self.checkpoint_work_allowance_us
        if isinstance(allowance, bool) or not isinstance(allowance, int) or allowance < 0:
            raise ConfigError(f"{where}: checkpoint_work_allowance_us must be a nonnegative integer")
        for name in ("host_store_dram_gb", "host_store_disk_gb"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
                raise ConfigError(f"{where}: {name} must be a number of GiB (0 or more)")
        if self.host_store_dir is not None and (not isinstance(self.host_store_dir, str) or not self.host_store_dir):
            raise ConfigError(f"{where}: host_store_dir must be a directory path")
        try:
            self.speculation_config().validate()
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"{where}: {exc}") from None
        for name in ("speculation_adaptive", "speculation_history_drafts", "speculation_learned_drafter"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{where}: {name} must be true or false")
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(f"{where}: log_level must be one of {', '.join(LOG_LEVELS)}")
        if self.log_format not in LOG_FORMATS:
            raise ConfigError(f"{where}: log_format must be one of {', '.join(LOG_FORMATS)}")
        for name in ("allowed_origins", "served_model_names"):
            value = getattr(self, name)
            if not isinstance(value, list) or not all(isinstance(v, str) and v.strip() for v in value):
                raise ConfigError(f"{where}: {name} must be a list of nonempty strings")
        for origin in self.allowed_origins:
            if origin != "*" and not origin.startswith(("http://", "https://")):
                raise ConfigError(f"{where}: allowed_origins entries are * or http(s)://HOST[:PORT], got {origin!r}")
        if self.host_store_restore not in RESTORE_POLICIES:
            raise ConfigError(f"{where}: host_store_restore must be one of {', '.join(RESTORE_POLICIES)}")

    def effective_queue_size(self, max_concurrency: int) -> int:
        return self.queue_size if self.queue_size is not None else DEFAULT_QUEUE_PER_SEQUENCE * max_concurrency

    def json_limits(self, context_length: int) -> JsonLimits:
        """Body structure bounds: by default enough for several full-context token-ID prompts,
        and for parsed objects to stay a small multiple of the body limit."""
        elements = self.max_json_elements
        if elements is None:
            elements = max(self.max_body_bytes // 128, 4 * context_length, 1024)
        return JsonLimits(max_elements=elements, max_depth=self.max_json_depth)

    def host_store_config(self) -> HostStoreConfig:
        dram = default_dram_bytes() if self.host_store_dram_gb is None else int(self.host_store_dram_gb * (1 << 30))
        return HostStoreConfig(
            dram_bytes=dram,
            directory=Path(self.host_store_dir) if self.host_store_dir else None,
            disk_bytes=int(self.host_store_disk_gb * (1 << 30)),
            restore=self.host_store_restore,
        )

    def speculation_config(self) -> SpeculationConfig:
        return SpeculationConfig(
            mode=self.speculation,
            max_width=self.speculation_max_width,
            adaptive=self.speculation_adaptive,
            max_batch_rows=self.speculation_max_batch_rows,
            shared_history_tokens=self.speculation_shared_history_tokens,
            history_drafts=self.speculation_history_drafts,
            learned_drafter=self.speculation_learned_drafter,
            drafter_catch_up_tokens=self.speculation_drafter_catch_up_tokens,
        )

    def prefix_cache_config(self) -> PrefixCacheConfig:
        return PrefixCacheConfig(
            enabled=self.prefix_cache,
            storage_fraction=float(self.checkpoint_storage_fraction),
            work_allowance_ns=self.checkpoint_work_allowance_us * 1000,
        )


def read_api_key_file(path: Path) -> str:
    """The key is the file's content without surrounding whitespace (a trailing newline is common)."""
    try:
        return Path(path).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ConfigError(f"cannot read API key file {path}: {exc}") from None

"""Where flare keeps what it builds or downloads once per machine: `$FLARE_CACHE`, default
`~/.cache/flare` (checkpoints, the export cache, the kernel library)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("FLARE_CACHE") or Path.home() / ".cache" / "flare")

"""The installed flare version (both CLIs' --version, GET /version)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def flare_version() -> str:
    try:
        return version("flare")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "0+unknown"

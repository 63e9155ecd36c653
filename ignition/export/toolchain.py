"""Versions of everything that shapes a core's bytes: the manifest's `toolchain`, and part of
every export cache key (a change to any of them must not reuse what older code built)."""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
from pathlib import Path

TOOLCHAIN_PACKAGES = (
    "flare",
    "torch",
    "onnx",
    "onnxscript",
    "onnxruntime",
    "numpy",
    "gguf",
    "safetensors",
    "tokenizers",
)

# Code that does not shape a core's bytes (presentation only) and so is not in its version.
_NOT_EXPORTER = {"ignition/cli.py", "ignition/inspect_core.py", "ignition/verify_core.py"}


@functools.lru_cache(maxsize=1)
def exporter_version() -> str:
    """Digest of the code that shapes a core: ignition (but its CLI and inspection views), the
    manifest schema, the runner validation drives and flare's kernels (their weight layout and
    the numbers validation records). Recorded as toolchain["flare-exporter"]."""
    repo = Path(__file__).resolve().parents[2]
    files = [p for p in (repo / "ignition").rglob("*.py") if p.relative_to(repo).as_posix() not in _NOT_EXPORTER]
    files += [repo / "helios" / "manifest.py", repo / "helios" / "engine" / "runner.py"]
    files += sorted(p for p in (repo / "helios" / "kernels").iterdir() if p.suffix in (".py", ".cc", ".h"))
    h = hashlib.sha256()
    for path in sorted(files, key=lambda p: p.relative_to(repo).as_posix()):
        if "__pycache__" in path.parts or not path.is_file():
            continue
        h.update(path.relative_to(repo).as_posix().encode() + b"\0")
        h.update(hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()[:16]


def toolchain() -> dict[str, str]:
    """The manifest's `toolchain`: the exporter's digest and the installed packages' versions."""
    versions = {"flare-exporter": exporter_version()}
    for package in TOOLCHAIN_PACKAGES:
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            pass
    return dict(sorted(versions.items()))

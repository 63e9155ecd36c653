"""From whatever model a user names to a compiled core: `helios serve MODEL`'s front half.

MODEL is a core folder (served as is), a `.gguf` file, a Hugging Face model folder (config.json
and safetensors), a packaged model name (shared/models.md), or an `ORG/NAME` repository id found
in the local Hugging Face cache through huggingface_hub's own cache lookup (which follows
refs/main), downloaded by the same library only when asked (`download=True`).

The recipe is inferred from the checkpoint's own metadata (config.json `model_type`, GGUF
`general.architecture`) against the recipes' families, unless one is named; the checkpoint's own
chat template then picks among the family's recipes and declares the tool and reasoning syntax
(ignition/template_syntax.py), and generation_config.json the sampling defaults. The core is compiled
once into `$FLARE_CACHE/cores/auto/`, keyed by the checkpoint's digest (hashed once and
remembered by its files' paths, sizes and mtimes, so a second start reads no weights), the
recipe, the options and the exporter's code version.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import math
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from rich.console import Console

from helios.cache_dir import cache_root
from helios.manifest import MANIFEST_NAME, Range, file_sha256
from ignition.checkpoints.base import CheckpointError
from ignition.checkpoints.gguf import read_gguf_architecture
from ignition.checkpoints.packaged import PACKAGED_MODELS, resolve_packaged
from ignition.checkpoints.safetensors_dir import read_safetensors_config, safetensors_files
from ignition.checkpoints.shapes import check_family
from ignition.export.display import StageDisplay
from ignition.export.toolchain import exporter_version
from ignition.recipes import HUB_ID, RECIPES_DIR, Recipe, RecipeError, available_recipes, load_recipe
from ignition.template_syntax import best_for_template, checkpoint_template, with_template_syntax

KINDS = ("core", "gguf", "folder", "packaged")  # an ORG/NAME is a folder in the hub cache
DEFAULT_AUTO_CORES = 4
GENERATION_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# What a download fetches: the config, tokenizer, template and safetensors weights, not a repo's
# other formats (original/*.pth, GGUF variants, ONNX exports) that flare never reads.
CHECKPOINT_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model"]
SHA256_HEX = re.compile(r"[0-9a-f]{64}")


class IntakeError(ValueError):
    """A model that cannot be served: one line saying what is wrong and what would work."""


@dataclass(frozen=True)
class Located:
    """A model on disk: what kind, where, and the name it is known by."""

    kind: str  # one of KINDS
    path: Path | None  # None only for a packaged model not yet installed
    name: str  # the checkpoint spec export takes (a path, or the packaged name)
    repo_id: str | None = None  # an ORG/NAME the user named


def locate(model: str, download: bool = False) -> Located:
    """Classify MODEL and find it on disk (IntakeError when it is none of the accepted kinds)."""
    path = Path(model).expanduser()
    if path.is_dir():
        if (path / MANIFEST_NAME).is_file():
            return Located("core", path, str(path))
        if (path / "config.json").is_file():
            if not safetensors_files_or_none(path):
                raise IntakeError(f"{path} has a config.json but no .safetensors weights")
            return Located("folder", path, str(path))
        raise IntakeError(
            f"{path} is neither a core (no {MANIFEST_NAME}) nor a Hugging Face model folder (no config.json)"
        )
    if path.is_file():
        if path.suffix != ".gguf":
            raise IntakeError(f"{path} is not a .gguf file, a core folder or a Hugging Face model folder")
        return Located("gguf", path, str(path))
    if model in PACKAGED_MODELS:
        return Located("packaged", None, model)
    if HUB_ID.fullmatch(model) and not model.startswith((".", "/", "~")):
        snapshot = hub_snapshot(model, download)
        return Located("folder", snapshot, str(snapshot), repo_id=model)
    raise IntakeError(
        f"{model}: no such file or folder, and not a packaged model ({', '.join(PACKAGED_MODELS)}) "
        "or an ORG/NAME Hugging Face id"
    )


def safetensors_files_or_none(folder: Path) -> list[Path]:
    try:
        return safetensors_files(folder)
    except (CheckpointError, OSError):
        return []


def hub_snapshot(repo_id: str, download: bool) -> Path:
    """The snapshot folder of `repo_id` that refs/main names in the local cache (downloaded with
    the hub library's progress bars when `download`)."""
    # Imported only for an ORG/NAME: the hub client costs every other start its import time.
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, local_files_only=not download, allow_patterns=CHECKPOINT_PATTERNS))
    except LocalEntryNotFoundError:
        raise IntakeError(
            f"{repo_id} is not in the local Hugging Face cache; pass --download to fetch it "
            "(or `hf download` it elsewhere and set HF_HUB_CACHE)"
        ) from None
    except (HfHubHTTPError, OSError) as exc:
        raise IntakeError(f"cannot download {repo_id}: {str(exc).splitlines()[0]}") from None


def model_type(located: Located) -> str:
    """The checkpoint's own architecture name: GGUF general.architecture or config.json model_type."""
    if located.kind == "packaged":
        return PACKAGED_MODELS[located.name].family
    assert located.path is not None
    try:
        if located.kind == "gguf":
            return read_gguf_architecture(located.path)
        return str(read_safetensors_config(located.path).get("model_type"))
    except CheckpointError as exc:
        raise IntakeError(str(exc)) from None


def infer_recipe(located: Located) -> Recipe:
    """The recipe for the checkpoint's family: one naming its repository id or packaged name if
    any does, else the first by name. IntakeError names the supported families otherwise."""
    kind = model_type(located)
    try:
        family = check_family(kind, located.name)
    except CheckpointError:
        family = None
    recipes = [load_recipe(name) for name in available_recipes()]
    matching = [r for r in recipes if r.family == family]
    if not matching:
        supported = sorted({r.family for r in recipes})
        raise IntakeError(
            f"{located.name} is a {kind!r} model, which no recipe serves; supported architectures: "
            f"{', '.join(supported)} (or pass --recipe)"
        )
    named = located.repo_id or Path(located.name).name
    for recipe in matching:
        if named in recipe.hub_ids or named == recipe.default_checkpoint:
            return recipe
    return best_for_template(matching, checkpoint_template(located.kind, located.path))


def with_checkpoint_sampling(recipe: Recipe, located: Located) -> Recipe:
    """An inferred recipe takes the sampling defaults the checkpoint's authors shipped in
    generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty), each
    declared range widened to hold its new default. Invalid values are ignored."""
    if located.kind != "folder" or located.path is None:
        return recipe
    try:
        shipped = json.loads((located.path / "generation_config.json").read_text())
    except (OSError, ValueError):
        return recipe
    if not isinstance(shipped, dict) or shipped.get("do_sample") is False:
        return recipe  # greedy by default: the recipe's sampling stays
    values: dict[str, float | int] = {}
    for name in GENERATION_FIELDS:
        value = shipped.get(name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            continue
        if name == "top_k" and (not isinstance(value, int) or value == 0):
            continue
        if (name in ("temperature", "top_p", "repetition_penalty") and value <= 0) or (name == "top_p" and value > 1):
            continue
        values[name] = value
    ranges = dict(recipe.sampling_ranges)
    for name, value in values.items():
        if name in ranges:
            ranges[name] = Range(min(ranges[name].min, value), max(ranges[name].max, value))
    return dataclasses.replace(
        recipe, sampling_defaults=dataclasses.replace(recipe.sampling_defaults, **values), sampling_ranges=ranges
    )


def resolve_recipe(located: Located, recipe: str | None) -> Recipe:
    if recipe is None:
        inferred = with_template_syntax(infer_recipe(located), checkpoint_template(located.kind, located.path))
        return with_checkpoint_sampling(inferred, located)
    try:
        return load_recipe(recipe)
    except RecipeError as exc:
        raise IntakeError(str(exc)) from None


METADATA_SUFFIXES = (".json", ".jinja")  # a folder's config, tokenizer and template files


def input_files(located: Located) -> list[Path]:
    """The files a checkpoint's core is compiled from (weights, and a folder's metadata)."""
    assert located.path is not None
    if located.kind == "gguf":
        return [located.path]
    weights = safetensors_files(located.path)
    metadata = [p for p in located.path.iterdir() if p.is_file() and p.suffix in METADATA_SUFFIXES]
    return sorted({*weights, *metadata})


def checkpoint_digest(located: Located, report: Callable[[str], None]) -> str:
    """The sha256 of the checkpoint's files: a packaged model's pinned one, else computed once
    and remembered by the files' paths, sizes and mtimes (a stamp in the cache), so a second
    start does not read gigabytes again. A single file's is its own sha256, as a packaged model's
    is its joined GGUF's: its name and its file then share one compiled core."""
    if located.kind == "packaged":
        return PACKAGED_MODELS[located.name].sha256
    files = input_files(located)
    stats = [(str(p.resolve()), st.st_size, st.st_mtime_ns) for p in files for st in [p.stat()]]
    stamp_key = hashlib.sha256(json.dumps(stats).encode()).hexdigest()
    stamp = cache_root() / "cores" / "auto" / ".digests" / stamp_key
    try:
        remembered = stamp.read_text().strip()
        if SHA256_HEX.fullmatch(remembered):
            return remembered
    except OSError:
        pass
    size = sum(size for _, size, _ in stats)
    report(f"hashing {located.name} ({size / 1e9:.2f} GB)")
    if len(files) == 1:
        digest = file_sha256(files[0])
    else:
        combined = hashlib.sha256()
        for path in files:
            combined.update(path.name.encode() + b"\0" + file_sha256(path).encode())
        digest = combined.hexdigest()
    try:
        stamp.parent.mkdir(parents=True, exist_ok=True)
        partial = stamp.with_name(f"{stamp.name}.{os.getpid()}.tmp")
        partial.write_text(digest + "\n")
        os.replace(partial, stamp)  # never a half-written stamp
    except OSError:
        pass  # a read-only cache still works; it hashes on every start
    return digest


def core_folder(located: Located, digest: str, recipe: Recipe, options: dict[str, object]) -> Path:
    """Where the auto-compiled core of a checkpoint (by digest), recipe and options lives."""
    material = {
        "checkpoint": digest,
        "recipe": recipe.name,
        "recipe_file": _recipe_digest(recipe),
        "options": options,
        "exporter": exporter_version(),
    }
    key = hashlib.sha256(json.dumps(material, sort_keys=True, default=str).encode()).hexdigest()[:16]
    stem = Path(located.name).stem if located.kind != "packaged" else located.name
    safe = "".join(c if c.isalnum() or c in "-_." else "-" for c in stem)[:48]
    return cache_root() / "cores" / "auto" / f"{safe}-{recipe.name}-{key}"


def _recipe_digest(recipe: Recipe) -> str:
    path = RECIPES_DIR / f"{recipe.name}.toml"
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else recipe.name


def compile_core(located: Located, recipe: Recipe, precision: str, console: Console) -> Path:
    """The cached core of these inputs, compiled first (with its progress on `console`) unless
    an earlier start left it there."""
    # The pipeline (onnx, onnxruntime, the exporter) loads only when a core may need compiling.
    from ignition.export.pipeline import ExportError, ExportOptions, export_core

    try:
        with StageDisplay(console) as display:
            digest = checkpoint_digest(located, lambda line: display.report("digest", line))
            folder = core_folder(located, digest, recipe, {"precision": precision})
            hold(folder)
            if (folder / MANIFEST_NAME).is_file():
                os.utime(folder)  # most recently used: the last to be evicted
                return folder
            options = ExportOptions(recipe=recipe, checkpoint=located.name, out=folder, precision=precision, force=True)
            if located.kind == "packaged":
                resolve_packaged(PACKAGED_MODELS[located.name], report=lambda line: display.report(_stage(line), line))
            export_core(options, display.report)
    except (CheckpointError, ExportError, RecipeError) as exc:
        raise IntakeError(str(exc)) from None
    evict_auto_cores(folder.parent, keep=folder)
    return folder


# Shared locks on the auto cores this process uses, held until it exits: eviction by another
# process skips a core someone still serves.
_held: list[IO[str]] = []


def _lock_file(folder: Path) -> Path:
    return folder.parent / ".locks" / f"{folder.name}.lock"


def hold(folder: Path) -> None:
    """Mark `folder` in use by this process (a shared flock, released when it exits)."""
    path = _lock_file(folder)
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = open(path, "a")  # held open for the life of the process
    fcntl.flock(lock, fcntl.LOCK_SH)
    _held.append(lock)


def evict_auto_cores(root: Path, keep: Path) -> None:
    """Keep the $FLARE_AUTO_CORES (default 4) most recently used auto-compiled cores: each code
    or checkpoint change compiles a new one, and the old ones would otherwise pile up. A core
    another process holds (serves) is never removed."""
    try:
        limit = max(1, int(os.environ.get("FLARE_AUTO_CORES", DEFAULT_AUTO_CORES)))
    except ValueError:
        limit = DEFAULT_AUTO_CORES
    cores = sorted(
        (p for p in root.iterdir() if (p / MANIFEST_NAME).is_file() and p != keep),
        key=lambda p: p.stat().st_mtime,
        reverse=True,
    )
    for stale in cores[limit - 1 :]:
        path = _lock_file(stale)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # in use
            shutil.rmtree(stale, ignore_errors=True)
            path.unlink(missing_ok=True)


def _stage(line: str) -> str:
    """A packaged model's report line as a display stage (installing, joining, verifying)."""
    word = line.split(" ", 1)[0]
    return {"installing": "install", "joining": "join", "verifying": "verify"}.get(word, "install")

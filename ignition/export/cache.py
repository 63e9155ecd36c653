"""The export cache: what every export of one checkpoint repeats, kept by content hash.

An entry holds the converted checkpoint's metadata (architecture, tokenizer, chat template,
special ids), the fp32 step graph (which carries the converted weights) and the torch
reference's validation logits. A later export of the same checkpoint, at any precision, then
skips read, convert and trace (and the reference half of validate): it quantizes the cached
graph and validates the engine against the cached reference. `CachedStages` is that wrapping:
the pipeline hands it each of those stages (and the torch program, kept per dtype beside the
graph) and gets the stage's product back, from the entry or from running the stage.

Location: `$FLARE_CACHE/export` (default `~/.cache/flare/export`), one folder per key.
The key is a sha256 over: the checkpoint's sha256 (plus, for a Hugging Face folder, its config
and tokenizer files), the exporter code version (`exporter_version()`), the toolchain versions,
the KV page size (a fixed dim of the graph) and this module's entry format. A change to any of
them is a different key; stale entries age out.

Bounded: after each new entry, least recently used entries are removed until the cache is under
`$FLARE_EXPORT_CACHE_GB` (default 16; 0 keeps only the newest entry). `ignition cache` lists
the entries, `ignition cache --clear` (or `rm -rf ~/.cache/flare/export`) empties it.

Entries are written to a staging folder and renamed into place, and evicted by renaming them
away before deleting, so concurrent exports never see half an entry. Every cached file's sha256
is checked on use: a corrupted entry is a miss (and is removed), never a silently different core.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, ParamSpec, TypeVar

from helios.cache_dir import cache_root
from helios.manifest import Architecture, Engine, TensorSpec, file_sha256
from ignition.checkpoints.base import Checkpoint
from ignition.checkpoints.packaged import PACKAGED_MODELS
from ignition.checkpoints.safetensors_dir import files_sha256, safetensors_files
from ignition.export.graph import STEP_GRAPH_FILE
from ignition.export.manifest import cache_layouts
from ignition.export.options import ExportOptions, Progress
from ignition.export.output import owner_alive
from ignition.export.reference import CachedReference, RecordingReference, Reference
from ignition.export.stages import TorchModel, Traced
from ignition.export.toolchain import exporter_version, toolchain
from ignition.models import DecoderLM
from ignition.recipes import Recipe

ENTRY_FORMAT = 1
ENTRY_NAME = "entry.json"
USED_NAME = "last-used"  # mtime = last use (LRU)
REFERENCE_NAME = "reference.npz"
TOKENIZER_NAME = "tokenizer.json"
DEFAULT_MAX_GB = 16.0

# Hugging Face folder files the reader consults besides the weights (their bytes are not in the
# checkpoint's sha256, which covers the .safetensors files only).
HF_METADATA_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "model.safetensors.index.json",
)


def export_cache_root() -> Path:
    return cache_root() / "export"


def max_cache_bytes() -> int:
    raw = os.environ.get("FLARE_EXPORT_CACHE_GB", "")
    try:
        gb = float(raw) if raw else DEFAULT_MAX_GB
    except ValueError:
        gb = DEFAULT_MAX_GB
    return int(max(gb, 0.0) * (1 << 30))


# -- checkpoint identity without reading it ----------------------------------------------------


@dataclass(frozen=True)
class Source:
    """What load_checkpoint(spec) will report as id and sha256, found without reading tensors."""

    checkpoint_id: str
    sha256: str
    extra: tuple[tuple[str, str], ...] = ()  # (file name, sha256) of metadata outside sha256


def identify(spec: str) -> Source | None:
    """The identity of a checkpoint spec, or None when it cannot be told cheaply (then the
    export runs uncached and load_checkpoint reports any problem with the spec)."""
    if spec in PACKAGED_MODELS:
        model = PACKAGED_MODELS[spec]
        return Source(model.name, model.sha256)
    path = Path(spec).expanduser()
    try:
        if path.is_file() and path.suffix == ".gguf":
            return Source(path.stem, file_sha256(path))
        if path.is_dir() and (path / "config.json").is_file():
            extra = tuple(
                (name, file_sha256(path / name) if (path / name).is_file() else "") for name in HF_METADATA_FILES
            )
            return Source(path.resolve().name, files_sha256(safetensors_files(path)), extra)
    except (OSError, ValueError):
        return None
    return None


def entry_key(source: Source, page_tokens: int) -> str:
    inputs = {
        "entry_format": ENTRY_FORMAT,
        "checkpoint_sha256": source.sha256,
        "checkpoint_files": [list(pair) for pair in source.extra],
        "exporter": exporter_version(),
        "toolchain": toolchain(),
        "page_tokens": page_tokens,
        "graph_file": STEP_GRAPH_FILE,
    }
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


# -- around the stages it can skip -------------------------------------------------------------

P = ParamSpec("P")
T = TypeVar("T")


class CachedStages:
    """The export cache around the stages it can skip: read, convert, trace and the torch
    program. Each method takes the stage (and its inputs) and returns the stage's product, from
    the entry or fresh; a context manager: leaving it discards an uncommitted entry.

    read looks the checkpoint up. On a hit no stage runs: read gives the entry's checkpoint
    (without tensors), convert a model built only if a stage needs it after all, trace the
    entry's fp32 step graph, reference its recorded logits and torch_program its program of that
    dtype when it has one. On a miss they run, trace and the torch program into a staging folder,
    the reference records validate's logits, and commit() turns the folder into an entry. With
    the cache off, or a spec that cannot be identified cheaply, they run into scratch.
    """

    def __init__(self, options: ExportOptions, progress: Progress, scratch: Path) -> None:
        self.options, self.progress, self.scratch = options, progress, scratch
        self.cache = ExportCache() if options.cache else None
        self.entry: Entry | None = None  # a hit
        self.staging: Staging | None = None  # a miss the cache will keep
        self.recorder: RecordingReference | None = None
        self.seconds: dict[str, float] = {}  # of read/convert/trace on a miss, kept in the entry

    def __enter__(self) -> CachedStages:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if self.staging is not None:
            self.staging.discard()

    @property
    def folder(self) -> Path:
        """Where the stages write what the cache keeps: the staging folder, else scratch."""
        return self.staging.path if self.staging is not None else self.scratch

    def read(self, stage: Callable[[str, Progress], Checkpoint]) -> Checkpoint:
        spec, progress = self.options.checkpoint, self.progress
        source = key = None
        if self.cache is not None:
            progress("read", f"looking up {spec} in the export cache")
            source = identify(spec)
            key = entry_key(source, self.options.recipe.limits.page_tokens) if source else None
            self.entry = self.cache.lookup(key) if key else None
        if self.entry is not None and source is not None:
            progress("read", f"export cache hit {self.entry.key[:12]}: converted checkpoint, nothing read")
            return self.entry.checkpoint(source)
        checkpoint = self._timed("read", stage, spec, progress)
        if self.cache is not None and key is not None and source is not None:
            self._stage(self.cache, key, source, checkpoint)
        return checkpoint

    def convert(self, stage: Callable[[Recipe, Checkpoint, Progress], DecoderLM], checkpoint: Checkpoint) -> TorchModel:
        spec, progress = self.options.checkpoint, self.progress
        if self.entry is not None:
            took = self.entry.saved_seconds
            progress("convert", f"skipped: cached (read+convert+export took {took:.1f}s when it was cached)")
            return TorchModel(spec, progress)
        return TorchModel(spec, progress, self._timed("convert", stage, self.options.recipe, checkpoint, progress))

    def trace(
        self,
        stage: Callable[[Recipe, Checkpoint, DecoderLM, Path, Progress], Traced],
        checkpoint: Checkpoint,
        model: TorchModel,
    ) -> Traced:
        recipe = self.options.recipe
        if self.entry is not None:
            self.progress("export", f"skipped: cached fp32 step graph {self.entry.key[:12]}")
            kv, state = cache_layouts(recipe, checkpoint)
            return Traced(self.entry.graph, self.entry.engine(), kv, state)
        # A miss converted the model: get() builds nothing. Timed under the CLI's stage name.
        return self._timed("export", stage, recipe, checkpoint, model.get(), self.folder, self.progress)

    def reference(self, model: TorchModel) -> Reference | None:
        """Validation's reference: on a hit the entry's recorded logits (None if it has none), on
        a miss the converted model, recording its logits when the cache keeps this export."""
        if self.entry is not None:
            return self.entry.reference()
        if self.staging is None:
            return model.get()
        self.recorder = RecordingReference(model.get())
        return self.recorder

    def torch_program(
        self,
        stage: Callable[[Checkpoint, Traced, TorchModel, str, Path, Progress], Path],
        checkpoint: Checkpoint,
        traced: Traced,
        model: TorchModel,
        dtype: str,
    ) -> Path:
        """The `dtype` torch step program beside the fp32 graph: the entry's, or the stage's into
        the staging folder (committed with the entry) or scratch. An entry cached without it (an
        earlier cpu-only export) keeps it so: the program is traced into scratch, and its model
        read and converted on a hit."""
        name = f"step.cuda.{dtype}.pt2"
        if self.entry is not None and (self.entry.path / name).is_file():
            self.progress("export", f"cached {dtype} torch step program")
            return self.entry.path / name
        return stage(checkpoint, traced, model, dtype, self.folder / name, self.progress)

    def commit(self, checkpoint: Checkpoint, traced: Traced) -> None:
        """Keep a fresh export's read/convert/trace results (a failure here never fails the export)."""
        if self.staging is None:
            return
        try:
            self.staging.commit(checkpoint, traced.engine, self.seconds, self.recorder)
        except OSError:
            self.staging.discard()

    def _stage(self, cache: ExportCache, key: str, source: Source, checkpoint: Checkpoint) -> None:
        """Trace into a new entry, if the checkpoint read is the one the key was derived from."""
        if (source.checkpoint_id, source.sha256) != (checkpoint.checkpoint_id, checkpoint.sha256):
            return
        try:
            self.staging = cache.stage(key)
        except OSError:  # an unwritable cache only costs the reuse
            return

    def _timed(self, name: str, stage: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        started = time.monotonic()
        product = stage(*args, **kwargs)
        self.seconds[name] = time.monotonic() - started
        return product


# -- entries -----------------------------------------------------------------------------------


@dataclass
class Entry:
    key: str
    path: Path
    meta: dict[str, Any]

    @property
    def graph(self) -> Path:
        return self.path / STEP_GRAPH_FILE

    @property
    def saved_seconds(self) -> float:
        return float(sum(self.meta.get("seconds", {}).values()))

    def engine(self) -> Engine:
        data = self.meta["engine"]
        return Engine(
            name=data["name"],
            file=data["file"],
            inputs=[TensorSpec(**spec) for spec in data["inputs"]],
            outputs=[TensorSpec(**spec) for spec in data["outputs"]],
            data_files=list(data["data_files"]),
        )

    def checkpoint(self, source: Source) -> Checkpoint:
        """The converted checkpoint without its tensors (they live in the cached graph)."""
        fields = dict(self.meta["checkpoint"])
        fields["architecture"] = Architecture(**fields["architecture"])
        fields["tokenizer_json"] = (self.path / TOKENIZER_NAME).read_text()
        return Checkpoint(checkpoint_id=source.checkpoint_id, sha256=source.sha256, tensors={}, **fields)

    def reference(self) -> CachedReference | None:
        path = self.path / REFERENCE_NAME
        return CachedReference(path) if path.is_file() else None


@dataclass
class Staging:
    """A new entry being written; commit() renames it into place."""

    cache: ExportCache
    key: str
    path: Path
    committed: bool = False

    def commit(
        self,
        checkpoint: Checkpoint,
        engine: Engine,
        seconds: dict[str, float],
        reference: RecordingReference | None,
    ) -> Entry | None:
        if self.committed:
            return None
        fields = {f.name: getattr(checkpoint, f.name) for f in dataclasses.fields(checkpoint)}
        for name in ("checkpoint_id", "sha256", "tensors", "tokenizer_json"):
            fields.pop(name)
        fields["architecture"] = dataclasses.asdict(checkpoint.architecture)
        (self.path / TOKENIZER_NAME).write_text(checkpoint.tokenizer_json)
        if reference is not None:
            reference.save(self.path / REFERENCE_NAME)
        files = {
            p.name: file_sha256(p)
            for p in sorted(self.path.iterdir())
            if p.is_file() and p.name not in (ENTRY_NAME, USED_NAME)
        }
        meta = {
            "entry_format": ENTRY_FORMAT,
            "key": self.key,
            "label": checkpoint.checkpoint_id,  # for `ignition cache` only: ids are not in the key
            "checkpoint": fields,
            "engine": dataclasses.asdict(engine),
            "seconds": {k: round(v, 3) for k, v in seconds.items()},
            "toolchain": toolchain(),
            "files": files,
        }
        (self.path / ENTRY_NAME).write_text(json.dumps(meta, indent=2) + "\n")  # key order kept
        (self.path / USED_NAME).touch()
        self.committed = True
        os.chmod(self.path, 0o755)  # mkdtemp makes it private; the cache is shared like any download
        for path in self.path.iterdir():
            os.chmod(path, 0o644)
        target = self.cache.root / self.key
        try:
            os.rename(self.path, target)
        except OSError:  # another export committed the same key first: keep theirs
            shutil.rmtree(self.path, ignore_errors=True)
            return None
        self.cache.evict(keep=self.key)
        return Entry(self.key, target, meta)

    def discard(self) -> None:
        if not self.committed:
            shutil.rmtree(self.path, ignore_errors=True)


@dataclass
class EntryInfo:
    key: str
    path: Path
    bytes: int
    last_used: float
    checkpoint: str


class ExportCache:
    def __init__(self, root: Path | None = None) -> None:
        self.root = Path(root) if root is not None else export_cache_root()

    def lookup(self, key: str) -> Entry | None:
        """The complete, intact entry for `key`, marked used; None on a miss."""
        path = self.root / key
        try:
            meta = json.loads((path / ENTRY_NAME).read_text())
        except (OSError, ValueError):
            return None
        try:
            intact = meta.get("entry_format") == ENTRY_FORMAT and all(
                file_sha256(path / name) == digest for name, digest in meta["files"].items()
            )
        except (OSError, KeyError, AttributeError):
            intact = False
        if not intact:
            self._remove(path)
            return None
        try:
            (path / USED_NAME).touch()
        except OSError:
            pass
        return Entry(key, path, meta)

    def stage(self, key: str) -> Staging:
        self.root.mkdir(parents=True, exist_ok=True)
        path = Path(tempfile.mkdtemp(prefix=f".staging-{os.getpid()}-{socket.gethostname()}-", dir=self.root))
        return Staging(self, key, path)

    def entries(self) -> list[EntryInfo]:
        found = []
        if not self.root.is_dir():
            return found
        for path in self.root.iterdir():
            if path.name.startswith(".") or not (path / ENTRY_NAME).is_file():
                continue
            try:
                meta = json.loads((path / ENTRY_NAME).read_text())
                used = (path / USED_NAME).stat().st_mtime if (path / USED_NAME).exists() else 0.0
                size = sum(p.stat().st_size for p in path.iterdir() if p.is_file())
            except (OSError, ValueError):
                continue
            arch = meta.get("checkpoint", {}).get("architecture", {})
            label = f"{meta.get('label', '?')} ({arch.get('family', '?')}, {arch.get('num_layers', '?')} layers)"
            found.append(EntryInfo(path.name, path, size, used, label))
        return sorted(found, key=lambda e: e.last_used)

    def evict(self, keep: str | None = None, limit: int | None = None) -> list[str]:
        """Remove least recently used entries (never `keep`) until the total fits `limit`;
        also clears staging folders of exports that died on this host."""
        self._clean_dead_staging()
        limit = max_cache_bytes() if limit is None else limit
        entries = self.entries()
        total = sum(e.bytes for e in entries)
        removed = []
        for entry in entries:
            if total <= limit:
                break
            if entry.key == keep:
                continue
            self._remove(entry.path)
            total -= entry.bytes
            removed.append(entry.key)
        return removed

    def clear(self) -> int:
        """Remove every entry; return the bytes freed."""
        freed = sum(e.bytes for e in self.entries())
        if self.root.is_dir():
            for path in self.root.iterdir():
                self._remove(path)
        return freed

    def _remove(self, path: Path) -> None:
        trash = path.with_name(f".trash-{os.getpid()}-{socket.gethostname()}-{time.monotonic_ns()}")
        try:
            os.rename(path, trash)
        except OSError:
            return
        shutil.rmtree(trash, ignore_errors=True)

    def _clean_dead_staging(self) -> None:
        if not self.root.is_dir():
            return
        for path in self.root.iterdir():
            if path.name.startswith((".staging-", ".trash-")) and not owner_alive(path.name.split("-", 2)[1:]):
                shutil.rmtree(path, ignore_errors=True)

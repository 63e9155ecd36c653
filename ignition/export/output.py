"""Atomic output (docs/cores.md): --out is at every moment the old core, the new one, or absent.

The core is assembled in a hidden temporary sibling (`.NAME.partial-PID-HOST-*`), core.json is
written last and the folder is renamed into place, so a failed or interrupted export never
leaves a folder that looks like a core. Leftovers of dead exports are removed by the next export
to the same place. An existing --out is replaced only with force, and only when it is a core (or
empty).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from helios.manifest import MANIFEST_NAME
from ignition.export.options import ExportError


def check_out(out: Path, force: bool) -> None:
    """Refuse an existing --out without force, and anything but a core or an empty folder with it."""
    if not (out.exists() or out.is_symlink()):
        return
    if not force:
        raise ExportError(f"{out} already exists; pass --force to replace it")
    if not out.is_dir():
        raise ExportError(f"refusing to replace {out}: it is not a folder")
    if not (out / MANIFEST_NAME).is_file() and any(out.iterdir()):
        raise ExportError(f"refusing to replace {out}: it is not a core (no {MANIFEST_NAME}) and not empty")


@contextlib.contextmanager
def work_folder(out: Path) -> Iterator[Path]:
    """A hidden sibling of `out` to export into, removed when the export ends however it ends."""
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_dead_partials(out)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-{os.getpid()}-{socket.gethostname()}-", dir=out.parent))
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)


def publish(folder: Path, out: Path, force: bool) -> None:
    """Give the finished core `folder` fixed permissions (readable by all, whatever the umask)
    and put it at `out`."""
    for path in folder.rglob("*"):
        os.chmod(path, 0o755 if path.is_dir() else 0o644)
    os.chmod(folder, 0o755)
    replace_into(folder, out, force)


def replace_into(folder: Path, out: Path, force: bool) -> None:
    """Rename the finished `folder` to `out`; an existing core is moved aside first and deleted
    after, so `out` is at every moment either the old core or the new one."""
    if not (out.exists() or out.is_symlink()):
        os.rename(folder, out)
        return
    check_out(out, force)
    aside = out.parent / f".{out.name}.old-{os.getpid()}-{socket.gethostname()}-{time.monotonic_ns()}"
    os.rename(out, aside)
    try:
        os.rename(folder, out)
    except BaseException:
        os.rename(aside, out)
        raise
    shutil.rmtree(aside, ignore_errors=True)


def remove_dead_partials(out: Path) -> None:
    """Remove `.NAME.partial-*` / `.NAME.old-*` siblings left by exports that died on this host."""
    if not out.parent.is_dir():
        return
    for kind in ("partial", "old"):
        prefix = f".{out.name}.{kind}-"
        for path in out.parent.glob(prefix + "*"):
            fields = path.name[len(prefix) :].split("-", 1)
            if not owner_alive(fields):
                shutil.rmtree(path, ignore_errors=True)


def owner_alive(fields: list[str]) -> bool:
    """Whether the process named by "[pid, host-...]" name fields may still be running: True
    unless it ran on this host and is gone (another host's folders are never touched)."""
    try:
        pid = int(fields[0])
    except (IndexError, ValueError):
        return True
    rest = fields[1] if len(fields) > 1 else ""
    if not rest.startswith(socket.gethostname() + "-"):
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True

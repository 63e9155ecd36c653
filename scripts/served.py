"""The measurement scripts' shared entry: a running server, or one `helios serve CORE` started
for the run (helios.launcher.HeliosProcess), then the result printed and optionally written as JSON."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from helios.launcher import HeliosProcess


def run_against(
    url: str | None,
    core: Path | None,
    measure: Callable[[str, int | None], dict[str, Any]],
    json_out: Path | None = None,
    pid: int | None = None,
) -> None:
    """measure(url, pid) against `url`, or against a server started on `core` (default
    cores/default) and stopped afterwards."""
    server = None
    if url is None:
        server = HeliosProcess(core or Path("cores/default"))
        url, pid = server.url, server.process.pid
    try:
        result = measure(url, pid)
    finally:
        if server is not None:
            server.stop()
    print(json.dumps(result))
    if json_out:
        json_out.write_text(json.dumps(result, indent=2) + "\n")

"""The measurement scripts' shared entry: a running server, or one `helios serve CORE` started
for the run (tests.conftest.Server), then the result printed and optionally written as JSON."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


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
        sys.path.insert(0, str(REPO))
        from tests.conftest import Server

        server = Server(core or Path("cores/default"))
        url, pid = server.url, server.process.pid
    try:
        result = measure(url, pid)
    finally:
        if server is not None:
            server.stop()
    print(json.dumps(result))
    if json_out:
        json_out.write_text(json.dumps(result, indent=2) + "\n")

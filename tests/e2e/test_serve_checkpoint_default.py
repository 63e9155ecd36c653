"""`helios serve` straight from the real default model: its packaged name serves in one command
(recipe inferred, compiled with progress shown), a second start reuses the compiled core, and so
does a start from the packaged model's .gguf file (the same bytes: one compiled core).

A scratch flare cache keeps the compiled cores out of the shared one, while its export cache and
joined checkpoints are the shared ones (links): the default core's export already read,
converted and traced this checkpoint, so a compile here is quantize + validate."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from helios.cache_dir import cache_root
from helios.launcher import HeliosProcess

GGUF_NAME = "qwen2.5-coder-0.5b"


@pytest.fixture(scope="module")
def linked_cache(default_core, tmp_path_factory) -> Iterator[dict[str, str]]:
    scratch = tmp_path_factory.mktemp("flare-cache")
    for shared in ("export", "checkpoints"):
        (scratch / shared).symlink_to(cache_root() / shared, target_is_directory=True)
    yield {"FLARE_CACHE": str(scratch)}


def serve(model: str, env: dict[str, str]) -> str:
    """The output of one `helios serve MODEL` that answered a chat."""
    server = HeliosProcess(model, env=env, timeout=900)
    try:
        answer = httpx.post(
            server.url + "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "Reply with exactly OK."}], "max_tokens": 4},
            timeout=120,
        ).json()
        assert answer["choices"][0]["message"]["content"].strip().startswith("OK"), answer
        return server.output()
    finally:
        server.stop()


def test_default_checkpoint_serves_in_one_command(linked_cache):
    first = serve(GGUF_NAME, linked_cache)
    assert "recipe qwen25_coder (qwen2)" in first
    assert "✓ quantize" in first and "✓ validate" in first
    second = serve(GGUF_NAME, linked_cache)
    assert "✓" not in second and "serving" in second
    auto = Path(linked_cache["FLARE_CACHE"]) / "cores" / "auto"
    (compiled,) = [core for core in auto.iterdir() if core.name.startswith(GGUF_NAME)]

    from_file = serve(str(cache_root() / "checkpoints" / f"{GGUF_NAME}.gguf"), linked_cache)
    assert "recipe qwen25_coder (qwen2)" in from_file, from_file
    assert "quantize" not in from_file and "serving" in from_file, from_file
    assert [core for core in auto.iterdir() if core.name.startswith(GGUF_NAME)] == [compiled]

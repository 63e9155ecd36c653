"""`helios serve` straight from the real default model: its .gguf file and its packaged name each
serve in one command (recipe inferred, compiled with progress shown), and a second start reuses
the compiled core.

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


def serve_twice(model: str, env: dict[str, str]) -> tuple[str, str]:
    """The outputs of a first and a second `helios serve MODEL`, each answering a chat."""
    outputs = []
    for _ in range(2):
        server = HeliosProcess(model, env=env, timeout=900)
        try:
            answer = httpx.post(
                server.url + "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "Reply with exactly OK."}], "max_tokens": 4},
                timeout=120,
            ).json()
            assert answer["choices"][0]["message"]["content"].strip().startswith("OK"), answer
            outputs.append(server.output())
        finally:
            server.stop()
    return outputs[0], outputs[1]


@pytest.mark.parametrize("how", ["gguf-file", "packaged-name"])
def test_default_checkpoint_serves_in_one_command(how, linked_cache):
    model = str(cache_root() / "checkpoints" / f"{GGUF_NAME}.gguf") if how == "gguf-file" else GGUF_NAME
    first, second = serve_twice(model, linked_cache)
    assert "recipe qwen25_coder (qwen2)" in first
    assert "✓ quantize" in first and "✓ validate" in first
    assert "✓" not in second and "serving" in second
    auto = Path(linked_cache["FLARE_CACHE"]) / "cores" / "auto"
    assert any(core.name.startswith(GGUF_NAME) for core in auto.iterdir())

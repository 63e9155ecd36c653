"""A core serves its checkpoint's native context unless the recipe or --context-length narrows
it; the default KV pool holds two full-context sequences."""

from __future__ import annotations

import pytest

from helios.manifest import Manifest
from ignition.export.manifest import serving_context
from ignition.export.pipeline import ExportError, ExportOptions, export_core
from ignition.recipes import load_recipe


def test_native_context_unless_narrowed():
    recipe = load_recipe("qwen25_coder")  # names no context_length: the checkpoint's own
    assert recipe.limits.context_length is None
    assert serving_context(recipe, 32768, None) == 32768
    assert serving_context(recipe, 32768, 4096) == 4096
    narrowing = load_recipe("qwen38")  # narrows to 32768, with its reason in the recipe
    assert serving_context(narrowing, 262144, None) == 32768
    assert serving_context(narrowing, 8192, None) == 8192  # never past the native context
    for wrong in (0, 32769):
        with pytest.raises(ExportError, match="must lie in 1..32768"):
            serving_context(recipe, 32768, wrong)


def test_context_length_option_sizes_the_core_and_its_pool(tiny_checkpoint_dir, tmp_path):
    recipe = load_recipe("qwen25_coder")
    out = tmp_path / "narrow"
    export_core(
        ExportOptions(
            recipe=recipe, checkpoint=str(tiny_checkpoint_dir), out=out, precision="fp32", context_length=4000
        )
    )
    limits = Manifest.load(out, verify_files=False).limits
    assert limits.context_length == 4000
    assert limits.kv_pages == 2 * 250  # two full-context sequences of 16-token pages
    assert limits.default_max_tokens == min(recipe.limits.default_max_tokens, 4000)
    with pytest.raises(ExportError, match="--context-length 40000 must lie in 1..32768"):
        export_core(
            ExportOptions(
                recipe=recipe,
                checkpoint=str(tiny_checkpoint_dir),
                out=tmp_path / "wide",
                precision="fp32",
                context_length=40000,
            )
        )
    assert not (tmp_path / "wide").exists()

"""The dense families users bring beyond the seed recipes (issue 40): each one's int4 export
validates, and `helios serve`'s recipe inference picks its recipe from config.json alone. Parity
with transformers at fp32 (prefill, paged decode, 16-bit pools, a served chat) is
tests/unit/test_families.py's, where their recipes are listed."""

from __future__ import annotations

import pytest

from helios.manifest import Manifest
from ignition.export.pipeline import ExportOptions, export_core
from ignition.intake import infer_recipe, locate
from ignition.recipes import load_recipe
from tests.unit.family_checkpoints import write_quantizable_checkpoint

DENSE = {"qwen3": "qwen3", "mistral": "mistral", "gemma3": "gemma3", "smollm3": "smollm3"}  # family -> its recipe


@pytest.mark.parametrize("family", sorted(DENSE))
def test_int4_export_validates_and_the_recipe_is_inferred(tmp_path, family):
    folder = write_quantizable_checkpoint(tmp_path / "ckpt", family, overrides={"tie_word_embeddings": True})
    recipe = infer_recipe(locate(str(folder)))
    assert recipe.name == DENSE[family]
    out = tmp_path / "core"
    export_core(ExportOptions(recipe=load_recipe(recipe.name), checkpoint=str(folder), out=out, precision="int4"))
    manifest = Manifest.load(out)
    assert manifest.precision == "int4" and manifest.architecture.family == family
    # Export validation passed (else no core); the int4 distribution stays close to fp32's (a tiny
    # random model's near-ties make top-1 agreement alone a poor measure).
    assert manifest.parity is not None and manifest.parity.mean_kl is not None and manifest.parity.mean_kl < 0.05

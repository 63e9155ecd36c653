"""Fixtures shared by the unit tests: the seed recipes' tiny family cores, exported once a session."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from ignition.recipes import COMPILED_FAMILIES, PLANNED_FAMILIES, load_recipe
from tests.conftest import CACHE, REPO, code_digest
from tests.unit.family_checkpoints import write_family_checkpoint

SEED_RECIPES = [
    "qwen38",
    "qwen38_dense",
    "glm53",
    "deepseek4",
    "deepseek41",
    "mimo_v2",
    "kimi3",
    "step5",
    "nemotron_h",
    "kimi31",
    "minimax_m3",
    "muse_spark",
    "gemma4",
    # Beyond the 13 seed recipes: the dense families users bring (issue 40).
    "qwen3",
    "mistral",
    "gemma3",
    "gemma2",
    "smollm3",
    "phi3",
]
COMPILED = [name for name in SEED_RECIPES if load_recipe(name).family in COMPILED_FAMILIES]
# Family cores that also carry an fp32 torch step program (--target cpu,cuda): every compiled one
# with FLARE_ALL_TORCH_FAMILIES=1 (~30 s of torch.export each); by default three that cover the
# program's distinct paths: recurrent state (Qwen 3.5), compressed attention with routed experts
# (DeepSeek V4), MLA (DeepSeek V3 / Kimi).
TORCH_PROGRAM_RECIPES = (
    COMPILED if os.environ.get("FLARE_ALL_TORCH_FAMILIES") == "1" else ["qwen38_dense", "deepseek4", "kimi3"]
)
# The family cores, kept across runs (family_env).
FAMILY_CORES = CACHE / "cores" / "families"
PLANNED = [name for name in SEED_RECIPES if load_recipe(name).family in PLANNED_FAMILIES]


@pytest.fixture(scope="session")
def family_env(tmp_path_factory, request):
    """Every compiled seed recipe's tiny checkpoint (tests/unit/family_checkpoints.py, 32 experts
    top-4 in every MoE family) and its fp32 core (with a torch program: TORCH_PROGRAM_RECIPES), exported up front by `ignition export`
    subprocesses, two families at a time (tracing is single-threaded; the machine has 2 cores).
    Only the recipes the selected tests name are exported. Recipes of one
    family export in sequence through a private export cache, so the second reuses the first's
    traced graph. Returns recipe -> (core, transformers reference), waiting for that export.
    A test names its recipes by a `recipe` parameter or `@pytest.mark.families(RECIPE, ...)`.
    The cores are shared: tests read them and never write into them. They are kept in the flare
    cache under a key of everything that shapes them (family_core_key): a later run with the same
    code and checkpoint bytes reads them instead of exporting again (~5 CPU-minutes)."""
    folder = tmp_path_factory.mktemp("families")
    env = {**os.environ, "FLARE_CACHE": str(folder / "cache")}
    selected = set()
    for item in request.session.items:
        if "family_env" in getattr(item, "fixturenames", ()):
            if hasattr(item, "callspec") and "recipe" in item.callspec.params:
                selected.add(item.callspec.params["recipe"])
            for mark in item.iter_markers("families"):
                selected.update(mark.args)
    families: dict[str, list[str]] = {}
    for recipe in [r for r in COMPILED if r in selected] or COMPILED:
        families.setdefault(load_recipe(recipe).family, []).append(recipe)
    checkpoints = {family: write_family_checkpoint(folder / f"ckpt-{family}", family) for family in families}
    code = code_digest()

    def export(family: str) -> dict[str, tuple[Path, str]]:
        done = {}
        for recipe in families[family]:
            # TORCH_PROGRAM_RECIPES also get the fp32 torch step program (validated against the reference
            # at export; test_torch_families holds it to the ONNX graph).
            targets = ["--target", "cpu,cuda", "--torch-dtype", "float32"] if recipe in TORCH_PROGRAM_RECIPES else []
            out = FAMILY_CORES / f"{recipe}-{family_core_key(code, checkpoints[family][0], targets)}"
            if (out / "core.json").is_file():
                done[recipe] = (out, "")
                continue
            for stale in FAMILY_CORES.glob(f"{recipe}-*"):
                shutil.rmtree(stale, ignore_errors=True)
            command = [
                sys.executable,
                "-m",
                "ignition.cli",
                "export",
                "--recipe",
                recipe,
                "--checkpoint",
                str(checkpoints[family][0]),
                "--precision",
                "fp32",
                *targets,
                "--out",
                str(out),
            ]
            result = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
            done[recipe] = (out, result.stdout + result.stderr if result.returncode else "")
        return done

    pool = ThreadPoolExecutor(max_workers=2)
    futures = {family: pool.submit(export, family) for family in families}
    try:
        yield lambda recipe: _finished(futures, checkpoints, recipe)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def family_core_key(code: str, checkpoint: Path, export_args: list[str]) -> str:
    """What a family core is made of: the exporting code (`code`: code_digest), the checkpoint's
    bytes (written afresh each session, the same bytes for the same code) and the export's options."""
    h = hashlib.sha256(code.encode())
    h.update(" ".join(export_args).encode())
    for path in sorted(checkpoint.rglob("*")):
        if path.is_file():
            h.update(path.relative_to(checkpoint).as_posix().encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


def _finished(futures: dict[str, Future], checkpoints: dict, recipe: str) -> tuple[Path, object]:
    family = load_recipe(recipe).family
    if family not in futures:
        raise LookupError(
            f"recipe {recipe!r} was not selected for export: name it by a `recipe` parameter or @pytest.mark.families"
        )
    core, failure = futures[family].result()[recipe]
    assert not failure, failure
    return core, checkpoints[family][1]

"""The learned drafter (ignition export --drafter, helios.engine.drafter) on real tiny cores: the
drafter compiled into the core, greedy drafts verified exactly, its K/V sharing the target's pages
through prefix checkpoints, and its counters on a live server."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

from helios.engine.api import GenerationRequest, SamplingParams
from helios.engine.engine import Engine
from helios.engine.prefix_cache import PrefixCacheConfig
from helios.engine.speculation import SpeculationConfig
from helios.launcher import HeliosProcess
from helios.manifest import Manifest
from ignition.export.options import ExportError
from ignition.export.pipeline import ExportOptions, export_core
from ignition.recipes import load_recipe
from tests.conftest import add_think_tokens
from tests.unit.tiny_checkpoints import write_tiny_checkpoint

PROMPT = np.random.default_rng(11).integers(300, 6000, 40).tolist()
# Learned drafts only, a fixed width: the tiny drafter costs as much as its target, so an adaptive
# width would (rightly) never draft.
LEARNED = {"history_drafts": False, "adaptive": False, "max_width": 4, "max_batch_rows": 8}


def export_with(checkpoint: Path, drafter: Path, out: Path) -> Path:
    export_core(
        ExportOptions(
            recipe=load_recipe("qwen25_coder"),
            checkpoint=str(checkpoint),
            out=out,
            precision="fp32",
            drafter=str(drafter),
        )
    )
    return out


@pytest.fixture(scope="module")
def cores(tmp_path_factory, tiny_checkpoint_dir) -> dict[str, Path]:
    """ "self": the target drafting for itself (every greedy draft is right); "other": a drafter
    with other random weights (most drafts are wrong)."""
    folder = tmp_path_factory.mktemp("drafter")
    other = write_tiny_checkpoint(folder / "other-checkpoint", "qwen2", seed=7)
    return {
        "self": export_with(tiny_checkpoint_dir, tiny_checkpoint_dir, folder / "self"),
        "other": export_with(tiny_checkpoint_dir, other, folder / "other"),
    }


def engine(core: Path, mode: str = "auto", cache: bool = False, **config) -> Engine:
    return Engine(
        core,
        Manifest.load(core, verify_files=False),
        kv_pages=96,
        threads=1,
        prefix_cache=PrefixCacheConfig(enabled=cache),
        speculation=SpeculationConfig(mode=mode, **config),
    )


def generate(e: Engine, ids: list[int], name: str, hints: tuple[int, ...] = (), **sampling) -> tuple[list[int], list]:
    params = {"max_tokens": 24, "top_k": 1, "ignore_eos": True, **sampling}
    events = e.generate(GenerationRequest(name, list(ids), SamplingParams(**params), checkpoint_hints=list(hints)))
    assert events[-1].finished and events[-1].error is None, events[-1].error
    return [t for ev in events for t in ev.token_ids], [entry for ev in events for entry in (ev.logprobs or [])]


def test_export_compiles_the_drafter_into_the_core(cores, tiny_checkpoint_dir):
    core = cores["other"]
    manifest = Manifest.load(core)  # every file listed and hashed, the drafter's too
    drafter = manifest.drafter
    assert drafter is not None and drafter.engine == "drafter"
    engine_spec = manifest.engine("drafter")
    assert engine_spec.file.startswith("drafter/") and (core / engine_spec.file).is_file()
    assert all(name in manifest.files for name in [engine_spec.file, *engine_spec.data_files])
    assert drafter.kv.page_tokens == manifest.kv.page_tokens and drafter.decode_weight_bytes > 0
    assert drafter.parity is not None and drafter.parity.top1_agreement > 0.9
    assert drafter.checkpoint_sha256 != manifest.identity.checkpoint_sha256  # another checkpoint
    shown = json.loads(
        subprocess.run(
            [sys.executable, "-m", "ignition.cli", "inspect", "--json", str(core)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    assert shown["drafter"]["engine"] == "drafter"


def test_export_refuses_a_drafter_it_cannot_serve(tmp_path, tiny_checkpoint_dir):
    # Another vocabulary: its draft ids would name other tokens.
    think = write_tiny_checkpoint(tmp_path / "think", "qwen2", seed=3)
    (think / "tokenizer.json").write_text(add_think_tokens((think / "tokenizer.json").read_text()))
    stages = []
    with pytest.raises(ExportError, match="another tokenizer"):
        export_core(
            ExportOptions(
                recipe=load_recipe("qwen25_coder"),
                checkpoint=str(tiny_checkpoint_dir),
                out=tmp_path / "core",
                precision="fp32",
                drafter=str(think),
            ),
            lambda stage, detail: stages.append(stage),
        )
    assert stages == [] and not (tmp_path / "core").exists()  # from the folders' tokenizer.json, before any work
    # Another family than the recipe compiles: refused before any work.
    llama = write_tiny_checkpoint(tmp_path / "llama", "llama")
    with pytest.raises(ExportError, match="'llama' model"):
        export_with(tiny_checkpoint_dir, llama, tmp_path / "core")


@pytest.mark.parametrize("name", ["self", "other"])
def test_learned_drafts_keep_greedy_output_and_logprobs_exact(cores, name):
    off, on = engine(cores[name], mode="off"), engine(cores[name], **LEARNED)
    want, want_logprobs = generate(off, PROMPT, "off", logprobs=2)
    got, got_logprobs = generate(on, PROMPT, "on", logprobs=2)
    assert got == want
    for a, b in zip(want_logprobs, got_logprobs):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
    s = on.stats()
    assert s.learned_drafter and not s.history_drafts_enabled
    assert s.draft_steps_total > 0 and s.verification_drafts_total > 0
    if name == "self":  # the drafter is the target: every draft is its greedy token
        assert s.accepted_drafts_total == s.verification_drafts_total
        assert s.verification_rounds_total < 23 // 2  # ~5 tokens per round
    else:
        assert s.accepted_drafts_total < s.verification_drafts_total
    assert on.block_manager.num_free == on.block_manager.num_pages
    off.shutdown()
    on.shutdown()


def test_sampled_output_matches_and_cancel_mid_round_leaks_nothing(cores):
    off, on = engine(cores["other"], mode="off"), engine(cores["other"], **LEARNED)
    sampling = {"top_k": 5, "temperature": 0.05}
    for seed in range(3):
        assert (
            generate(on, PROMPT, f"on{seed}", seed=seed, **sampling)[0]
            == generate(off, PROMPT, f"off{seed}", seed=seed, **sampling)[0]
        )
    events = []
    on.submit(
        GenerationRequest("cancel", PROMPT, SamplingParams(max_tokens=30, top_k=1, ignore_eos=True)), events.append
    )
    for _ in range(4):
        on.step()
    on.abort("cancel")
    while not (events and events[-1].finished):
        on.step()
    assert on.block_manager.num_free == on.block_manager.num_pages
    off.shutdown()
    on.shutdown()


def test_a_restored_prefix_brings_its_drafter_kv(cores):
    """A request restoring a prefix checkpoint starts its drafter where the checkpoint's pages
    hold drafter K/V (read by the request that captured it), not from token 0; the drafter being
    the target, every draft after the restore is still right, so the restored K/V is the real one."""
    e = engine(cores["self"], cache=True, **LEARNED)
    first, _ = generate(e, PROMPT, "first", hints=(len(PROMPT),), max_tokens=16)
    fed: list[int] = []
    step = e.scheduler.speculator.learned.runner.step

    def spy(rows):
        fed.extend(row.history_len for row in rows if len(row.token_ids) > 1)
        return step(rows)

    e.scheduler.speculator.learned.runner.step = spy
    before = e.stats()
    turn = PROMPT + first + [901, 902, 903]
    generate(e, turn, "second", max_tokens=16)
    after = e.stats()
    assert after.cache_hits_total > before.cache_hits_total
    assert fed and fed[0] >= len(PROMPT) // 16 * 16  # caught up from the restored pages, not from 0
    offered = after.verification_drafts_total - before.verification_drafts_total
    assert offered > 0 and after.accepted_drafts_total - before.accepted_drafts_total == offered
    e.shutdown()


def test_served_core_reports_its_drafter(cores, tmp_path):
    config = tmp_path / "helios.toml"
    config.write_text(
        "[server]\nspeculation_history_drafts = false\nspeculation_adaptive = false\nspeculation_max_width = 3\n"
    )
    server = HeliosProcess(cores["self"], "--config", str(config))
    try:
        card = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]
        assert card["flare"]["learned_drafter"] is True
        body = {"prompt": "def fibonacci(n):", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        assert httpx.post(server.url + "/v1/completions", json=body, timeout=120).status_code == 200
        snapshot = httpx.get(server.url + "/metrics", params={"format": "json"}, timeout=30).json()
        assert snapshot["learned_drafter"] is True and snapshot["draft_steps"] > 0
        assert snapshot["accepted_drafts"] > 0
        assert "learned drafter:" in server.output()
    finally:
        server.stop()
    # speculation_learned_drafter = false: the core still serves, without its drafter.
    config.write_text("[server]\nspeculation_learned_drafter = false\n")
    server = HeliosProcess(cores["self"], "--config", str(config))
    try:
        snapshot = httpx.get(server.url + "/metrics", params={"format": "json"}, timeout=30).json()
        assert snapshot["learned_drafter"] is False
    finally:
        server.stop()


def test_a_core_missing_its_drafter_files_is_refused(cores, tmp_path):
    """A 1.8 core whose drafter files were removed is refused by name (its listing says so)."""
    core = tmp_path / "core"
    shutil.copytree(cores["self"], core)
    shutil.rmtree(core / "drafter")
    with pytest.raises(ValueError, match="drafter/"):
        Manifest.load(core)

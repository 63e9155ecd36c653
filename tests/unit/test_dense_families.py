"""The dense families users bring beyond the seed recipes (issue 40): each one's int4 export
validates, and `helios serve`'s recipe inference picks its recipe from config.json alone. Parity
with transformers at fp32 (prefill, paged decode, 16-bit pools, a served chat) is
tests/unit/test_families.py's, where their recipes are listed."""

from __future__ import annotations

import json

import pytest

from helios.manifest import Manifest
from ignition.export.pipeline import ExportOptions, export_core
from ignition.intake import infer_recipe, locate
from ignition.recipes import load_recipe
from tests.unit.family_checkpoints import write_quantizable_checkpoint

DENSE = {
    "qwen3": "qwen3",
    "mistral": "mistral",
    "gemma3": "gemma3",
    "gemma2": "gemma2",
    "smollm3": "smollm3",
    "phi3": "phi3",
}  # family -> its recipe


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


def test_qwen3_gguf_reads_through_the_name_map_and_exports(tmp_path):
    """A tiny Qwen3 written as llama.cpp's converter writes it (gguf's TensorNameMap, qwen2 BPE
    vocabulary): read back equal to its folder, logits equal to transformers', exported."""
    import gguf
    import numpy as np
    import torch
    from safetensors.torch import load_file
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from ignition.checkpoints.load import load_checkpoint
    from ignition.models import FAMILIES
    from tests.unit.gguf_writing import add_bpe_vocabulary, add_dense_hyperparameters, add_named_tensors, finish
    from tests.unit.tiny_checkpoints import TINY, write_tiny_checkpoint

    folder = write_tiny_checkpoint(tmp_path / "qwen2", "qwen2")  # for its real Qwen tokenizer files
    base = json.loads((folder / "config.json").read_text())
    config = Qwen3Config(
        **{k: base[k] for k in TINY},
        vocab_size=base["vocab_size"],
        rope_theta=1000000.0,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=base["bos_token_id"],
        eos_token_id=base["eos_token_id"],
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).eval()
    model.save_pretrained(folder)
    tensors = {k: v.numpy() for k, v in load_file(folder / "model.safetensors").items()}

    path = tmp_path / "tiny-qwen3.gguf"
    writer = gguf.GGUFWriter(path, "qwen3")
    add_dense_hyperparameters(writer, config)
    writer.add_rope_freq_base(1000000.0)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    add_bpe_vocabulary(writer, folder, "qwen2", config.bos_token_id, config.eos_token_id)
    add_named_tensors(writer, gguf.MODEL_ARCH.QWEN3, config.num_hidden_layers, tensors)
    finish(writer)

    checkpoint = load_checkpoint(str(path))
    assert checkpoint.architecture.family == "qwen3" and checkpoint.model_config["model_type"] == "qwen3"
    assert sorted(checkpoint.tensors) == sorted(tensors)
    for name, value in tensors.items():
        np.testing.assert_array_equal(checkpoint.tensors[name], value, err_msg=name)
    ids = torch.from_numpy(np.random.default_rng(5).integers(0, 5000, 40))
    family = FAMILIES["qwen3"]
    ours = family.build(checkpoint.architecture, checkpoint.model_config, checkpoint.tensors).reference(ids)
    with torch.no_grad():
        theirs = model(ids.unsqueeze(0)).logits[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=2e-4)

    out = tmp_path / "core"
    export_core(ExportOptions(recipe=load_recipe("qwen3"), checkpoint=str(path), out=out, precision="fp32"))
    assert Manifest.load(out).identity.checkpoint_id == "tiny-qwen3"


@pytest.mark.families("mistral")
def test_pages_before_every_window_are_never_read(family_env):
    """Mistral windows every layer, so a step reads only its window's pages: NaN written into the
    pages wholly before the window (on a shuffled table) leaves the decode step's logits as they
    were, bit for bit."""
    import numpy as np

    from helios.engine.runner import Runner, StepRow
    from tests.unit.family_checkpoints import TINY_CONFIGS

    core, _ = family_env("mistral")
    manifest = Manifest.load(core)
    window, page = TINY_CONFIGS["mistral"]["sliding_window"], manifest.kv.page_tokens
    rng = np.random.default_rng(11)
    prompt = rng.integers(0, manifest.architecture.vocab_size, size=4 * window).tolist()
    runner = Runner(core, manifest, num_pages=2 * len(prompt) // page + 4)
    table = rng.permutation(runner.num_pages).tolist()[: len(prompt) // page + 1]
    runner.step([StepRow(prompt, 0, table)])
    decode = [StepRow([prompt[-1]], len(prompt), table)]
    before = runner.step(decode).logits[0].copy()
    stale = (len(prompt) - window + 1) // page  # table columns wholly before the window
    assert stale >= 2
    pages = runner.num_pages
    for row in range(runner.pool.shape[0] // pages):  # every (layer, K or V) block of the pool
        runner.pool[[row * pages + p for p in table[:stale]]] = np.nan
    after = runner.step(decode).logits[0]
    np.testing.assert_array_equal(after, before)


@pytest.mark.families("mistral")
def test_pages_before_every_window_go_back_to_the_pool(family_env):
    """A windowed core's sequence holds only its window's pages: on a pool far smaller than the
    sequence, greedy tokens equal those of a pool that keeps every page."""
    from dataclasses import replace

    import numpy as np

    from helios.engine.api import GenerationRequest, SamplingParams
    from helios.engine.engine import Engine
    from tests.unit.family_checkpoints import TINY_CONFIGS

    core, _ = family_env("mistral")
    manifest = Manifest.load(core)
    window, page = TINY_CONFIGS["mistral"]["sliding_window"], manifest.kv.page_tokens
    assert manifest.kv.window == window
    prompt = np.random.default_rng(5).integers(0, manifest.architecture.vocab_size, size=40).tolist()
    params = SamplingParams(max_tokens=200, top_k=1, ignore_eos=True)
    pool = -(-window // page) + 2  # the window's pages, a partial one and the next token's
    kept = replace(manifest, kv=replace(manifest.kv, window=None))
    runs = {}
    for name, spec, pages in (("windowed", manifest, pool), ("kept", kept, 64)):
        engine = Engine(core, spec, kv_pages=pages, threads=1)
        events = engine.generate(GenerationRequest(name, list(prompt), params))
        assert events[-1].finished and events[-1].error is None, events[-1].error
        runs[name] = [t for ev in events for t in ev.token_ids]
        assert engine.block_manager.num_free == pages  # everything went back at the end
    assert len(runs["windowed"]) == 200 and (len(prompt) + 200) // page > pool
    assert runs["windowed"] == runs["kept"]

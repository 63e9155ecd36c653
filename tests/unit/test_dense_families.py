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


# family -> (GGUF architecture's gguf.MODEL_ARCH, its BPE pre-tokenizer, config class, model class,
# what the config adds). SmolLM3: every fourth layer without rotary, as llama.cpp hardcodes it.
GGUF_DENSE = {
    "qwen3": ("QWEN3", "qwen2", "Qwen3Config", "Qwen3ForCausalLM", {"tie_word_embeddings": False}),
    "smollm3": ("SMOLLM3", "smaug-bpe", "SmolLM3Config", "SmolLM3ForCausalLM", {"no_rope_layer_interval": 4}),
}


@pytest.mark.parametrize("family", sorted(GGUF_DENSE))
def test_dense_gguf_reads_through_the_name_map_and_exports(tmp_path, family):
    """A tiny Qwen3 / SmolLM3 written as llama.cpp's converter writes it (gguf's TensorNameMap,
    SmolLM3's q/k rows permuted as for llama, a BPE vocabulary): read back equal to its folder,
    logits equal to transformers', and the Qwen3 one exported."""
    import gguf
    import numpy as np
    import torch
    import transformers
    from safetensors.torch import load_file

    from ignition.checkpoints.load import load_checkpoint
    from ignition.models import FAMILIES
    from tests.unit.gguf_writing import add_bpe_vocabulary, add_dense_hyperparameters, add_named_tensors, finish
    from tests.unit.tiny_checkpoints import TINY, write_tiny_checkpoint

    arch, pre, config_class, model_class, extra = GGUF_DENSE[family]
    folder = write_tiny_checkpoint(tmp_path / "qwen2", "qwen2")  # for its real Qwen tokenizer files
    base = json.loads((folder / "config.json").read_text())
    config = getattr(transformers, config_class)(
        **{k: base[k] for k in TINY},
        vocab_size=base["vocab_size"],
        rope_theta=1000000.0,
        max_position_embeddings=4096,
        bos_token_id=base["bos_token_id"],
        eos_token_id=base["eos_token_id"],
        **extra,
    )
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config).eval()
    model.save_pretrained(folder)
    tensors = {k: v.numpy() for k, v in load_file(folder / "model.safetensors").items()}
    written = dict(tensors)
    if family == "smollm3":  # llama.cpp's convert_hf_to_gguf permute of q/k rows
        for name, value in tensors.items():
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                written[name] = value.reshape(heads, 2, -1, value.shape[1]).swapaxes(1, 2).reshape(value.shape)
        written.pop("lm_head.weight", None)  # tied: llama.cpp writes the embedding only

    path = tmp_path / f"tiny-{family}.gguf"
    writer = gguf.GGUFWriter(path, family)
    add_dense_hyperparameters(writer, config)
    writer.add_rope_freq_base(1000000.0)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    add_bpe_vocabulary(writer, folder, pre, config.bos_token_id, config.eos_token_id)
    add_named_tensors(writer, getattr(gguf.MODEL_ARCH, arch), config.num_hidden_layers, written)
    finish(writer)

    checkpoint = load_checkpoint(str(path))
    assert checkpoint.architecture.family == family and checkpoint.model_config["model_type"] == family
    expected = {k: v for k, v in tensors.items() if k in written}
    assert sorted(checkpoint.tensors) == sorted(expected)
    for name, value in expected.items():
        np.testing.assert_array_equal(checkpoint.tensors[name], value, err_msg=name)
    ids = torch.from_numpy(np.random.default_rng(5).integers(0, 5000, 40))
    ours = FAMILIES[family].build(checkpoint.architecture, checkpoint.model_config, checkpoint.tensors).reference(ids)
    with torch.no_grad():
        theirs = model(ids.unsqueeze(0)).logits[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=2e-4)

    if family == "qwen3":  # (the Qwen vocabulary lacks SmolLM3's stop token <|end_of_text|>)
        out = tmp_path / "core"
        export_core(ExportOptions(recipe=load_recipe(family), checkpoint=str(path), out=out, precision="fp32"))
        assert Manifest.load(out).identity.checkpoint_id == f"tiny-{family}"


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

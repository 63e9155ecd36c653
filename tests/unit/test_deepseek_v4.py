"""DeepSeek-V4 (ignition/models/deepseek_v4.py) against transformers' DeepseekV4ForCausalLM.

A tiny random checkpoint written by transformers' save_pretrained (sliding, HCA and CSA layers,
hash-routed and top-k MoE, 2 hyper-connection streams, YaRN compress rotary, compress rates 4
and 2 so windows complete every few tokens, an indexer top-3 that drops entries, a 6-token
window). Then, as tests/unit/test_families.py does for the exported families: two rows of
different lengths batched, a shuffled block table over a pool of stale garbage, prefill in two
chunks, 16 greedy decode steps, logits within 1e-4 relative of transformers' full-sequence
logits, through the torch step forward. The exported graph of the same architecture (32
experts) is held to the same protocol through `ignition export` and helios' Runner by
tests/unit/test_families.py (recipes deepseek4 and deepseek41).
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from safetensors import safe_open

pytest.importorskip("transformers")
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

from helios.engine.runner import StepRow, pack_rows, scatter_new_kv
from helios.manifest import KVLayout
from ignition.models.deepseek_v4 import build_deepseek_v4, inv_freq_of, plan_of
from tests.unit.family_checkpoints import randomise_deepseek_v4

CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"
VOCAB = 300
CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=16,
    q_lora_rank=24,
    partial_rotary_factor=0.5,
    num_experts_per_tok=2,
    n_routed_experts=4,
    layer_types=["sliding_attention", HCA, CSA],
    mlp_layer_types=["hash_moe", "moe", "moe"],
    compress_rates={CSA: 2, HCA: 4},
    hc_mult=2,
    hc_sinkhorn_iters=4,
    sliding_window=6,
    o_groups=2,
    o_lora_rank=8,
    # 16 indexer heads: an all-zero ReLU score (a tie whose top-k order is arbitrary) stays improbable
    index_n_heads=16,
    index_head_dim=8,
    index_topk=3,
    swiglu_limit=1.5,
    max_position_embeddings=4096,
    rope_parameters={
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 16,
        "beta_fast": 32,
        "beta_slow": 1,
    },
)
PAGE = 8
RELATIVE = 1e-4
DECODE_STEPS = 16


def _reference_model() -> DeepseekV4ForCausalLM:
    config = DeepseekV4Config(**CONFIG)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(config).eval()
    randomise_deepseek_v4(model, torch.Generator().manual_seed(1))
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(config.json dict, tensors as the safetensors reader gives them, transformers model)."""
    folder = tmp_path_factory.mktemp("deepseek_v4")
    reference = _reference_model()
    reference.save_pretrained(folder, max_shard_size="100KB")
    tensors = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name).to(torch.float32).numpy()
    return json.loads((folder / "config.json").read_text()), tensors, reference


@pytest.fixture(scope="module")
def model(checkpoint):
    config, tensors, _ = checkpoint
    return build_deepseek_v4(config, tensors)


@pytest.fixture(scope="module")
def sequences(checkpoint):
    """Two prompts (37 and 23 tokens) with 16 greedy tokens each, and transformers' logits [T, V]
    over each whole sequence."""
    reference = checkpoint[2]
    rng = np.random.default_rng(7)
    out = []
    with torch.no_grad():
        for length in (37, 23):
            seq = rng.integers(0, VOCAB, size=length).tolist()
            for _ in range(DECODE_STEPS):
                seq.append(int(reference(torch.tensor([seq])).logits[0, -1].argmax()))
            out.append((seq, length, reference(torch.tensor([seq])).logits[0].double().numpy()))
    return out


def _relative(engine: np.ndarray, reference: np.ndarray) -> float:
    return float(np.abs(engine.astype(np.float64) - reference).max() / np.abs(reference).max())


def _paged_errors(step, pool: np.ndarray, num_pages: int, sequences) -> tuple[float, float]:
    """(max prefill error, max decode error) relative to transformers, driving `step(rows) -> logits`
    over `pool` (filled with garbage here): row 0 prefills in two chunks, row 1 in one, then both
    decode 16 tokens, batched, on a shuffled block table."""
    rng = np.random.default_rng(3)
    pool[...] = rng.standard_normal(pool.shape, dtype=np.float32)
    pages_each = -(-max(len(s) for s, _, _ in sequences) // PAGE)
    order = rng.permutation(num_pages).tolist()
    tables = [order[:pages_each], order[pages_each : 2 * pages_each]]
    (seq0, prompt0, logits0), (seq1, prompt1, logits1) = sequences
    split = 20
    logits = step([StepRow(seq0[:split], 0, tables[0]), StepRow(seq1[:prompt1], 0, tables[1])])
    errors = [_relative(logits[0], logits0[split - 1]), _relative(logits[1], logits1[prompt1 - 1])]
    logits = step([StepRow(seq0[split:prompt0], split, tables[0])])
    errors.append(_relative(logits[0], logits0[prompt0 - 1]))
    decode = []
    for i in range(DECODE_STEPS):
        rows = [StepRow([seq[prompt + i]], prompt + i, table) for (seq, prompt, _), table in zip(sequences, tables)]
        logits = step(rows)
        decode += [_relative(logits[b], ref[prompt + i]) for b, (_, prompt, ref) in enumerate(sequences)]
    return max(errors), max(decode)


def _layout(model) -> KVLayout:
    return KVLayout(
        page_tokens=PAGE,
        num_layers=model.arch.num_layers,
        kv_heads=model.arch.num_kv_heads,
        head_dim=model.arch.head_dim,
    )


def test_plan_reads_configs_as_transformers_does(checkpoint):
    config = checkpoint[0]
    plan = plan_of(config)
    assert plan.layer_types == CONFIG["layer_types"] and plan.mlp_types == CONFIG["mlp_layer_types"]
    assert plan.rates == {CSA: 2, HCA: 4} and plan.rope_dim == 8
    # Pool geometry: the CSA layer's 5 x 16 + 4 x 8 channels per token fill 2 x 4 heads of 16.
    assert plan.cache_dims() == (4, 16)
    # The legacy keys of hub config.json files give the same plan and rotary.
    legacy = {
        k: v
        for k, v in config.items()
        if k not in ("layer_types", "mlp_layer_types", "compress_rates", "partial_rotary_factor", "rope_parameters")
    }
    legacy.update(
        compress_ratios=[0, 128, 4],
        compress_rate_csa=2,
        compress_rate_hca=4,
        num_hash_layers=1,
        qk_rope_head_dim=8,
        rope_scaling={
            "type": "yarn",
            **{
                k: CONFIG["rope_parameters"][k]
                for k in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow")
            },
        },
    )
    old = plan_of({"text_config": legacy})
    assert dataclasses.replace(old, compress_rope={}) == dataclasses.replace(plan, compress_rope={})
    for kind in ("main", "compress"):
        assert torch.equal(inv_freq_of(old, kind)[0], inv_freq_of(plan, kind)[0])
    # transformers' defaults (layer schedule, hash layers, rotary) and a YaRN attention factor it
    # derives when a nested config leaves it out.
    nested = {
        "main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        "compress": {
            "rope_type": "yarn",
            "rope_theta": 160000.0,
            "partial_rotary_factor": 0.5,
            "factor": 4.0,
            "original_max_position_embeddings": 16,
            "mscale": 1.0,
            "mscale_all_dim": 0.5,
        },
    }
    plain = {"main": nested["main"], "compress": {k: v for k, v in nested["compress"].items() if "mscale" not in k}}
    bare = {k: v for k, v in CONFIG.items() if k not in ("layer_types", "mlp_layer_types", "rope_parameters")}
    for extra in (
        {"num_hidden_layers": 5, "partial_rotary_factor": None},
        {"rope_parameters": nested},
        {"rope_parameters": plain},
    ):
        theirs = DeepseekV4Config(**{**bare, **extra})
        ours = plan_of({**bare, **extra})
        assert ours.layer_types == theirs.layer_types and ours.mlp_types == theirs.mlp_layer_types
        rotary = DeepseekV4RotaryEmbedding(theirs)
        for kind in ("main", "compress"):
            inv, scale = inv_freq_of(ours, kind)
            assert torch.allclose(inv, getattr(rotary, f"{kind}_inv_freq")), kind
            assert scale == pytest.approx(getattr(rotary, f"{kind}_attention_scaling")), kind
    for bad, message in (
        ({"scoring_func": "sigmoid"}, "scoring"),
        ({"num_key_value_heads": 2}, "MQA"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "rope type"),
    ):
        with pytest.raises(ValueError, match=message):
            inv_freq_of(plan_of({**bare, **bad}), "compress")


def test_loader_takes_both_layouts_and_keeps_mtp_aside(checkpoint, model, sequences):
    config, tensors, reference = checkpoint
    assert "model.layers.0.ffn.experts.0.w1.weight" in tensors  # save_pretrained writes DeepSeek's names
    seq, _, logits = sequences[0]
    ours = model.reference(torch.tensor(seq)).double().numpy()
    assert _relative(ours, logits) <= RELATIVE
    # transformers' own module names (fused experts), plus MTP tensors kept aside.
    state = {name: t.to(torch.float32).numpy() for name, t in reference.state_dict().items()}
    state["mtp.0.norm.weight"] = state["model.layers.3.attn_hc.fn"] = np.ones(4, np.float32)
    again = build_deepseek_v4(config, state)
    assert sorted(again.mtp_tensors) == ["model.layers.3.attn_hc.fn", "mtp.0.norm.weight"]
    expected = model.reference(torch.tensor(seq)).numpy()
    assert np.array_equal(again.reference(torch.tensor(seq)).numpy(), expected)
    # The hub's original layout: no "model." prefix, embed / hc_head_* at the top level.
    hub = {}
    for name, value in tensors.items():
        name = name.removeprefix("model.").replace("embed_tokens.", "embed.").replace("hc_head.hc_", "hc_head_")
        hub[name] = value
    assert "embed.weight" in hub and "hc_head_fn" in hub and "layers.2.attn.indexer.compressor.ape" in hub
    assert np.array_equal(build_deepseek_v4(config, hub).reference(torch.tensor(seq)).numpy(), expected)
    with pytest.raises(ValueError, match="checkpoint shape"):
        build_deepseek_v4(config, {**state, "model.layers.0.self_attn.sinks": np.ones(5, np.float32)})
    del state["model.layers.2.self_attn.compressor.indexer.q_b_proj.weight"]
    with pytest.raises(KeyError, match="indexer.q_b_proj"):
        build_deepseek_v4(config, state)


def test_paged_torch_steps_match_transformers(model, sequences):
    layout = _layout(model)
    num_pages = 2 * -(-53 // PAGE) + 3
    pool = np.zeros((layout.num_layers * 2 * num_pages, PAGE, layout.kv_heads, layout.head_dim), np.float32)
    pages = pool.reshape(layout.num_layers, 2, num_pages, PAGE, layout.kv_heads, layout.head_dim)

    def step(rows: list[StepRow]) -> np.ndarray:
        inputs = {k: torch.from_numpy(v) for k, v in pack_rows(rows, PAGE).items()}
        with torch.no_grad():
            out = model(
                inputs["input_ids"],
                inputs["positions"],
                inputs["history_lens"],
                inputs["query_lens"],
                inputs["block_tables"],
                torch.from_numpy(pool),
                inputs["logprob_token_ids"],
            )
        scatter_new_kv(pages, rows, out[5].numpy())
        return out[0].numpy()

    prefill, decode = _paged_errors(step, pool, num_pages, sequences)
    assert prefill <= RELATIVE, f"prefill logits differ by {prefill:.3g} relative"
    assert decode <= RELATIVE, f"decode logits differ by {decode:.3g} relative"

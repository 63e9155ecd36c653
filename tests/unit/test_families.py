"""The 13 seed recipes and the dense families users bring (qwen3) against their architectures' transformers reference implementations.

For every recipe whose family the exporter compiles: a tiny random checkpoint written by
transformers (tests/unit/family_checkpoints.py), `ignition export --recipe NAME --checkpoint DIR
--precision fp32`, then the core's step graph through the paged cache (two rows of different
lengths batched in each step, a shuffled non-contiguous block table, prefill in two chunks, 16
greedy decode steps) must give the transformers model's logits within 1e-4 relative (max
|engine - reference| / max |reference|) at every returned position. Every MoE family's checkpoint
has 32 experts, 4 routed a token (grouped top-k with 4 groups, 2 kept, where the family groups),
so this is also each routing variant's parity at realistic sparsity. Then `helios serve` on the
core and one chat round trip through its template and parsers.

Recipes whose family is not compiled yet must be refused by the exporter with the missing
features named (docs/recipes.md keeps the list).
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import llguidance
import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from helios.engine.constraints import parser_limits
from helios.engine.runner import Runner, StepRow
from helios.launcher import HeliosProcess
from helios.manifest import Manifest
from helios.neutral.grammar import OutputFormat, compiler_for
from helios.neutral.tokenizer import Tokenizer
from ignition.cli import app
from ignition.recipes import available_recipes, load_recipe
from tests.unit.conftest import COMPILED, PLANNED, SEED_RECIPES
from tests.unit.family_checkpoints import build_reference as build_reference_model
from tests.unit.family_checkpoints import write_family_checkpoint
from tests.unit.test_parsers import CALL_BLOCKS, SCHEMAS

pytest.importorskip("transformers")

RELATIVE = 1e-4
DECODE_STEPS = 16


def test_every_seed_recipe_exists_and_is_classified():
    assert set(SEED_RECIPES) <= set(available_recipes())
    assert sorted(COMPILED + PLANNED) == sorted(SEED_RECIPES)


def _core(family_env, recipe: str) -> tuple[Path, object]:
    return family_env(recipe)


def _relative(engine: np.ndarray, reference: np.ndarray) -> float:
    return float(np.abs(engine.astype(np.float64) - reference).max() / np.abs(reference).max())


@pytest.mark.parametrize("recipe", COMPILED)
def test_engine_matches_transformers_on_prefill_and_paged_decode(family_env, recipe):
    core, reference = _core(family_env, recipe)
    manifest = Manifest.load(core)
    assert manifest.architecture.family == load_recipe(recipe).family
    assert manifest.parity is not None and manifest.parity.max_abs_logit_error < 1e-3
    assert 0 < manifest.decode_weight_bytes
    vocab = manifest.architecture.vocab_size
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, vocab, size=37).tolist(), rng.integers(0, vocab, size=23).tolist()]

    # Greedy continuations by transformers, then its logits over each whole sequence.
    sequences = []
    with torch.no_grad():
        for prompt in prompts:
            seq = list(prompt)
            for _ in range(DECODE_STEPS):
                logits = reference(torch.tensor([seq])).logits[0]
                seq.append(int(logits[-1].argmax()))
            sequences.append((seq, reference(torch.tensor([seq])).logits[0].double().numpy()))

    page = manifest.kv.page_tokens
    pages_each = -(-max(len(s) for s, _ in sequences) // page)
    runner = Runner(core, manifest, num_pages=2 * pages_each + 3)
    runner.pool[...] = rng.standard_normal(runner.pool.shape, dtype=np.float32)  # stale garbage
    if runner.state_pool is not None:  # recurrent families: stale slots too (history 0 ignores them)
        runner.state_pool[...] = rng.standard_normal(runner.state_pool.shape, dtype=np.float32)
    order = rng.permutation(runner.num_pages).tolist()
    tables = [order[:pages_each], order[pages_each : 2 * pages_each]]
    slots = [2, 0]  # each row's recurrent-state slot (ignored by cores without state)

    # Prefill: row 0 in two chunks (the second reads the first through the pool), row 1 in one.
    split = 20
    out = runner.step(
        [
            StepRow(sequences[0][0][:split], 0, tables[0], state_slot=slots[0]),
            StepRow(prompts[1], 0, tables[1], state_slot=slots[1]),
        ]
    )
    errors = [
        _relative(out.logits[0], sequences[0][1][split - 1]),
        _relative(out.logits[1], sequences[1][1][len(prompts[1]) - 1]),
    ]
    out = runner.step([StepRow(sequences[0][0][split : len(prompts[0])], split, tables[0], state_slot=slots[0])])
    errors.append(_relative(out.logits[0], sequences[0][1][len(prompts[0]) - 1]))
    prefill_error = max(errors)
    # Decode: both rows, one token each per step, histories of different lengths.
    decode_errors = []
    for step in range(DECODE_STEPS):
        rows = []
        for (seq, _), prompt, table, slot in zip(sequences, prompts, tables, slots):
            position = len(prompt) + step
            rows.append(StepRow([seq[position]], position, table, state_slot=slot))
        out = runner.step(rows)
        for b, ((_seq, logits), prompt) in enumerate(zip(sequences, prompts)):
            decode_errors.append(_relative(out.logits[b], logits[len(prompt) + step]))
    assert prefill_error <= RELATIVE, f"prefill logits differ by {prefill_error:.3g} relative"
    assert len(decode_errors) == 2 * DECODE_STEPS
    assert max(decode_errors) <= RELATIVE, f"decode logits differ by {max(decode_errors):.3g} relative"


# A 16-bit pool against the float32 pool on the same steps: the whole logit vector of every
# output within this relative error of the largest logit (the families' weights are drawn at unit
# scale, so a rounded key moves a logit more than a trained model's would).
POOL_RELATIVE = {"bfloat16": 3e-2, "float16": 4e-3}


@pytest.mark.parametrize("recipe", COMPILED)
def test_16bit_pools_follow_the_float32_pool(family_env, recipe):
    """Every family's core over a bfloat16 and a float16 pool: a chunked prefill and paged decode
    on a shuffled block table (fed the float32 pool's greedy tokens) give the float32 pool's
    logits within POOL_RELATIVE at 80% of the outputs or more (families whose pool gathers read
    get a Cast of the pages)."""
    core, _ = _core(family_env, recipe)
    manifest = Manifest.load(core)
    rng = np.random.default_rng(11)
    ids = rng.integers(0, manifest.architecture.vocab_size, size=40).tolist()
    page = manifest.kv.page_tokens
    pages = -(-(len(ids) + DECODE_STEPS) // page)
    table = rng.permutation(pages + 2).tolist()[:pages]

    def run(pool: str, tokens: list[int] | None = None) -> tuple[np.ndarray, list[int]]:
        runner = Runner(core, manifest, num_pages=pages + 2, kv_dtype=pool)
        assert runner.pool_dtype == pool and runner.pool.itemsize == (4 if pool == "float32" else 2)
        logits = [runner.step([StepRow(ids[:25], 0, table, state_slot=0)]).logits[0]]
        logits.append(runner.step([StepRow(ids[25:], 25, table, state_slot=0)]).logits[0])
        fed = []
        for step in range(DECODE_STEPS):
            fed.append(int(logits[-1].argmax()) if tokens is None else tokens[step])
            logits.append(runner.step([StepRow([fed[-1]], len(ids) + step, table, state_slot=0)]).logits[0])
        return np.array(logits, dtype=np.float64), fed

    want, tokens = run("float32")
    for pool, bound in POOL_RELATIVE.items():
        got, _ = run(pool, tokens)
        errors = np.array([_relative(g, w) for g, w in zip(got, want)])
        assert np.isfinite(got).all()
        # A discrete choice (experts, sparse key selection) may flip at a near-tie and move one
        # step's logits a lot; a misread pool would move most of them.
        within = (errors <= bound).mean()
        assert within >= 0.8, (
            f"{pool} pool: {1 - within:.0%} of outputs differ by more than {bound} ({errors.round(4)})"
        )


CHAT = {
    "messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Use the tool.",
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "user", "content": "Thanks. And tomorrow?"},
    ],
    "tools": [
        {
            "type": "function",
            "function": {
                "name": "weather",
                "description": "Weather by city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
            },
        }
    ],
    "max_tokens": 6,
    "seed": 1,
}


@pytest.mark.parametrize("recipe", COMPILED)
def test_helios_serves_a_chat_round_trip(family_env, recipe):
    core, _ = _core(family_env, recipe)
    manifest = Manifest.load(core)
    loaded = load_recipe(recipe)
    assert (manifest.parsers.tool, manifest.parsers.reasoning) == (loaded.tool_parser, loaded.reasoning_parser)
    # A recipe without tool syntax (gemma2, gemma3, phi3) gets the conversation without its tool turns.
    tools = manifest.template.supports_tools
    chat = CHAT if tools else PLAIN_CHAT
    server = HeliosProcess(core)
    try:
        response = httpx.post(
            server.url + "/v1/chat/completions", json={"model": manifest.model_id, **chat}, timeout=120
        )
        assert response.status_code == 200, response.text
        body = response.json()
        choice = body["choices"][0]
        assert choice["finish_reason"] in ("length", "stop", "tool_calls")
        assert body["usage"]["completion_tokens"] >= 1
        # System, tools, history and tool result all rendered (or the plain history).
        assert body["usage"]["prompt_tokens"] > (40 if tools else 20)
        counted = httpx.post(
            server.url + "/v1/messages/count_tokens",
            headers={"anthropic-version": "2023-06-01"},
            json={"model": manifest.model_id, "messages": [{"role": "user", "content": "hi"}]},
            timeout=60,
        )
        assert counted.status_code == 200, counted.text
        # api.md: under an output constraint the family's tool-call envelope stays open. The
        # served request is accepted, and the grammar it enforces (compiled over this core's own
        # tokenizer) admits the answer and a call block its parser reads (tests/unit/test_parsers.py).
        constrained = {
            **chat,
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}},
        }
        response = httpx.post(
            server.url + "/v1/chat/completions", json={"model": manifest.model_id, **constrained}, timeout=120
        )
        assert response.status_code == 200, response.text
        compiler = compiler_for(Tokenizer.from_core(core, manifest), manifest)
        grammar = compiler.output_grammar(OutputFormat("json_schema", ANSWER), manifest.parsers.tool, SCHEMAS, "x")
        for text in ('{"value": 7}', *([CALL_BLOCKS[manifest.parsers.tool]] if tools else [])):
            matcher = llguidance.LLMatcher(compiler.llg, grammar, log_level=0, limits=parser_limits())
            tokens = compiler.llg.tokenize_str(text, parse_special=True)
            assert matcher.consume_tokens(tokens) and matcher.is_accepting(), (recipe, text)
    except httpx.TransportError as exc:  # the server went away: its log says why
        pytest.fail(f"{exc!r}; helios log:\n{server.output()}")
    finally:
        server.stop()


PLAIN_CHAT = {
    "messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": "Sunny."},
        {"role": "user", "content": "Thanks. And tomorrow?"},
    ],
    "max_tokens": 6,
}
ANSWER = {"type": "object", "properties": {"value": {"type": "integer"}}, "required": ["value"]}


@pytest.mark.parametrize("recipe", [name for name in ("deepseek4", "deepseek41") if name in COMPILED])
def test_deepseek_reasoning_effort_scores(family_env, recipe):
    """api.md: DeepSeek V4.1 also takes a JSON integer 1..100 as the top-level reasoning_effort (or in
    chat_template_kwargs); V4, and the Messages/Responses effort fields, refuse numbers with a 400."""
    from tests.unit.scripted import ScriptedServer

    core, _ = _core(family_env, recipe)
    numeric = load_recipe(recipe).reasoning.numeric_effort
    manifest = Manifest.load(core)
    assert manifest.template.numeric_effort == (list(numeric) if numeric else None)
    server = ScriptedServer(core)
    try:

        def chat(**extra):
            body = {
                "model": manifest.model_id,
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2,
                **extra,
            }
            return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)

        assert chat(reasoning_effort="max").status_code == 200
        assert f"<reasoning_effort>{'100' if numeric else 'max'}</reasoning_effort><think>" in server.engine.prompt
        assert chat(reasoning_effort=None).status_code == 200  # explicit null: the encoder's high default
        assert f"<reasoning_effort>{'75' if numeric else 'high'}</reasoning_effort>" in server.engine.prompt
        scored = chat(reasoning_effort=80)
        if numeric:
            assert scored.status_code == 200, scored.text
            assert "<reasoning_effort>80</reasoning_effort><think>" in server.engine.prompt
            assert chat(reasoning_effort=80, chat_template_kwargs={"reasoning_effort": 30}).status_code == 200
            assert "<reasoning_effort>30</reasoning_effort>" in server.engine.prompt  # the client's kwargs win
            assert chat(reasoning_effort=1, chat_template_kwargs={"enable_thinking": False}).status_code == 200
            assert "reasoning_effort" not in server.engine.prompt and server.engine.prompt.endswith("</think>")
            refused = [chat(reasoning_effort=bad) for bad in (0, 101, 80.0, True, "80")]
        else:
            refused = [scored, chat(chat_template_kwargs={"reasoning_effort": 80})]
        for response in refused:
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert set(error) >= {"type", "message", "param", "code"} and "reasoning_effort" in error["message"]
        effort = httpx.post(
            server.url + "/v1/messages",
            headers={"anthropic-version": "2023-06-01"},
            timeout=60,
            json={
                "model": manifest.model_id,
                "max_tokens": 2,
                "output_config": {"effort": 80},
                "messages": [{"role": "user", "content": "hi"}],
            },
        )
        assert effort.status_code == 400 and effort.json()["type"] == "error", effort.text
        # The native encoder's refusals travel in the manifest; helios answers them before rendering.
        assert manifest.template.rejects == ["drop_thinking", "continuation", "add_generation_prompt_false"]
        user = [{"role": "user", "content": "hi"}]
        for extra in (
            {"chat_template_kwargs": {"drop_thinking": False}},
            {"add_generation_prompt": False},
            {"messages": [*user, {"role": "assistant", "content": "par"}]},
        ):
            response = chat(**extra)
            assert response.status_code == 400 and "this model core's encoder" in response.json()["error"]["message"]
        assert not server.engine.prompt.endswith("par")  # none of them was rendered or submitted
    finally:
        server.stop()


@pytest.mark.parametrize("recipe", PLANNED or ["qwen38"])
def test_exporter_refuses_families_it_cannot_compile(tmp_path, recipe, monkeypatch):
    family = load_recipe(recipe).family
    if not PLANNED:  # every seed family compiles now: the refusal path, for a family marked planned
        from ignition.models import PLANNED as planned

        monkeypatch.setitem(planned, family, "a feature the exporter lacks")
    out = tmp_path / "core"
    result = CliRunner().invoke(app, ["export", "--recipe", recipe, "--checkpoint", str(tmp_path), "--out", str(out)])
    assert result.exit_code != 0
    text = " ".join(result.output.split())
    assert f"the '{family}' family, which cannot be compiled yet: missing" in text, text
    assert not out.exists()


def test_recipe_sampling_follows_the_api_table():
    table = {  # api.md "Reasoning, sampling, and usage": temperature, top_p, top_k (-1 = disabled)
        "qwen38": (1, 0.95, 20),
        "qwen38_dense": (1, 0.95, 20),
        "glm53": (1, 0.95, -1),
        "deepseek4": (1, 0.95, -1),
        "deepseek41": (1, 1, -1),
        "mimo_v2": (1, 0.95, -1),
        "kimi3": (1, 1, -1),
        "step5": (1, 0.95, -1),
        "nemotron_h": (1, 0.95, -1),
        "kimi31": (1, 0.95, -1),
        "minimax_m3": (1, 0.95, -1),
        "muse_spark": (1, 1, -1),
        "gemma4": (1, 0.95, 64),
    }
    intervals = {
        "qwen38": {"temperature": (0.7, 1), "top_p": (0.8, 0.95), "presence_penalty": (0, 2)},
        "qwen38_dense": {"temperature": (0.7, 1), "top_p": (0.8, 0.95), "presence_penalty": (0, 2)},
        "glm53": {"temperature": (0.95, 1), "top_p": (0.95, 1)},
        "deepseek41": {"repetition_penalty": (1, 1.1)},
        "kimi3": {"top_p": (0.95, 1)},
    }
    for name, (temperature, top_p, top_k) in table.items():
        recipe = load_recipe(name)
        d = recipe.sampling_defaults
        assert (d.temperature, d.top_p, d.top_k) == (temperature, top_p, top_k), name
        assert (d.min_p, d.repetition_penalty, d.presence_penalty, d.frequency_penalty) == (0, 1, 0, 0), name
        got = {k: (r.min, r.max) for k, r in recipe.sampling_ranges.items()}
        assert got == intervals.get(name, {}), name


def test_recipe_reasoning_declarations():
    qwen = load_recipe("qwen38").reasoning
    assert qwen.effort_levels == ["low", "medium", "xhigh"] and qwen.starts_in_reasoning
    for name in ("deepseek4", "deepseek41"):
        recipe = load_recipe(name)
        assert recipe.reasoning.effort_levels == ["low", "high", "xhigh", "max"]
        assert recipe.reasoning.default_effort == "high"
        assert recipe.template_rejects == ["drop_thinking", "continuation", "add_generation_prompt_false"]
        assert (recipe.tool_parser, recipe.reasoning_parser) == ("deepseek_dsml", "deepseek")
    assert load_recipe("deepseek4").reasoning.numeric_effort is None
    assert load_recipe("deepseek41").reasoning.numeric_effort == (1, 100)
    kimi = load_recipe("kimi3").reasoning
    assert kimi.always and kimi.effort_levels == ["low", "high", "max"] and kimi.default_effort == "max"
    assert load_recipe("gemma4").reasoning.open == "<|channel>thought"


def _render(template: str, **kwargs) -> str:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ValueError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    source = (load_recipe("deepseek4").path.parent / template).read_text()
    return env.from_string(source).render(**kwargs)


def test_deepseek_templates_follow_the_native_encoder_rules():
    user = [{"role": "user", "content": "hi"}]
    for template in ("templates/deepseek_v4.jinja", "templates/deepseek_v41.jinja"):
        assert _render(template, messages=user, add_generation_prompt=True).endswith(
            "<reasoning_effort>" + ("75" if "41" in template else "high") + "</reasoning_effort><think>"
        )
        assert _render(template, messages=user, add_generation_prompt=True, enable_thinking=False).endswith("</think>")
        for kwargs in ({"drop_thinking": True}, {"add_generation_prompt": False}):
            with pytest.raises(ValueError):
                _render(template, messages=user, **kwargs)
        with pytest.raises(ValueError, match="continuation"):
            _render(template, messages=user + [{"role": "assistant", "content": "par"}], add_generation_prompt=True)
    v41 = "templates/deepseek_v41.jinja"
    assert "<reasoning_effort>80</reasoning_effort>" in _render(v41, messages=user, reasoning_effort=80)
    assert "<reasoning_effort>100</reasoning_effort>" in _render(v41, messages=user, reasoning_effort="max")
    for bad in (0, 101, 80.0, True, "80"):
        with pytest.raises(ValueError):
            _render(v41, messages=user, reasoning_effort=bad)
    with pytest.raises(ValueError):
        _render("templates/deepseek_v4.jinja", messages=user, reasoning_effort=80)


def test_kimi3_template_always_thinks():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    source = (load_recipe("kimi3").path.parent / "templates/kimi_k3.jinja").read_text()
    template = ImmutableSandboxedEnvironment().from_string(source)
    user = [{"role": "user", "content": "hi"}]
    on = template.render(messages=user, add_generation_prompt=True)
    assert on.endswith("<|im_middle|>max<|im_end|><|im_assistant|>assistant<|im_middle|><think>")
    assert template.render(messages=user, add_generation_prompt=True, enable_thinking=False, thinking=False) == on
    assert "<|im_middle|>low<|im_end|>" in template.render(
        messages=user, add_generation_prompt=True, reasoning_effort="low"
    )
    history = [*user, {"role": "assistant", "content": "ok", "reasoning_content": "because"}]
    assert "<think>because</think>ok" in template.render(messages=history)


def test_mtp_tensors_are_kept_aside(tmp_path):
    """MTP layers (model.layers.N for N >= num_hidden_layers) are not in the step graph but are
    kept for later speculative decoding rather than rejected as unknown tensors."""
    from safetensors.torch import save_file

    from ignition.checkpoints.safetensors_dir import read_safetensors_dir
    from ignition.models import build_model

    folder, _ = write_family_checkpoint(tmp_path / "ckpt", "deepseek_v3")
    layers = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
    extra = {
        f"model.layers.{layers}.eh_proj.weight": torch.zeros(64, 128),
        f"model.layers.{layers}.enorm.weight": torch.ones(64),
    }
    save_file(extra, folder / "model-mtp.safetensors", metadata={"format": "pt"})  # a shard of its own
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"].update({name: "model-mtp.safetensors" for name in extra})
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    model = build_model(*read_safetensors_dir(folder).model_inputs())
    assert set(model.mtp_tensors) == set(extra)


def test_nemotron_h_plan_and_both_checkpoint_layouts():
    """Nemotron-H: one mixer per layer ("ME*M-": only the attention layer has K/V rows, the Mamba-2
    layers carry state, the MLP/MoE layers neither); the loader takes save_pretrained's layout
    (`backbone.*`, per-expert tensors) and transformers' module names (`model.*`, stacked experts),
    and keeps `mtp.*` aside."""
    from ignition.models import architecture, cache_layout
    from ignition.models import build_model as build_configured
    from ignition.models.nemotron_h import plan_nemotron_h

    reference = build_reference_model("nemotron_h")
    config = json.loads(reference.config.to_json_string())
    plan = plan_nemotron_h(config)
    assert [layer.kind for layer in plan.layers] == ["mamba2", "ffn", "gqa", "mamba2", "ffn"]
    kv_layers, state = cache_layout("nemotron_h", config, len(plan.layers))
    assert kv_layers == 1 and [(s.layer, s.kind) for s in state.layers] == [(0, "mamba2"), (3, "mamba2")]
    legacy = {k: v for k, v in config.items() if k != "layers_block_type"} | {"hybrid_override_pattern": "ME*M-"}
    assert [layer.kind for layer in plan_nemotron_h(legacy).layers] == [layer.kind for layer in plan.layers]
    state_dict = {name: t.numpy() for name, t in reference.state_dict().items()}
    assert "model.layers.1.mixer.experts.up_proj" in state_dict  # stacked [E, I, latent]
    state_dict["mtp.0.norm.weight"] = np.ones(4, np.float32)
    model = build_configured(architecture("nemotron_h", config), config, state_dict)
    assert sorted(model.mtp_tensors) == ["mtp.0.norm.weight"]
    ids = torch.tensor(np.random.default_rng(3).integers(0, config["vocab_size"], size=29))
    with torch.no_grad():
        expected = reference(ids.unsqueeze(0)).logits[0].double().numpy()
    assert _relative(model.reference(ids).numpy(), expected) <= RELATIVE


def _family_tokenizer(family: str):
    from helios.manifest import TokenizerSpec
    from helios.neutral.tokenizer import Tokenizer
    from ignition.tiny_text import MARKUP, byte_tokenizer
    from tests.unit.family_checkpoints import SPECIALS

    specials = SPECIALS[family]
    spec = TokenizerSpec(
        file="tokenizer.json",
        bos_token_id=256,
        eos_token_ids=[],
        pad_token_id=None,
        add_bos=False,
        special_tokens={t: 256 + i for i, t in enumerate(specials) if t not in MARKUP},
    )
    return Tokenizer(byte_tokenizer(specials), spec, 256 + len(specials))


def test_kimi_k2_tool_sections_stream_token_by_token():
    from tests.unit.test_parsers import merged, run, spec

    tok = _family_tokenizer("deepseek_v3")
    section = (
        "Checking.<|tool_calls_section_begin|><|tool_call_begin|>functions.lookup:0<|tool_call_argument_begin|>"
        '{"query": "alpha"}<|tool_call_end|><|tool_call_begin|>functions.lookup:1<|tool_call_argument_begin|>'
        '{"limit": 3}<|tool_call_end|><|tool_calls_section_end|>'
    )
    assert merged(run(section, spec("kimi_k2"), tokenizer=tok)) == [
        ("text", "Checking."),
        ("call", "lookup", {"query": "alpha"}),
        ("call", "lookup", {"limit": 3}),
    ]
    assert merged(run("No tools here.", spec("kimi_k2"), tokenizer=tok)) == [("text", "No tools here.")]
    from helios.neutral.parsers import ToolParseError

    with pytest.raises(ToolParseError):
        run(
            "<|tool_calls_section_begin|><|tool_call_begin|>functions.lookup:0<|tool_call_argument_begin|>{oops}"
            "<|tool_call_end|><|tool_calls_section_end|>",
            spec("kimi_k2"),
            tokenizer=tok,
        )


def test_mimo_function_tags_keep_values_verbatim():
    from tests.unit.test_parsers import merged, run, spec

    tok = _family_tokenizer("mimo_v2_flash")
    call = "<tool_call>\n<function=run>\n<parameter=code>\n    x = 1\n</parameter>\n</function>\n</tool_call>"
    assert merged(run(call, spec("mimo"), tokenizer=tok)) == [("call", "run", {"code": "\n    x = 1\n"})]
    assert merged(run(call, spec("qwen3_coder"), tokenizer=tok)) == [("call", "run", {"code": "    x = 1"})]


def test_prompt_scoring_is_refused_where_logits_are_post_processed(tmp_path, monkeypatch):
    """Gemma 4 soft-caps its logits after the lm_head; a score graph of the bare lm_head would
    report other numbers than generation, so --prompt-logprobs must be refused, clearly, and
    before any heavy work (no tensor is read)."""
    import ignition.export.stages
    from ignition.export.pipeline import ExportError, ExportOptions, export_core

    checkpoint, _ = write_family_checkpoint(tmp_path / "ckpt", "gemma4")
    options = ExportOptions(
        recipe=load_recipe("gemma4"),
        checkpoint=str(checkpoint),
        out=tmp_path / "core",
        precision="fp32",
        prompt_logprobs=True,
        cache=False,
    )

    def no_reading(spec):
        raise AssertionError("the checkpoint's tensors were read before --prompt-logprobs was refused")

    monkeypatch.setattr(ignition.export.stages, "load_checkpoint", no_reading)
    with pytest.raises(ExportError, match="--prompt-logprobs is not supported for this family .*soft-caps"):
        export_core(options)
    assert not (tmp_path / "core").exists()

"""Exact logprobs, prompt scoring and explicit ids (api.md "Generation log probabilities" and
"Prompt log probabilities") on the tiny fp32 core exported with --prompt-logprobs: the engine
against a float64 evaluation of the same weights, and the three OpenAI protocols end to end."""

from __future__ import annotations

import dataclasses
import gzip
import json

import httpx
import numpy as np
import pytest
import torch

from helios.engine.api import FinishReason, GenerationRequest, PromptLogprob, SamplingParams, TokenLogprob
from helios.engine.engine import Engine
from helios.manifest import Manifest
from helios.protocols.common import chat_logprob_entries, completion_logprobs, prompt_logprobs_field
from ignition.checkpoints.load import load_checkpoint
from ignition.models import build_model
from tests.unit.live import ANTHROPIC, USER, sse

HELD_OUT = (
    "The lighthouse keeper counted the ships that passed each night and wrote their names in a "
    "ledger that nobody else ever read."
)


@pytest.fixture(scope="module")
def reference(tiny_checkpoint_dir):
    """float64 log-softmax of the tiny checkpoint's weights over a sequence: [T, V]."""
    model = build_model(*load_checkpoint(str(tiny_checkpoint_dir)).model_inputs()).double()

    def run(ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            return torch.log_softmax(model.reference(torch.tensor(ids)), -1).numpy()

    return run


@pytest.fixture(scope="module")
def engine(tiny_core):
    return Engine(tiny_core, Manifest.load(tiny_core))


@pytest.fixture(scope="module")
def tokenizer(tiny_core):
    from helios.neutral.tokenizer import Tokenizer

    return Tokenizer.from_core(tiny_core, Manifest.load(tiny_core))


def scored(engine: Engine, ids: list[int], k: int = 5, request_id: str = "score", max_tokens: int = 0):
    events = engine.generate(
        GenerationRequest(request_id, ids, SamplingParams(max_tokens=max_tokens), prompt_logprobs=k)
    )
    return [e for ev in events for e in (ev.prompt_logprobs or [])], events


def test_manifest_declares_logprob_capacities(tiny_core):
    caps = Manifest.load(tiny_core).logprobs
    assert (caps.max_top_logprobs, caps.explicit_token_ids, caps.prompt_logprobs) == (20, True, True)
    assert caps.max_explicit_token_ids == 128
    assert [(e.name, e.target) for e in Manifest.load(tiny_core).engines] == [
        ("step", "cpu"),
        ("score", "cpu"),
        ("step", "cuda"),
    ]


def test_prompt_scores_match_float64_evaluation(engine, tokenizer, reference):
    ids = tokenizer.encode(HELD_OUT, add_bos=False)
    entries, events = scored(engine, ids)
    assert events[-1].finish_reason is FinishReason.LENGTH and events[-1].completion_tokens == 0
    assert len(entries) == len(ids) and entries[0] is None
    expected = reference(ids)
    for j in range(1, len(ids)):
        row, entry = expected[j - 1], entries[j]
        assert entry.token_id == ids[j]
        assert abs(entry.logprob - row[ids[j]]) <= 1e-3
        # Rank: 1 + count strictly greater, up to float32-vs-float64 near-ties.
        low = 1 + int((row > row[ids[j]] + 1e-5).sum())
        high = 1 + int((row > row[ids[j]] - 1e-5).sum())
        assert low <= entry.rank <= high
        best = np.lexsort((np.arange(row.size), -row))[:5]
        assert [t for t, _, _ in entry.top] == best.tolist()
        assert all(abs(lp - row[t]) <= 1e-3 for t, lp, _ in entry.top)
        assert [r for _, _, r in entry.top] == [1 + sum(o > lp for _, o, _ in entry.top) for _, lp, _ in entry.top]


def test_generation_logprob_equals_prompt_score_of_the_same_position(engine, tokenizer):
    ids = tokenizer.encode(HELD_OUT, add_bos=False)
    entries, _ = scored(engine, ids, request_id="whole")
    for cut in (5, len(ids) - 1):
        target = ids[cut]
        events = engine.generate(
            GenerationRequest(
                f"gen-{cut}",
                ids[:cut],
                SamplingParams(max_tokens=1, logprobs=20, logprob_token_ids=[target]),
            )
        )
        entry = events[0].logprobs[0]
        assert entry.explicit and entry.top[0][0] == target
        assert entry.top[0][1] == pytest.approx(entries[cut].logprob, abs=1e-5)
        # The natural alternatives at that position agree too.
        natural = engine.generate(GenerationRequest(f"nat-{cut}", ids[:cut], SamplingParams(max_tokens=1, logprobs=5)))
        assert [t for t, _ in natural[0].logprobs[0].top] == [t for t, _, _ in entries[cut].top]


def test_chunked_scoring_equals_one_pass_and_emits_per_chunk(tiny_core, engine, tokenizer):
    ids = tokenizer.encode(HELD_OUT, add_bos=False)
    whole, _ = scored(engine, ids, request_id="one-pass")
    manifest = Manifest.load(tiny_core)
    manifest.limits = dataclasses.replace(manifest.limits, prefill_chunk_size=7, max_batch_tokens=9)
    chunked_engine = Engine(tiny_core, manifest)
    chunked, events = scored(chunked_engine, ids, request_id="chunked", max_tokens=2)
    per_event = [len(e.prompt_logprobs) for e in events if e.prompt_logprobs]
    assert len(per_event) == -(-len(ids) // 7) and sum(per_event) == len(ids)
    assert events[-1].completion_tokens == 2  # generation follows the scored prompt
    for a, b in zip(whole[1:], chunked[1:]):
        assert (a.token_id, a.rank) == (b.token_id, b.rank) and a.logprob == pytest.approx(b.logprob, abs=1e-5)


def test_explicit_ids_are_full_vocabulary_logprobs(engine, tokenizer, reference):
    ids = tokenizer.encode("Explicit ids are read", add_bos=False)
    chosen = [7, 3, 151935, 0]
    events = engine.generate(
        GenerationRequest("explicit", ids, SamplingParams(max_tokens=1, logprobs=0, logprob_token_ids=chosen))
    )
    entry = events[0].logprobs[0]
    row = reference(ids)[-1]
    assert [t for t, _ in entry.top][:4] == chosen
    assert len(entry.top) == 4 + (entry.token_id not in chosen)
    assert all(abs(lp - row[t]) <= 1e-3 for t, lp in entry.top)


def test_engine_refuses_what_the_core_cannot_do(tiny_think_core):
    engine = Engine(tiny_think_core, Manifest.load(tiny_think_core))  # exported without --prompt-logprobs
    with pytest.raises(ValueError, match="re-export it with --prompt-logprobs"):
        engine.submit(
            GenerationRequest("p", [1, 2, 3], SamplingParams(max_tokens=0), prompt_logprobs=1), lambda e: None
        )
    with pytest.raises(ValueError, match="logprobs on"):
        engine.submit(GenerationRequest("x", [1, 2], SamplingParams(logprob_token_ids=[3])), lambda e: None)


# -- protocols on the live tiny server ------------------------------------------------------------


@pytest.fixture(scope="module")
def http(tiny_server):
    with httpx.Client(base_url=tiny_server.url, timeout=120) as client:
        yield client


def test_non_finite_logprobs_are_minus_9999_in_every_encoding(tokenizer):
    """api.md: non-finite logprobs are represented as -9999.0 (prompt scores, Completions arrays
    and maps, Chat entries and alternatives); finite values pass unchanged."""
    nan, ninf = float("nan"), float("-inf")
    position = PromptLogprob(22, nan, 7, [(11, -0.5, 1), (33, ninf, 6)])
    [_, scored] = prompt_logprobs_field(tokenizer, [None, position], 2)
    assert {key: value["logprob"] for key, value in scored.items()} == {"22": -9999.0, "11": -0.5, "33": -9999.0}
    generated = [TokenLogprob(22, nan, [(11, -0.5), (33, ninf)])]
    arrays = completion_logprobs(tokenizer, generated, [0], 2, as_ids=True)
    assert arrays["token_logprobs"] == [-9999.0] and arrays["top_logprobs"] == [
        {"token_id:11": -0.5, "token_id:33": -9999.0}
    ]
    [entry] = chat_logprob_entries(tokenizer, generated, 2, as_ids=False)
    assert entry["logprob"] == -9999.0 and [t["logprob"] for t in entry["top_logprobs"]] == [-0.5, -9999.0]
    assert json.loads(json.dumps(entry))["logprob"] == -9999.0  # valid JSON, no NaN/Infinity literals


def test_completions_echo_scores_the_prompt(http, tokenizer):
    prompt = "Once upon a time"
    ids = tokenizer.encode_raw_prompt(prompt)
    body = {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 2}
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(len(t) == 2 for t in lp["top_logprobs"][1:])
    strings = [tokenizer.token_string(t) for t in ids]
    assert lp["text_offset"] == [sum(len(s) for s in strings[:i]) for i in range(len(ids))]
    # The inferred prompt_logprobs field comes along: actual token first, with its rank.
    field = choice["prompt_logprobs"]
    assert field[0] is None and len(field) == len(ids)
    first = field[1][str(ids[1])]
    assert first["decoded_token"] == strings[1] and first["rank"] >= 1
    assert first["logprob"] == pytest.approx(lp["token_logprobs"][1])


def test_completions_prompt_logprobs_with_generation(http, tokenizer):
    body = {
        "prompt": [[11, 22, 33], [44, 55]],
        "max_tokens": 2,
        "ignore_eos": True,
        "prompt_logprobs": 3,
        "logprobs": 1,
        "echo": True,
        "return_tokens_as_token_ids": True,
    }
    out = http.post("/v1/completions", json=body).json()
    first = out["choices"][0]
    assert len(first["prompt_logprobs"]) == 3
    assert all(len(entry) in (3, 4) for entry in first["prompt_logprobs"][1:])  # actual + 3 alternatives
    # return_tokens_as_token_ids changes the arrays' token strings, not prompt_logprobs' decoded_token
    assert first["prompt_logprobs"][1]["22"]["decoded_token"] == tokenizer.decode([22]) != "token_id:22"
    arrays = first["logprobs"]
    assert arrays["tokens"][:3] == ["token_id:11", "token_id:22", "token_id:33"]
    assert len(arrays["tokens"]) == 3 + 2  # echoed prompt entries, then the generated ones
    assert arrays["text_offset"][3] == len(tokenizer.decode([11, 22, 33]))  # generated offsets follow the echo
    assert out["choices"][1]["prompt_logprobs"][0] is None


def test_completions_streaming_echo_frames_come_before_generated_entries(http):
    body = {
        "prompt": "Streaming echo",
        "max_tokens": 2,
        "ignore_eos": True,
        "echo": True,
        "logprobs": 1,
        "stream": True,
    }
    frames = [d for _, d in sse(http.post("/v1/completions", json=body).text) if d != "[DONE]"]
    parts = [c["logprobs"] for f in frames for c in f["choices"] if c["logprobs"]]
    assert parts[0]["token_logprobs"][0] is None  # the prompt frame leads
    assert sum(len(p["tokens"]) for p in parts) == len(parts[0]["tokens"]) + 2
    assert frames[0]["choices"][0]["text"].startswith("Streaming echo")


def test_chat_prompt_logprobs_are_top_level(http):
    body = {"messages": USER, "max_tokens": 1, "prompt_logprobs": 2, "return_token_ids": True}
    out = http.post("/v1/chat/completions", json=body).json()
    assert len(out["prompt_logprobs"]) == len(out["prompt_token_ids"]) and out["prompt_logprobs"][0] is None
    for position, entry in enumerate(out["prompt_logprobs"][1:], start=1):
        assert str(out["prompt_token_ids"][position]) in entry


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/chat/completions", {"messages": USER, "prompt_logprobs": 1, "stream": True}),
        ("/v1/chat/completions", {"messages": USER, "prompt_logprobs": 21}),
        ("/v1/chat/completions", {"messages": USER, "prompt_logprobs": 1, "max_tokens": 0}),
        ("/v1/completions", {"prompt": "x", "prompt_logprobs": 0, "stream": True}),
        ("/v1/responses", {"input": "x", "prompt_logprobs": 1}),
        ("/v1/messages", {"messages": USER, "max_tokens": 1, "prompt_logprobs": 1}),
        ("/v1/messages", {"messages": USER, "max_tokens": 1, "logprob_token_ids": [1]}),
        ("/v1/chat/completions", {"messages": USER, "logprob_token_ids": [1, 2]}),  # logprobs not enabled
        ("/v1/chat/completions", {"messages": USER, "logprobs": True, "logprob_token_ids": list(range(129))}),
        ("/v1/chat/completions", {"messages": USER, "logprobs": True, "logprob_token_ids": [151936]}),
        ("/v1/chat/completions", {"messages": USER, "logprobs": True, "logprob_token_ids": [-1]}),
        ("/v1/completions", {"prompt": "x", "logprobs": 1, "logprob_token_ids": ["1"]}),
        ("/v1/responses", {"input": "x", "logprob_token_ids": [1]}),  # no logprobs include
    ],
)
def test_logprob_request_errors(http, path, body):
    response = http.post(path, json=body, headers=ANTHROPIC)
    assert response.status_code == 400, response.text


@pytest.mark.parametrize("protocol", ["chat", "completions", "responses"])
@pytest.mark.parametrize("stream", [False, True])
def test_explicit_ids_replace_alternatives_in_caller_order(http, protocol, stream):
    ids = [9, 4, 9, 151935, 4, 0]
    body = {
        "logprob_token_ids": ids,
        "return_tokens_as_token_ids": True,
        "stream": stream,
        "ignore_eos": True,
        "seed": 3,
    }
    if protocol == "chat":
        path = "/v1/chat/completions"
        body.update(messages=USER, max_tokens=1, logprobs=True, top_logprobs=2)
    elif protocol == "completions":
        path = "/v1/completions"
        body.update(prompt="Pick:", max_tokens=1, logprobs=2)
    else:
        path = "/v1/responses"
        body.update(input="Pick:", max_output_tokens=16, top_logprobs=2, include=["message.output_text.logprobs"])
    response = http.post(path, json=body)
    assert response.status_code == 200, response.text
    frames = [d for _, d in sse(response.text) if d != "[DONE]"] if stream else [response.json()]
    entries = []
    for frame in frames:
        if protocol == "responses":
            if stream and frame.get("type") == "response.output_text.delta":
                entries += frame["logprobs"]
            elif not stream:
                entries += [
                    e for item in frame["output"] for part in item.get("content", []) for e in part.get("logprobs", [])
                ]
        for choice in frame.get("choices", []):
            values = choice.get("logprobs") or {}
            if protocol == "chat":
                entries += values.get("content", [])
            else:
                entries += [
                    {"token": t, "top_logprobs": top}
                    for t, top in zip(values.get("tokens", []), values.get("top_logprobs", []))
                ]
    if protocol != "responses":
        assert len(entries) == 1
    expected = ["token_id:9", "token_id:4", "token_id:151935", "token_id:0"]
    for entry in entries:
        top = entry["top_logprobs"]
        names = list(top) if isinstance(top, dict) else [t["token"] for t in top]
        assert names == expected + ([] if entry["token"] in expected else [entry["token"]])


# -- System One and Decisions ----------------------------------------------------------------------


SYSTEMONE = {
    "model": "local",
    "state": {"message": "Charged twice"},
    "questions": {
        "refund": {"type": "noul", "instructions": "Is a refund requested?"},
        "team": {"type": "choice", "criteria": {"billing": None, "support": "Other help"}},
        "urgency": {"type": "score", "instructions": {"ask": "How urgent?"}, "criteria": ["Routine", "Soon", "Urgent"]},
    },
}


def test_systemone_answers_and_usage(http):
    out = http.post("/v1/systemone", json=SYSTEMONE).json()
    answers = out["answers"]
    assert set(answers) == {"refund", "team", "urgency"}
    assert 0 <= answers["refund"]["noul"] <= 1
    team = answers["team"]
    assert set(team["probabilities"]) == {"billing", "support"} and sum(
        team["probabilities"].values()
    ) == pytest.approx(1)
    assert team["choice"] == max(team["probabilities"], key=team["probabilities"].get)
    ranked = sorted(team["probabilities"].values(), reverse=True)
    assert team["confidence"] == pytest.approx(ranked[0] - ranked[1])
    urgency = answers["urgency"]
    probs = [urgency["probabilities"][str(i)] for i in range(3)]
    assert urgency["legend"] == ["Routine", "Soon", "Urgent"]
    assert urgency["score"] == pytest.approx(sum(i * p for i, p in enumerate(probs)))
    assert 0 <= urgency["confidence"] <= 1
    assert out["usage"]["output_tokens"] == 3 and out["usage"]["input_tokens"] > 3 * 20


def test_systemone_schema_errors_are_422_details(http):
    body = {
        "model": "local",
        "state": 5,
        "questions": {
            "a": {"type": "box"},
            "b": {"type": "choice", "criteria": {}},
            "c": {"type": "score", "criteria": ["x", None]},
            "d": {"type": "noul", "color": "red"},
        },
    }
    response = http.post("/v1/systemone", json=body)
    assert response.status_code == 422
    locs = {tuple(d["loc"]) for d in response.json()["detail"]}
    assert locs == {
        ("body", "state"),
        ("body", "questions", "a", "type"),
        ("body", "questions", "b", "criteria"),
        ("body", "questions", "c", "criteria"),
        ("body", "questions", "d", "color"),
    }
    assert http.post("/v1/systemone", json={"model": "m", "state": "s", "questions": {}}).status_code == 422
    assert http.post("/v1/systemone", content=b"{oops", headers={"Content-Type": "application/json"}).status_code == 400
    assert http.post("/v1/systemone", json={**SYSTEMONE, "assets": {"img": {"data_base64": "AA=="}}}).status_code == 400
    # Image assets: a text-only core refuses them even with the opt-in header; compressed multipart is a 415.
    assert (
        http.post(
            "/v1/systemone",
            json={**SYSTEMONE, "assets": {"img": {"data_base64": "AA=="}}},
            headers={"TypeSafe-Danger-Zone-Images": "true"},
        ).status_code
        == 400
    )
    parts = {"files": ("request", json.dumps(SYSTEMONE), "application/json")}
    multipart = httpx.Request("POST", "http://x", files=parts)
    headers = {"Content-Type": multipart.headers["Content-Type"]}
    assert http.post("/v1/systemone", content=multipart.read(), headers=headers).status_code == 400
    compressed = http.post(
        "/v1/systemone", content=gzip.compress(multipart.read()), headers={**headers, "Content-Encoding": "gzip"}
    )
    assert compressed.status_code == 415 and compressed.json()["error"]["code"] == "unsupported_content_encoding"


def test_decisions_answers_reuse_the_state_prefix(http):
    body = {
        "model": "local",
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "Charged"}, {"type": "text", "text": "twice"}]}
        ],
        "safety_identifier": "user-1",
        "questions": [
            {"type": "predicate", "name": "refund", "instructions": "Refund requested?"},
            {
                "type": "choice",
                "instructions": "Which team?",
                "choices": [{"value": "billing", "description": "Payments"}, {"value": False}],
            },
            {
                "type": "score",
                "instructions": "Urgency?",
                "levels": [{"label": "Routine"}, {"label": "Urgent", "description": "Act today"}],
            },
        ],
    }
    out = http.post("/v1/decisions", json=body).json()
    refund, team, urgency = out["answers"]
    assert (refund["name"], team["name"]) == ("refund", None)
    assert 0 <= refund["probability"] <= 1
    assert [c["value"] for c in team["probabilities"]] == ["billing", False]
    best = max(team["probabilities"], key=lambda c: c["probability"])
    assert team["choice"] == best["value"] and 0 < team["confidence"] <= best["probability"]
    assert [(lv["value"], lv["label"]) for lv in urgency["probabilities"]] == [(0, "Routine"), (1, "Urgent")]
    usage = out["usage"]
    assert usage["output_tokens"] == 3 and usage["output_tokens_details"] == {"reasoning_tokens": 0}
    assert usage["total_tokens"] == usage["input_tokens"] + 3
    assert usage["input_tokens_details"]["cached_tokens"] > 0  # later questions restored the state


@pytest.mark.parametrize(
    "body",
    [
        {"model": "m", "input": "x", "questions": [{"type": "predicate", "instructions": "q"}], "extra": 1},
        {"model": "m", "input": "x", "questions": []},
        {"model": "m", "input": "x", "questions": [{"type": "predicate", "name": None, "instructions": "q"}]},
        {
            "model": "m",
            "input": "x",
            "questions": [{"type": "choice", "instructions": "q", "choices": [{"value": "a"}]}],
        },
        {
            "model": "m",
            "input": "x",
            "questions": [{"type": "choice", "instructions": "q", "choices": [{"value": "a"}, {"value": "a"}]}],
        },
        {"model": "m", "input": "x", "questions": [{"type": "score", "instructions": "q", "levels": [{"label": "a"}]}]},
        {
            "model": "m",
            "input": [{"role": "system", "content": "x"}],
            "questions": [{"type": "predicate", "instructions": "q"}],
        },
        {
            "model": "m",
            "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}],
            "questions": [{"type": "predicate", "instructions": "q"}],
        },
        {"model": "m", "input": "x", "questions": [{"type": "predicate"}]},
        {
            "model": "m",
            "input": "x",
            "safety_identifier": "x" * 129,
            "questions": [{"type": "predicate", "instructions": "q"}],
        },
    ],
)
def test_decisions_validation_errors(http, body):
    response = http.post("/v1/decisions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"

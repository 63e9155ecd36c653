"""The tiny core served by its torch step program (`helios serve --engine torch`, CPU torch): every
protocol path answers what the ONNX-served core answers, token for token, with the same logprobs
(within fp32 rounding); prefix checkpoints and the host store's tiers work on the torch runner's
pool. (The scheduler regressions, speculation included, run on it in test_scheduler.py.)"""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest

from helios.engine.api import CheckpointCandidate, CheckpointRole, GenerationRequest, SamplingParams
from helios.engine.assembly import RunnerChoice, choose_runner
from helios.engine.engine import Engine
from helios.engine.host_store import HostStoreConfig
from helios.engine.prefix_cache import PrefixCacheConfig
from helios.engine.torch_runner import TorchRunner
from helios.manifest import Manifest
from tests.unit.live import sse

GREEDY = {"temperature": 0, "top_k": 1, "seed": 3}
CHAT = {
    "model": "local",
    "messages": [{"role": "user", "content": "Write a haiku about paged attention."}],
    "max_tokens": 12,
    "logprobs": True,
    "top_logprobs": 3,
    **GREEDY,
}
COMPLETION = {"model": "local", "prompt": "def fibonacci(n):", "max_tokens": 10, "logprobs": 2, "echo": True, **GREEDY}


def post(server, path: str, body: dict) -> httpx.Response:
    response = httpx.post(server.url + path, json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response


def chat_tokens(body: dict) -> list[tuple[str, float]]:
    return [(e["token"], e["logprob"]) for e in body["choices"][0]["logprobs"]["content"]]


def assert_same(got: list[tuple[str, float]], want: list[tuple[str, float]]) -> None:
    assert [t for t, _ in got] == [t for t, _ in want]
    np.testing.assert_allclose([lp for _, lp in got], [lp for _, lp in want], atol=1e-3)


def test_startup_line_names_the_engine(tiny_torch_server):
    assert "engine: torch step program (float32" in tiny_torch_server.output()
    assert "on cpu" in tiny_torch_server.output()


def test_chat_and_completions_equal_the_onnx_engine(tiny_server, tiny_torch_server):
    want, got = (
        post(tiny_server, "/v1/chat/completions", CHAT).json(),
        post(tiny_torch_server, "/v1/chat/completions", CHAT).json(),
    )
    assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
    assert_same(chat_tokens(got), chat_tokens(want))
    top = [[a["logprob"] for a in e["top_logprobs"]] for e in got["choices"][0]["logprobs"]["content"]]
    top_want = [[a["logprob"] for a in e["top_logprobs"]] for e in want["choices"][0]["logprobs"]["content"]]
    np.testing.assert_allclose(top, top_want, atol=1e-3)
    # Completions with echo: prompt scores (the score graph over the torch program's hidden states).
    want, got = (
        post(tiny_server, "/v1/completions", COMPLETION).json(),
        post(tiny_torch_server, "/v1/completions", COMPLETION).json(),
    )
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    lp, lp_want = got["choices"][0]["logprobs"], want["choices"][0]["logprobs"]
    assert lp["tokens"] == lp_want["tokens"]
    np.testing.assert_allclose(
        [x if x is not None else 0.0 for x in lp["token_logprobs"]],
        [x if x is not None else 0.0 for x in lp_want["token_logprobs"]],
        atol=1e-3,
    )


def test_streams_equal_the_onnx_engine(tiny_server, tiny_torch_server):
    body = {**CHAT, "stream": True}
    texts = []
    for server in (tiny_server, tiny_torch_server):
        frames = sse(post(server, "/v1/chat/completions", body).text)
        texts.append(
            "".join(f["choices"][0]["delta"].get("content") or "" for _, f in frames if f != "[DONE]" and f["choices"])
        )
    assert texts[0] == texts[1] and texts[0]
    messages = {
        "model": "local",
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "Name a prime."}],
        **GREEDY,
        "stream": True,
    }
    streamed = []
    for server in (tiny_server, tiny_torch_server):
        response = httpx.post(
            server.url + "/v1/messages", json=messages, timeout=120, headers={"anthropic-version": "2023-06-01"}
        )
        assert response.status_code == 200
        streamed.append(
            "".join(f["delta"].get("text", "") for name, f in sse(response.text) if name == "content_block_delta")
        )
    assert streamed[0] == streamed[1]


def test_prefix_checkpoint_is_reused(tiny_torch_server):
    before = reused_tokens(tiny_torch_server)
    body = {**CHAT, "messages": [{"role": "system", "content": "You are terse. " * 30}, *CHAT["messages"]]}
    first = post(tiny_torch_server, "/v1/chat/completions", body).json()
    second = post(tiny_torch_server, "/v1/chat/completions", body).json()
    # The same tokens; logprobs within float noise, not bit for bit: torch's CPU matmuls block by
    # row count, so a restored prompt's shorter prefill sums in another order (AVX-512 hosts).
    assert_same(chat_tokens(second), chat_tokens(first))
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert reused_tokens(tiny_torch_server) > before


def reused_tokens(server) -> int:
    return httpx.get(server.url + "/metrics", params={"format": "json"}, timeout=30).json()["reused_tokens"]


def test_host_store_tiers_on_the_torch_runner(tiny_core, tmp_path: Path):
    manifest = Manifest.load(tiny_core, verify_files=False)
    ids = np.random.default_rng(5).integers(100, 5000, 100).tolist()

    def engine() -> Engine:
        return Engine(
            tiny_core,
            manifest,
            kv_pages=128,
            threads=1,
            prefix_cache=PrefixCacheConfig(),
            host_store=HostStoreConfig(dram_bytes=1 << 30, directory=tmp_path, restore="always"),
            choice=RunnerChoice("torch", "cpu"),
        )

    def run(engine: Engine, name: str) -> tuple[list[int], int]:
        request = GenerationRequest(
            name,
            list(ids),
            SamplingParams(max_tokens=8, ignore_eos=True, top_k=1),
            checkpoints=[CheckpointCandidate(len(ids), CheckpointRole.ENDPOINT)],
        )
        events = engine.generate(request)
        assert events[-1].finished and events[-1].error is None, events[-1].error
        return [t for e in events for t in e.token_ids], events[-1].cached_tokens

    first = engine()
    assert isinstance(first.runner, TorchRunner)
    expected, cached = run(first, "cold")
    first.prefix_cache.clear()
    assert run(first, "dram") == (expected, len(ids) - 1)
    first.shutdown()
    restarted = engine()
    assert run(restarted, "disk") == (expected, len(ids) - 1)
    assert restarted.stats().host_store.hits == 1
    restarted.shutdown()


def test_device_and_engine_choice(tiny_core):
    manifest = Manifest.load(tiny_core, verify_files=False)
    assert choose_runner(manifest, "cpu", "auto") == RunnerChoice("onnx", "cpu", "auto")  # the core's kv_dtype
    assert choose_runner(manifest, "cpu", "auto", "bf16") == RunnerChoice("onnx", "cpu", "bfloat16")
    assert choose_runner(manifest, "cpu", "torch") == RunnerChoice("torch", "cpu", "float32")  # the program's
    with pytest.raises(ValueError, match="weights' dtype"):
        choose_runner(manifest, "cpu", "torch", "fp16")
    with pytest.raises(ValueError, match="unknown KV pool dtype"):
        choose_runner(manifest, "cpu", "auto", "int8")
    with pytest.raises(ValueError, match="CPU only"):
        choose_runner(manifest, "cuda", "onnx")
    with pytest.raises(ValueError, match="no CUDA device"):
        choose_runner(manifest, "cuda", "auto")  # no GPU on this machine
    without = Manifest.from_dict(
        {**manifest_dict(manifest), "engines": [e for e in manifest_dict(manifest)["engines"] if e["target"] == "cpu"]}
    )
    with pytest.raises(ValueError, match="--target cpu,cuda"):
        choose_runner(without, "auto", "torch")
    assert choose_runner(without, "auto", "auto") == RunnerChoice("onnx", "cpu", "auto")


def manifest_dict(manifest: Manifest) -> dict:
    import dataclasses

    return dataclasses.asdict(manifest)

"""Host prefix store on the real tiny core: checkpoints outlive the pool (DRAM tier) and the
process (disk tier), restore with identical output, and a record that fails any check is
recomputed, never served."""

from __future__ import annotations

import dataclasses
import errno
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np

from helios.engine import host_store as host_store_module
from helios.engine.api import CheckpointCandidate, CheckpointRole, GenerationRequest, SamplingParams
from helios.engine.engine import Engine
from helios.engine.host_store import HostStoreConfig
from helios.engine.prefix_cache import PrefixCacheConfig
from helios.launcher import HeliosProcess
from helios.manifest import Manifest

LENGTH = 100


def make_engine(core: Path, folder: Path | None, dram_bytes: int = 1 << 30, manifest: Manifest | None = None) -> Engine:
    manifest = manifest or Manifest.load(core, verify_files=False)
    return Engine(
        core,
        manifest,
        kv_pages=128,
        threads=1,
        prefix_cache=PrefixCacheConfig(),
        host_store=HostStoreConfig(dram_bytes=dram_bytes, directory=folder, restore="always"),
    )


def run(engine: Engine, ids: list[int], name: str) -> tuple[list[int], int]:
    request = GenerationRequest(
        name,
        list(ids),
        SamplingParams(max_tokens=8, ignore_eos=True, top_k=1),
        checkpoints=[CheckpointCandidate(len(ids), CheckpointRole.ENDPOINT)],
    )
    events = engine.generate(request)
    assert events[-1].finished and events[-1].error is None, events[-1].error
    return [t for e in events for t in e.token_ids], events[-1].cached_tokens


def prompt() -> list[int]:
    return np.random.default_rng(5).integers(100, 5000, LENGTH).tolist()


def test_dram_tier_outlives_the_pool_and_disk_tier_the_process(tiny_core, tmp_path):
    ids = prompt()
    first = make_engine(tiny_core, tmp_path)
    expected, cached = run(first, ids, "cold")
    assert cached == 0
    first.prefix_cache.clear()  # the pool forgets; the host store does not
    again, cached = run(first, ids, "dram")
    assert again == expected and cached == LENGTH - 1
    stats = first.stats().host_store
    assert stats.hits == 1 and stats.reused_tokens == LENGTH - 1 and stats.memory_records == 1
    assert stats.bytes_out > 0 and stats.bytes_in > 0
    first.shutdown()  # pending disk writes finish
    assert first.stats().host_store.disk_records == 1 and first.stats().host_store.held["nvme"] == 1

    restarted = make_engine(tiny_core, tmp_path)
    out, cached = run(restarted, ids, "disk")
    assert out == expected and cached == LENGTH - 1
    assert restarted.stats().host_store.hits == 1
    restarted.shutdown()


def test_corrupt_truncated_and_foreign_records_are_recomputed(tiny_core, tmp_path):
    ids = prompt()
    writer = make_engine(tiny_core, tmp_path)
    expected, _ = run(writer, ids, "write")
    writer.shutdown()
    (record,) = tmp_path.rglob("*.rec")
    data = bytearray(record.read_bytes())
    data[-5] ^= 0xFF  # a bit flip in the K/V payload
    record.write_bytes(bytes(data))
    reader = make_engine(tiny_core, tmp_path, dram_bytes=0)
    out, cached = run(reader, ids, "flipped")
    assert out == expected and cached == 0
    assert reader.stats().host_store.dropped[("nvme", "io_error")] == 1
    reader.shutdown()  # its recompute captured the prefix again: a sound record replaced the bad one
    healed = make_engine(tiny_core, tmp_path, dram_bytes=0)
    assert run(healed, ids, "healed") == (expected, LENGTH - 1)
    healed.shutdown()

    (record,) = tmp_path.rglob("*.rec")
    record.write_bytes(record.read_bytes()[: record.stat().st_size // 2])  # a torn write
    reader = make_engine(tiny_core, tmp_path, dram_bytes=0)
    out, cached = run(reader, ids, "torn")
    assert out == expected and cached == 0 and reader.stats().host_store.dropped[("nvme", "io_error")] == 1
    reader.shutdown()

    manifest = Manifest.load(tiny_core, verify_files=False)
    other = dataclasses.replace(manifest, digest="0" * 64)  # another core: its records never apply
    foreign = make_engine(tiny_core, tmp_path, dram_bytes=0, manifest=other)
    assert foreign.stats().host_store.disk_records == 0  # its own folder under the same directory
    out, cached = run(foreign, ids, "foreign")
    assert cached == 0
    foreign.shutdown()


def test_unwritable_directory_degrades_to_memory(tiny_core, tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    engine = make_engine(tiny_core, blocked)
    ids = prompt()
    expected, _ = run(engine, ids, "cold")
    engine.prefix_cache.clear()
    out, cached = run(engine, ids, "warm")
    assert out == expected and cached == LENGTH - 1 and engine.stats().host_store.disk_records == 0
    engine.shutdown()


def test_a_full_disk_degrades_to_memory_without_failing_a_request(tiny_core, tmp_path, monkeypatch):
    """Every record write fails with ENOSPC: requests succeed, records stay in DRAM (restored from
    there after the pool forgets), and the failures are counted, never raised."""

    def full(*_args, **_kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(host_store_module, "write_record", full)
    engine = make_engine(tiny_core, tmp_path)
    ids = prompt()
    expected, _ = run(engine, ids, "cold")
    engine.prefix_cache.clear()
    out, cached = run(engine, ids, "warm")
    assert out == expected and cached == LENGTH - 1
    engine.shutdown()
    stats = engine.stats().host_store
    assert stats.dropped[("nvme", "io_error")] >= 1 and stats.disk_records == 0 and stats.memory_records >= 1
    assert not list(tmp_path.rglob("*.rec")) and not list(tmp_path.rglob("*.tmp"))


def test_a_turn_extends_the_chain_and_output_matches_an_engine_without_a_host_store(tiny_core, tmp_path):
    """Turns are chain links (the second turn stores only its own pages); a third turn restores
    both links from disk in a restarted engine, with the output of an engine that has no store."""
    rng = np.random.default_rng(8)
    turn1 = prompt()
    turn2 = turn1 + rng.integers(100, 5000, 37).tolist()
    turn3 = turn2 + rng.integers(100, 5000, 20).tolist()
    plain = Engine(
        tiny_core,
        Manifest.load(tiny_core, verify_files=False),
        kv_pages=128,
        threads=1,
        prefix_cache=PrefixCacheConfig(enabled=False),
    )
    expected = run(plain, turn3, "plain")[0]
    plain.shutdown()
    writer = make_engine(tiny_core, tmp_path)
    run(writer, turn1, "turn1")
    run(writer, turn2, "turn2")
    writer.shutdown()
    sizes = sorted(p.stat().st_size for p in tmp_path.rglob("*.rec"))
    assert len(sizes) == 2 and sizes[0] < sizes[1] / 2  # the second link: 37 tokens of 137
    reader = make_engine(tiny_core, tmp_path, dram_bytes=0)
    out, cached = run(reader, turn3, "turn3")
    assert out == expected and cached == len(turn2)
    stats = reader.stats().host_store
    assert stats.hits == 1 and stats.reused_tokens == len(turn2)
    reader.shutdown()


def test_a_prompt_evicted_from_a_full_pool_comes_back_from_dram(tiny_core):
    """Eviction order: other prompts push the first one's checkpoint out of the pool (LRU); its
    restore then evicts their checkpoints in turn to make room for the chain beside the request."""
    manifest = Manifest.load(tiny_core, verify_files=False)
    engine = Engine(
        tiny_core,
        manifest,
        kv_pages=40,
        threads=1,
        prefix_cache=PrefixCacheConfig(storage_fraction=0.9),
        host_store=HostStoreConfig(dram_bytes=1 << 30, restore="always"),
    )
    rng = np.random.default_rng(21)
    main = rng.integers(100, 5000, 200).tolist()  # 13 pages
    expected, _ = run(engine, main, "main")
    for index in range(3):  # 10 pages each: the third one evicts `main` from the 36-page budget
        run(engine, rng.integers(100, 5000, 150).tolist(), f"other{index}")
    assert 200 not in [c.length for c in engine.prefix_cache.checkpoints()]
    assert engine.block_manager.num_free < 15  # the chain (13) + the request's own page (2) need more
    out, cached = run(engine, main, "again")
    assert out == expected and cached == 199
    stats = engine.stats()
    assert stats.host_store.hits == 1 and stats.checkpoint_evictions_total >= 2
    engine.shutdown()


def _usage_cached(protocol: str, body: dict) -> int:
    usage = body["usage"]
    if protocol == "messages":
        return usage["cache_read_input_tokens"]
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details")
    return details["cached_tokens"]


def _prompt_tokens(protocol: str, body: dict) -> int:
    usage = body["usage"]
    if protocol == "messages":
        return usage["input_tokens"] + usage["cache_read_input_tokens"] + usage["cache_creation_input_tokens"]
    return usage.get("prompt_tokens", usage.get("input_tokens"))


def _output(protocol: str, body: dict) -> object:
    return {
        "chat": lambda: body["choices"][0]["message"],
        "completions": lambda: body["choices"][0]["text"],
        "messages": lambda: body["content"],
        "responses": lambda: body["output"][-1]["content"],
    }[protocol]()


def test_a_restarted_server_reuses_the_disk_tier_on_every_protocol(tiny_core, tmp_path):
    """`helios serve --host-store DIR`: after a restart every protocol's prompt comes back from
    disk, its usage reports exactly the restored tokens, the output is the cold one, and
    concurrent requests for one record all restore it."""
    system = "You are a careful assistant. " * 40
    anthropic = {"anthropic-version": "2023-06-01"}
    requests = {
        "chat": (
            "/v1/chat/completions",
            {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "Say hi."}]},
        ),
        "completions": ("/v1/completions", {"prompt": system + "Once upon a time"}),
        "messages": ("/v1/messages", {"system": system, "messages": [{"role": "user", "content": "Say hello."}]}),
        "responses": ("/v1/responses", {"instructions": system, "input": "Say hey."}),
    }
    # Seeded sampling, not greedy: the random tiny model's near-tied logits make greedy picks hang
    # on float rounding (page order, threads); the engine-level test above proves greedy identity.
    common = {"max_tokens": 6, "seed": 3}
    folder = tmp_path / "records"
    config = tmp_path / "helios.toml"  # restore even where the tiny model's prefill is cheaper
    config.write_text(f'[server]\nhost_store_dir = "{folder}"\nhost_store_restore = "always"\n')

    def send(url: str, protocol: str) -> dict:
        path, body = requests[protocol]
        body = {**body, **({"max_output_tokens": 16, "seed": 3} if protocol == "responses" else common)}
        response = httpx.post(url + path, json=body, headers=anthropic, timeout=120)
        assert response.status_code == 200, response.text
        return response.json()

    first = HeliosProcess(tiny_core, "--config", str(config))
    try:
        cold = {protocol: send(first.url, protocol) for protocol in requests}
    finally:
        first.stop()  # SIGTERM: the engine shuts down and its disk writes finish
    assert cold["chat"]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    second = HeliosProcess(tiny_core, "--config", str(config))
    try:
        for protocol in requests:
            warm = send(second.url, protocol)
            assert _output(protocol, warm) == _output(protocol, cold[protocol]), protocol
            assert _prompt_tokens(protocol, warm) == _prompt_tokens(protocol, cold[protocol])
            assert _usage_cached(protocol, warm) == _prompt_tokens(protocol, warm) - 1, protocol
        metrics = httpx.get(second.url + "/metrics", params={"format": "json"}, timeout=30).json()
        assert metrics["host_hits"] >= 4 and metrics["host_reused_tokens"] > 0 and metrics["host_bytes_in"] > 0
        text = httpx.get(second.url + "/metrics", timeout=30).text
        assert 'flare_host_cache_held_total{tier="nvme"}' in text
        assert "flare_host_cache_missing_tokens_count 0.0" not in text
        assert "flare_host_cache_estimated_transfer_ns_count 0.0" not in text
    finally:
        second.stop()
    third = HeliosProcess(tiny_core, "--config", str(config))
    try:
        with ThreadPoolExecutor(4) as pool:  # four requests racing for one record
            raced = list(pool.map(lambda _: send(third.url, "chat"), range(4)))
        for body in raced:
            assert _output("chat", body) == _output("chat", cold["chat"])
            assert _usage_cached("chat", body) == _prompt_tokens("chat", body) - 1
        metrics = httpx.get(third.url + "/metrics", params={"format": "json"}, timeout=30).json()
        assert metrics["host_hits"] == 1  # the first admission restored it; the others reused the pool
    finally:
        third.stop()

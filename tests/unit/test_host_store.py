"""Host prefix store on the real tiny core: checkpoints outlive the pool (DRAM tier) and the
process (disk tier), restore with identical output, and a record that fails any check is
recomputed, never served."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import httpx
import numpy as np

from helios.engine.api import CheckpointCandidate, CheckpointRole, GenerationRequest, SamplingParams
from helios.engine.engine import Engine
from helios.engine.host_store import HostStoreConfig
from helios.engine.prefix_cache import PrefixCacheConfig
from helios.manifest import Manifest
from tests.conftest import Server

LENGTH = 100


def make_engine(core: Path, folder: Path | None, dram_bytes: int = 1 << 30, manifest: Manifest | None = None) -> Engine:
    manifest = manifest or Manifest.load(core, verify_files=False)
    return Engine(core, manifest, kv_pages=128, threads=1, prefix_cache=PrefixCacheConfig(),
                  host_store=HostStoreConfig(dram_bytes=dram_bytes, directory=folder))


def run(engine: Engine, ids: list[int], name: str) -> tuple[list[int], int]:
    request = GenerationRequest(name, list(ids), SamplingParams(max_tokens=8, ignore_eos=True, top_k=1),
                                checkpoints=[CheckpointCandidate(len(ids), CheckpointRole.ENDPOINT)])
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


def test_a_restarted_server_reuses_the_disk_tier_on_every_protocol(tiny_core, tmp_path):
    """`helios serve --host-store DIR`: after a restart the conversation's prefix comes back from
    disk (usage reports it as cached, as pool hits are), with the same seeded output."""
    system = "You are a careful assistant. " * 40
    chat = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "Say hi."}],
            "max_tokens": 6, "seed": 3, "ignore_eos": True}
    first = Server(tiny_core, "--host-store", str(tmp_path))
    try:
        cold = httpx.post(first.url + "/v1/chat/completions", json=chat, timeout=120).json()
        assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    finally:
        first.stop()  # SIGTERM: the engine shuts down and its disk writes finish
    second = Server(tiny_core, "--host-store", str(tmp_path))
    try:
        warm = httpx.post(second.url + "/v1/chat/completions", json=chat, timeout=120).json()
        assert warm["choices"][0]["message"] == cold["choices"][0]["message"]
        assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] >= cold["usage"]["prompt_tokens"] - 1
        messages = httpx.post(second.url + "/v1/messages", headers={"anthropic-version": "2023-06-01"}, timeout=120,
                              json={"system": system, "messages": [{"role": "user", "content": "Say hello."}],
                                    "max_tokens": 2})
        assert messages.json()["usage"]["cache_read_input_tokens"] > 0  # the shared system prefix
        text = httpx.get(second.url + "/metrics", timeout=30).text
        assert "flare_host_cache_hits_total 1.0" in text or "flare_host_cache_hits_total 2.0" in text
        assert 'flare_host_cache_held_total{tier="nvme"}' in text
    finally:
        second.stop()

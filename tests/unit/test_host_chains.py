"""Host store chains, eviction order, concurrent writers and disk failures, on synthetic pages
(helios.engine.host_store; the engine-level tests are in test_host_store.py)."""

from __future__ import annotations

import errno
import threading
from pathlib import Path

import numpy as np
import pytest
from ml_dtypes import bfloat16

from helios.engine import host_store as host_store_module
from helios.engine.host_records import read_link
from helios.engine.host_store import HostStore, HostStoreConfig
from helios.transport.config import ConfigError, ServerConfig

PT = 4  # page tokens
PAGE_SHAPE = (2, 2, 1, PT, 1, 8)  # layers, K/V, one page, page tokens, kv heads, head dim
PAGE_BYTES = int(np.prod(PAGE_SHAPE)) * 4


class Pool:
    """A fake KV pool: page p of a prefix holds that prefix's ids (so a restore can be checked)."""

    def __init__(self, ids: list[int]):
        self.ids = ids

    def read(self, first_page: int) -> np.ndarray:
        pages = -(-len(self.ids) // PT)
        out = np.zeros((2, 2, pages - first_page, PT, 1, 8), np.float32)
        for p in range(first_page, pages):
            chunk = self.ids[p * PT : (p + 1) * PT]
            out[:, :, p - first_page, : len(chunk)] = np.asarray(chunk, np.float32)[:, None, None]
        return out


def store(folder: Path | None = None, dram_pages: int = 1000, disk_pages: int = 1000) -> HostStore:
    record = PAGE_BYTES + 64  # a one-page record with its ids, roughly
    config = HostStoreConfig(dram_bytes=dram_pages * record, directory=folder, disk_bytes=disk_pages * (record + 400))
    return HostStore("core-identity-" + "0" * 50, config, PT, PAGE_BYTES)


def offer(host: HostStore, ids: list[int]) -> None:
    host.offer(np.asarray(ids), Pool(ids).read)


def restored(host: HostStore, prompt: list[int]) -> list[int] | None:
    """The ids a restore of the longest chain writes into pages (None: no chain)."""
    chain = host.find(prompt, len(prompt))
    if chain is None:
        return None
    records = host.load(chain, prompt)
    assert records is not None
    pages = np.zeros((-(-chain.length // PT), PT), np.float32)
    for record in records:
        first = record.link.first_page
        pages[first : first + record.kv.shape[2]] = record.kv[0, 0, :, :, 0, 0]
    assert np.concatenate([r.ids for r in records]).tolist() == prompt[: chain.length]
    return pages.reshape(-1)[: chain.length].astype(int).tolist()


def test_turns_become_links_of_one_chain_and_restore_whole():
    host = store()
    turn1 = list(range(10, 20))  # 10 tokens: pages 0-2, the last one partial
    turn2 = turn1 + list(range(50, 57))  # 17 tokens
    offer(host, turn1)
    offer(host, turn2)
    chain = host.find(turn2 + [99], 18)
    assert [(link.start, link.length, link.first_page) for link in chain.links] == [(0, 10, 0), (10, 17, 2)]
    # The second link carries pages 2-4 only (page 2 again, completed), not the whole prefix.
    assert chain.links[1].nbytes < chain.links[0].nbytes + PAGE_BYTES
    assert restored(host, turn2 + [99]) == turn2
    assert restored(host, turn1 + [7, 7]) == turn1  # the root alone serves another continuation
    offer(host, turn1)  # a duplicate offer is skipped, not stored twice
    assert host.store_skipped == 1 and host.stats().memory_records == 2


def test_lru_eviction_takes_chain_ends_and_keeps_chains_whole():
    host = store(dram_pages=5)  # room for five one-page records: the six pages below overflow it
    a1, b1 = [1] * 8, [2] * 8
    a2, a3 = a1 + [3] * 4, a1 + [3] * 4 + [4] * 4
    for ids in (a1, a2, a3, b1):
        offer(host, ids)
    # a3 is the least recently used chain end (a1 was touched after it as its root): it goes first.
    assert host.stats().memory_records == 3 and host.dropped[("dram", "end_of_chain")] == 1
    assert host.find(a3 + [0], 13).length == 12
    offer(host, [5] * 4)  # one more page: the next chain end (a2) goes, its root stays
    assert host.find(a3 + [0], 13).length == 8 and host.find(b1 + [0], 9) is not None
    assert host.dropped[("dram", "end_of_chain")] == 2
    assert [host.find(ids + [0], 99).length for ids in (a1, b1, [5] * 4)] == [8, 8, 4]
    # Eviction took whole chain ends: no link left whose parent is gone.
    assert all(link.parent is None or link.parent in host._links for link in host._links.values())


def test_a_lost_link_drops_its_descendants(tmp_path):
    host = store(tmp_path)
    root, leaf = [1] * 8, [1] * 8 + [2] * 8
    offer(host, root)
    offer(host, leaf)
    host.close()
    (root_file,) = [p for p in tmp_path.rglob("*.rec") if p.name.startswith("8-")]
    data = bytearray(root_file.read_bytes())
    data[-1] ^= 0x40
    root_file.write_bytes(bytes(data))
    reader = store(tmp_path, dram_pages=0)
    assert reader.stats().disk_records == 2
    chain = reader.find(leaf + [0], 17)
    assert chain is not None and reader.load(chain, leaf + [0]) is None  # never served
    assert reader.dropped[("nvme", "io_error")] == 1 and reader.dropped[("nvme", "end_of_chain")] == 1
    assert reader.stats().disk_records == 0 and not list(tmp_path.rglob("*.rec"))


def test_orphans_on_disk_are_dropped_at_start(tmp_path):
    host = store(tmp_path)
    offer(host, [1] * 8)
    offer(host, [1] * 16)
    host.close()
    (root_file,) = [p for p in tmp_path.rglob("*.rec") if p.name.startswith("8-")]
    root_file.unlink()  # another process evicted the root
    reader = store(tmp_path)
    assert reader.stats().disk_records == 0 and reader.dropped[("nvme", "end_of_chain")] == 1


def test_concurrent_writers_of_one_record_never_expose_a_partial_file(tmp_path):
    """Several stores (as several processes would) write the same records into one directory
    while a reader keeps opening them: every read passes every check."""
    prompts = [[i] * 8 + [j] * 8 for i in range(3) for j in range(3)]
    stop = threading.Event()
    failures: list[str] = []

    def read_all() -> None:
        while not stop.is_set():
            for path in tmp_path.rglob("*.rec"):
                try:
                    read_link(path, "core-identity-" + "0" * 50, "float32")
                except FileNotFoundError:
                    pass
                except Exception as exc:
                    failures.append(f"{path.name}: {exc}")

    reader = threading.Thread(target=read_all)
    reader.start()
    writers = [store(tmp_path) for _ in range(3)]
    threads = [threading.Thread(target=lambda w=w: [offer(w, ids) for ids in prompts]) for w in writers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for writer in writers:
        writer.close()
    stop.set()
    reader.join()
    assert not failures
    assert not list(tmp_path.rglob("*.tmp"))
    fresh = store(tmp_path, dram_pages=0)
    for ids in prompts:
        assert restored(fresh, ids + [0]) == ids
    assert fresh.dropped[("nvme", "io_error")] == 0


def test_a_full_disk_keeps_records_in_memory(tmp_path, monkeypatch):
    def full(*_args, **_kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(host_store_module, "write_record", full)
    host = store(tmp_path)
    offer(host, [1] * 8)
    offer(host, [1] * 16)
    host.close()
    assert host.dropped[("nvme", "io_error")] == 2 and host.stats().disk_records == 0
    assert host.stats().parked_records == 0
    assert restored(host, [1] * 17) == [1] * 16  # from DRAM


def test_restores_are_priced_against_prefill():
    host = store()
    ids = list(range(40))
    offer(host, ids)
    chain = host.find(ids + [1], 41)
    host.prefill_ns_per_token = 1e-3  # prefill predicted nearly free: recompute instead
    assert not host.worth_restoring(chain, 0, 41) and host.restores_declined == 1
    host.prefill_ns_per_token = 1e6
    assert host.worth_restoring(chain, 0, 41)
    assert not host.worth_restoring(chain, 40, 41)  # the pool already holds as much
    assert not host.worth_restoring(None, 0, 41)
    stats = host.stats().histograms
    assert stats["missing_tokens"][0][-1] == ("+Inf", 4) and stats["estimated_transfer_ns"][0][-1][1] == 2
    assert stats["estimated_prefill_ns"][1] >= 40 * 1e6


def test_a_record_larger_than_a_tier_is_not_kept_there(tmp_path):
    host = store(tmp_path, dram_pages=1, disk_pages=100)
    offer(host, [1] * 16)  # four pages: beyond DRAM, within disk
    host.close()
    assert host.dropped[("dram", "oversize")] == 1 and host.stats().memory_records == 0
    assert host.stats().disk_records == 1 and restored(host, [1] * 17) == [1] * 16


@pytest.mark.parametrize("field", ["identity", "inputs", "dtype"])
def test_foreign_or_unknown_records_are_refused(tmp_path, field):
    host = store(tmp_path)
    offer(host, [3] * 8)
    host.close()
    (path,) = tmp_path.rglob("*.rec")
    header, _, payload = path.read_bytes().partition(b"\n")
    needle, replacement = {
        "identity": (b'"identity": "core-identity-' + b"0" * 50 + b'"', b'"identity": "another-core"'),
        "inputs": (b'"inputs": []', b'"inputs": [{"image": 1}]'),
        "dtype": (b'"dtype": "float32"', b'"dtype": "bfloat16"'),  # never read as another type
    }[field]
    path.write_bytes(header.replace(needle, replacement) + b"\n" + payload)
    reader = store(tmp_path)
    assert reader.stats().disk_records == 0 and reader.dropped[("nvme", "io_error")] == 1


def test_a_16bit_pool_keeps_16bit_records_that_a_float32_reader_refuses(tmp_path):
    """A bfloat16 pool's pages go to DRAM and disk as bfloat16 (half a float32 record's payload) and
    come back equal; a reader expecting float32 refuses the file instead of misreading it."""
    bf16 = np.dtype(bfloat16)
    config = HostStoreConfig(dram_bytes=0, directory=tmp_path, disk_bytes=1 << 20)
    ids = list(range(1, 13))
    writer = HostStore("core-identity-" + "0" * 50, config, PT, PAGE_BYTES // 2, "bfloat16")
    writer.offer(np.asarray(ids), lambda first: Pool(ids).read(first).astype(bf16))
    writer.close()
    (path,) = tmp_path.rglob("*.rec")
    assert path.stat().st_size < PAGE_BYTES * 3 // 2 + 1000  # three bf16 pages, not three float32 ones
    reader = HostStore("core-identity-" + "0" * 50, config, PT, PAGE_BYTES // 2, "bfloat16")
    chain = reader.find(ids + [0], 13)
    [record] = reader.load(chain, ids + [0])
    assert record.kv.dtype == bf16 and np.array_equal(record.kv.astype(np.float32), Pool(ids).read(0))
    refusing = HostStore("core-identity-" + "0" * 50, config, PT, PAGE_BYTES, "float32")
    assert refusing.stats().disk_records == 0 and refusing.dropped[("nvme", "io_error")] == 1


def test_config_file_keys(tmp_path):
    path = tmp_path / "helios.toml"
    path.write_text(
        f'[server]\nhost_store_dir = "{tmp_path}"\nhost_store_dram_gb = 0.5\nhost_store_disk_gb = 2\n'
        'host_store_restore = "always"\n'
    )
    config = ServerConfig.load(path).host_store_config()
    assert (config.directory, config.dram_bytes, config.disk_bytes, config.restore) == (
        tmp_path,
        1 << 29,
        2 << 30,
        "always",
    )
    for bad in (
        'host_store_restore = "sometimes"',
        "host_store_dram_gb = -1",
        'host_store_disk_gb = "x"',
        "host_store_dir = 3",
    ):
        path.write_text(f"[server]\n{bad}\n")
        with pytest.raises(ConfigError):
            ServerConfig.load(path)


def test_a_prefix_rewritten_by_another_process_under_another_chain_is_reindexed(tmp_path):
    """Two processes sharing a directory link the same prefix differently (one had the parent,
    the other did not): the last rename wins, and the loser re-reads it instead of calling it
    corrupt."""
    root, leaf = [1] * 8, [1] * 8 + [2] * 8
    ours = store(tmp_path, dram_pages=0)  # reads go to disk
    offer(ours, root)
    offer(ours, leaf)
    ours.close()
    (tmp_path / "elsewhere").mkdir()
    other = store(tmp_path / "elsewhere")  # never saw the root: links the leaf as a chain root
    offer(other, leaf)
    other.close()
    (theirs,) = (tmp_path / "elsewhere").rglob("16-*.rec")
    (shared,) = tmp_path.glob("*/16-*.rec")
    theirs.replace(shared)  # its rename lands last in the shared folder
    chain = ours.find(leaf + [0], 17)
    assert [link.start for link in chain.links] == [0, 8]  # what `ours` indexed
    assert ours.load(chain, leaf + [0]) is None  # not served this time...
    assert ours.dropped[("nvme", "io_error")] == 0 and shared.exists()  # ...nor taken for corruption
    assert restored(ours, leaf + [0]) == leaf  # the next lookup indexed the file as it is
    assert [link.start for link in ours.find(leaf + [0], 17).links] == [0]


def test_malformed_chain_fields_are_dropped(tmp_path):
    host = store(tmp_path)
    offer(host, [4] * 8)
    host.close()
    (path,) = tmp_path.rglob("*.rec")
    header, _, payload = path.read_bytes().partition(b"\n")
    key = path.stem.partition("-")[2]
    path.write_bytes(header.replace(b'"parent": null', f'"parent": "{key}"'.encode()) + b"\n" + payload)
    reader = store(tmp_path)  # a record that is its own parent would never end a walk
    assert reader.stats().disk_records == 0 and reader.dropped[("nvme", "io_error")] == 1

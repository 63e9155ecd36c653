"""A memory-read-bandwidth probe for scripts/bench.py: the machine figure its bandwidth bounds use.

python scripts/bandwidth.py [--threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np


def _cache_bytes() -> int:
    """The largest CPU cache (the last level) in bytes, from sysfs; 32 MiB when unreadable."""
    largest = 0
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            size = (index / "size").read_text().strip()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:].upper(), 1)
        try:
            largest = max(largest, int(size.rstrip("KMGkmg")) * scale)
        except ValueError:
            continue
    return largest or 32 << 20


def _available_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def read_bandwidth(threads: int, passes: int = 5, buffer_bytes: int | None = None) -> dict:
    """Aggregate memory read bandwidth in GB/s with `threads` readers (the runtimes' thread count).

    A buffer of at least 4x the last-level cache (>= 1 GiB, <= 4 GiB and a quarter of the free
    memory) is written once (untouched pages would all read the one shared zero page), split into
    one contiguous slice per thread, and every pass OR-reduces each slice as uint64 on its own
    pool thread (numpy releases the GIL inside the reduction); GB/s = buffer bytes / the pass's
    wall time, best of `passes` after one warm-up pass. numpy's loop is not a tuned streaming
    kernel, so this is a floor on what the memory system delivers, i.e. a bound computed from it
    is, if anything, too low."""
    size = buffer_bytes or min(max(1 << 30, 4 * _cache_bytes()), 4 << 30)
    available = _available_bytes()
    if available and not buffer_bytes:
        size = min(size, available // 4)
    size -= size % (8 * threads * 4096)
    buf = np.empty(size // 8, dtype=np.uint64)
    buf.fill(0x0101010101010101)
    slices = np.array_split(buf, threads)
    samples = []
    with ThreadPoolExecutor(max_workers=threads) as pool:
        list(pool.map(np.bitwise_or.reduce, slices))
        for _ in range(passes):
            start = time.perf_counter()
            list(pool.map(np.bitwise_or.reduce, slices))
            samples.append(size / (time.perf_counter() - start) / 1e9)
    del slices, buf
    return {
        "gbs": round(max(samples), 2),
        "threads": threads,
        "buffer_mb": size >> 20,
        "passes": passes,
        "samples": [round(x, 2) for x in samples],
        "method": "numpy uint64 OR-reduce, one slice per thread",
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    print(json.dumps(read_bandwidth(parser.parse_args().threads)))

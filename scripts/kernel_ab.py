"""What the kernel A/B scripts share (scripts/int4_stream.py, scripts/attention_speed.py): the
--threads/--library/--turns options, the kernel library builds they name, a session over a graph
with one build's operators, and the median time of a run."""

from __future__ import annotations

import argparse
import statistics
import time

import onnxruntime as ort

from helios import kernels
from helios.engine.runner import session_options


def add_options(parser: argparse.ArgumentParser, repeats: int) -> None:
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--library", nargs="+", help="kernel library builds to compare (default: helios')")
    parser.add_argument("--turns", type=int, default=2, help="alternations of the libraries")


def libraries(args: argparse.Namespace) -> list[str]:
    """The builds named by --library, else the one helios.kernels builds here."""
    if args.library:
        return args.library
    library, why = kernels.available()
    if library is None:
        raise SystemExit(f"flare's kernels cannot run here: {why}")
    return [str(library)]


def session(model: bytes, threads: int, library: str) -> ort.InferenceSession:
    """The serialized model under the step graph's own session settings, with `library`'s kernels."""
    options = session_options(threads)
    options.register_custom_ops_library(str(library))
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def median_ms(sess: ort.InferenceSession, feeds: dict, repeats: int, warmups: int = 1) -> float:
    """Median ms of one run over `repeats` runs after `warmups` runs."""
    for _ in range(warmups):
        sess.run(None, feeds)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        sess.run(None, feeds)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)

"""Open a core's ONNX graph with whatever runs its flare operators here."""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import onnx
import onnxruntime as ort

from helios.kernels import available
from helios.kernels.int4_layout import to_matmul_nbits, uses_int4_tiles

log = logging.getLogger(__name__)


def open_session(path: Path, options: ort.SessionOptions, providers: list[str]) -> tuple[ort.InferenceSession, str]:
    """(session, kernels) for the graph at `path`; `kernels` says what runs its int4 matmuls:
    "flare" (the ai.flare library), "onnxruntime" (rewritten to MatMulNBits because the library
    cannot run here: the reason is logged) or "" (the graph has none)."""
    header = onnx.load(str(path), load_external_data=False)
    if not uses_int4_tiles(header):
        return ort.InferenceSession(str(path), options, providers=providers), ""
    library, why = available()
    if library is not None and providers == ["CPUExecutionProvider"]:
        options.register_custom_ops_library(str(library))
        return ort.InferenceSession(str(path), options, providers=providers), "flare"
    why = why or f"providers {providers} are not the CPU's"
    log.warning("%s: running flare's int4 matmuls as onnxruntime MatMulNBits (%s)", path.name, why)
    model = onnx.load(str(path))
    to_matmul_nbits(model)
    with tempfile.TemporaryDirectory(prefix="flare-graph-") as tmp:
        rewritten = Path(tmp) / path.name
        onnx.save(model, str(rewritten), save_as_external_data=True, location=path.name + ".data")
        del model
        return ort.InferenceSession(str(rewritten), options, providers=providers), "onnxruntime"

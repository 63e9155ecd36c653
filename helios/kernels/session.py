"""Open a core's ONNX graph with whatever runs its flare operators here."""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

import onnx
import onnxruntime as ort

from helios.kernels import DOMAIN, available
from helios.kernels.attention import to_group_query_attention
from helios.kernels.int4_layout import to_matmul_nbits
from helios.kernels.moe import to_dense_experts

log = logging.getLogger(__name__)


def uses_flare_ops(model: onnx.ModelProto) -> bool:
    return any(node.domain == DOMAIN for node in model.graph.node)


def open_session(path: Path, options: ort.SessionOptions, providers: list[str]) -> tuple[ort.InferenceSession, str]:
    """(session, kernels) for the graph at `path`; `kernels` says what runs its ai.flare
    operators: "flare" (flare's kernel library), "onnxruntime" (rewritten to onnxruntime's
    MatMulNBits and GroupQueryAttention, and routed experts to dense Einsums, because the library
    cannot run here: the reason is logged) or "" (the graph has none)."""
    header = onnx.load(str(path), load_external_data=False)
    if not uses_flare_ops(header):
        return ort.InferenceSession(str(path), options, providers=providers), ""
    library, why = available()
    if library is not None and providers == ["CPUExecutionProvider"]:
        options.register_custom_ops_library(str(library))
        if os.environ.get("FLARE_EXPERTS", "").lower() == "dense" and any(
            n.op_type in ("MoE", "MoEInt4") and n.domain == DOMAIN for n in header.graph.node
        ):
            # A comparison switch (scripts/moe_tps.py): routed experts computed densely, as
            # ignition's graphs did before ai.flare.MoE.
            model = onnx.load(str(path))
            to_dense_experts(model)
            return _open_rewritten(model, path, options, providers), "flare"
        return ort.InferenceSession(str(path), options, providers=providers), "flare"
    why = why or f"providers {providers} are not the CPU's"
    log.warning("%s: running flare's operators as onnxruntime kernels (%s)", path.name, why)
    model = onnx.load(str(path))
    to_matmul_nbits(model)
    to_group_query_attention(model)
    to_dense_experts(model)
    return _open_rewritten(model, path, options, providers), "onnxruntime"


def _open_rewritten(
    model: onnx.ModelProto, path: Path, options: ort.SessionOptions, providers: list[str]
) -> ort.InferenceSession:
    with tempfile.TemporaryDirectory(prefix="flare-graph-") as tmp:
        rewritten = Path(tmp) / path.name
        onnx.save(model, str(rewritten), save_as_external_data=True, location=path.name + ".data")
        del model
        return ort.InferenceSession(str(rewritten), options, providers=providers)

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
from helios.kernels.head import fuse_logprob_head
from helios.kernels.int4_layout import to_matmul_nbits
from helios.kernels.kv_dtype import retype_pool
from helios.kernels.moe import to_dense_experts
from helios.kernels.norm_fusion import fuse_norms

log = logging.getLogger(__name__)


def uses_flare_ops(model: onnx.ModelProto) -> bool:
    return any(node.domain == DOMAIN for node in model.graph.node)


def open_session(
    path: Path,
    options: ort.SessionOptions,
    providers: list[str],
    kv_dtype: str = "float32",
    candidates: bool = False,
) -> tuple[ort.InferenceSession, str]:
    """(session, kernels) for the graph at `path`, its kv_pool input declared `kv_dtype` (a step
    graph's; helios.kernels.kv_dtype); `kernels` says what runs its ai.flare operators: "flare"
    (flare's kernel library), "onnxruntime" (rewritten to onnxruntime's MatMulNBits and
    GroupQueryAttention, and routed experts to dense Einsums, because the library cannot run here:
    the reason is logged) or "" (the graph has none). Where the library runs, a graph's logprob
    head runs fused whatever else it holds (helios.kernels.head), reporting sampling candidates
    with `candidates` (a step graph's), and norms that feed int4 matmuls run inside them
    (helios.kernels.norm_fusion)."""
    header = onnx.load(str(path), load_external_data=False)
    retype = kv_dtype != "float32"
    flare_ops = uses_flare_ops(header)
    library, why = available()
    if library is not None and providers == ["CPUExecutionProvider"]:
        options.register_custom_ops_library(str(library))
        kernels = "flare" if flare_ops else ""
        if os.environ.get("FLARE_EXPERTS", "").lower() == "dense" and any(
            n.op_type in ("MoE", "MoEInt4") and n.domain == DOMAIN for n in header.graph.node
        ):
            # A comparison switch (scripts/moe_tps.py): routed experts computed densely, as
            # ignition's graphs did before ai.flare.MoE.
            model = onnx.load(str(path))
            to_dense_experts(model)
            fuse_logprob_head(model, candidates)
            fuse_norms(model)
            if retype:
                retype_pool(model, kv_dtype)
            return _open_rewritten(model, path, options, providers), kernels
        # Every graph with a logprob head (step and score graphs alike) runs it fused, so both
        # report the same numbers; norms before int4 matmuls run inside them (the same bits).
        fused = fuse_logprob_head(header, candidates) + fuse_norms(header)
        if retype:
            retype_pool(header, kv_dtype)
        if retype or fused:
            return _open_header(header, path, options, providers), kernels
        return ort.InferenceSession(str(path), options, providers=providers), kernels
    if not flare_ops:
        if retype:
            retype_pool(header, kv_dtype)
            return _open_header(header, path, options, providers), ""
        return ort.InferenceSession(str(path), options, providers=providers), ""
    why = why or f"providers {providers} are not the CPU's"
    log.warning("%s: running flare's operators as onnxruntime kernels (%s)", path.name, why)
    model = onnx.load(str(path))
    to_matmul_nbits(model)
    to_group_query_attention(model)
    to_dense_experts(model)
    if retype:
        retype_pool(model, kv_dtype)
    return _open_rewritten(model, path, options, providers), "onnxruntime"


def _open_header(
    header: onnx.ModelProto, path: Path, options: ort.SessionOptions, providers: list[str]
) -> ort.InferenceSession:
    """A session over an edited graph whose weights stay in `path`'s external data files."""
    options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(path.parent))
    return ort.InferenceSession(header.SerializeToString(), options, providers=providers)


def _open_rewritten(
    model: onnx.ModelProto, path: Path, options: ort.SessionOptions, providers: list[str]
) -> ort.InferenceSession:
    with tempfile.TemporaryDirectory(prefix="flare-graph-") as tmp:
        rewritten = Path(tmp) / path.name
        onnx.save(model, str(rewritten), save_as_external_data=True, location=path.name + ".data")
        del model
        return ort.InferenceSession(str(rewritten), options, providers=providers)

"""The prompt-scoring head (`ignition export --prompt-logprobs`): a second, small graph.

The step graph already returns `hidden`, the final-normed hidden state of every fed position.
Scoring a prompt position needs the full-vocabulary distribution there, which the step graph
computes only at each row's last token (the lm_head is its biggest matmul). The score graph is
that lm_head plus the statistics api.md asks for, applied to any number of positions:

    inputs  hidden [N, H] float32, targets [N] int64 (the prompt's next token at each position)
    outputs target_logprobs [N], target_ranks [N] int64 (1 + count of strictly greater logprobs),
            top_logprobs [N, K], top_ids [N, K] (K = TOP_K, decreasing, ties by lower id)

Its lm_head weights are quantized exactly like the step graph's (see quantize.quantize_score),
so a prompt score and a generation logprob at the same position are the same number.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import helper, numpy_helper
from torch import nn

from helios.manifest import Architecture, Engine, TensorSpec
from ignition.export.graph import OPSET, save_with_external_data
from ignition.models import TOP_K, logprob_stats

# The exporter's optimizer passes log each step at INFO; an export shows its own progress.
for _name in ("onnx_ir", "onnxscript"):
    logging.getLogger(_name).setLevel(logging.WARNING)

SCORE_FILE = "score.onnx"
INPUT_NAMES = ["hidden", "targets"]
OUTPUT_NAMES = ["target_logprobs", "target_ranks", "top_logprobs", "top_ids"]


class ScoreHead(nn.Module):
    def __init__(self, lm_head: nn.Linear) -> None:
        super().__init__()
        self.lm_head = lm_head

    def forward(self, hidden: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, ...]:
        logits = self.lm_head(hidden)
        logprobs, _, top_logprobs, top_ids = logprob_stats(logits)
        target = torch.gather(logprobs, 1, targets.unsqueeze(1))
        ranks = 1 + (logprobs > target).to(torch.int64).sum(dim=1)
        return target.squeeze(1), ranks, top_logprobs, top_ids


def score_signature(arch: Architecture) -> tuple[list[TensorSpec], list[TensorSpec]]:
    inputs = [TensorSpec("hidden", "float32", ["N", arch.hidden_size]), TensorSpec("targets", "int64", ["N"])]
    outputs = [
        TensorSpec("target_logprobs", "float32", ["N"]),
        TensorSpec("target_ranks", "int64", ["N"]),
        TensorSpec("top_logprobs", "float32", ["N", TOP_K]),
        TensorSpec("top_ids", "int64", ["N", TOP_K]),
    ]
    return inputs, outputs


def lm_head_from_step_graph(graph_path: Path) -> nn.Linear:
    """The lm_head of an fp32 step graph (the MatMul or Gemm producing `logits`), as a Linear.

    Taken from the graph rather than the checkpoint so an export-cache hit, which has no
    checkpoint tensors, builds the same head."""
    # Only the graph structure is read, then the one weight: a 0.5B fp32 graph holds ~2 GB.
    proto = onnx.load(str(graph_path), load_external_data=False)
    inits = {t.name: t for t in proto.graph.initializer}
    node = next((n for n in proto.graph.node if "logits" in n.output), None)
    if node is None or node.op_type not in ("MatMul", "Gemm") or node.input[1] not in inits:
        raise ValueError(f"{graph_path}: no constant lm_head matmul produces 'logits'")
    weight = numpy_helper.to_array(inits[node.input[1]], base_dir=str(Path(graph_path).parent)).astype(np.float32)
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if node.op_type == "MatMul" or not attrs.get("transB", 0):
        weight = weight.T  # MatMul(x, W) holds W as [H, V]; a Linear holds [V, H]
    if node.op_type == "Gemm" and len(node.input) > 2 and node.input[2]:
        raise ValueError(f"{graph_path}: an lm_head with a bias is not supported")
    head = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    head.weight = nn.Parameter(torch.from_numpy(np.ascontiguousarray(weight)), requires_grad=False)
    return head


def export_score_graph(lm_head: nn.Linear, arch: Architecture, out_dir: Path, file_name: str = SCORE_FILE) -> Engine:
    """Write out_dir/file_name (+ .data): the fp32 score graph of `lm_head`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = torch.export.Dim("N", min=1)
    # N=3 in the trace: distinct from every weight dim, so nothing specializes on it.
    sample = (torch.zeros(3, arch.hidden_size), torch.zeros(3, dtype=torch.int64))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            ScoreHead(lm_head).eval(),
            sample,
            input_names=INPUT_NAMES,
            output_names=OUTPUT_NAMES,
            dynamic_shapes=({0: rows}, {0: rows}),
            opset_version=OPSET,
            dynamo=True,
            optimize=True,
            verbose=False,
        )
    proto = program.model_proto
    inputs, outputs = score_signature(arch)
    for value, spec in zip(list(proto.graph.input) + list(proto.graph.output), inputs + outputs):
        for dim, want in zip(value.type.tensor_type.shape.dim, spec.shape):
            if isinstance(want, str):
                dim.Clear()
                dim.dim_param = want
    data_name = file_name + ".data"
    save_with_external_data(proto, out_dir / file_name, data_name)
    return Engine(name="score", file=file_name, inputs=inputs, outputs=outputs, data_files=[data_name])

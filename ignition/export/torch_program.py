"""The step module as a torch.export program: the core's engine for helios' torch runner
(`ignition export --target cuda`; docs/architecture.md, "The GPU engine").

The program is the *same* step module the ONNX graph is traced from, with the same inputs,
outputs and dynamic dims (graph.step_signature), exported with torch.export on the CPU (no GPU is
needed to write it) and saved as one `.pt2` archive:
- weights in `dtype` (bfloat16 for GPUs; float32 gives a program equal to the ONNX graph within
  fp32 rounding, which is how CI proves it), the logprob head in fp32 (base.step_outputs);
- flare's hot ops (pool_attention, add_rms_norm, experts) kept opaque as `flare::` ops, which
  helios registers (helios.kernels.torch_ops) and runs with Triton kernels on CUDA;
- node metadata that records where the exporter ran (stack traces, source paths) stripped, so
  the same model gives a byte-identical archive.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from pathlib import Path

import torch

from helios.manifest import Architecture, Engine, KVLayout, StateLayout, TensorSpec
from ignition.export.graph import sample_inputs, step_dynamic_shapes, step_signature
from ignition.models import DecoderLM, ops

TORCH_PROGRAM_FILE = "step.cuda.pt2"
TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
# Node metadata kept in the archive: what the graph computes, not where it was traced.
KEPT_NODE_METADATA = ("val", "tensor_meta", "nn_module_stack", "torch_fn", "source_fn_stack", "unbacked_bindings")


class TorchExportError(ValueError):
    pass


def export_torch_program(
    model: DecoderLM,
    arch: Architecture,
    kv: KVLayout,
    out_dir: Path,
    dtype: str = "bfloat16",
    state: StateLayout | None = None,
    file_name: str = TORCH_PROGRAM_FILE,
) -> Engine:
    """Write out_dir/file_name and return the manifest's "step" engine for target "cuda"."""
    vision = model.mrope_section is not None
    engine = dataclasses.replace(torch_program_engine(arch, kv, dtype, state, vision), file=file_name)
    torch_dtype = TORCH_DTYPES[dtype]
    # A copy: the fp32 model stays the export's validation reference.
    module = model if torch_dtype == torch.float32 else copy.deepcopy(model).to(torch_dtype)
    args = tuple(
        t.to(torch_dtype) if t is not None and t.is_floating_point() else t
        for t in sample_inputs(kv, state, arch.hidden_size if vision else 0)
    )
    with torch.no_grad(), warnings.catch_warnings(), ops.fused_export():
        warnings.simplefilter("ignore")
        program = torch.export.export(
            module.eval(), args, dynamic_shapes=step_dynamic_shapes(model, state, vision), strict=False
        )
    strip_metadata(program)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.export.save(program, out_dir / file_name)
    return engine


def torch_program_engine(
    arch: Architecture, kv: KVLayout, dtype: str, state: StateLayout | None, vision: bool
) -> Engine:
    """The manifest's "step" engine of target "cuda"; TorchExportError for what cannot be exported."""
    if dtype not in TORCH_DTYPES:
        raise TorchExportError(f"unknown torch program dtype {dtype!r} (choose {', '.join(TORCH_DTYPES)})")
    if dtype != "float32" and (state is not None or vision):
        raise TorchExportError(
            f"a {dtype} torch program of a model with recurrent state or a vision tower is not "
            "supported yet (export it with --torch-dtype float32)"
        )
    inputs, outputs = step_signature(arch, kv, state, vision)
    return Engine(
        name="step",
        file=TORCH_PROGRAM_FILE,
        inputs=_retyped(inputs, dtype),
        outputs=_retyped(outputs, dtype),
        target="cuda",
        dtype=dtype,
        torch_version=torch.__version__,
    )


def strip_metadata(program: torch.export.ExportedProgram) -> None:
    """Drop node metadata that differs between checkouts and runs of the same code."""
    for module in program.graph_module.modules():
        if isinstance(module, torch.fx.GraphModule):
            for node in module.graph.nodes:
                for key in [k for k in node.meta if k not in KEPT_NODE_METADATA]:
                    del node.meta[key]


def _retyped(specs: list[TensorSpec], dtype: str) -> list[TensorSpec]:
    """The contract's specs for a program whose pool, new K/V and hidden states are `dtype`."""
    return [TensorSpec(s.name, dtype, s.shape) if s.name in ("kv_pool", "new_kv", "hidden") else s for s in specs]

"""One-shot check of the GPU engine on a CUDA machine (/work/shared/gpu-notes.md, sections 1, 5, 6).

    python scripts/gpu_check.py --out $OUT/gpu_check.json [--deadline 420] [--fixture tests/data/gpu_fixture]
    python scripts/gpu_check.py --cpu-smoke --out /tmp/gpu_smoke.json   # the plumbing, tiny shapes, on a CPU
    python scripts/gpu_check.py --write-fixture tests/data/gpu_fixture   # a ~1 MB fp32 core for phase compat

Phases (each one's results are written to --out as soon as it ends, so a killed run still reports):
  env      versions, GPU, `nvidia-smi -L`, device-to-device copy bandwidth (the bounds' bandwidth)
  kernels  pool_attention_triton vs pool_attention_ref on the device, fp32 and bf16 pools
  compat   the fixture core's torch program (written by CPU torch here) loaded by the device's torch:
           TorchRunner on cuda (graphs) vs on cpu, same rows; graph replay vs eager, bit for bit
  model:*  Qwen2.5-Coder 0.5B / 1.5B shapes, random weights: bf16 export on the machine, parity vs an
           fp32 reference, decode b1/b8 (graph replay alone and through TorchRunner.step), prefill
  peer     transformers Qwen2 + StaticCache + torch.compile(reduce-overhead) decode (gpt-fast's method)
  targets  the targets in docs/performance.md ("GPU"), met / not met, with the numbers
Every exception is recorded verbatim and the run goes on; past --deadline the remaining phases are
skipped (and say so). No network and no weights are needed: every model is random.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a plain script from a copy of the tree (helios, ignition)
# The phases live in the sibling modules scripts/gpu_check_*.py (this folder is sys.path[0] of a
# script run): _common (Shape, Plan, the run's context and results file, model helpers), _device
# (env, kernels, compat), _models (model:*), _peer (peer), _run (the phase order, targets).


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("gpu_check.json"))
    parser.add_argument("--deadline", type=float, default=420.0, help="seconds; later phases are skipped past it")
    parser.add_argument("--fixture", default=str(ROOT / "tests" / "data" / "gpu_fixture"))
    parser.add_argument("--cpu-smoke", action="store_true", help="every phase on the CPU with tiny shapes")
    parser.add_argument("--phases", default="env,kernels,compat,model,peer", help="comma-separated subset")
    parser.add_argument("--peer-models", default="0.5b,1.5b", help="peer models, in order (time allowing)")
    parser.add_argument("--write-fixture", type=Path, help="only write the compat phase's fixture core there")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    t0 = time.monotonic()  # log times, elapsed_s and --deadline count from here
    args = parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    # Compiled kernels go to a scratch folder: nothing is reused from, or left for, another run.
    os.environ["TRITON_CACHE_DIR"] = os.path.join(tmp, "triton")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tmp, "inductor")
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # read when @triton.jit decorates: before helios' kernels import
    # Imported only now, not at the top: the phase modules load torch (and may load triton), which
    # must see the variables above.
    from gpu_check_run import run_check

    try:
        return run_check(args, tmp, t0)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

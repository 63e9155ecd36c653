"""scripts/gpu_check.py's run: builds the run's context, runs the phases in order (each one's results
written as it ends), then the closing targets phase (the GPU targets of docs/performance.md, "GPU", met / not met)."""

from __future__ import annotations

import argparse
import functools
from pathlib import Path
from typing import Any

import torch
from gpu_check_common import MODELS, SMOKE, TINY, Phase, Plan, Results, Run, error_record, write_fixture
from gpu_check_device import phase_compat, phase_env, phase_kernels, reference_attention_if_no_kernel
from gpu_check_models import phase_model
from gpu_check_peer import phase_peer


def run_check(args: argparse.Namespace, tmp: Path, t0: float) -> int:
    run = Run(
        args=args,
        plan=SMOKE if args.cpu_smoke else Plan(),
        device="cpu" if args.cpu_smoke or args.write_fixture else "cuda",
        tmp=tmp,
        t0=t0,
    )
    if args.write_fixture:
        manifest = write_fixture(args.write_fixture)
        run.log(f"wrote {args.write_fixture} (torch {manifest.engines[0].torch_version})")
        return 0
    results = run.results = Results(run)
    if run.device == "cpu":
        torch.set_num_threads(1)  # tiny shapes: threads only add spin-waits on a shared 2-core machine
    try:  # fp32 comparisons mean fp32 (the bf16 program is unaffected)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")
    except Exception as exc:
        results.data["tf32_error"] = error_record(exc)
    if run.device == "cuda" and not torch.cuda.is_available():
        results.data["fatal"] = "torch.cuda.is_available() is False (use --cpu-smoke on a machine without a GPU)"
        results.write()
        run.log(results.data["fatal"])
        return 2
    wanted = set(args.phases.split(","))
    phases: list[tuple[str, Phase, float]] = [
        ("env", phase_env, 0),
        ("kernels", phase_kernels, 30),
        ("compat", phase_compat, 20),
    ]
    for shape in MODELS if run.device == "cuda" else [TINY]:
        phases.append((f"model:{shape.name}", functools.partial(phase_model, shape=shape), 45))
    phases.append(("peer", phase_peer, 40))
    for name, fn, needs in phases:
        if name.split(":")[0] in wanted:
            results.phase(name, fn, needs)
        if name == "kernels" and name in wanted and (why := reference_attention_if_no_kernel(run)):
            results.data["attention_fallback"] = why
            run.log(why)
    results.phase("targets", phase_targets)
    results.data["finished"] = True
    results.write()
    run.log(f"done: {args.out}")
    return 0


def phase_targets(run: Run, rec: dict) -> None:
    phases = run.results.data["phases"]
    compat = phases.get("compat", {})
    main = "1.5b" if run.device == "cuda" else "tiny"
    model = phases.get(f"model:{main}", {})
    peer = phases.get("peer", {}).get(main, {})

    def target(value: Any, threshold: float, what: str, higher: bool = True) -> dict:
        met = None if value is None else (value >= threshold if higher else value <= threshold)
        return {"met": met, "value": value, "threshold": threshold, "what": what}

    out: dict[str, Any] = {}
    for name in [s.name for s in MODELS] if run.device == "cuda" else ["tiny"]:
        p = phases.get(f"model:{name}", {}).get("parity", {})
        out[f"parity_{name}_dlogprob"] = target(
            p.get("max_abs_dlogprob_top20"), 2e-2, "max |dlogprob| over the fp32 top-20", False
        )
        out[f"parity_{name}_top1"] = target(
            p.get("top1_agreement"), 0.99, f"top-1 agreement over {p.get('positions')} positions"
        )
    bitwise = [compat.get(k, {}).get("same_bucket_bitwise") for k in ("graph_vs_eager_b1", "graph_vs_eager_b3")]
    out["graph_equals_eager"] = {
        "met": None if None in bitwise else all(bitwise),
        "value": bitwise,
        "what": "graph replay == eager step on the same buffers, bit for bit (b1, b3)",
    }
    b1 = model.get("decode_b1", {})
    out["b1_runner_of_bound"] = target(b1.get("runner_of_bound"), 0.60, f"{main} b1 through TorchRunner.step / bound")
    out["b1_replay_of_bound"] = target(b1.get("replay_of_bound"), 0.75, f"{main} b1 graph replay alone / bound")
    out["b1_over_peer"] = target(peer.get("ours_over_peer_b1"), 1.2, f"{main} b1 ours / compiled transformers")
    out["b8_over_our_b1"] = target(model.get("b8_over_b1"), 4.0, f"{main} b8 / b1, both through the runner")
    out["b8_over_peer"] = target(peer.get("ours_over_peer_b8"), 1.5, f"{main} b8 ours / compiled transformers")
    out["prefill_2048"] = target(
        model.get(f"prefill_{max(run.plan.chunks)}_tok_s"), 60000, f"{main} prefill tok/s, one chunk"
    )
    rec["targets"] = out
    peer_all = phases.get("peer", {})
    rec["peer_ratios"] = {
        k: {r: v[r] for r in ("ours_over_peer_b1", "ours_over_peer_b8") if r in v}
        for k, v in peer_all.items()
        if isinstance(v, dict)
    }  # every model the peer reached
    rec["met"] = sorted(k for k, v in out.items() if v["met"] is True)
    rec["not_met"] = sorted(k for k, v in out.items() if v["met"] is False)
    rec["not_measured"] = sorted(k for k, v in out.items() if v["met"] is None)
    if run.device == "cpu":
        rec["note"] = "cpu-smoke: tiny shapes on a CPU; the numbers say nothing about the GPU"
    run.log(f"  targets met {rec['met']}, not met {rec['not_met']}, not measured {rec['not_measured']}")

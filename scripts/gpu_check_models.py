"""scripts/gpu_check.py's phase 4 (model:<shape>): a real model shape with random weights, exported
as bf16 on the machine, then parity vs an fp32 reference, prefill speed and decode speed (b1, b8)
through TorchRunner against the bandwidth bound."""

from __future__ import annotations

import shutil
import time
from functools import partial
from typing import Any

import numpy as np
import torch
from gpu_check_common import Run, Shape, export_core, make_runner, random_model

PEAK_BF16_TFLOPS = 790.0  # an 8k bf16 matmul on this H200 (KINDS.md), if phase env did not measure it


def phase_model(run: Run, rec: dict, shape: Shape) -> None:
    from helios.engine.step_io import StepRow

    device, plan, results = run.device, run.plan, run.results
    folder = run.tmp / f"core-{shape.name}"
    model = random_model(shape, device)
    params = sum(p.numel() for p in model.parameters())
    manifest, rec["export_s"] = export_core(model, shape, folder, "bfloat16", max_batch=8)
    rec.update(
        params=params,
        program_bytes=(folder / manifest.engines[0].file).stat().st_size,
        program_dtype=manifest.engines[0].dtype,
    )
    run.log(f"  {shape.name}: exported in {rec['export_s']:.1f}s")
    seqs = 10  # 0-7: b8, 8: b1, 9: parity; then the prefill scratch pages
    per_seq = -(-(max(plan.history + 2 * plan.steps + 64, plan.prompt + plan.parity_steps + 1)) // 16)
    num_pages = seqs * per_seq + -(-max(plan.chunks) // 16)
    started = time.perf_counter()
    runner = make_runner(folder, manifest, num_pages, device, graphs=True, max_batch=8)
    rec.update(
        runner_init_s=round(time.perf_counter() - started, 2),
        num_pages=num_pages,
        buckets=runner.graphs.buckets,
        cuda_graphs=device == "cuda",
    )
    run.log(f"  {shape.name}: runner (load + capture) in {rec['runner_init_s']}s")
    tables = [list(range(s * per_seq, (s + 1) * per_seq)) for s in range(seqs)]
    scratch = list(range(seqs * per_seq, num_pages))
    rng = np.random.default_rng(1)
    with run.attempt(rec, "parity"):
        rec["parity"] = parity(run, model, runner, tables[9], rng, shape.vocab)
        run.log(f"  {shape.name}: parity {rec['parity']}")
    del model
    run.free_memory()
    results.write()
    bw = results.data["phases"].get("env", {}).get("bandwidth_GBps")
    weight_bytes, kv_token = manifest.decode_weight_bytes, 2 * shape.layers * shape.kv_heads * shape.head_dim * 2
    rec.update(decode_weight_bytes=weight_bytes, kv_bytes_per_token=kv_token, bandwidth_GBps=bw)
    hist = [0] * seqs
    tokens = [0] * seqs
    with run.attempt(rec, "prefill"):
        for s in range(9):  # every decode sequence gets its history (the first call also warms up)
            out = runner.step([StepRow(rng.integers(0, shape.vocab, plan.history).tolist(), 0, tables[s])])
            hist[s], tokens[s] = plan.history, int(out.top_ids[0, 0])
        for chunk in plan.chunks:
            row = StepRow(rng.integers(0, shape.vocab, chunk).tolist(), 0, scratch)
            warm = run.timed_host(partial(runner.step, [row]), 1)  # the prefill kernels of this shape compile
            reps = min(3, run.affordable(warm, 3, 0.02))
            seconds = run.timed_host(partial(runner.step, [row]), reps)
            rec[f"prefill_{chunk}_tok_s"] = round(chunk * reps / seconds)
            # lm_head runs on the last token only: a prefill token costs the non-embedding matmuls
            tflops = chunk * reps / seconds * 2 * (params - shape.vocab * shape.hidden) / 1e12
            rec[f"prefill_{chunk}_tflops"] = round(tflops, 1)
            peak = results.data["phases"].get("env", {}).get("matmul_bf16_tflops") or PEAK_BF16_TFLOPS
            rec[f"prefill_{chunk}_of_matmul_peak"] = round(tflops / peak, 3)
        results.write()
    for batch, first in ((1, 8), (8, 0)):
        with run.attempt(rec, f"decode b{batch}"):
            rec[f"decode_b{batch}"] = decode_speed(
                run, runner, list(range(first, first + batch)), tables, hist, tokens, bw, weight_bytes, kv_token
            )
            run.log(f"  {shape.name}: decode b{batch} {rec[f'decode_b{batch}']}")
            results.write()
    with run.attempt(rec, "eager decode b1"):  # the same steps without graphs: what capture buys
        steps = min(32, plan.steps)
        seconds = run.timed_host(partial(runner.run_eager, [StepRow([tokens[8]], hist[8], tables[8])]), steps)
        rec["eager_b1_tok_s"] = round(steps / seconds, 1)
    if "decode_b1" in rec and "decode_b8" in rec:
        rec["b8_over_b1"] = round(rec["decode_b8"]["runner_tok_s"] / rec["decode_b1"]["runner_tok_s"], 2)
    del runner
    shutil.rmtree(folder, ignore_errors=True)  # a 1.5B program is 3 GB of a 64 GiB disk


def parity(run: Run, model: Any, runner: Any, table: list[int], rng: Any, vocab: int) -> dict:
    """Our bf16 program's last-position logprobs (a prompt, then decode steps through the runner's
    graphs) vs the fp32 model's at the same positions (one full-sequence forward, plain-torch ops)."""
    from helios.engine.step_io import StepRow

    device = run.device
    prompt, steps = run.plan.prompt, run.plan.parity_steps
    ids = rng.integers(0, vocab, prompt + steps).tolist()
    runner.step([StepRow(ids[:prompt], 0, table)])
    ours = []
    for i in range(steps):
        out = runner.step([StepRow([ids[prompt + i]], prompt + i, table)])
        ours.append(out.logits[0] - out.logsumexp[0])
    ours_lp = torch.from_numpy(np.stack(ours)).to(device)
    arch = model.arch
    n_tok = prompt + steps
    with torch.no_grad():
        inputs = (
            torch.tensor([ids], device=device),
            torch.arange(n_tok, device=device)[None],
            torch.zeros(1, dtype=torch.int64, device=device),
            torch.tensor([n_tok], device=device),
            torch.zeros(1, 1, dtype=torch.int64, device=device),
            torch.zeros(arch.num_layers * 2, 16, arch.num_kv_heads, arch.head_dim, device=device),
            torch.zeros(1, 1, dtype=torch.int64, device=device),
            torch.zeros(steps, dtype=torch.int64, device=device),
            torch.arange(prompt, n_tok, device=device),
        )
        ref_lp = torch.log_softmax(model(*inputs)[0].float(), dim=-1)
    top_ref = ref_lp.topk(20, dim=-1)
    ours_at_top = ours_lp.gather(1, top_ref.indices)
    dlp = (ours_at_top - top_ref.values).abs().amax(1)
    agree = ours_lp.argmax(1) == top_ref.indices[:, 0]
    margin = top_ref.values[:, 0] - top_ref.values[:, 1]
    kl = (ref_lp.exp() * (ref_lp - ours_lp)).sum(1)
    decided = margin > 4e-2  # positions whose top-1 is not a near tie at the logprob tolerance
    return {
        "positions": steps,
        "top1_agreement": agree.float().mean().item(),
        "top1_agreement_margin_gt_4e-2": agree[decided].float().mean().item() if decided.any() else None,
        "max_abs_dlogprob_top20": dlp.max().item(),
        "mean_abs_dlogprob_top20": dlp.mean().item(),
        "mean_kl": kl.mean().item(),
        "median_top1_margin": margin.median().item(),
        "ref_top1_logprob_mean": top_ref.values[:, 0].mean().item(),
    }


def decode_speed(
    run: Run,
    runner: Any,
    seqs: list[int],
    tables: list,
    hist: list,
    tokens: list,
    bw: float | None,
    weight_bytes: int,
    kv_token: int,
) -> dict:
    """Greedy decode of `seqs` through TorchRunner.step (host work included), then the same
    bucket's graph replayed alone in a loop (CUDA events), both against the bandwidth bound."""
    from helios.engine.step_io import StepRow

    def step() -> None:
        out = runner.step([StepRow([tokens[s]], hist[s], tables[s]) for s in seqs])
        for i, s in enumerate(seqs):
            tokens[s], hist[s] = int(out.top_ids[i, 0]), hist[s] + 1

    step()  # the first replay of this bucket
    steps = run.affordable(run.timed_host(step, 2) / 2, run.plan.steps)
    batch = len(seqs)
    start_hist = hist[seqs[0]]
    runner_s = run.timed_host(step, steps)
    replay = runner.graphs.replays[runner.graphs.bucket(batch)]
    replay_s = run.device_seconds(replay, steps)
    res = {
        "steps": steps,
        "history_start": start_hist,
        "runner_tok_s": round(batch * steps / runner_s, 1),
        "replay_tok_s": round(batch * steps / replay_s, 1),
        "host_us_per_step": round((runner_s - replay_s) / steps * 1e6, 1),
    }
    if bw:
        context = start_hist + steps // 2
        bound = batch * bw * 1e9 / (weight_bytes + batch * context * kv_token)
        res.update(
            bound_tok_s=round(bound, 1),
            runner_of_bound=round(res["runner_tok_s"] / bound, 3),
            replay_of_bound=round(res["replay_tok_s"] / bound, 3),
        )
    return res

"""scripts/gpu_check.py's phase 5 (peer): transformers' Qwen2 with a StaticCache, decoding through
torch.compile(mode="reduce-overhead") (gpt-fast's method), held against phase model's numbers."""

from __future__ import annotations

import contextlib
import inspect
import time
import warnings
from typing import Any

import torch
from gpu_check_common import MODELS, TINY, Run, Shape, error_record


def hf_model(run: Run, shape: Shape) -> Any:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    kw = dict(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.inter,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.max_positions,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
    )
    try:  # transformers 5 names rope settings rope_parameters, 4.x takes rope_theta
        config = Qwen2Config(**kw, rope_parameters={"rope_type": "default", "rope_theta": shape.theta})
    except TypeError:
        config = Qwen2Config(**kw, rope_theta=shape.theta)
    config._attn_implementation = "sdpa"
    with torch.device(run.device):
        model = Qwen2ForCausalLM(config)  # HF's own init (N(0, 0.02)), on the device
    return model.to(run.device, torch.bfloat16).eval().requires_grad_(False)


def static_cache(run: Run, model: Any, batch: int, length: int) -> Any:
    from transformers import StaticCache

    params = inspect.signature(StaticCache.__init__).parameters
    kw: dict[str, Any] = {"config": model.config, "max_cache_len": length}
    kw.update(
        {k: v for k, v in (("max_batch_size", batch), ("device", run.device), ("dtype", torch.bfloat16)) if k in params}
    )
    return StaticCache(**kw)


def peer_decode(run: Run, model: Any, batch: int) -> dict:
    """gpt-fast's loop: eager prefill into a StaticCache, then one-token steps through
    torch.compile(mode="reduce-overhead", fullgraph=True) (CUDA graphs), argmax on the device."""
    device = run.device
    steps, history = run.plan.steps, run.plan.history
    cache = static_cache(run, model, batch, history + steps + 8)
    prompt = torch.randint(0, model.config.vocab_size, (batch, history), device=device)
    torch._dynamo.reset()
    with torch.no_grad():
        out = model(
            input_ids=prompt, past_key_values=cache, cache_position=torch.arange(history, device=device), use_cache=True
        )
        token = out.logits[:, -1:].argmax(-1)
        position = torch.tensor([history], device=device)

        def one(token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
            logits = model(input_ids=token, past_key_values=cache, cache_position=position, use_cache=True).logits
            return logits[:, -1:].argmax(-1)

        res: dict[str, Any] = {"batch": batch, "history_start": history}
        # cpu-smoke: dynamo's capture only (no Inductor build on 2 cores)
        options = {"mode": "reduce-overhead"} if run.plan.compile_peer else {"backend": "eager"}
        started = time.perf_counter()
        for fullgraph in (True, False):  # a graph break is recorded, then compiled around
            try:
                step = torch.compile(one, fullgraph=fullgraph, dynamic=False, **options)
                for _ in range(3):  # compile, record, replay
                    token = step(token, position).clone()  # clone: the next replay overwrites the output
                    position += 1
                break
            except Exception as exc:
                if not fullgraph:
                    raise
                res["fullgraph_error"] = error_record(exc)
                torch._dynamo.reset()
        run.sync()
        res.update(compile=f"{options}, fullgraph={fullgraph}", compile_s=round(time.perf_counter() - started, 1))
        with contextlib.suppress(Exception):  # > 0: Inductor ran this step without CUDA graphs (a mutated input, ...)
            from torch._dynamo.utils import counters

            res["cudagraph_skips"] = counters["inductor"]["cudagraph_skips"]

        def decode() -> None:
            nonlocal token
            token = step(token, position).clone()
            position.add_(1)

        steps = run.affordable(run.timed_host(decode, 2) / 2, steps)
        seconds = run.timed_host(decode, steps)
    res.update(steps=steps, tok_s=round(batch * steps / seconds, 1))
    return res


def peer_floor(run: Run, model: Any) -> dict:
    """HF eager `generate` (dynamic cache, no compile) at b=1: prefill subtracted."""
    n = run.plan.floor_tokens
    prompt = torch.randint(0, model.config.vocab_size, (1, run.plan.history), device=run.device)

    def gen(k: int) -> float:
        return run.timed_host(
            lambda: model.generate(prompt, max_new_tokens=k, min_new_tokens=k, do_sample=False, pad_token_id=0), 1
        )

    gen(2)  # warm-up
    seconds = gen(n) - gen(1)
    return {"tokens": n, "tok_s": round((n - 1) / seconds, 1)}


def phase_peer(run: Run, rec: dict) -> None:
    warnings.filterwarnings("ignore", message=".*past_key_values.*")  # deprecated in transformers 5.2x, kept for 4.x
    import transformers  # here, not at the top: a missing transformers fails this phase only

    results = run.results
    rec["transformers"] = transformers.__version__
    shapes = {s.name: s for s in MODELS} if run.device == "cuda" else {"tiny": TINY}
    wanted = run.args.peer_models.split(",") if run.device == "cuda" else ["tiny"]
    for name in wanted:
        shape, res = shapes[name], {}
        rec[name] = res
        if run.left() < 40:
            res["skipped"] = f"deadline: {run.left():.0f}s left"
            continue
        with run.attempt(res, "build"):
            model = hf_model(run, shape)
            for batch in (1, 8):
                if run.left() < 35:
                    res[f"b{batch}"] = {"skipped": f"deadline: {run.left():.0f}s left"}
                    continue
                with run.attempt(res, f"b{batch}"):
                    res[f"b{batch}"] = peer_decode(run, model, batch)
                    run.log(f"  peer {name} b{batch}: {res[f'b{batch}']}")
                results.write()
            if run.left() > 20:
                with run.attempt(res, "eager generate"):
                    res["eager_generate_b1"] = peer_floor(run, model)
            del model
            torch._dynamo.reset()
            run.free_memory()
        ours = results.data["phases"].get(f"model:{name}", {})
        for batch in (1, 8):
            mine, theirs = ours.get(f"decode_b{batch}", {}), res.get(f"b{batch}", {})
            if "runner_tok_s" in mine and "tok_s" in theirs:
                res[f"ours_over_peer_b{batch}"] = round(mine["runner_tok_s"] / theirs["tok_s"], 2)
        results.write()
    if any(r.get("errors") for r in rec.values() if isinstance(r, dict)):
        rec["errors"] = [e for r in rec.values() if isinstance(r, dict) for e in r.get("errors", [])]

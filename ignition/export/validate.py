"""Export parity: the ONNX engine, run the way helios runs it, against the torch reference.

The reference is `DecoderLM.reference`: a plain causal forward over the whole sequence (no
paging, no fused ops, repeated KV heads, HF-style rotary). It greedily continues the prompt for
`decode_steps` tokens; the engine is then fed the same tokens (teacher forcing) through `Runner`:

- the prompt in two prefill chunks (the second attends to the first through the pool),
- then one decode step per generated token,
- with a shuffled, non-contiguous block table over a pool whose unused slots hold random
  values, so a paging or masking bug cannot hide behind zeros or identity page order.

A prompt shorter than MIN_TOKENS is repeated up to that length: rotary errors (a wrong theta)
only show over long distances, and a repeated text makes the model attend far back. Logits are
compared at every position the engine returns (end of each chunk, each decode step).

Tolerances (TOLERANCES; a miss raises ParityError with the numbers), measured on the real
Qwen2.5-Coder-0.5B with this function (3 prompts, each repeated to 64 tokens, 2 chunks + 8
decode steps = 10 positions; KL is the mean KL(reference || engine) of next-token distributions):

  engine                                   max |err|   top-1   mean KL
  fp32 (the shipped graph)                 2e-5..5e-5  1.0     0
  int8 (block 128)                         0.51..0.63  1.0     <= 0.0012
  int4 (block 32, int8 lm_head, 4-bit emb) 2.9..5.0    1.0     0.002..0.022  (0.08 unrepeated)
  int4 b32, int4 block-128 lm_head         3.3         1.0     0.003 (one prompt; int8 head: 0.0017)
  int4 as shipped (layers block 64)        4.4         1.0     0.0029 (one prompt; b32: 0.0014)
  int4 block 128 (honest, not shipped)     3.7..7.5    0.9..1  0.006..0.45
  broken: rotate-half vs interleaved       22..33      0..0.1  8.7..10.5
  broken: q/k/v bias dropped (unrepeated)  27..38      0       15..16
  broken: attention mask one token short   -- onnxruntime rejects the inputs (a ParityError too)
  broken: rope theta 1e4 instead of 1e6    fp32: 2.7..6.7 (fails 1e-3); int4: KL 0.006..0.51

fp32: max |err| <= 1e-3 is decisive (same math, other kernels). Quantized: mean KL is the main
test, set ~20x above honest int4 / ~40x above honest int8 and >15x below gross breakage; top-1
and max |err| are coarse backstops. A subtly wrong rotary theta hides inside int4 noise at this
length, so the fp32 graph should be validated too (it fails by 1000x).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from helios.engine.runner import Runner, StepRow
from helios.engine.step_io import StepRunner
from helios.manifest import MANIFEST_NAME, KVLayout, Manifest, Parity, StateLayout
from ignition.checkpoints.base import Checkpoint
from ignition.export.reference import Reference

# What export validates on (repeated to MIN_TOKENS) and `ignition verify` smoke-runs.
VALIDATION_PROMPT = (
    "<|im_start|>user\nWrite a Python function that returns the sum of a list.<|im_end|>\n<|im_start|>assistant\n"
)


class ParityError(RuntimeError):
    """The exported engine disagrees with the torch reference beyond the precision's tolerance."""


@dataclass(frozen=True)
class Tolerance:
    max_abs: float  # max |engine logit - reference logit| over all checked positions
    min_top1: float  # min fraction of positions whose argmax agrees
    max_kl: float  # max mean KL(reference || engine) of the next-token distributions, nats


TOLERANCES = {
    "fp32": Tolerance(max_abs=1e-3, min_top1=0.0, max_kl=float("inf")),  # max-abs is decisive
    "int8": Tolerance(max_abs=4.0, min_top1=0.8, max_kl=0.05),
    "int4": Tolerance(max_abs=16.0, min_top1=0.6, max_kl=0.5),
    # A bf16 torch program (--target cuda): bf16 weights and activations, fp32 softmax and head.
    "bfloat16": Tolerance(max_abs=4.0, min_top1=0.8, max_kl=0.05),
}
# Runs the validation sequence: num_pages -> a fresh runner (the ONNX graph's, unless given).
RunnerFactory = Callable[[int], StepRunner]
# A torch program's weights dtype -> its TOLERANCES key.
TORCH_PROGRAM_PRECISION = {"float32": "fp32", "bfloat16": "bfloat16"}


def torch_program_runners(core: Path, manifest: Manifest) -> RunnerFactory:
    """The core's torch step program on CPU torch through helios' torch runner (no decode graphs),
    as export validation and `ignition verify` run it."""

    def make(num_pages: int) -> StepRunner:
        from helios.engine.torch_runner import TorchRunner  # torch's runner only where a program is

        return TorchRunner(core, manifest, num_pages, device="cpu", state_slots=3, graphs=False)

    return make


MIN_TOKENS = 64  # shorter prompts are repeated up to this length (see module docstring)


def validate(
    core_or_onnx_path: Path,
    model: Reference,
    kv_layout: KVLayout,
    prompt_ids: list[int],
    decode_steps: int = 8,
    *,
    precision: str,
    seed: int = 0,
    state: StateLayout | None = None,
    make_runner: RunnerFactory | None = None,
) -> Parity:
    """Compare engine and reference logits; return Parity, or raise ParityError past tolerance.

    core_or_onnx_path: a core folder (its core.json names the step graph) or a step .onnx file;
    make_runner: another engine to hold to the same reference (e.g. the torch step program).
    """
    if precision not in TOLERANCES:
        raise ValueError(f"unknown precision {precision!r}")
    if not prompt_ids:
        raise ValueError("validation needs a non-empty prompt")
    tolerance = TOLERANCES[precision]
    if make_runner is None:
        graph = _graph_path(Path(core_or_onnx_path))

        def make_runner(num_pages: int) -> StepRunner:
            return Runner.from_graph(graph, kv_layout, num_pages=num_pages, state=state, state_slots=3)

    prompt = (list(prompt_ids) * -(-MIN_TOKENS // len(prompt_ids)))[: max(MIN_TOKENS, len(prompt_ids))]

    sequence, reference = _reference(model, prompt, decode_steps)
    try:
        engine, positions = _engine(make_runner, kv_layout, sequence, len(prompt), seed)
    except Exception as exc:  # an engine that cannot even run these inputs is broken
        raise ParityError(f"{precision} engine failed on the validation sequence: {exc}") from exc
    expected = reference[positions].astype(np.float64)
    engine = engine.astype(np.float64)
    error = float(np.abs(engine - expected).max())
    top1 = float(np.mean(engine.argmax(-1) == expected.argmax(-1)))
    kl = float(np.mean(_kl(expected, engine)))
    parity = Parity(
        max_abs_logit_error=error,
        tolerance=tolerance.max_abs,
        prompt_tokens=len(prompt),
        decode_steps=decode_steps,
        top1_agreement=top1,
        mean_kl=kl,
    )
    if not (
        np.isfinite(engine).all()
        and error <= tolerance.max_abs
        and top1 >= tolerance.min_top1
        and kl <= tolerance.max_kl
    ):
        raise ParityError(
            f"{precision} engine disagrees with the torch reference: max |logit error| {error:.4g} "
            f"(tolerance {tolerance.max_abs:g}), top-1 agreement {top1:.3f} (minimum {tolerance.min_top1:g}), "
            f"mean KL {kl:.4g} nats (maximum {tolerance.max_kl:g}) over {len(positions)} positions of a "
            f"{len(prompt)}-token prompt + {decode_steps} decode steps"
        )
    return parity


def validation_prompt(tokenizer_file: Path, checkpoint: Checkpoint) -> list[int]:
    """VALIDATION_PROMPT's ids under the core's tokenizer, leaving out ids past the model's vocabulary."""
    ids = Tokenizer.from_file(str(tokenizer_file)).encode(VALIDATION_PROMPT, add_special_tokens=False).ids
    vocab = checkpoint.architecture.vocab_size
    return [i for i in ids if i < vocab]


def _kl(ref_logits: np.ndarray, engine_logits: np.ndarray) -> np.ndarray:
    """KL(softmax(ref) || softmax(engine)) per row, float64."""

    def log_softmax(x: np.ndarray) -> np.ndarray:
        shifted = x - x.max(-1, keepdims=True)
        return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))

    ref, eng = log_softmax(ref_logits), log_softmax(engine_logits)
    return (np.exp(ref) * (ref - eng)).sum(-1)


def _graph_path(path: Path) -> Path:
    if path.is_dir():
        manifest = Manifest.load(path, verify_files=False) if (path / MANIFEST_NAME).is_file() else None
        return path / (manifest.engine("step").file if manifest else "step.onnx")
    return path


@torch.no_grad()
def _reference(model: Reference, prompt_ids: list[int], decode_steps: int) -> tuple[list[int], np.ndarray]:
    """Greedy continuation by the reference; logits [len(sequence), V] of the whole sequence."""
    sequence = list(prompt_ids)
    logits = model.reference(torch.tensor(sequence))
    for _ in range(decode_steps):
        sequence.append(int(logits[-1].argmax()))
        logits = model.reference(torch.tensor(sequence))
    return sequence, logits.float().numpy()


def _engine(
    make_runner: RunnerFactory, kv: KVLayout, sequence: list[int], prompt_len: int, seed: int
) -> tuple[np.ndarray, list[int]]:
    """Engine logits at the positions it reports, and those positions."""
    rng = np.random.default_rng(seed)
    pages = -(-len(sequence) // kv.page_tokens)
    runner = make_runner(3 * pages + 2)
    every_page = list(range(runner.num_pages))
    garbage = rng.standard_normal(
        (kv.num_layers, 2, runner.num_pages, kv.page_tokens, kv.kv_heads, kv.head_dim), dtype=np.float32
    )
    runner.write_pages(every_page, garbage)  # stale garbage
    slot = None
    if runner.num_state_slots:  # a stale slot: the first chunk (history 0) must ignore it
        width = runner.read_state(0).shape[0]
        stale = rng.standard_normal((runner.num_state_slots, width), dtype=np.float32)
        for index, values in enumerate(stale):
            runner.write_state(index, values)
        slot = 1
    table = [int(p) for p in rng.permutation(runner.num_pages)[:pages]]
    if table == sorted(table):  # make sure the order itself is exercised
        table.reverse()

    logits, positions = [], []
    split = prompt_len // 2
    steps = [(0, split), (split, prompt_len)]  # two prefill chunks
    steps += [(p, p + 1) for p in range(prompt_len, len(sequence))]  # decode: one token each
    for start, end in steps:
        out = runner.step([StepRow(sequence[start:end], start, table, state_slot=slot)])
        logits.append(out.logits[0])
        positions.append(end - 1)
    return np.stack(logits), positions


SCORE_TOLERANCE = 1e-3  # |score-graph logprob - step-graph logprob| at the same position


def validate_scores(
    step_graph: Path, score_graph: Path, kv: KVLayout, prompt_ids: list[int], state: StateLayout | None = None
) -> None:
    """The score graph must report what the step graph reports at the same position.

    The prompt is prefilled once with every position scored; the step graph then computes the
    last scored position's distribution as an ordinary generation step (the prompt minus its last
    token). Target logprob, the natural alternatives and the rank must agree. Raises ParityError.
    """
    prompt = list(prompt_ids)
    if len(prompt) < 2:
        raise ValueError("score validation needs a prompt of at least 2 tokens")
    pages = -(-len(prompt) // kv.page_tokens)
    table = list(range(pages))
    try:
        slot = 0 if state is not None else None
        runner = Runner.from_graph(step_graph, kv, num_pages=pages, score_graph=score_graph, state=state, state_slots=1)
        scored = runner.step(
            [StepRow(prompt, 0, table, score_targets=prompt[1:] + [-1], state_slot=slot)]
        ).prompt_scores[0]
        runner = Runner.from_graph(step_graph, kv, num_pages=pages, state=state, state_slots=1)
        step = runner.step([StepRow(prompt[:-1], 0, table, state_slot=slot)])
    except Exception as exc:
        raise ParityError(f"the prompt-scoring graph failed on the validation prompt: {exc}") from exc
    if scored is None or len(scored.target_logprobs) != len(prompt) - 1:
        raise ParityError("the prompt-scoring graph did not score every prompt position")
    logits = step.logits[0].astype(np.float64)
    logprobs = logits - (logits.max() + np.log(np.exp(logits - logits.max()).sum()))
    target = prompt[-1]
    got = float(scored.target_logprobs[-1])
    errors = [abs(got - logprobs[target])]
    errors += list(np.abs(scored.top_logprobs[-1] - logprobs[scored.top_ids[-1]]))
    lowest = 1 + int((logprobs > logprobs[target] + SCORE_TOLERANCE).sum())
    highest = 1 + int((logprobs > logprobs[target] - SCORE_TOLERANCE).sum())
    rank = int(scored.target_ranks[-1])
    if not (max(errors) <= SCORE_TOLERANCE and lowest <= rank <= highest and np.isfinite(scored.target_logprobs).all()):
        raise ParityError(
            f"prompt scores disagree with the step graph: max |logprob error| {max(errors):.4g} "
            f"(tolerance {SCORE_TOLERANCE:g}), rank {rank} (expected {lowest}..{highest})"
        )

"""Runs the core's torch step program (`ignition export --target cuda`) and owns its KV pool.

The same contract as the ONNX runner (helios/engine/runner.py; both are `StepRunner`s): rows in,
one `StepOutput` out, new K/V written into the rows' pages. What differs is where it runs:

- The pool is one torch tensor on the device, in the program's dtype (bf16 on a GPU), with one
  spare page past the block manager's pages: padded rows of a captured batch write there.
- New K/V are scattered into the pool on the device, inside the same call as the program.
- Decode steps (every row one token, last position only, at most one explicit logprob id) run as
  CUDA graphs captured at start-up per batch bucket (1, 2, 4, 8, 16, ... up to max_concurrency),
  largest first in one memory pool: the live rows are copied into static buffers, the rest of
  the bucket is padding (history 0, the spare page), and the graph replays. Prefill, mixed and
  verification steps run eagerly. `DecodeGraphs` holds that logic; on a CPU (CI) its "graphs"
  are eager calls over the same static buffers, so bucket, padding and page logic are the same.

Pages leave and enter the pool as numpy arrays in the pool's dtype (bf16 as ml_dtypes' type): the
host store keeps them so, and a float32 page written in is rounded to the pool's type.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from helios.engine.runner import SPARE_STATE_SLOTS, PromptScorer
from helios.engine.step_io import (
    StepOutput,
    StepRow,
    check_rows,
    new_token_slots,
    pack_images,
    pack_rows,
    run_in_groups,
)
from helios.kernels import kv_dtype as kv_types
from helios.kernels import torch_ops  # noqa: F401 (registers flare::*, which torch.export.load needs)
from helios.manifest import Engine, Manifest

TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# Outputs of the step program, in order (docs/architecture.md, "The step graph").
OUTPUTS = ("logits", "logsumexp", "top_logprobs", "top_ids", "token_logprobs", "new_kv", "hidden")


def load_step_program(path: Path, device: torch.device) -> torch.nn.Module:
    """The program at `path` as a callable module on `device` (flare's ops are registered at import;
    their Triton kernels here, on CUDA)."""
    if device.type == "cuda":
        from helios.kernels.triton_attention import register_cuda_kernel

        register_cuda_kernel()
    program = torch.export.load(str(path))
    if device.type != "cpu":
        program = torch.export.passes.move_to_device_pass(program, device)
    return program.module()


def decode_buckets(max_batch: int) -> list[int]:
    """Captured decode batch sizes: 1, 2, 4, 8, then every 16 up to max_batch (nano-vllm's set)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return sorted(set(sizes + [max_batch]))


class TorchRunner:
    copies_pages = True
    exports_pages = True

    def __init__(
        self,
        core_dir: Path,
        manifest: Manifest,
        num_pages: int,
        device: str = "cpu",
        threads: int | None = None,
        state_slots: int | None = None,
        graphs: bool | None = None,
        max_batch: int | None = None,
    ) -> None:
        """graphs: decode through DecodeGraphs (default: on CUDA, for a core without recurrent state or
        images); on a CPU its graphs are eager stand-ins. max_batch: the largest bucket (default
        the core's max_concurrency)."""
        self.engine: Engine = manifest.engine("step", "cuda")
        if num_pages < 1:
            raise ValueError("num_pages must be >= 1")
        self.device = torch.device(device)
        if self.device.type == "cpu" and threads:
            torch.set_num_threads(threads)
        self.kv = manifest.kv
        self.num_pages = num_pages
        self.max_positions: int | None = manifest.architecture.max_position_embeddings
        self.graph_seconds = 0.0
        self.split_mixed = True
        self.dtype = TORCH_DTYPES[self.engine.dtype or "float32"]
        self.module = load_step_program(Path(core_dir) / self.engine.file, self.device)
        kv = self.kv
        # One spare page (index num_pages) that padded rows of a captured batch write to.
        self.pool = torch.zeros(
            (kv.num_layers * 2 * (num_pages + 1), kv.page_tokens, kv.kv_heads, kv.head_dim),
            dtype=self.dtype,
            device=self.device,
        )
        self.pages = self.pool.view(kv.num_layers, 2, num_pages + 1, kv.page_tokens, kv.kv_heads, kv.head_dim)
        names = {spec.name for spec in self.engine.inputs}
        self.takes_images = "image_embeds" in names
        self.hidden_size = manifest.architecture.hidden_size
        self.state_pool: torch.Tensor | None = None
        if manifest.state is not None:
            slots = state_slots if state_slots is not None else manifest.limits.max_concurrency + SPARE_STATE_SLOTS
            self.state_pool = torch.zeros((slots, manifest.state.width), dtype=torch.float32, device=self.device)
        score = next((e for e in manifest.engines if e.name == "score"), None)
        self.scorer = PromptScorer(Path(core_dir) / score.file, threads) if score is not None else None
        self.graphs: DecodeGraphs | None = None
        plain = self.state_pool is None and not self.takes_images  # the buffers hold no state or image inputs
        if graphs and not plain:
            raise ValueError("decode graphs need a core without recurrent state or images")
        if graphs if graphs is not None else (self.device.type == "cuda" and plain):
            self.graphs = DecodeGraphs(self, max_batch or manifest.limits.max_concurrency)

    # -- StepRunner ------------------------------------------------------------------------------

    @property
    def num_state_slots(self) -> int:
        return 0 if self.state_pool is None else self.state_pool.shape[0]

    @property
    def can_verify(self) -> bool:
        return True

    @property
    def can_score_prompts(self) -> bool:
        return self.scorer is not None

    @property
    def pool_bytes(self) -> int:
        return self.pool.numel() * self.pool.element_size()

    @property
    def decode_graph_launches(self) -> int:
        return self.graphs.launches if self.graphs is not None else 0

    @property
    def replay_gpu_ns(self) -> int:
        return self.graphs.replay_gpu_ns if self.graphs is not None else 0

    @property
    def pool_dtype(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def step(self, rows: list[StepRow]) -> StepOutput:
        check_rows(rows, self.kv, self.num_pages, self.max_positions, self.num_state_slots)
        started = time.perf_counter()
        if self.graphs is not None and self.graphs.fits(rows):
            out = self.graphs.run(rows)
        else:
            out = run_in_groups(rows, self.run_eager, self.split_mixed)
        self.graph_seconds += time.perf_counter() - started
        return out

    def copy_page(self, src: int, dst: int) -> None:
        if not (0 <= src < self.num_pages and 0 <= dst < self.num_pages):
            raise IndexError(f"page out of range 0..{self.num_pages - 1}: {src} -> {dst}")
        self.pages[:, :, dst] = self.pages[:, :, src]

    def read_pages(self, pages: list[int]) -> np.ndarray:
        """A copy in the pool's dtype (bfloat16 as ml_dtypes' numpy type)."""
        index = torch.as_tensor(pages, dtype=torch.int64, device=self.device)
        chosen = self.pages[:, :, index].cpu()
        if self.dtype == torch.bfloat16:  # numpy has no bfloat16: move the bits
            return chosen.view(torch.int16).numpy().view(kv_types.numpy_dtype("bfloat16"))
        return chosen.numpy()

    def write_pages(self, pages: list[int], data: np.ndarray) -> None:
        """`data` in read_pages' layout; another dtype is rounded to the pool's."""
        index = torch.as_tensor(pages, dtype=torch.int64, device=self.device)
        data = np.ascontiguousarray(data)
        if data.dtype == kv_types.numpy_dtype("bfloat16"):
            values = torch.from_numpy(data.view(np.int16)).view(torch.bfloat16)
        else:
            values = torch.from_numpy(data.astype(np.float32, copy=False))
        self.pages[:, :, index] = values.to(self.device, self.dtype)

    def read_state(self, slot: int) -> np.ndarray:
        if self.state_pool is None:
            raise ValueError("this core keeps no recurrent state")
        return self.state_pool[slot].cpu().numpy().copy()

    def write_state(self, slot: int, state: np.ndarray) -> None:
        if self.state_pool is None:
            raise ValueError("this core keeps no recurrent state")
        self.state_pool[slot] = torch.from_numpy(np.asarray(state, dtype=np.float32)).to(self.device)

    # -- one eager call --------------------------------------------------------------------------

    def program_args(self, packed: dict[str, torch.Tensor], state_slots: torch.Tensor | None = None) -> tuple:
        """The program's positional inputs: the contract's, then state, then image inputs."""
        args: tuple = tuple(
            packed[n] for n in ("input_ids", "positions", "history_lens", "query_lens", "block_tables")
        ) + (self.pool,)
        args += (packed["logprob_token_ids"], packed["logit_rows"], packed["logit_positions"])
        if self.state_pool is not None:
            args += (self.state_pool, state_slots)
        elif self.takes_images:
            args += (None, None)
        if self.takes_images:
            args += (packed["mrope_positions"], packed["image_embeds"].to(self.dtype), packed["image_slots"])
        return args

    def run_eager(self, rows: list[StepRow]) -> StepOutput:
        """One step without the decode graphs (what they are held against)."""
        arrays = pack_rows(rows, self.kv.page_tokens)
        if self.takes_images:
            arrays.update(pack_images(rows, arrays["positions"], self.hidden_size))
        elif any(r.image_features is not None for r in rows):
            raise ValueError("this core's step program takes no image features")
        packed = {k: torch.from_numpy(v).to(self.device) for k, v in arrays.items()}
        slots = None
        if self.state_pool is not None:
            slots = torch.tensor([r.state_slot for r in rows], dtype=torch.int64, device=self.device)
        with torch.inference_mode():
            outputs = self.module(*self.program_args(packed, slots))
            slot_pages, slot_offsets, rows_index, tokens_index = (
                torch.from_numpy(a).to(self.device) for a in new_token_slots(rows, self.kv.page_tokens)
            )
            self.pages[:, :, slot_pages, slot_offsets] = outputs[5][:, :, rows_index, tokens_index]
            if slots is not None:
                self.state_pool[slots] = outputs[7].float()
        return self.outputs_of(rows, outputs)

    def outputs_of(self, rows: list[StepRow], outputs: tuple, count: int | None = None) -> StepOutput:
        """StepOutput of the first `count` output rows (default all): logits and stats in fp32."""
        logits, lse, top_lp, top_ids, explicit, _, hidden = (o[:count] if count else o for o in outputs[:7])
        scores = None
        if any(r.score_targets is not None for r in rows):
            if self.scorer is None:
                raise ValueError("this core has no prompt-scoring graph (export it with --prompt-logprobs)")
            scores = self.scorer.score(rows, hidden.float().cpu().numpy())
        first = None
        if any(r.output_positions is not None for r in rows):
            first = np.cumsum([0] + [r.num_outputs for r in rows])[:-1].tolist()
        return StepOutput(
            logits=logits.float().cpu().numpy(),
            logsumexp=lse.float().cpu().numpy(),
            top_logprobs=top_lp.float().cpu().numpy(),
            top_ids=top_ids.cpu().numpy(),
            token_logprobs=explicit.float().cpu().numpy() if any(r.logprob_ids for r in rows) else None,
            prompt_scores=scores,
            first=first,
        )


class DecodeGraphs:
    """Decode steps as captured graphs, one per batch bucket, over static input buffers.

    A bucket's graph computes the program and the K/V scatter for `bucket` rows of one token each.
    Live rows are copied into the buffers' first rows; padded rows decode token 0 at position 0
    with no history and write their K/V into the spare page. Block tables are as wide as the
    longest sequence the pool allows (context / page_tokens), padded with the spare page.
    """

    def __init__(self, runner: TorchRunner, max_batch: int, capture: bool | None = None) -> None:
        self.runner = runner
        device, kv = runner.device, runner.kv
        self.spare = runner.num_pages
        # Block-table columns: the longest sequence the pool can hold (no sequence has more pages).
        self.width = min(-(-(runner.max_positions or 1 << 30) // kv.page_tokens), runner.num_pages)
        self.buckets = decode_buckets(max_batch)
        top = self.buckets[-1]

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int64, device=device)

        self.inputs = {
            "input_ids": zeros(top, 1),
            "positions": zeros(top, 1),
            "history_lens": zeros(top),
            "query_lens": torch.ones(top, dtype=torch.int64, device=device),
            "block_tables": torch.full((top, self.width), self.spare, dtype=torch.int64, device=device),
            "logprob_token_ids": zeros(top, 1),
            "logit_rows": torch.arange(top, device=device),
            "logit_positions": zeros(top),
        }
        self.slot_pages = torch.full((top,), self.spare, dtype=torch.int64, device=device)
        self.slot_offsets = zeros(top)
        self.outputs: dict[int, tuple] = {}
        self.replays: dict[int, Callable[[], None]] = {}
        self.launches = 0  # replays (metrics: graph launches by kind)
        self.replay_gpu_ns = 0  # their device time (CUDA events; 0 for the CPU stand-ins)
        self.captured = False
        self.capture_all(device.type == "cuda" if capture is None else capture)

    def fits(self, rows: list[StepRow]) -> bool:
        """A plain decode step of at most the largest bucket's rows."""
        return len(rows) <= self.buckets[-1] and all(
            len(r.token_ids) == 1
            and r.output_positions is None
            and r.score_targets is None
            and len(r.logprob_ids or ()) <= 1
            for r in rows
        )

    def bucket(self, batch: int) -> int:
        return next(b for b in self.buckets if b >= batch)

    def forward(self, bucket: int) -> tuple:
        """The program and the K/V scatter over the first `bucket` rows of the static buffers."""
        inputs = {name: value[:bucket] for name, value in self.inputs.items()}
        outputs = self.runner.module(*self.runner.program_args(inputs))
        rows = torch.arange(bucket, device=self.runner.device)
        self.runner.pages[:, :, self.slot_pages[:bucket], self.slot_offsets[:bucket]] = outputs[5][:, :, rows, 0]
        return outputs

    def capture_all(self, capture: bool) -> None:
        """CUDA graphs, largest bucket first, sharing one memory pool; on a CPU, eager stand-ins."""
        if not capture:
            for bucket in self.buckets:
                self.replays[bucket] = self._eager(bucket)
            return
        self.captured = True
        pool = None
        stream = torch.cuda.Stream()
        with torch.inference_mode():
            for bucket in reversed(self.buckets):
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    self.forward(bucket)  # warm-up: Triton compiles, allocator settles
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[bucket] = self.forward(bucket)
                pool = graph.pool() if pool is None else pool
                self.replays[bucket] = graph.replay
        # The warm-ups wrote padding K/V into the spare page only; live pages are untouched.

    def _eager(self, bucket: int) -> Callable[[], None]:
        def run() -> None:
            self.outputs[bucket] = self.forward(bucket)

        return run

    def run(self, rows: list[StepRow]) -> StepOutput:
        batch, page_tokens = len(rows), self.runner.kv.page_tokens
        bucket = self.bucket(batch)
        history = [r.history_len for r in rows]
        tables = np.full((bucket, self.width), self.spare, dtype=np.int64)
        for b, row in enumerate(rows):
            used = -(-row.history_len // page_tokens)
            tables[b, :used] = row.block_table[:used]
        slot_pages = np.full(bucket, self.spare, dtype=np.int64)
        slot_offsets = np.zeros(bucket, dtype=np.int64)
        for b, row in enumerate(rows):
            slot_pages[b] = row.block_table[row.history_len // page_tokens]
            slot_offsets[b] = row.history_len % page_tokens
        host = {
            "input_ids": np.array([[r.token_ids[0]] for r in rows] + [[0]] * (bucket - batch), dtype=np.int64),
            "positions": np.array([[h] for h in history] + [[0]] * (bucket - batch), dtype=np.int64),
            "history_lens": np.array(history + [0] * (bucket - batch), dtype=np.int64),
            "block_tables": tables,
            "logprob_token_ids": np.array(
                [[(r.logprob_ids or [0])[0]] for r in rows] + [[0]] * (bucket - batch), dtype=np.int64
            ),
        }
        with torch.inference_mode():
            for name, value in host.items():
                self.inputs[name][:bucket].copy_(torch.from_numpy(value), non_blocking=True)
            self.slot_pages[:bucket].copy_(torch.from_numpy(slot_pages), non_blocking=True)
            self.slot_offsets[:bucket].copy_(torch.from_numpy(slot_offsets), non_blocking=True)
            timing = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if self.captured else None
            if timing:
                timing[0].record()
            self.replays[bucket]()
            if timing:
                timing[1].record()
            self.launches += 1
            out = self.runner.outputs_of(rows, self.outputs[bucket], count=batch)  # copies to the host: synced
            if timing:
                self.replay_gpu_ns += int(timing[0].elapsed_time(timing[1]) * 1e6)
            return out

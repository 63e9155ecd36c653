"""Runs the core's step graph on onnxruntime and owns the paged KV pool.

The pool is one zeroed numpy array of the contract shape
[layers * 2 * num_pages, page_tokens, kv_heads, head_dim] (docs/architecture.md), float32 or a
16-bit type (helios.kernels.kv_dtype: the session's kv_pool input is retyped to match).
onnxruntime reads it in place through an OrtValue that wraps the numpy memory (never copied per
call); only the runner writes it, by scattering each step's new K/V into the rows' pages (already
rounded to the pool's type by the attention kernel, so the store is exact).

Plain data in and out: `StepRow`s (token ids, history length, page table) go in, a `StepOutput`
with one row of logits/logprob stats per input row comes out. No torch, no scheduler state.

A core with recurrent layers (manifest `state`) also gets a state pool [slots, width] float32,
bound the same way; each row names its sequence's slot (`StepRow.state_slot`) and the runner
writes the row's `new_state` back into that slot after the call.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from helios.engine.step_io import (
    PromptScores,
    StepOutput,
    StepRow,
    check_rows,
    pack_images,
    pack_rows,
    run_in_groups,
    scatter_new_kv,
)
from helios.kernels import kv_dtype as kv_types
from helios.kernels.head import candidate_ids_name, outside_logit_name
from helios.kernels.session import open_session
from helios.manifest import KVLayout, Manifest, StateLayout

# Prompt positions the score graph takes per call: its [N, V] logits and log-softmax are
# ~1.2 MB per position on a 152k vocabulary, so a 512-token chunk is scored in 4 slices.
SCORE_POSITIONS_PER_CALL = 128

# State slots beyond the engine's concurrency (tests and validation use a few of their own).
SPARE_STATE_SLOTS = 4


class Runner:
    copies_pages = True
    exports_pages = True
    decode_graph_launches = 0  # onnxruntime's CPU provider captures no graphs
    replay_gpu_ns = 0

    def __init__(
        self,
        core_dir: Path,
        manifest: Manifest,
        num_pages: int,
        threads: int | None = None,
        state_slots: int | None = None,
        kv_dtype: str = "float32",
    ) -> None:
        """state_slots: recurrent-state slots (cores with `state`); default the core's concurrency
        plus SPARE_STATE_SLOTS. kv_dtype: the pool's element type (float32, bfloat16, float16, or
        auto: helios.kernels.kv_dtype.resolve)."""
        engine = manifest.engine("step")
        if state_slots is None:
            state_slots = manifest.limits.max_concurrency + SPARE_STATE_SLOTS
        self._setup(
            Path(core_dir) / engine.file, manifest.kv, num_pages, threads, manifest.state, state_slots, kv_dtype
        )
        score = next((e for e in manifest.engines if e.name == "score"), None)
        self.scorer = PromptScorer(Path(core_dir) / score.file, threads) if score is not None else None
        # Positions past the graph's rotary tables would read out of range.
        self.max_positions = manifest.architecture.max_position_embeddings

    @classmethod
    def from_graph(
        cls,
        graph_path: Path,
        kv: KVLayout,
        num_pages: int,
        threads: int | None = None,
        score_graph: Path | None = None,
        state: StateLayout | None = None,
        state_slots: int = SPARE_STATE_SLOTS,
        kv_dtype: str = "float32",
    ) -> Runner:
        """A runner over a bare step graph (export validation has no core.json yet)."""
        runner = cls.__new__(cls)
        runner._setup(Path(graph_path), kv, num_pages, threads, state, state_slots, kv_dtype)
        runner.scorer = PromptScorer(Path(score_graph), threads) if score_graph is not None else None
        return runner

    def _setup(
        self,
        graph_path: Path,
        kv: KVLayout,
        num_pages: int,
        threads: int | None,
        state: StateLayout | None = None,
        state_slots: int = 0,
        kv_dtype: str = "float32",
    ) -> None:
        if num_pages < 1:
            raise ValueError("num_pages must be >= 1")
        if kv.dtype != "float32":  # the type the graph declares; the pool's own is kv_dtype
            raise ValueError(f"this runner takes step graphs with a float32 kv_pool, not {kv.dtype}")
        kv_dtype = kv_types.canonical(kv_dtype)
        if kv_dtype == "auto":
            kv_dtype = kv_types.resolve("auto", fused=kv_types.fused_reads_only(graph_path))
        self.kv = kv
        self.num_pages = num_pages
        self.threads = threads
        self.scorer: PromptScorer | None = None  # the core's score graph, when it has one
        self.max_positions: int | None = None
        self.split_mixed = True  # False: one graph call per step whatever the padding (tests)
        self.graph_seconds = 0.0  # time inside the step graph's runs (EngineStats.graph_seconds_total)
        # kernels: what runs the graph's ai.flare operators ("flare", "onnxruntime" or "").
        self.session, self.kernels = open_session(
            graph_path, self._session_options(), ["CPUExecutionProvider"], kv_dtype, candidates=True
        )
        self.pool = np.zeros(
            (kv.num_layers * 2 * num_pages, kv.page_tokens, kv.kv_heads, kv.head_dim),
            dtype=kv_types.numpy_dtype(kv_dtype),
        )
        self._pool_dtype = kv_dtype
        # Wraps the numpy buffer (no copy): writes to self.pool are what the next call reads.
        self._pool_value = kv_types.ort_value(self.pool)
        # The same memory as [layers, 2, pages, tokens, kvh, D]: the scatter/copy view.
        self._pages = self.pool.reshape(kv.num_layers, 2, num_pages, kv.page_tokens, kv.kv_heads, kv.head_dim)
        self._output_names = [o.name for o in self.session.get_outputs()]
        # What every step reads; token_logprobs and hidden only for rows that ask for them.
        self._step_outputs = [n for n in self._output_names if n not in ("token_logprobs", "hidden")]
        self._input_names = {i.name for i in self.session.get_inputs()}
        # A multimodal step graph (manifest `vision`) takes image features of this width.
        self.takes_images = "image_embeds" in self._input_names
        self.hidden_size = next((i.shape[1] for i in self.session.get_inputs() if i.name == "image_embeds"), 0)
        # Recurrent state: [slots, width], zeroed; the graph ignores a slot's contents for a row
        # without history, so a slot is reused without clearing.
        self.state = state
        self.state_pool: np.ndarray | None = None
        if state is not None:
            if state.dtype != "float32":
                raise ValueError(f"this runner supports a float32 state pool, not {state.dtype}")
            if state_slots < 1:
                raise ValueError("a core with recurrent state needs state_slots >= 1")
            if "state_pool" not in self._input_names:
                raise ValueError("the core declares recurrent state but its step graph has no state_pool input")
            self.state_pool = np.zeros((state_slots, state.width), dtype=np.float32)
            self._state_value = ort.OrtValue.ortvalue_from_numpy(self.state_pool)

    @property
    def num_state_slots(self) -> int:
        """Recurrent-state slots (0: the core keeps no per-sequence state)."""
        return 0 if self.state_pool is None else self.state_pool.shape[0]

    def _session_options(self) -> ort.SessionOptions:
        return session_options(self.threads)

    # -- public API -----------------------------------------------------------------------------

    def step(self, rows: list[StepRow]) -> StepOutput:
        """Run one engine step over `rows`, write their new K/V into the pool, return each row's
        outputs (one, or one per output position), in row order."""
        check_rows(rows, self.kv, self.num_pages, self.max_positions, self.num_state_slots)
        return run_in_groups(rows, self._run, self.split_mixed)

    @property
    def can_score_prompts(self) -> bool:
        return self.scorer is not None

    def copy_page(self, src: int, dst: int) -> None:
        """Copy one page (every layer's K and V) onto another: copy-on-write for shared prefixes."""
        if not (0 <= src < self.num_pages and 0 <= dst < self.num_pages):
            raise IndexError(f"page out of range 0..{self.num_pages - 1}: {src} -> {dst}")
        self._pages[:, :, dst] = self._pages[:, :, src]

    def read_pages(self, pages: list[int]) -> np.ndarray:
        return self._pages[:, :, pages]  # fancy indexing: a fresh copy, in the pool's dtype

    def write_pages(self, pages: list[int], data: np.ndarray) -> None:
        self._pages[:, :, pages] = data  # another dtype is rounded to the pool's

    def read_state(self, slot: int) -> np.ndarray:
        if self.state_pool is None:
            raise ValueError("this core keeps no recurrent state")
        return self.state_pool[slot].copy()

    def write_state(self, slot: int, state: np.ndarray) -> None:
        if self.state_pool is None:
            raise ValueError("this core keeps no recurrent state")
        self.state_pool[slot] = state

    @property
    def pool_bytes(self) -> int:
        return self.pool.nbytes

    @property
    def pool_dtype(self) -> str:
        return self._pool_dtype

    # -- internals ------------------------------------------------------------------------------

    @property
    def can_verify(self) -> bool:
        """The step graph returns outputs at chosen positions (format 1.7): speculation can run."""
        return "logit_positions" in self._input_names

    def _run(self, rows: list[StepRow]) -> StepOutput:
        if not self.can_verify and any(r.output_positions is not None for r in rows):
            raise ValueError("this core's step graph returns each row's last position only (re-export it)")
        binding = self.session.io_binding()
        packed = pack_rows(rows, self.kv.page_tokens)
        if self.takes_images:
            packed.update(pack_images(rows, packed["positions"], self.hidden_size))
        elif any(r.image_features is not None for r in rows):
            raise ValueError("this core's step graph takes no image features")
        for name, value in packed.items():
            if name in self._input_names:  # a 1.1 core's graph has no logprob_token_ids
                binding.bind_cpu_input(name, value)
        binding.bind_ortvalue_input("kv_pool", self._pool_value)
        slots = None
        if self.state_pool is not None:
            slots = np.array([r.state_slot for r in rows], dtype=np.int64)
            binding.bind_ortvalue_input("state_pool", self._state_value)
            binding.bind_cpu_input("state_slots", slots)
        # Only the outputs this step reads are fetched: each costs a binding and a wrapper.
        fetched = [*self._step_outputs]
        if any(r.logprob_ids for r in rows) and "token_logprobs" in self._output_names:
            fetched.append("token_logprobs")
        if any(r.score_targets is not None for r in rows) and "hidden" in self._output_names:
            fetched.append("hidden")
        for name in fetched:
            binding.bind_output(name, "cpu")
        start = time.perf_counter()
        self.session.run_with_iobinding(binding)
        self.graph_seconds += time.perf_counter() - start
        # OrtValues stay in onnxruntime's memory; only the outputs used are turned into arrays.
        values = dict(zip(fetched, binding.get_outputs()))
        out = {name: values[name].numpy() for name in ("logits", "logsumexp", "top_logprobs", "top_ids")}
        for field, name in (
            ("candidate_ids", candidate_ids_name("top_ids")),
            ("outside_logit", outside_logit_name("top_ids")),
        ):
            out[field] = values[name].numpy() if name in values else None  # where the head runs fused
        scatter_new_kv(self._pages, rows, values["new_kv"].numpy())
        if slots is not None:  # the state after each row's last new token
            self.state_pool[slots] = values["new_state"].numpy()
        explicit = None
        if any(r.logprob_ids for r in rows):
            if "token_logprobs" not in values:
                raise ValueError("this core's step graph has no explicit logprob ids (re-export it)")
            explicit = values["token_logprobs"].numpy()
        scores = None
        if any(r.score_targets is not None for r in rows):
            if self.scorer is None:
                raise ValueError("this core has no prompt-scoring graph (export it with --prompt-logprobs)")
            scores = self.scorer.score(rows, values["hidden"].numpy())
        first = None
        if any(r.output_positions is not None for r in rows):
            first = np.cumsum([0] + [r.num_outputs for r in rows])[:-1].tolist()
        return StepOutput(**out, token_logprobs=explicit, prompt_scores=scores, first=first)


# The score graph's outputs, by name (a fused head adds more), in PromptScores' field order.
SCORE_OUTPUTS = ["target_logprobs", "target_ranks", "top_logprobs", "top_ids"]


class PromptScorer:
    """The core's prompt-scoring graph (onnxruntime, CPU) over a step's hidden states: what any
    runner uses for rows with score_targets."""

    def __init__(self, path: Path, threads: int | None = None) -> None:
        self.path = path
        self.threads = threads
        self._session: ort.InferenceSession | None = None

    def score(self, rows: list[StepRow], hidden: np.ndarray) -> list[PromptScores | None]:
        """Run the score graph over every scored position of `rows` (hidden: [B, L, H])."""
        picked, targets, owners = [], [], []
        for b, row in enumerate(rows):
            if row.score_targets is None:
                continue
            t = np.asarray(row.score_targets, dtype=np.int64)
            if t.shape != (len(row.token_ids),):
                raise ValueError("score_targets needs one entry per new token")
            keep = np.nonzero(t >= 0)[0]
            picked.append(hidden[b, keep])
            targets.append(t[keep])
            owners.append((b, len(keep)))
        flat_hidden = np.ascontiguousarray(np.concatenate(picked), dtype=np.float32)
        flat_targets = np.concatenate(targets)
        results = []
        for lo in range(0, len(flat_targets), SCORE_POSITIONS_PER_CALL):
            hi = lo + SCORE_POSITIONS_PER_CALL
            feeds = {"hidden": flat_hidden[lo:hi], "targets": flat_targets[lo:hi]}
            results.append(self.session.run(SCORE_OUTPUTS, feeds))
        if results:
            merged = [np.concatenate(parts) for parts in zip(*results)]
        else:
            merged = [
                np.zeros((0,), np.float32),
                np.zeros((0,), np.int64),
                np.zeros((0, 0), np.float32),
                np.zeros((0, 0), np.int64),
            ]
        scores: list[PromptScores | None] = [None] * len(rows)
        at = 0
        for b, n in owners:
            scores[b] = PromptScores(*(m[at : at + n] for m in merged))
            at += n
        return scores

    @property
    def session(self) -> ort.InferenceSession:
        if self._session is None:  # loaded on first use
            self._session, _ = open_session(self.path, session_options(self.threads), ["CPUExecutionProvider"])
        return self._session


def session_options(threads: int | None) -> ort.SessionOptions:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads or os.cpu_count() or 1
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    # Shapes change every step (B, L, and M every page_tokens tokens). onnxruntime caches
    # a memory pattern per distinct input-shape set, which would only grow here; the arena
    # still reuses buffers. For the same reason the runner does not pad B/L to buckets: the
    # CPU provider compiles nothing per shape, so padding would only add work.
    opts.enable_mem_pattern = False
    return opts

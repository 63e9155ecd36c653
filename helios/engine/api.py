"""Plain-data types that cross the boundary between the HTTP frontend and the engine.

The engine (scheduler, KV pages, runner, sampler) never sees HTTP; the server never sees
sequences or pages. A request goes in as `GenerationRequest`; `Engine.submit` returns a
`RequestStream` that yields `GenerationEvent`s until one has `finished=True`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:  # a type only: the plain-data module imports no engine machinery
    from helios.engine.host_store import HostStoreStats


@dataclass
class SamplingParams:
    """Resolved sampling: already clamped to the core's ranges (see helios.neutral.sampling)."""

    temperature: float = 1.0  # always > 0 after resolution
    top_p: float = 1.0
    top_k: int = -1  # <= 0 disables
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None  # None: nondeterministic
    max_tokens: int = 16  # generated-token budget; 0 only with prompt scoring (else never submitted)
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)  # string stops, matched across token boundaries
    stop_token_ids: list[int] = field(default_factory=list)  # ids that end generation (no entry)
    stop_token_sequences: list[list[int]] = field(default_factory=list)  # id runs that end it (no entries)
    logprobs: int | None = None  # None: no logprobs; k in 0..20: chosen token plus k alternatives
    # Explicit ids (deduplicated, caller order) reported instead of natural alternatives.
    logprob_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    # OpenAI logit_bias: token id -> additive bias applied to the logits before sampling (never
    # to reported logprobs, which stay the model's raw distribution). Empty: none.
    logit_bias: dict[int, float] = field(default_factory=dict)

    @property
    def has_user_stops(self) -> bool:
        return bool(self.stop or self.stop_token_ids or self.stop_token_sequences)


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, stop token id, or stop string
    LENGTH = "length"  # max_tokens reached, or context/page capacity exhausted
    ABORT = "abort"  # cancelled: by the client, or (GenerationEvent.error says why) by the server
    ERROR = "error"  # engine failure; GenerationEvent.error has the message


class CheckpointRole(str, enum.Enum):
    """Why a prompt position is a candidate prefix-checkpoint boundary (api.md, GPU checkpoints)."""

    ANCHOR = "anchor"  # end of the shared preamble (system + tools), before the first message
    HINT = "hint"  # end of a client-marked block (Anthropic cache_control, first four)
    MESSAGE = "message"  # end of a whole rendered message
    ENDPOINT = "endpoint"  # the exact end of the prompt


@dataclass(frozen=True)
class CheckpointCandidate:
    """A prompt position where the engine may capture an immutable KV checkpoint.

    `position` counts whole prompt tokens before the boundary (0 < position <= prompt length).
    The engine chooses among candidates under its work allowance and storage budget; nothing
    is ever captured or reused at a position that was not offered here."""

    position: int
    role: CheckpointRole


@dataclass
class ImageInput:
    """One image of a prompt (a core with a vision graph): where its tokens sit, what the profile
    made of it, and its decoded pixels (helios.engine.vision turns them into features)."""

    offset: int  # prompt index of its first image token
    tokens: int  # image tokens it occupies (its features)
    grid: tuple[int, int]  # (rows, cols) of encoder patches after resizing
    size: tuple[int, int]  # (height, width) after resizing
    pixels: Any  # decoded RGB, uint8 [height0, width0, 3] (numpy)
    digest: bytes  # content and processing settings: the image's part of prefix identity


@dataclass
class GenerationRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    # Candidate prefix-checkpoint boundaries (helios.neutral.prefix_boundaries computes them).
    checkpoints: list[CheckpointCandidate] = field(default_factory=list)
    # Bare positions of client cache hints; the engine treats each as a HINT candidate.
    checkpoint_hints: list[int] = field(default_factory=list)
    # Structured output: an llguidance grammar (compiled spec string, helios.neutral.grammar)
    # masking the answer's tokens once reasoning has ended. None: unconstrained.
    grammar: str | None = None
    # Reasoning delimiters and budget (helios.engine.constraints). None: no reasoning syntax.
    reasoning: ReasoningControl | None = None
    # Prompt scoring (api.md "Prompt log probabilities"): None, or the natural alternatives
    # (0..20) per prompt position. Scoring starts from an uncached prompt.
    prompt_logprobs: int | None = None
    # time.monotonic() after which a request never yet admitted to a batch gives up waiting:
    # it ends with ABORT and an error saying so (the server's bounded queue wait). None: no bound.
    queue_deadline: float | None = None
    # Images of the prompt, in prompt order (a core with a vision graph; empty otherwise).
    images: list[ImageInput] = field(default_factory=list)
    # The client's conversation id (prompt_cache_key or a session header): a routing hint for a
    # scale-out frontend (helios.cluster); the engine ignores it.
    session_hint: str | None = None


@dataclass
class ReasoningControl:
    """Plain data the engine needs to track reasoning by token and cap it.

    budget applies only when output starts inside reasoning (`starts_open`): after `budget`
    generated reasoning tokens the close token is forced (when the close is one token)."""

    open_token_id: int | None  # single-token opener, None when matched as text
    close_token_id: int | None  # single-token close, None when matched as text
    starts_open: bool  # the prompt opened reasoning
    budget: int | None = None
    tool_open_ids: list[int] = field(default_factory=list)  # single-token tool openers (implicit close)
    tool_open_texts: list[str] = field(default_factory=list)  # an undecided opener delays a forced close


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    # (token_id, logprob): natural alternatives best first, or, when `explicit`, the caller's
    # logprob_token_ids in caller order (+ the chosen token when absent), never truncated.
    top: list[tuple[int, float]]
    explicit: bool = False


@dataclass
class PromptLogprob:
    """One scored prompt position: the actual token and up to k natural alternatives, each as
    (token_id, logprob, rank); rank = 1 + count of vocabulary entries with a greater logprob."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float, int]]


@dataclass
class GenerationEvent:
    """Output since the previous event of the same request.

    token_ids are the newly committed generated tokens (including ones whose text is still held
    back by the detokenizer or a possible stop match); text is the newly released text.
    """

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None = None
    # Prompt scores of the positions completed since the last event (position 0 is None), in
    # prompt order; every scored prompt's entries arrive before its first generated token.
    prompt_logprobs: list[PromptLogprob | None] | None = None
    finished: bool = False
    finish_reason: FinishReason | None = None
    stop_reason: str | int | list[int] | None = None  # the matched stop string, stop token id or id run
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens reused from prefix checkpoints at admission
    completion_tokens: int = 0  # cumulative generated tokens so far
    error: str | None = None


@dataclass
class EngineStats:
    active: int  # admitted sequences (holding pages)
    pending: int  # submitted, waiting for admission (new or preempted)
    free_pages: int
    total_pages: int
    page_tokens: int
    prefill_tokens_total: int  # prompt (and recomputed) tokens fed in prefill chunks
    generated_tokens_total: int
    completed_total: int  # finished with STOP or LENGTH
    cancelled_total: int  # ABORT
    failed_total: int  # ERROR
    steps_total: int
    admitted_total: int  # requests admitted for the first time
    preempted_total: int
    step_seconds_total: float
    schedule_seconds_total: float
    # Prefix checkpoints (helios.engine.prefix_cache).
    reused_tokens_total: int = 0  # prompt tokens restored from checkpoints (every admission)
    cache_hits_total: int = 0  # admissions that restored a checkpoint
    cached_pages: int = 0  # pages owned by checkpoints
    checkpoint_storage_pages: int = 0  # the most pages checkpoints may own
    intake_pages: int = 0  # pages of checkpoints fetched from the host store
    checkpoints: int = 0  # checkpoints held
    checkpoint_captures: dict[str, int] = field(default_factory=dict)  # by role: anchor/message/endpoint
    checkpoint_skips: dict[str, int] = field(default_factory=dict)  # unknown_cost/work_budget/storage/recurrent_state
    checkpoint_evictions_total: int = 0
    checkpoint_extra_work_ns_total: int = 0  # charged predicted copy work
    # Output constraints (helios.engine.constraints).
    reasoning_budget_cuts_total: int = 0  # requests whose reasoning was closed by their budget
    grammar_mask_seconds_total: float = 0.0  # time computing grammar masks (beside the forward pass)
    # Seconds inside onnxruntime's graph runs (part of step_seconds_total): the rest of the step
    # time is host work (scheduling, packing inputs, KV scatter, sampling, detokenizing).
    graph_seconds_total: float = 0.0
    decode_graph_launches_total: int = 0  # steps replayed as captured decode graphs (torch runner on CUDA)
    replay_gpu_ns_total: int = 0  # their summed device time
    host_store: HostStoreStats | None = None  # None: no host prefix store
    # Speculative decoding (helios.engine.speculation; api.md's table).
    verification_rounds_total: int = 0  # progressing decode rounds, zero-draft ones included
    verification_drafts_total: int = 0  # drafts offered in them, rejected ones included
    accepted_drafts_total: int = 0  # drafts committed (the bonus token excluded)
    draft_rounds_total: int = 0  # rounds that offered at least one draft
    rounds_by_width: dict[int, int] = field(default_factory=dict)  # step graphs by their widest round's drafts
    history_drafts_enabled: bool = False
    draft_steps_total: int = 0  # draft positions the learned drafter ran
    learned_drafter: bool = False  # the core's learned drafter proposes drafts
    # Image input (helios.engine.vision.ImagePlacer.counters): api.md's input_* counters.
    images: dict[str, int] = field(default_factory=dict)
    kv_pool_bytes: int = 0  # the KV pool's memory (the learned drafter's pool not included)
    kv_pool_dtype: str = ""  # its element type ("float32", "bfloat16", "float16")


Sink = Callable[[GenerationEvent], None]


@runtime_checkable
class ServingEngine(Protocol):
    """The engine as the server sees it. helios.engine.engine.Engine (one process) and
    helios.cluster.engine.ClusterEngine (replicas on Ray Serve) implement it; so do the tests'
    scripted engines. Every method may be called from any thread."""

    def submit(self, request: GenerationRequest, sink: Sink) -> None:
        """Queue a request; `sink` receives its events, the last one `finished`."""
        ...

    def abort(self, request_id: str, reason: str | None = None) -> bool:
        """End a request early (its sink gets a final ABORT event); False: it already ended."""
        ...

    def abort_all(self, reason: str) -> int:
        """Abort every live request (a draining server); returns how many."""
        ...

    def num_pending(self) -> int:
        """Requests submitted and not yet admitted (the server's queue bound reads it)."""
        ...

    def healthy(self) -> bool:
        """The step loop is alive and accepting work."""
        ...

    def stats(self) -> EngineStats: ...

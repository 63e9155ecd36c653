"""Plain-data types that cross the boundary between the HTTP frontend and the engine.

The engine (scheduler, KV pages, runner, sampler) never sees HTTP; the server never sees
sequences or pages. A request goes in as `GenerationRequest`; `Engine.submit` returns a
`RequestStream` that yields `GenerationEvent`s until one has `finished=True`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """Resolved sampling: already clamped to the core's ranges (see helios.frontend.sampling)."""

    temperature: float = 1.0  # always > 0 after resolution
    top_p: float = 1.0
    top_k: int = -1  # <= 0 disables
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None  # None: nondeterministic
    max_tokens: int = 16  # generated-token budget; 0 is handled by the frontend (never submitted)
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)  # string stops, matched across token boundaries
    stop_token_ids: list[int] = field(default_factory=list)  # ids that end generation (no entry)
    logprobs: int | None = None  # None: no logprobs; k in 0..20: chosen token plus k alternatives
    include_stop_str_in_output: bool = False


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, stop token id, or stop string
    LENGTH = "length"  # max_tokens reached, or context/page capacity exhausted
    ABORT = "abort"  # cancelled by the client
    ERROR = "error"  # engine failure; GenerationEvent.error has the message


@dataclass
class GenerationRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    # Prompt positions at which prefix checkpoints may be captured (engine-speed issue).
    checkpoint_hints: list[int] = field(default_factory=list)


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token_id, logprob) natural alternatives, best first


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
    finished: bool = False
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the matched stop string or stop token id
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens reused from prefix checkpoints at admission
    completion_tokens: int = 0  # cumulative generated tokens so far
    error: str | None = None

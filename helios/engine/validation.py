"""What the engine accepts: the checks `Engine.submit` runs before queueing a request.

Plain data, so a frontend that reaches its engines remotely (helios.cluster) runs the very same
checks before dispatch and a bad request is a 400, never a failed stream.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from helios.engine.api import GenerationRequest
from helios.manifest import Manifest


@dataclass(frozen=True)
class RequestCheck:
    context_length: int
    vocab_size: int
    max_top_logprobs: int
    explicit_token_ids: bool
    max_explicit_token_ids: int
    can_score_prompts: bool  # the core has a prompt-scoring graph

    @classmethod
    def for_core(cls, manifest: Manifest, can_score_prompts: bool) -> RequestCheck:
        caps = manifest.logprobs
        return cls(
            context_length=manifest.limits.context_length,
            vocab_size=manifest.architecture.vocab_size,
            max_top_logprobs=caps.max_top_logprobs,
            explicit_token_ids=caps.explicit_token_ids,
            max_explicit_token_ids=caps.max_explicit_token_ids,
            can_score_prompts=can_score_prompts,
        )

    def __call__(self, request: GenerationRequest) -> None:
        """Raise ValueError (the server's 400) for a request the engine cannot run."""
        prompt = request.prompt_token_ids
        n = len(prompt)
        if n == 0:
            raise ValueError("the prompt has no tokens")
        if n + 1 > self.context_length:
            raise ValueError(
                f"the prompt has {n} tokens; with at least one output token this exceeds the "
                f"context length of {self.context_length} tokens"
            )
        ids = np.asarray(prompt)
        if ids.dtype.kind not in "iu" or ids.min() < 0 or ids.max() >= self.vocab_size:
            raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size})")
        s = request.sampling
        scoring = request.prompt_logprobs is not None
        if s.max_tokens < (0 if scoring else 1):
            raise ValueError("max_tokens must be at least 1")
        top = self.max_top_logprobs
        if s.logprobs is not None and not 0 <= s.logprobs <= top:
            raise ValueError(f"logprobs must be between 0 and {top} for this core")
        if s.logprob_token_ids:
            if not self.explicit_token_ids or s.logprobs is None:
                raise ValueError(
                    "explicit logprob token ids need a core with explicit-ID logprob inputs and logprobs on"
                )
            if len(s.logprob_token_ids) > self.max_explicit_token_ids:
                raise ValueError(f"at most {self.max_explicit_token_ids} logprob token ids")
            if min(s.logprob_token_ids) < 0 or max(s.logprob_token_ids) >= self.vocab_size:
                raise ValueError(f"logprob token ids must be in [0, {self.vocab_size})")
        if s.logit_bias:
            if min(s.logit_bias) < 0 or max(s.logit_bias) >= self.vocab_size:
                raise ValueError(f"logit_bias token ids must be in [0, {self.vocab_size})")
            if not all(math.isfinite(b) for b in s.logit_bias.values()):
                raise ValueError("logit_bias values must be finite")
        if scoring:
            if not self.can_score_prompts:
                raise ValueError(
                    "prompt logprobs are not available in this model core; re-export it with --prompt-logprobs"
                )
            if not 0 <= request.prompt_logprobs <= top:
                raise ValueError(f"prompt_logprobs must be between 0 and {top}")

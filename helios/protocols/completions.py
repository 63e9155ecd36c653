"""POST /v1/completions: raw prompts (text or token ids, optionally batched) without templates.

Choice index = prompt_index * n + choice_index. Usage counts each prompt once; cached usage is
each prompt's first choice's admission count; completion usage sums every choice. max_tokens 0
tokenizes (and echoes) without submitting anything, unless the prompt is scored (echo with
logprobs, or prompt_logprobs): then the prompt is submitted and nothing is generated.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from helios.engine.api import GenerationEvent, GenerationRequest, SamplingParams
from helios.neutral.answer import ChoiceState
from helios.neutral.errors import RequestError
from helios.neutral.prefix_boundaries import endpoint
from helios.neutral.request import engine_requests
from helios.neutral.sampling import (
    check_top_logprobs,
    parse_token_ids,
    requested_max_tokens,
    resolve_max_tokens,
)
from helios.neutral.tokenizer import Tokenizer
from helios.protocols import common
from helios.protocols.fields import choice_count, opt_bool, opt_int, reject_present
from helios.transport.context import ServerContext
from helios.transport.generation import Codec, Frame


@dataclass
class Prompt:
    token_ids: list[int]
    echo_text: str  # the original text, or the decoded token prompt


@dataclass
class CompletionPlan:
    response_id: str
    prompts: list[Prompt]
    n: int
    requests: list[GenerationRequest]  # empty when max_tokens is 0
    echo: bool
    stream: bool
    options: common.StreamOptions
    logprobs: int | None
    as_token_ids: bool
    base: SamplingParams
    echo_scores: bool = False  # echo with logprobs: prompt entries lead the logprobs arrays
    cache_key: str | None = None  # prompt_cache_key: a routing hint
    prompt_logprobs: int | None = None  # alternatives of choices[i].prompt_logprobs; None: omitted

    def prompt_of(self, choice_index: int) -> int:
        return choice_index // self.n


def decode_prompts(value: Any, tokenizer: Tokenizer, vocab_size: int) -> list[Prompt]:
    """string | [string] | [id] | [[id]] -> prompts, ids validated against the vocabulary."""
    if isinstance(value, str):
        return [_text_prompt(value, tokenizer)]
    if not isinstance(value, list) or not value:
        raise RequestError(
            "prompt must be a string, an array of strings, or a nonempty array of token ids", param="prompt"
        )
    if all(isinstance(v, str) for v in value):
        return [_text_prompt(v, tokenizer) for v in value]
    if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return [_token_prompt(value, tokenizer, vocab_size)]
    if all(isinstance(v, list) for v in value):
        return [_token_prompt(v, tokenizer, vocab_size) for v in value]
    raise RequestError("prompt mixes strings, token ids and arrays", param="prompt")


def _text_prompt(text: str, tokenizer: Tokenizer) -> Prompt:
    ids = tokenizer.encode_raw_prompt(text)
    if not ids:
        raise RequestError("an empty text prompt needs a BOS token, and this model core has none", param="prompt")
    return Prompt(ids, text)


def _token_prompt(ids: list[Any], tokenizer: Tokenizer, vocab_size: int) -> Prompt:
    if not ids:
        raise RequestError("token-id prompts must not be empty", param="prompt")
    checked = parse_token_ids(ids, "prompt", vocab_size)
    return Prompt(checked, tokenizer.decode(checked))


@dataclass(frozen=True)
class CompletionRequest:
    """A Completions body decoded once: every field validated, the prompts tokenized; build()
    reads only this."""

    prompts: list[Prompt]
    n: int
    stream: bool
    stream_options: common.StreamOptions
    echo: bool
    top_logprobs: int | None  # natural alternatives per entry; None: logprobs off
    echo_scores: bool  # echo with logprobs: the prompt's entries lead the arrays (api.md)
    prompt_logprobs: int | None  # the prompt_logprobs field's count (or echo's)
    scoring: int | None  # alternatives the engine scores the prompt with; None: unscored
    sampling: SamplingParams  # without max_tokens, which depends on each prompt
    max_tokens: int | None
    as_token_ids: bool
    cache_key: str | None  # prompt_cache_key: a routing hint


def decode(ctx: ServerContext, body: dict[str, Any]) -> CompletionRequest:
    """The body's fields, checked in the order their errors are reported."""
    m = ctx.manifest
    if body.get("suffix") is not None:
        raise RequestError("suffix is not supported", param="suffix")
    reject_present(body, ("tools", "tool_choice"), "by raw completions")
    reject_present(body, ("thinking_token_budget",), "by raw completions (no reasoning region)")
    common.reject_unsupported_extensions(body, biased=True)
    n = choice_count(body)
    best_of = opt_int(body, "best_of", None)
    if best_of is not None and best_of != n:
        raise RequestError("best_of must equal n (ranked sampling is not supported)", param="best_of")
    stream = opt_bool(body, "stream", False)
    echo = opt_bool(body, "echo", False)
    raw_logprobs = common.opt_logprob_count(body, "logprobs")
    # echo with logprobs scores the prompt too (its entries lead the arrays, api.md).
    echo_scores = echo and raw_logprobs is not None
    if echo_scores:
        common.prompt_logprobs_count(raw_logprobs, streaming=stream, manifest=m, name="logprobs")
    k = check_top_logprobs(raw_logprobs, "logprobs", m.logprobs) if raw_logprobs is not None else None
    explicit = common.logprob_token_ids(body, k is not None, m)
    field = common.prompt_logprobs_count(body.get("prompt_logprobs"), streaming=stream, manifest=m)
    # An explicit prompt_logprobs wins for that field; echo infers it from logprobs.
    prompt_k = field if field is not None else (k if echo_scores else None)
    scoring = max(k or 0, prompt_k or 0) if (echo_scores or prompt_k is not None) else None

    if "prompt" not in body:
        raise RequestError("prompt is required", param="prompt")
    raw = body["prompt"]
    count = len(raw) if isinstance(raw, list) and raw and not isinstance(raw[0], (int, bool)) else 1
    if count * n > ctx.admission.slots:
        # Checked before tokenizing: an oversized group is a 400 whatever its prompts hold.
        raise RequestError(
            f"{count} prompt(s) x n={n} needs more admission slots than this server has ({ctx.admission.slots})",
            param="n",
        )
    sampling = common.request_sampling(body, m, logprobs=k, biased=True)
    sampling.logprob_token_ids = explicit
    return CompletionRequest(
        prompts=decode_prompts(raw, ctx.tokenizer, m.architecture.vocab_size),
        n=n,
        stream=stream,
        stream_options=common.stream_options(body),
        echo=echo,
        top_logprobs=k,
        echo_scores=echo_scores,
        prompt_logprobs=prompt_k,
        scoring=scoring,
        sampling=sampling,
        max_tokens=requested_max_tokens(body.get("max_tokens"), allow_zero=True),
        as_token_ids=opt_bool(body, "return_tokens_as_token_ids", False),
        cache_key=common.prompt_cache_key(body),
    )


def build(ctx: ServerContext, request: CompletionRequest, response_id: str) -> CompletionPlan:
    """One engine request per (prompt, choice), each with its own output budget."""
    prompts = request.prompts
    limits = ctx.manifest.limits
    budgets = [resolve_max_tokens(request.max_tokens, len(p.token_ids), limits) for p in prompts]
    requests: list[GenerationRequest] = []
    # max_tokens 0 reaches the model only to score the prompt (api.md).
    if any(budgets) or request.scoring is not None:
        for pi, (prompt, budget) in enumerate(zip(prompts, budgets)):
            requests += engine_requests(
                response_id,
                prompt.token_ids,
                dataclasses.replace(request.sampling, max_tokens=budget),
                choices=request.n,
                first_index=pi * request.n,
                checkpoints=endpoint(prompt.token_ids),  # raw prompts: the endpoint only
                prompt_logprobs=request.scoring,
            )
    return CompletionPlan(
        response_id=response_id,
        prompts=prompts,
        n=request.n,
        requests=requests,
        echo=request.echo,
        stream=request.stream,
        options=request.stream_options,
        logprobs=request.top_logprobs,
        as_token_ids=request.as_token_ids,
        base=request.sampling,
        echo_scores=request.echo_scores,
        prompt_logprobs=request.prompt_logprobs,
        cache_key=request.cache_key,
    )


def plan(ctx: ServerContext, body: dict[str, Any], response_id: str) -> CompletionPlan:
    """Decode, then build (runs in the frontend pool)."""
    return build(ctx, decode(ctx, body), response_id)


# -- encoding --------------------------------------------------------------------------------------


class CompletionEncoder(common.OpenAIStream):
    """One ChoiceState per (prompt, choice); a text_completion object or its chunks. Without
    engine requests (max_tokens 0, unscored) every choice is the echo alone, finished by length."""

    def __init__(self, ctx: ServerContext, p: CompletionPlan):
        self.ctx, self.p, self.options = ctx, p, p.options
        self.states = [ChoiceState(i, ctx.tokenizer) for i in range(len(p.prompts) * p.n)]
        self.created = common.now()
        self.echoed = [not p.echo] * len(self.states)
        self.scored = [0] * len(self.states)  # prompt entries streamed per choice

    def usage(self) -> dict[str, Any]:
        p = self.p
        prompt_tokens = sum(len(pr.token_ids) for pr in p.prompts)
        if not p.requests:
            return common.usage(prompt_tokens, 0, 0)
        cached = sum(self.states[pi * p.n].cached_tokens for pi in range(len(p.prompts)))
        return common.usage(prompt_tokens, sum(s.completion_tokens for s in self.states), cached)

    def response(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.p.response_id,
            "object": "text_completion",
            "created": self.created,
            "model": self.ctx.model_id,
            "choices": choices,
        }

    def chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        out = self.response(choices)
        if self.p.options.continuous_usage:
            out["usage"] = self.usage()
        return out

    def _unsubmitted(self) -> list[dict[str, Any]]:
        p = self.p
        return [
            {
                "index": pi * p.n + j,
                "text": prompt.echo_text if p.echo else "",
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
                "prompt_logprobs": None,
            }
            for pi, prompt in enumerate(p.prompts)
            for j in range(p.n)
        ]

    def start(self) -> list[Frame]:
        if self.p.requests:
            return []
        return [
            (self.chunk([{k: v for k, v in c.items() if k != "prompt_logprobs"}]), None) for c in self._unsubmitted()
        ]

    def apply(self, index: int, event: GenerationEvent) -> list[Frame]:
        p, tokenizer = self.p, self.ctx.tokenizer
        state = self.states[index]
        delta = state.apply(event)
        if not p.stream:
            return []
        prompt = p.prompts[p.prompt_of(index)]
        text = delta.text
        if not self.echoed[index]:
            self.echoed[index] = True
            text = prompt.echo_text + text
        entries = delta.logprobs if p.logprobs is not None else []
        logprobs = None
        if entries:
            logprobs = common.completion_logprobs(
                tokenizer,
                entries,
                delta.offsets,
                p.logprobs or 0,
                p.as_token_ids,
                offset_base=len(prompt.echo_text) if p.echo else 0,
            )
        if p.echo_scores and delta.prompt_logprobs:
            # One logprob frame per completed prompt chunk, before generated entries.
            first = self.scored[index]
            self.scored[index] += len(delta.prompt_logprobs)
            logprobs = common.echo_logprobs(
                tokenizer,
                prompt.token_ids,
                delta.prompt_logprobs,
                p.logprobs or 0,
                p.as_token_ids,
                first=first,
                offset_base=common.echo_chars(tokenizer, prompt.token_ids[:first]),
            )
        if not (text or logprobs or event.finished):
            return []
        return [
            (
                self.chunk(
                    [
                        {
                            "index": index,
                            "text": text,
                            "logprobs": logprobs,
                            "finish_reason": common.finish_reason_name(state.finish_reason) if event.finished else None,
                            "stop_reason": state.stop_reason if event.finished else None,
                        }
                    ]
                ),
                None,
            )
        ]

    def body(self) -> dict[str, Any]:
        p, tokenizer = self.p, self.ctx.tokenizer
        if not p.requests:
            return {**self.response(self._unsubmitted()), "usage": self.usage(), "system_fingerprint": None}
        choices = []
        for s in self.states:
            prompt = p.prompts[p.prompt_of(s.index)]
            prefix = prompt.echo_text if p.echo else ""
            logprobs = None
            if p.logprobs is not None:
                logprobs = common.completion_logprobs(
                    tokenizer, s.logprobs, s.offsets, p.logprobs, p.as_token_ids, offset_base=len(prefix)
                )
                if p.echo_scores:
                    echoed = common.echo_logprobs(
                        tokenizer, prompt.token_ids, s.prompt_logprobs, p.logprobs, p.as_token_ids
                    )
                    logprobs = {key: echoed[key] + logprobs[key] for key in logprobs}
            choices.append(
                {
                    "index": s.index,
                    "text": prefix + s.full_text,
                    "logprobs": logprobs,
                    "finish_reason": common.finish_reason_name(s.finish_reason),
                    "stop_reason": s.stop_reason,
                    "prompt_logprobs": (
                        common.prompt_logprobs_field(tokenizer, s.prompt_logprobs, p.prompt_logprobs)
                        if p.prompt_logprobs is not None
                        else None
                    ),
                }
            )
        return {**self.response(choices), "usage": self.usage(), "system_fingerprint": None}


CODEC = Codec("completions", "cmpl-", plan, CompletionEncoder)

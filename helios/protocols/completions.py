"""POST /v1/completions: raw prompts (text or token ids, optionally batched) without templates.

Choice index = prompt_index * n + choice_index. Usage counts each prompt once; cached usage is
each prompt's first choice's admission count; completion usage sums every choice. max_tokens 0
tokenizes (and echoes) without submitting anything, unless the prompt is scored (echo with
logprobs, or prompt_logprobs): then the prompt is submitted and nothing is generated.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from helios.engine.api import GenerationRequest, SamplingParams
from helios.frontend.checkpoints import endpoint
from helios.frontend.errors import RequestError
from helios.frontend.sampling import (
    check_top_logprobs,
    child_seed,
    parse_token_ids,
    resolve_max_tokens,
)
from helios.frontend.tokenizer import Tokenizer
from helios.protocols import common
from helios.server.admission import GenerationGroup, terminal_failure
from helios.server.context import ServerContext, new_response_id, response_headers
from helios.server.errors import ApiError, json_response, server_error
from helios.server.sse import KEEPALIVE_SECONDS, SSEWriter

log = logging.getLogger("helios.completions")


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
    prompt_logprobs: int | None = None  # alternatives of choices[i].prompt_logprobs; None: omitted

    def prompt_of(self, choice_index: int) -> int:
        return choice_index // self.n


def decode_prompts(value: Any, tokenizer: Tokenizer, vocab_size: int) -> list[Prompt]:
    """string | [string] | [id] | [[id]] -> prompts, ids validated against the vocabulary."""
    if isinstance(value, str):
        return [_text_prompt(value, tokenizer)]
    if not isinstance(value, list) or not value:
        raise RequestError("prompt must be a string, an array of strings, or a nonempty array of token ids",
                           param="prompt")
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


def plan(ctx: ServerContext, body: dict[str, Any], response_id: str) -> CompletionPlan:
    m = ctx.manifest
    if body.get("suffix") is not None:
        raise RequestError("suffix is not supported", param="suffix")
    common.reject_present(body, ("tools", "tool_choice"), "by raw completions")
    common.reject_present(body, ("thinking_token_budget",), "by raw completions (no reasoning region)")
    common.reject_unsupported_extensions(body)
    n = common.choice_count(body)
    best_of = common.opt_int(body, "best_of", None)
    if best_of is not None and best_of != n:
        raise RequestError("best_of must equal n (ranked sampling is not supported)", param="best_of")
    stream = common.opt_bool(body, "stream", False)
    echo = common.opt_bool(body, "echo", False)
    raw_logprobs = common.opt_int(body, "logprobs", None)
    if raw_logprobs is not None and not 0 <= raw_logprobs <= 20:
        raise RequestError("logprobs must be between 0 and 20", param="logprobs")
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
    base = common.request_sampling(body, m, logprobs=k)
    base.logprob_token_ids = explicit
    prompts = decode_prompts(raw, ctx.tokenizer, m.architecture.vocab_size)
    budgets = [resolve_max_tokens(body.get("max_tokens"), len(p.token_ids), m.limits, allow_zero=True)
               for p in prompts]
    requests: list[GenerationRequest] = []
    # max_tokens 0 reaches the model only to score the prompt (api.md).
    if any(budgets) or scoring is not None:
        for pi, (prompt, budget) in enumerate(zip(prompts, budgets)):
            for j in range(n):
                requests.append(GenerationRequest(
                    request_id=f"{response_id}-{pi * n + j}",
                    prompt_token_ids=prompt.token_ids,
                    sampling=dataclasses.replace(base, max_tokens=budget, seed=child_seed(base.seed, j)),
                    checkpoints=endpoint(prompt.token_ids),  # raw prompts: the exact endpoint only
                    prompt_logprobs=scoring,
                ))
    return CompletionPlan(
        response_id=response_id,
        prompts=prompts,
        n=n,
        requests=requests,
        echo=echo,
        stream=stream,
        options=common.stream_options(body),
        logprobs=k,
        as_token_ids=common.opt_bool(body, "return_tokens_as_token_ids", False),
        base=base,
        echo_scores=echo_scores,
        prompt_logprobs=prompt_k,
    )


# -- handler ---------------------------------------------------------------------------------------

async def handle(request: web.Request, ctx: ServerContext) -> web.StreamResponse:
    body = await ctx.read_json_object(request)
    response_id = new_response_id("cmpl")
    p = await ctx.in_frontend(plan, ctx, body, response_id)
    if not p.requests:
        return await _zero_tokens(request, ctx, p)
    reservation = ctx.reserve(len(p.requests))
    group = ctx.start_group(p.requests, reservation)
    headers = response_headers(request, response_id)
    try:
        if p.stream:
            return await _stream(request, ctx, p, group, headers)
        return await _buffered(ctx, p, group, headers)
    finally:
        group.close()


def _states(ctx: ServerContext, p: CompletionPlan) -> list[common.ChoiceState]:
    return [common.ChoiceState(i, ctx.tokenizer) for i in range(len(p.prompts) * p.n)]


def _usage(p: CompletionPlan, states: list[common.ChoiceState]) -> dict[str, Any]:
    prompt_tokens = sum(len(pr.token_ids) for pr in p.prompts)
    cached = sum(states[pi * p.n].cached_tokens for pi in range(len(p.prompts))) if states else 0
    return common.usage(prompt_tokens, sum(s.completion_tokens for s in states), cached)


def _response(ctx: ServerContext, p: CompletionPlan, choices: list[dict[str, Any]],
              usage: dict[str, Any]) -> dict[str, Any]:
    return {"id": p.response_id, "object": "text_completion", "created": common.now(), "model": ctx.model_id,
            "choices": choices, "usage": usage, "system_fingerprint": None}


async def _zero_tokens(request: web.Request, ctx: ServerContext, p: CompletionPlan) -> web.StreamResponse:
    """max_tokens 0: tokenization and echo only; nothing reaches the model (no cache lookup)."""
    choices = [
        {"index": pi * p.n + j, "text": prompt.echo_text if p.echo else "", "logprobs": None,
         "finish_reason": "length", "stop_reason": None, "prompt_logprobs": None}
        for pi, prompt in enumerate(p.prompts) for j in range(p.n)
    ]
    usage = common.usage(sum(len(pr.token_ids) for pr in p.prompts), 0, 0)
    if not p.stream:
        return json_response(_response(ctx, p, choices, usage))
    writer = await SSEWriter.start(request)
    created = common.now()
    for choice in choices:
        chunk = {"id": p.response_id, "object": "text_completion", "created": created, "model": ctx.model_id,
                 "choices": [{k: v for k, v in choice.items() if k != "prompt_logprobs"}]}
        if p.options.continuous_usage:
            chunk["usage"] = usage
        await writer.send(chunk)
    if p.options.include_usage:
        await writer.send({"id": p.response_id, "object": "text_completion", "created": created,
                           "model": ctx.model_id, "choices": [], "usage": usage})
    await writer.done()
    return writer.response


async def _buffered(ctx: ServerContext, p: CompletionPlan, group: GenerationGroup,
                    headers: dict[str, str]) -> web.Response:
    states = _states(ctx, p)
    while not all(s.finished for s in states):
        item = await group.next()
        assert item is not None
        index, event = item
        states[index].apply(event)
        if event.finished and (failure := terminal_failure(event)) is not None:
            raise failure.with_headers(headers)
    choices = []
    for s in states:
        prompt = p.prompts[p.prompt_of(s.index)]
        prefix = prompt.echo_text if p.echo else ""
        logprobs = None
        if p.logprobs is not None:
            logprobs = common.completion_logprobs(ctx.tokenizer, s.logprobs, s.offsets, p.logprobs,
                                                  p.as_token_ids, offset_base=len(prefix))
            if p.echo_scores:
                echoed = common.echo_logprobs(ctx.tokenizer, prompt.token_ids, s.prompt_logprobs, p.logprobs,
                                              p.as_token_ids)
                logprobs = {key: echoed[key] + logprobs[key] for key in logprobs}
        choices.append({
            "index": s.index,
            "text": prefix + s.full_text,
            "logprobs": logprobs,
            "finish_reason": common.finish_reason_name(s.finish_reason),
            "stop_reason": s.stop_reason,
            "prompt_logprobs": (common.prompt_logprobs_field(ctx.tokenizer, s.prompt_logprobs, p.prompt_logprobs)
                                if p.prompt_logprobs is not None else None),
        })
    return json_response(_response(ctx, p, choices, _usage(p, states)), headers=headers)


async def _stream(request: web.Request, ctx: ServerContext, p: CompletionPlan, group: GenerationGroup,
                  headers: dict[str, str]) -> web.StreamResponse:
    writer = await SSEWriter.start(request, headers)
    states = _states(ctx, p)
    created = common.now()
    echoed = [not p.echo] * len(states)
    scored = [0] * len(states)  # prompt entries streamed per choice

    def chunk(choices: list[dict[str, Any]]) -> dict[str, Any]:
        out = {"id": p.response_id, "object": "text_completion", "created": created, "model": ctx.model_id,
               "choices": choices}
        if p.options.continuous_usage:
            out["usage"] = _usage(p, states)
        return out

    try:
        while not all(s.finished for s in states):
            item = await group.next(KEEPALIVE_SECONDS)
            if item is None:
                await writer.comment()
                continue
            index, event = item
            state = states[index]
            delta = state.apply(event)
            if event.finished and (failure := terminal_failure(event)) is not None:
                await writer.send(common.stream_error(failure))
                await writer.close()
                return writer.response
            prompt = p.prompts[p.prompt_of(index)]
            text = delta.text
            if not echoed[index]:
                echoed[index] = True
                text = prompt.echo_text + text
            entries = delta.logprobs if p.logprobs is not None else []
            logprobs = None
            if entries:
                logprobs = common.completion_logprobs(ctx.tokenizer, entries, delta.offsets, p.logprobs or 0,
                                                      p.as_token_ids,
                                                      offset_base=len(prompt.echo_text) if p.echo else 0)
            if p.echo_scores and delta.prompt_logprobs:
                # One logprob frame per completed prompt chunk, before generated entries.
                first = scored[index]
                scored[index] += len(delta.prompt_logprobs)
                logprobs = common.echo_logprobs(
                    ctx.tokenizer, prompt.token_ids, delta.prompt_logprobs, p.logprobs or 0, p.as_token_ids,
                    first=first, offset_base=common.echo_chars(ctx.tokenizer, prompt.token_ids[:first]),
                )
            if not (text or logprobs or event.finished):
                continue
            await writer.send(chunk([{
                "index": index,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": common.finish_reason_name(state.finish_reason) if event.finished else None,
                "stop_reason": state.stop_reason if event.finished else None,
            }]))
        if p.options.include_usage:
            await writer.send({**chunk([]), "usage": _usage(p, states)})
        await writer.done()
    except (ConnectionResetError, ConnectionError):
        pass
    except ApiError as exc:
        await common.try_send_stream_error(writer, exc)
    except Exception:
        log.exception("completion stream failed")
        await common.try_send_stream_error(writer, server_error("the stream failed"))
    return writer.response

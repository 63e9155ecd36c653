"""Runs scorer questions (helios.neutral.label_scorer) on the engine, one after another.

Shared by /v1/systemone and /v1/decisions: each question is one engine request with one slot of
admission; a later question reuses the state's prefix checkpoint. Dropping the HTTP request
cancels the question in flight (the group's close aborts it).
"""

from __future__ import annotations

from helios.neutral.assets import Asset
from helios.neutral.label_scorer import Question, Scored, Scorer, label_logprobs
from helios.transport.admission import terminal_failure
from helios.transport.context import ServerContext
from helios.transport.errors import server_error


def scorer(ctx: ServerContext) -> Scorer:
    return Scorer(ctx.manifest, ctx.tokenizer, ctx.template)


async def score_questions(
    ctx: ServerContext, state: str, questions: list[Question], response_id: str, assets: list[Asset] | None = None
) -> list[Scored]:
    """assets: System One image assets the state and questions refer to (helios.neutral.assets)."""
    s = scorer(ctx)
    s.assets = list(assets or [])
    await ctx.in_frontend(s.check_core)
    # Compile every question before running any: a bad one fails the request up front.
    compiled = [
        await ctx.in_frontend(s.compile, state, question, response_id, i) for i, question in enumerate(questions)
    ]
    results = []
    for item in compiled:
        group = ctx.start_group([item.request], ctx.reserve(1))
        try:
            entry = None
            while True:
                got = await group.next()
                assert got is not None
                _, event = got
                if event.finished and (failure := terminal_failure(event)) is not None:
                    raise failure
                if event.logprobs:
                    entry = event.logprobs[0]
                if event.finished:
                    break
        finally:
            group.close()
        if entry is None:
            raise server_error("the engine returned no label logprobs for a question")
        results.append(
            Scored(
                logprobs=label_logprobs(entry.top, item.label_ids),
                prompt_tokens=event.prompt_tokens,
                cached_tokens=event.cached_tokens,
                output_tokens=event.completion_tokens,
            )
        )
    return results

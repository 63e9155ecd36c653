"""POST /v1/decisions: the vLLM Decisions text protocol over the same scorer as System One.

Every validation failure is an OpenAI-style HTTP 400. Confidence of a choice or score is the
winning label's full-vocabulary probability (its normalized probability times the labels' total
raw mass), unlike System One's own formulas.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from helios.neutral import label_scorer as d
from helios.neutral.errors import RequestError
from helios.protocols.scoring import score_questions, scorer
from helios.transport.context import ServerContext, new_response_id, response_headers
from helios.transport.errors import ApiError, json_response

TOP_KEYS = {"model", "input", "questions", "safety_identifier"}
QUESTION_KEYS = {
    "predicate": {"type", "name", "instructions"},
    "choice": {"type", "name", "instructions", "choices"},
    "score": {"type", "name", "instructions", "levels"},
}


def _bad(message: str, param: str) -> RequestError:
    return RequestError(message, param=param)


def decode(body: dict[str, Any], max_options: int) -> tuple[str, list[tuple[dict[str, Any], d.Question]]]:
    for key in body:
        if key not in TOP_KEYS:
            raise _bad(f"unknown field {key!r}", key)
    if not isinstance(body.get("model"), str):
        raise _bad("model must be a string", "model")
    identifier = body.get("safety_identifier")
    if identifier is not None and not (isinstance(identifier, str) and len(identifier) <= 128):
        raise _bad("safety_identifier must be a string of at most 128 characters", "safety_identifier")
    text = _input_text(body.get("input"))
    questions = body.get("questions")
    if not isinstance(questions, list) or not 1 <= len(questions) <= d.MAX_QUESTIONS:
        raise _bad(f"questions must be an array of 1 to {d.MAX_QUESTIONS} questions", "questions")
    return text, [(raw, _question(raw, i, max_options)) for i, raw in enumerate(questions)]


def _input_text(value: Any) -> str:
    """Text input, or user messages whose text / input_text parts join with newlines and whose
    messages join with blank lines."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list) or not value:
        raise _bad("input must be a string or a nonempty array of user messages", "input")
    messages = []
    for message in value:
        if not isinstance(message, dict) or message.get("role") != "user":
            raise _bad("input messages must be user messages", "input")
        if set(message) - {"role", "content", "type"} or message.get("type", "message") != "message":
            raise _bad("input messages take only role and content", "input")
        content = message.get("content")
        if isinstance(content, str):
            messages.append(content)
            continue
        if not isinstance(content, list):
            raise _bad("message content must be a string or an array of text parts", "input")
        parts = []
        for part in content:
            if not (
                isinstance(part, dict)
                and part.get("type") in ("text", "input_text")
                and isinstance(part.get("text"), str)
                and set(part) <= {"type", "text"}
            ):
                raise _bad("message content parts must be text or input_text (images are not supported here)", "input")
            parts.append(part["text"])
        messages.append("\n".join(parts))
    return "\n\n".join(messages)


def _question(raw: Any, index: int, max_options: int) -> d.Question:
    param = f"questions[{index}]"
    if not isinstance(raw, dict):
        raise _bad("each question must be an object", param)
    kind = raw.get("type")
    if not isinstance(kind, str) or kind not in QUESTION_KEYS:
        raise _bad("question type must be 'predicate', 'choice' or 'score'", f"{param}.type")
    for key in raw:
        if key not in QUESTION_KEYS[kind]:
            raise _bad(f"unknown field {key!r} in a {kind} question", f"{param}.{key}")
    if "name" in raw and not isinstance(raw["name"], str):
        raise _bad("name must be a string when given", f"{param}.name")
    instructions = raw.get("instructions")
    if not isinstance(instructions, str):
        raise _bad("instructions must be a string", f"{param}.instructions")
    if kind == "predicate":
        return d.Question("binary", instructions, list(d.BINARY_OPTIONS))
    if kind == "choice":
        limit = min(128, max_options)
        choices = raw.get("choices")
        if not isinstance(choices, list) or not 2 <= len(choices) <= limit:
            raise _bad(f"choices must be an array of 2 to {limit} choices", f"{param}.choices")
        options, seen = [], set()
        for choice in choices:
            value = choice.get("value") if isinstance(choice, dict) else None
            if (
                not isinstance(choice, dict)
                or set(choice) - {"value", "description"}
                or not isinstance(value, (str, bool))
            ):
                raise _bad(
                    "each choice needs a string or boolean value and an optional description", f"{param}.choices"
                )
            key = (type(value), value)
            if key in seen:
                raise _bad("choice values must be distinct", f"{param}.choices")
            seen.add(key)
            options.append(d.Option(d.as_text(value), _description(choice, f"{param}.choices")))
        return d.Question("choice", instructions, options)
    limit = min(10, max_options)
    levels = raw.get("levels")
    if not isinstance(levels, list) or not 2 <= len(levels) <= limit:
        raise _bad(f"levels must be an array of 2 to {limit} levels", f"{param}.levels")
    options = []
    for level in levels:
        if (
            not isinstance(level, dict)
            or set(level) - {"label", "description"}
            or not isinstance(level.get("label"), str)
        ):
            raise _bad("each level needs a string label and an optional description", f"{param}.levels")
        options.append(d.Option(level["label"], _description(level, f"{param}.levels")))
    return d.Question("score", instructions, options)


def _description(item: dict[str, Any], param: str) -> str | None:
    description = item.get("description")
    if description is not None and not isinstance(description, str):
        raise _bad("description must be a string", param)
    return description


def encode_answer(raw: dict[str, Any], question: d.Question, scored: d.Scored) -> dict[str, Any]:
    probs = scored.probabilities
    out: dict[str, Any] = {"name": raw.get("name"), "type": raw["type"]}
    if question.kind == "binary":
        return {**out, "probability": probs[0]}
    best = d.winner(probs)
    confidence = probs[best] * scored.mass
    if question.kind == "choice":
        values = [c["value"] for c in raw["choices"]]
        return {
            **out,
            "choice": values[best],
            "probabilities": [{"value": v, "probability": p} for v, p in zip(values, probs)],
            "confidence": confidence,
        }
    return {
        **out,
        "score": d.expected_score(probs),
        "probabilities": [
            {"value": i, "label": level["label"], "probability": p}
            for i, (level, p) in enumerate(zip(raw["levels"], probs))
        ],
        "confidence": confidence,
    }


async def handle(request: web.Request, ctx: ServerContext) -> web.StreamResponse:
    if request.content_type.startswith("multipart/"):
        raise ApiError(400, "invalid_request_error", "multipart bodies are not supported on /v1/decisions")
    body = await ctx.read_json_object(request)
    text, questions = await ctx.in_frontend(decode, body, scorer(ctx).max_options())
    response_id = new_response_id("dec")
    results = await score_questions(ctx, text, [q for _, q in questions], response_id)
    usage = d.Usage()
    answers = []
    for (raw, question), scored in zip(questions, results):
        usage.add(scored)
        answers.append(encode_answer(raw, question, scored))
    return json_response(
        {
            "model": ctx.model_id,
            "answers": answers,
            "usage": {
                "input_tokens": usage.input_tokens,
                "input_tokens_details": {"cached_tokens": usage.cached_tokens},
                "output_tokens": usage.output_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage.input_tokens + usage.output_tokens,
            },
        },
        headers=response_headers(request, response_id),
    )

"""POST /v1/systemone: the TypeSafe System One schema (noul / choice / score) over the scorer.

Schema failures answer HTTP 422 with Jev-style `detail` entries ({type, loc, msg, input});
malformed JSON, unsupported cores and templates answer 400 in the Chat Completions error shape.
Image assets (helios.neutral.assets) need the TypeSafe-Danger-Zone-Images: true header and a
vision core; they come as data_base64 or as parts of an uncompressed multipart body.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from aiohttp import web

from helios.neutral import label_scorer as d
from helios.neutral.assets import Asset
from helios.neutral.errors import RequestError
from helios.protocols.assets import bind_assets
from helios.protocols.scoring import score_questions, scorer
from helios.transport.context import ServerContext, new_response_id, response_headers
from helios.transport.errors import ApiError, bad_request, json_response, too_large

QUESTION_KEYS = {"type", "instructions", "criteria"}
MAX_CHOICE_CRITERIA = 128
MAX_SCORE_LEVELS = 10


class SchemaErrors(Exception):
    def __init__(self, details: list[dict[str, Any]]):
        super().__init__(f"{len(details)} schema error(s)")
        self.details = details


def _detail(kind: str, loc: list[Any], msg: str, value: Any = None) -> dict[str, Any]:
    return {"type": kind, "loc": ["body", *loc], "msg": msg, "input": value}


def decode(body: dict[str, Any], max_options: int) -> tuple[str, list[tuple[str, dict[str, Any], d.Question]]]:
    """(state text, [(name, question JSON, neutral question)]) or SchemaErrors."""
    errors: list[dict[str, Any]] = []
    if not isinstance(body.get("model"), str):
        errors.append(
            _detail(
                "missing" if "model" not in body else "string_type",
                ["model"],
                "model must be a string",
                body.get("model"),
            )
        )
    state = body.get("state")
    if not isinstance(state, (str, dict, list)):
        errors.append(
            _detail(
                "missing" if "state" not in body else "model_attributes_type",
                ["state"],
                "state must be a string, an object or an array",
                state,
            )
        )
    questions = body.get("questions")
    decoded: list[tuple[str, dict[str, Any], d.Question]] = []
    if not isinstance(questions, dict):
        errors.append(
            _detail(
                "missing" if "questions" not in body else "dict_type",
                ["questions"],
                "questions must be an object of named questions",
                questions,
            )
        )
    elif not 1 <= len(questions) <= d.MAX_QUESTIONS:
        errors.append(
            _detail(
                "too_short" if not questions else "too_long",
                ["questions"],
                f"questions must have 1 to {d.MAX_QUESTIONS} entries",
                len(questions),
            )
        )
    else:
        for name, raw in questions.items():
            question = _question(name, raw, errors, max_options)
            if question is not None:
                decoded.append((name, raw, question))
    if errors:
        raise SchemaErrors(errors)
    return d.as_text(state), decoded


def _question(name: str, raw: Any, errors: list[dict[str, Any]], max_options: int) -> d.Question | None:
    loc = ["questions", name]
    if not isinstance(raw, dict):
        errors.append(_detail("model_type", loc, "a question must be an object", raw))
        return None
    before = len(errors)
    for key in raw:
        if key not in QUESTION_KEYS:
            errors.append(_detail("extra_forbidden", [*loc, key], "extra fields are not permitted", raw[key]))
    kind = raw.get("type")
    instructions = raw.get("instructions")
    text = d.as_text(instructions) if instructions is not None else name
    criteria = raw.get("criteria")
    question = None
    if kind == "noul":
        question = d.Question("binary", text, list(d.BINARY_OPTIONS))
    elif kind == "choice":
        limit = min(MAX_CHOICE_CRITERIA, max_options)
        if not isinstance(criteria, dict) or not 1 <= len(criteria) <= limit:
            errors.append(
                _detail(
                    "value_error",
                    [*loc, "criteria"],
                    f"choice criteria must be an object with 1 to {limit} labels",
                    criteria,
                )
            )
        else:
            options = [
                d.Option(label, d.as_text(desc) if desc is not None else None) for label, desc in criteria.items()
            ]
            question = d.Question("choice", text, options)
    elif kind == "score":
        limit = min(MAX_SCORE_LEVELS, max_options)
        if not isinstance(criteria, list) or not 1 <= len(criteria) <= limit or any(c is None for c in criteria):
            errors.append(
                _detail(
                    "value_error",
                    [*loc, "criteria"],
                    f"score criteria must be an array of 1 to {limit} nonnull levels",
                    criteria,
                )
            )
        else:
            question = d.Question("score", text, [d.Option(d.as_text(level)) for level in criteria])
    else:
        errors.append(_detail("literal_error", [*loc, "type"], "type must be 'noul', 'choice' or 'score'", kind))
    return question if len(errors) == before else None


def encode_answer(raw: dict[str, Any], question: d.Question, scored: d.Scored) -> dict[str, Any]:
    probs = scored.probabilities
    if question.kind == "binary":
        return {"type": "noul", "noul": probs[0]}
    if question.kind == "choice":
        labels = list(raw["criteria"])
        return {
            "type": "choice",
            "choice": labels[d.winner(probs)],
            "probabilities": dict(zip(labels, probs)),
            "confidence": d.choice_confidence(probs),
        }
    return {
        "type": "score",
        "score": d.expected_score(probs),
        "legend": list(raw["criteria"]),
        "probabilities": {str(i): p for i, p in enumerate(probs)},
        "confidence": d.score_confidence(probs),
    }


async def read_multipart(request: web.Request, ctx: ServerContext) -> tuple[dict[str, Any], dict[str, bytes]]:
    """(the JSON request part, image parts by name) of an uncompressed multipart body: the JSON
    part first, then uniquely named image parts, all within the body limit."""
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):  # api.md: multipart is never compressed
        raise ApiError(
            415,
            "invalid_request_error",
            f"multipart bodies must not be compressed (Content-Encoding {encoding!r}); send identity",
            "unsupported_content_encoding",
        )
    limit = ctx.config.max_body_bytes
    if (request.content_length or 0) > limit:
        raise too_large(limit)
    try:
        reader = await request.multipart()
        first = await reader.next()
        if first is None or first.headers.get("Content-Type", "").split(";")[0].strip() != "application/json":
            raise bad_request("a multipart System One request starts with its application/json part")
        body = json.loads(await first.read(decode=False))
        parts: dict[str, bytes] = {}
        total = 0
        while (part := await reader.next()) is not None:
            name = part.name
            if not name or name in parts:
                raise bad_request(f"multipart image parts need unique names (got {name!r})")
            parts[name] = bytes(await part.read(decode=False))
            total += len(parts[name])
            if total > limit:
                raise too_large(limit)
    except (ValueError, AssertionError, UnicodeDecodeError) as exc:
        raise bad_request(f"the multipart body could not be read: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request("the JSON request part must be an object")
    return body, parts


async def handle(request: web.Request, ctx: ServerContext) -> web.StreamResponse:
    parts: dict[str, bytes] = {}
    multipart = request.content_type.startswith("multipart/")  # the asset form of a request
    if multipart:
        body, parts = await read_multipart(request, ctx)
    else:
        body = await ctx.read_json_object(request)
    assets: list[Asset] = []
    originals = body.get("questions")
    if body.get("assets") is not None or multipart:
        if request.headers.get("TypeSafe-Danger-Zone-Images", "").strip().lower() != "true":
            raise bad_request("image assets need the TypeSafe-Danger-Zone-Images: true header")
        if ctx.manifest.vision is None:
            raise bad_request("image assets need a vision model core; this core is text-only")
        originals = copy.deepcopy(originals)  # bind_assets rewrites references; legends keep them as written
        try:
            assets = bind_assets(body, parts)
        except RequestError as exc:
            raise ApiError.from_request_error(exc) from None
    try:
        state, questions = decode(body, scorer(ctx).max_options())
    except SchemaErrors as exc:
        return json_response({"detail": exc.details}, status=422)
    response_id = new_response_id("sysone")
    results = await score_questions(ctx, state, [q for _, _, q in questions], response_id, assets)
    usage = d.Usage()
    answers = {}
    for (name, raw, question), scored in zip(questions, results):
        usage.add(scored)
        original = originals.get(name, raw) if isinstance(originals, dict) else raw
        answers[name] = encode_answer(original, question, scored)
    return json_response(
        {
            "model": ctx.model_id,
            "answers": answers,
            "usage": {"input_tokens": usage.input_tokens, "output_tokens": usage.output_tokens},
        },
        headers=response_headers(request, response_id),
    )

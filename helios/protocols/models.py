"""GET /v1/models and /v1/models/{model}: one vLLM-compatible card for the loaded core.

All values come from the manifest and the serving configuration; nothing is inferred from the
model's name.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote

from aiohttp import web

from helios.neutral.images import image_budget, max_images
from helios.neutral.sampling import DISTRIBUTION_FIELDS, INTEGER_FIELDS, MAX_TOP_LOGPROBS
from helios.transport.context import ServerContext
from helios.transport.errors import json_response, not_found


def model_card(ctx: ServerContext) -> dict[str, Any]:
    """The one card (api.md): under the first served name, every alias reaching the same card."""
    m = ctx.manifest
    created = ctx.created
    defaults = m.sampling.defaults
    ranges: dict[str, Any] = {}
    for name in DISTRIBUTION_FIELDS:
        bounds = m.sampling.ranges.get(name)
        if bounds is None:
            ranges[name] = None  # fixed at the prepared default
        elif name in INTEGER_FIELDS:
            ranges[name] = {"min": int(bounds.min), "max": int(bounds.max)}
        else:
            ranges[name] = {"min": bounds.min, "max": bounds.max}
    return {
        "id": ctx.model_id,
        "object": "model",
        "created": created,
        "owned_by": "local",
        # The OpenAI SDK's Model has this optional field; sending it keeps SDK round trips exact.
        "shutdown_date": None,
        "root": m.identity.checkpoint_id,
        "parent": None,
        "max_model_len": m.limits.context_length,
        "permission": [
            {
                # Stable for the life of the server: derived from the start time, not random.
                "id": f"modelperm-{m.identity.checkpoint_sha256[:16]}{created:x}",
                "object": "model_permission",
                "created": created,
                "allow_create_engine": False,
                "allow_sampling": True,
                "allow_logprobs": m.logprobs.max_top_logprobs > 0,
                "allow_search_indices": False,
                "allow_view": True,
                "allow_fine_tuning": False,
                "organization": "*",
                "group": None,
                "is_blocking": False,
            }
        ],
        "flare": {
            "vocab_size": m.architecture.vocab_size,
            "max_top_logprobs": max(0, min(MAX_TOP_LOGPROBS, m.logprobs.max_top_logprobs)),
            "max_concurrency": ctx.max_concurrency,
            "prefill_chunk_size": m.limits.prefill_chunk_size,
            "default_max_tokens": m.limits.default_max_tokens,
            "sampling_defaults": {
                "seed": defaults.seed,
                "temperature": defaults.temperature,
                "top_p": defaults.top_p,
                "top_k": defaults.top_k,
                "min_p": defaults.min_p,
                "repetition_penalty": defaults.repetition_penalty,
                "presence_penalty": defaults.presence_penalty,
                "frequency_penalty": defaults.frequency_penalty,
            },
            "thinking_token_budget": ctx.config.thinking_token_budget,
            "sampling_ranges": ranges,
            # Zero on text-only cores (no vision graph is prepared).
            "max_images_per_prompt": max_images(m),
            "max_image_tokens_per_prompt": image_budget(m),
            "image_feature_window_tokens": m.vision.image_feature_window_tokens if m.vision else 0,
            "max_image_tokens_per_image": m.vision.max_image_tokens_per_image if m.vision else 0,
            "max_image_pixels": m.vision.max_image_pixels if m.vision else 0,
            "max_image_bytes": m.vision.max_image_bytes if m.vision else 0,
            "input_modalities": ["text", "image"] if m.vision else ["text"],
            "output_modalities": ["text"],
            # A smaller model compiled into the core proposes speculative drafts (api.md learned_drafter).
            "learned_drafter": m.drafter is not None,
        },
    }


def served_names(ctx: ServerContext) -> set[str]:
    ident = ctx.manifest.identity
    return {*ctx.model_names, ctx.manifest.model_id, ident.checkpoint_id, *(a for a in ident.aliases if a)}


async def list_models(request: web.Request, ctx: ServerContext) -> web.Response:
    return json_response({"object": "list", "data": [model_card(ctx)]})


async def retrieve_model(request: web.Request, ctx: ServerContext) -> web.Response:
    # The route matches the rest of the path, so ids with slashes work raw or %2F-encoded.
    name = request.match_info.get("model", "")
    names = served_names(ctx)
    if name not in names and unquote(name) in names:
        name = unquote(name)
    if name not in names:
        raise not_found(f"the model {name!r} does not exist", code="model_not_found")
    return json_response(model_card(ctx))

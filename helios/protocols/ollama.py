"""GET /api/version, GET /api/tags and POST /api/show: Ollama model discovery (discovery only;
no /api/chat).

Everything comes from the loaded manifest and the serving limits, never from the model's name.
Errors are {"error": "message"} (the app renders ApiError in this shape under /api/), except
authentication, which stays OpenAI-shaped.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from aiohttp import web

from helios.protocols.models import served_names
from helios.transport import bodies
from helios.transport.context import ServerContext
from helios.transport.errors import ApiError, bad_request, json_response, not_found

# The Ollama API version helios' discovery routes are compatible with. Clients gate on it: Codex
# 0.162.1's `--oss --local-provider ollama` refuses a server older than 0.13.4, and other
# Ollama-aware tools probe /api/version to detect a server at all.
OLLAMA_API_VERSION = "0.13.5"

# Ollama's zero time: the artifact's modification time is not part of the contract.
UNKNOWN_TIME = "0001-01-01T00:00:00Z"


def details(ctx: ServerContext) -> dict[str, Any]:
    m = ctx.manifest
    return {
        "parent_model": "",
        "format": "flare",
        "family": m.architecture.family,
        "families": [],
        "parameter_size": "",  # not declared by the core
        "quantization_level": m.precision.upper(),
    }


def capabilities(ctx: ServerContext) -> list[str]:
    m = ctx.manifest
    caps = ["completion"]
    if m.vision is not None:
        caps.append("vision")
    if m.parsers.tool:
        caps.append("tools")
    if m.parsers.reasoning:
        caps.append("thinking")
    return caps


def model_info(ctx: ServerContext) -> dict[str, Any]:
    # general.architecture names the key prefix Ollama clients read context_length under.
    return {
        "general.architecture": "flare",
        "general.name": ctx.model_id,
        "flare.context_length": ctx.manifest.limits.context_length,
        "flare.vocab_size": ctx.manifest.architecture.vocab_size,
    }


def digest(ctx: ServerContext) -> str:
    """A SHA-256 cache key over the prepared identity and everything discovery advertises."""
    ident = ctx.manifest.identity
    material = {
        "identity": {
            "recipe": ident.recipe,
            "checkpoint_id": ident.checkpoint_id,
            "checkpoint_sha256": ident.checkpoint_sha256,
            "aliases": ident.aliases,
        },
        "precision": ctx.manifest.precision,
        "name": ctx.model_id,
        "details": details(ctx),
        "capabilities": capabilities(ctx),
        "model_info": model_info(ctx),
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


async def version(request: web.Request, ctx: ServerContext) -> web.Response:
    return json_response({"version": OLLAMA_API_VERSION})


async def tags(request: web.Request, ctx: ServerContext) -> web.Response:
    entry = {
        "name": ctx.model_id,
        "model": ctx.model_id,
        "modified_at": UNKNOWN_TIME,
        "size": 0,
        "digest": digest(ctx),
        "details": details(ctx),
    }
    return json_response({"models": [entry]})


async def show(request: web.Request, ctx: ServerContext) -> web.Response:
    if bodies.content_encodings(request.headers.get("Content-Encoding")):
        # Discovery bodies are small; api.md accepts them uncompressed only.
        raise ApiError(
            415, "invalid_request_error", "/api/show accepts uncompressed JSON only", "unsupported_content_encoding"
        )
    body = await ctx.read_json_object(request)
    name = body.get("model")
    if not isinstance(name, str) or not name:
        raise bad_request("model must be a nonempty string")
    verbose = body.get("verbose")
    if verbose is not None and not isinstance(verbose, bool):
        raise bad_request("verbose must be a boolean")
    if name not in served_names(ctx):
        raise not_found(f"model {name!r} not found", code="model_not_found")
    # verbose adds nothing: templates and tensor inventories are not exposed.
    return json_response(
        {
            "license": "",
            "modelfile": "",
            "parameters": "",
            "details": details(ctx),
            "model_info": model_info(ctx),
            "capabilities": capabilities(ctx),
            "modified_at": UNKNOWN_TIME,
        }
    )

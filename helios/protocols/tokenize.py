"""POST /tokenize, POST /detokenize and GET /version, in vLLM's shapes.

/tokenize takes a raw `prompt` (counted as /v1/completions counts it) or chat `messages`
(rendered exactly as /v1/chat/completions renders them, so its count is that request's
prompt_tokens); /detokenize turns ids back into text. Neither reaches the engine.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from helios.neutral.errors import RequestError
from helios.neutral.sampling import parse_token_ids
from helios.protocols import chat
from helios.protocols.fields import opt_bool
from helios.transport.context import ServerContext
from helios.transport.errors import json_response
from helios.version import flare_version


def tokenize_body(ctx: ServerContext, body: dict[str, Any]) -> dict[str, Any]:
    """The token ids of a prompt or of a chat conversation, with their count and the context."""
    with_strings = opt_bool(body, "return_token_strs", False)
    if body.get("messages") is not None:
        if body.get("prompt") is not None:
            raise RequestError("send either prompt or messages, not both", param="prompt")
        add_special = opt_bool(body, "add_special_tokens", False)
        ids = chat.render(ctx, chat.decode(ctx, body), prepare=False).prompt_ids
        bos = ctx.tokenizer.spec.bos_token_id
        if add_special and bos is not None and ids[:1] != [bos]:
            ids = [bos, *ids]  # the template's own special tokens are always there
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise RequestError("prompt must be a string (or send chat messages)", param="prompt")
        add_special = opt_bool(body, "add_special_tokens", True)
        ids = ctx.tokenizer.encode_raw_prompt(prompt) if add_special else ctx.tokenizer.encode(prompt, add_bos=False)
    strings = [ctx.tokenizer.id_to_token(i) or "" for i in ids] if with_strings else None
    return {
        "count": len(ids),
        "max_model_len": ctx.manifest.limits.context_length,
        "tokens": ids,
        "token_strs": strings,
    }


def detokenize_body(ctx: ServerContext, body: dict[str, Any]) -> dict[str, Any]:
    ids = parse_token_ids(body.get("tokens"), "tokens", ctx.manifest.architecture.vocab_size)
    return {"prompt": ctx.tokenizer.decode(ids)}


async def tokenize(request: web.Request, ctx: ServerContext) -> web.Response:
    body = await ctx.read_json_object(request)
    return json_response(await ctx.in_frontend(tokenize_body, ctx, body))


async def detokenize(request: web.Request, ctx: ServerContext) -> web.Response:
    body = await ctx.read_json_object(request)
    return json_response(await ctx.in_frontend(detokenize_body, ctx, body))


async def version(request: web.Request, ctx: ServerContext) -> web.Response:
    return json_response({"version": flare_version()})

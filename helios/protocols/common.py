"""Pieces the protocol codecs share: native-extension checks, output-format and logprob field
decoding, OpenAI usage objects, stream error payloads and OpenAI logprob encodings.

Nothing here translates one protocol into another; each protocol module decodes its own JSON
into the neutral request and encodes engine events into its own JSON.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from helios.engine.api import FinishReason, PromptLogprob, SamplingParams, TokenLogprob
from helios.manifest import Manifest
from helios.neutral.errors import RequestError
from helios.neutral.fields import require_bool, require_int
from helios.neutral.grammar import OutputFormat
from helios.neutral.sampling import DISTRIBUTION_FIELDS, SamplingFields, logprob_count, resolve_sampling
from helios.neutral.tokenizer import Tokenizer
from helios.protocols.fields import opt_bool, opt_int, opt_object
from helios.transport.errors import ApiError, openai_error_body

NONFINITE_LOGPROB = -9999.0


@dataclass
class StreamOptions:
    include_usage: bool = False
    continuous_usage: bool = False  # only meaningful with include_usage


def stream_options(body: dict[str, Any]) -> StreamOptions:
    options = opt_object(body, "stream_options") or {}
    include = opt_bool(options, "include_usage", False)
    continuous = opt_bool(options, "continuous_usage_stats", False)
    return StreamOptions(include_usage=include, continuous_usage=include and continuous)


GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")


def reject_unsupported_extensions(body: dict[str, Any], *, structured: bool = False, biased: bool = False) -> None:
    """Native extensions this engine cannot honour: refuse rather than silently ignore.
    `structured`: the caller decodes the guided-decoding fields itself (decode_guided);
    `biased`: the caller decodes logit_bias (OpenAI Chat and Completions)."""
    if not biased and body.get("logit_bias"):
        raise RequestError("logit_bias is not supported by this endpoint", param="logit_bias")
    min_tokens = opt_int(body, "min_tokens", 0)
    if min_tokens:
        raise RequestError("min_tokens is not supported", param="min_tokens")
    if not structured:
        for name in GUIDED_FIELDS:
            if body.get(name) is not None:
                raise RequestError(f"{name} is not supported by this endpoint", param=name)


# -- structured output formats ---------------------------------------------------------------------


def _schema(value: Any, param: str) -> dict[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise RequestError(f"{param} must be a JSON schema object", param=param) from None
    if not isinstance(value, dict):
        raise RequestError(f"{param} must be a JSON schema object", param=param)
    return value


def decode_format(value: Any, param: str, *, nested: bool) -> OutputFormat | None:
    """OpenAI response_format ({"type", "json_schema": {...}}, nested) or Responses text.format /
    Anthropic output_config.format ({"type", "schema", ...}, flat). type "text" is no constraint."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise RequestError(f"{param} must be an object", param=param.split(".")[0])
    kind = value.get("type")
    top = param.split(".")[0]
    if kind in (None, "text"):
        if kind is None:
            raise RequestError(f"{param}.type is required", param=top)
        return None
    if kind == "json_object":
        return OutputFormat("json_object", {"type": "object"})
    if kind == "json_schema":
        holder = value.get("json_schema") if nested else value
        if not isinstance(holder, dict):
            raise RequestError(f"{param}.json_schema must be an object", param=top)
        if "schema" not in holder:
            raise RequestError(f"{param} needs a schema", param=top)
        name = holder.get("name")
        return OutputFormat(
            "json_schema", _schema(holder["schema"], f"{param}.schema"), name if isinstance(name, str) else None
        )
    raise RequestError(f"{param}.type must be text, json_object or json_schema", param=top)


def decode_guided(body: dict[str, Any]) -> tuple[OutputFormat | None, str]:
    """vLLM guided decoding (guided_json / guided_regex / guided_choice / guided_grammar, or the
    structured_outputs object with json / regex / choice / grammar): at most one."""
    found: list[tuple[str, str, Any]] = []
    for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
        if body.get(name) is not None:
            found.append((name, name.removeprefix("guided_"), body[name]))
    outputs = body.get("structured_outputs")
    if outputs is not None:
        if not isinstance(outputs, dict):
            raise RequestError("structured_outputs must be an object", param="structured_outputs")
        for key in ("json", "regex", "choice", "grammar"):
            if outputs.get(key) is not None:
                found.append(("structured_outputs", key, outputs[key]))
    if not found:
        return None, "response_format"
    if len(found) > 1:
        raise RequestError("only one guided decoding constraint may be given", param=found[1][0])
    param, key, value = found[0]
    if key == "json":
        return OutputFormat("json_schema", _schema(value, param)), param
    if key == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise RequestError(f"{param} choices must be a nonempty array of strings", param=param)
        return OutputFormat("choice", value), param
    if not isinstance(value, str) or not value:
        raise RequestError(f"{param} must be a nonempty string", param=param)
    return OutputFormat("regex" if key == "regex" else "lark", value), param


def reasoning_switch(body: dict[str, Any], kwargs: dict[str, Any]) -> bool | None:
    """enable_thinking from chat_template_kwargs (wins) or the top-level field."""
    if "enable_thinking" in kwargs:
        return None  # already a template variable
    value = body.get("enable_thinking")
    return None if value is None else require_bool(value, "enable_thinking")


MAX_LOGPROB_TOKEN_IDS = 128  # api.md: elements before deduplication


def logprob_token_ids(body: dict[str, Any], logprobs_enabled: bool, manifest: Manifest) -> list[int] | None:
    """api.md logprob_token_ids: validated, deduplicated in first-occurrence order; None when
    omitted, null or empty."""
    ids = body.get("logprob_token_ids")
    if ids is None or ids == []:
        return None
    name = "logprob_token_ids"
    if not isinstance(ids, list):
        raise RequestError("logprob_token_ids must be an array of token ids", param=name)
    if len(ids) > MAX_LOGPROB_TOKEN_IDS:
        raise RequestError(f"logprob_token_ids accepts at most {MAX_LOGPROB_TOKEN_IDS} ids", param=name)
    vocab = manifest.architecture.vocab_size
    for value in ids:
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < vocab:
            raise RequestError(f"logprob_token_ids must be integers in [0, {vocab})", param=name)
    if not logprobs_enabled:
        raise RequestError("logprob_token_ids requires generation logprobs to be enabled", param=name)
    if not manifest.logprobs.explicit_token_ids:
        raise RequestError(
            "explicit logprob token ids are not available in this model core; re-export it with a current ignition",
            param=name,
        )
    return list(dict.fromkeys(ids))


def prompt_logprobs_count(
    value: Any, *, streaming: bool, manifest: Manifest, name: str = "prompt_logprobs"
) -> int | None:
    """A prompt-scoring request's alternatives count (0..20), or None when not requested."""
    if value is None:
        return None
    require_int(value, name)
    if streaming and name == "prompt_logprobs":
        raise RequestError("prompt_logprobs cannot be used with stream: true", param=name)
    k = logprob_count(value, name)
    if not manifest.logprobs.prompt_logprobs:
        raise RequestError(
            "prompt logprobs are not available in this model core; re-export it with --prompt-logprobs", param=name
        )
    return k


# -- usage and errors ------------------------------------------------------------------------------


def usage(
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int,
    *,
    reasoning_tokens: int | None = None,
    image_tokens: int = 0,
) -> dict[str, Any]:
    """OpenAI usage with prompt_tokens_details.cached_tokens always present (vLLM's
    --enable-prompt-tokens-details); chat adds completion_tokens_details.reasoning_tokens, and
    image requests prompt_tokens_details.multimodal_tokens.image (already in prompt_tokens)."""
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
    if image_tokens:
        out["prompt_tokens_details"]["multimodal_tokens"] = {"image": image_tokens}
    if reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return out


def stream_error(error: ApiError) -> dict[str, Any]:
    """A terminal SSE error frame (no [DONE] follows)."""
    return openai_error_body(error)


class OpenAIStream:
    """The stream ends Chat and Completions encoders share: the usage chunk when
    stream_options.include_usage asked for it, then [DONE]; a failure is one error frame."""

    done_sentinel = True
    options: StreamOptions

    def chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        raise NotImplementedError

    def usage(self) -> dict[str, Any]:
        raise NotImplementedError

    def end(self) -> list[tuple[Any, str | None]]:
        return [({**self.chunk([]), "usage": self.usage()}, None)] if self.options.include_usage else []

    def failure(self, error: ApiError) -> list[tuple[Any, str | None]]:
        return [(stream_error(error), None)]


def finish_reason_name(reason: FinishReason | None) -> str | None:
    if reason is None:
        return None
    return "length" if reason == FinishReason.LENGTH else "stop"


def now() -> int:
    return int(time.time())


def logprob_value(value: float) -> float:
    return value if math.isfinite(value) else NONFINITE_LOGPROB


# -- logprob encodings ---------------------------------------------------------------------------


def token_label(tokenizer: Tokenizer, token_id: int, as_ids: bool) -> str:
    return f"token_id:{token_id}" if as_ids else tokenizer.token_string(token_id)


def natural_top(entry: TokenLogprob, k: int) -> list[tuple[int, float]]:
    """k alternatives by decreasing logprob, increasing id on ties; explicit ids as requested."""
    if entry.explicit:
        return entry.top
    return sorted(entry.top, key=lambda t: (-t[1], t[0]))[:k]


def chat_logprob_entries(
    tokenizer: Tokenizer, entries: list[TokenLogprob], k: int, as_ids: bool
) -> list[dict[str, Any]]:
    def one(token_id: int, lp: float) -> dict[str, Any]:
        return {
            "token": token_label(tokenizer, token_id, as_ids),
            "logprob": logprob_value(lp),
            "bytes": list(tokenizer.token_bytes(token_id)),
        }

    return [
        {**one(e.token_id, e.logprob), "top_logprobs": [one(t, lp) for t, lp in natural_top(e, k)]} for e in entries
    ]


def completion_logprobs(
    tokenizer: Tokenizer, entries: list[TokenLogprob], offsets: list[int], k: int, as_ids: bool, offset_base: int = 0
) -> dict[str, Any]:
    """Parallel arrays of Completions; top maps keep the first id per decoded string."""
    tops = []
    for e in entries:
        top: dict[str, float] = {}
        for token_id, lp in natural_top(e, k):
            top.setdefault(token_label(tokenizer, token_id, as_ids), logprob_value(lp))
        tops.append(top)
    return {
        "tokens": [token_label(tokenizer, e.token_id, as_ids) for e in entries],
        "token_logprobs": [logprob_value(e.logprob) for e in entries],
        "top_logprobs": tops,
        "text_offset": [offset_base + o for o in offsets],
    }


def prompt_logprobs_field(tokenizer: Tokenizer, entries: list[PromptLogprob | None], k: int) -> list[Any]:
    """vLLM's prompt_logprobs: per prompt position null or {id: {logprob, rank, decoded_token}},
    the actual token first, then up to k natural alternatives."""
    out: list[Any] = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        scored = {str(entry.token_id): _scored(tokenizer, entry.token_id, entry.logprob, entry.rank)}
        for token_id, lp, rank in entry.top[:k]:
            scored.setdefault(str(token_id), _scored(tokenizer, token_id, lp, rank))
        out.append(scored)
    return out


def _scored(tokenizer: Tokenizer, token_id: int, logprob: float, rank: int) -> dict[str, Any]:
    return {"logprob": logprob_value(logprob), "rank": rank, "decoded_token": tokenizer.token_string(token_id)}


def echo_logprobs(
    tokenizer: Tokenizer,
    prompt_ids: list[int],
    entries: list[PromptLogprob | None],
    k: int,
    as_ids: bool,
    first: int = 0,
    offset_base: int = 0,
) -> dict[str, Any]:
    """Completions arrays for echoed prompt positions first..first+len(entries): position zero has
    null token_logprobs and top_logprobs; text_offset counts the preceding decoded token strings
    (offset_base: the characters of the positions before `first`)."""
    tokens, values, tops, offsets = [], [], [], []
    chars = offset_base
    for position, entry in enumerate(entries, start=first):
        token_id = prompt_ids[position]
        tokens.append(token_label(tokenizer, token_id, as_ids))
        offsets.append(chars)
        chars += len(tokenizer.token_string(token_id))
        if entry is None:
            values.append(None)
            tops.append(None)
            continue
        values.append(logprob_value(entry.logprob))
        top: dict[str, float] = {}
        for alt_id, lp, _ in entry.top[:k]:
            top.setdefault(token_label(tokenizer, alt_id, as_ids), logprob_value(lp))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def echo_chars(tokenizer: Tokenizer, prompt_ids: list[int]) -> int:
    """Characters of the decoded token strings of `prompt_ids` (where generated offsets start)."""
    return sum(len(tokenizer.token_string(t)) for t in prompt_ids)


def request_sampling(
    body: Mapping[str, Any],
    manifest: Manifest,
    *,
    stop_name: str = "stop",
    logprobs: int | None = None,
    biased: bool = False,
) -> SamplingParams:
    """A request body's sampling fields (native extensions included), handed to the neutral layer
    as SamplingFields and resolved against the core's prepared policy; max_tokens and per-choice
    seeds are set when its engine requests are built. `biased`: the protocol has logit_bias."""
    return resolve_sampling(
        SamplingFields(
            values={name: body.get(name) for name in DISTRIBUTION_FIELDS},
            seed=body.get("seed"),
            stop=body.get(stop_name),
            stop_name=stop_name,
            stop_token_ids=body.get("stop_token_ids"),
            stop_token_sequences=body.get("stop_token_sequences"),
            ignore_eos=body.get("ignore_eos"),
            include_stop_str_in_output=body.get("include_stop_str_in_output"),
            logprobs=logprobs,
            logit_bias=body.get("logit_bias") if biased else None,
        ),
        manifest.sampling,
        manifest.architecture.vocab_size,
    )


def prompt_cache_key(body: Mapping[str, Any]) -> str | None:
    """OpenAI's prompt_cache_key: the client's conversation id, kept only as a routing hint (a
    value that is not a short nonempty string is ignored, never an error)."""
    key = body.get("prompt_cache_key")
    return key if isinstance(key, str) and 0 < len(key) <= 256 else None


def opt_logprob_count(body: Mapping[str, Any], name: str) -> int | None:
    value = body.get(name)
    return None if value is None else logprob_count(value, name)

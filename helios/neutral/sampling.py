"""Resolve a request's sampling fields against the core's prepared policy (manifest.sampling).

Rules (api.md "Reasoning, sampling, and usage"):
- an omitted (or null) field takes the prepared default;
- numeric values are clamped to the core's inclusive range; a parameter without a range is fixed
  at its default, whatever the request says; temperature 0 (or -0.0) therefore becomes the range
  minimum, or the default without a range;
- malformed types are HTTP 400: numbers must be JSON numbers (booleans are not), top_k must be an
  integer, non-finite values are rejected;
- seed is request-controlled; omitted uses the prepared default.

Output budget: max_tokens omitted -> manifest.limits.default_max_tokens. Either way the budget is
bounded by the context left after the prompt. Decision (documented in docs/architecture.md): a
prompt that alone fills the context is rejected (400); a larger max_tokens is *clamped* to the
remaining context rather than rejected as vLLM does, because api.md says remaining context
bounds output, and agent clients routinely send budgets larger than a small core's context. A
clamped request that runs out reports finish_reason "length".
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from helios.engine.api import SamplingParams
from helios.manifest import Limits, Logprobs, Sampling
from helios.neutral.errors import RequestError
from helios.neutral.fields import require_bool, require_int, require_number

DISTRIBUTION_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)
INTEGER_FIELDS = frozenset({"top_k"})

MAX_STOP_STRINGS = 4
MAX_STOP_BYTES = 4096
MAX_TOKEN_STOPS = 16  # stop_token_ids and stop_token_sequences together (api.md)
MAX_STOP_SEQUENCE_IDS = 64
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS_ENTRIES = 300  # OpenAI's limit
MAX_LOGIT_BIAS = 100.0
TOKEN_ID_KEY = re.compile(r"-?[0-9]{1,10}")  # ASCII digits only: int() would also take "١" or "1_0"
SEED_MODULUS = 1 << 64  # seeds are taken modulo 2**64 so the engine always sees a nonnegative int


def resolve_distribution(values: Mapping[str, Any], sampling: Sampling) -> dict[str, float | int]:
    """The seven distribution parameters, defaulted, type-checked and clamped."""
    resolved: dict[str, float | int] = {}
    for name in DISTRIBUTION_FIELDS:
        default = getattr(sampling.defaults, name)
        raw = values.get(name)
        if raw is None:
            resolved[name] = default
            continue
        value: float = require_int(raw, name) if name in INTEGER_FIELDS else require_number(raw, name)
        bounds = sampling.ranges.get(name)
        if bounds is None:
            resolved[name] = default  # no range: fixed at the prepared default
            continue
        value = min(max(value, bounds.min), bounds.max)
        resolved[name] = int(round(value)) if name in INTEGER_FIELDS else float(value)
    return resolved


def resolve_seed(value: Any, default: int | None) -> int | None:
    if value is None:
        return None if default is None else default % SEED_MODULUS
    seed = require_int(value, "seed")
    if not -(1 << 63) <= seed < SEED_MODULUS:
        raise RequestError("seed must fit in 64 bits", param="seed")
    return seed % SEED_MODULUS


def child_seed(seed: int | None, choice_index: int) -> int | None:
    """The configured or explicit seed advances by choice index (n > 1 stays reproducible)."""
    return None if seed is None else (seed + choice_index) % SEED_MODULUS


def parse_stop_strings(value: Any, name: str = "stop") -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise RequestError(f"{name} must be a string or an array of strings", param=name)
    if len(stops) > MAX_STOP_STRINGS:
        raise RequestError(f"{name} accepts at most {MAX_STOP_STRINGS} strings", param=name)
    if any(s == "" for s in stops):
        raise RequestError(f"{name} strings must be nonempty", param=name)
    if sum(len(s.encode("utf-8")) for s in stops) > MAX_STOP_BYTES:
        raise RequestError(f"{name} strings may total at most {MAX_STOP_BYTES} UTF-8 bytes", param=name)
    return list(stops)


def parse_token_ids(value: Any, name: str, vocab_size: int) -> list[int]:
    """A list of vocabulary ids (no booleans, no negatives, below vocab_size)."""
    if not isinstance(value, list):
        raise RequestError(f"{name} must be an array of token ids", param=name)
    for token in value:
        if isinstance(token, bool) or not isinstance(token, int):
            raise RequestError(f"{name} must contain integer token ids", param=name)
        if not 0 <= token < vocab_size:
            raise RequestError(f"{name} contains token id {token}, outside the vocabulary of {vocab_size}", param=name)
    return list(value)


def parse_token_stops(ids: Any, sequences: Any, vocab_size: int) -> tuple[list[int], list[list[int]]]:
    """stop_token_ids (one-token stops) and stop_token_sequences (runs of ids): at most 16
    nonempty stops together, each sequence at most 64 vocabulary ids."""
    stop_ids = [] if ids is None else parse_token_ids(ids, "stop_token_ids", vocab_size)
    name = "stop_token_sequences"
    runs: list[list[int]] = []
    if sequences is not None:
        if not isinstance(sequences, list):
            raise RequestError(f"{name} must be an array of token-id arrays", param=name)
        for i, run in enumerate(sequences):
            ids_i = parse_token_ids(run, f"{name}[{i}]", vocab_size)
            if not ids_i or len(ids_i) > MAX_STOP_SEQUENCE_IDS:
                raise RequestError(f"{name}[{i}] must hold 1 to {MAX_STOP_SEQUENCE_IDS} token ids", param=name)
            runs.append(ids_i)
    if len(stop_ids) + len(runs) > MAX_TOKEN_STOPS:
        param = name if runs else "stop_token_ids"
        raise RequestError(
            f"token stops (stop_token_ids and stop_token_sequences) accept at most "
            f"{MAX_TOKEN_STOPS} sequences together",
            param=param,
        )
    return stop_ids, runs


def parse_logit_bias(value: Any, vocab_size: int) -> dict[int, float]:
    """OpenAI logit_bias: an object of token id (a decimal string key) -> bias in [-100, 100],
    at most 300 entries, every id inside the vocabulary."""
    name = "logit_bias"
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise RequestError(f"{name} must be an object mapping token ids to biases", param=name)
    if len(value) > MAX_LOGIT_BIAS_ENTRIES:
        raise RequestError(f"{name} accepts at most {MAX_LOGIT_BIAS_ENTRIES} entries", param=name)
    biases: dict[int, float] = {}
    for key, raw in value.items():
        text = key.strip() if isinstance(key, str) else ""
        if not TOKEN_ID_KEY.fullmatch(text):
            raise RequestError(f"{name} keys must be token ids, got {key[:32]!r}", param=name)
        token = int(text)
        if not 0 <= token < vocab_size:
            raise RequestError(f"{name} names token id {token}, outside the vocabulary of {vocab_size}", param=name)
        bias = require_number(raw, f"{name}[{key}]")
        if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise RequestError(f"{name}[{key}] must be between -100 and 100", param=name)
        biases[token] = float(bias)
    return biases


def requested_max_tokens(value: Any, name: str = "max_tokens", *, allow_zero: bool) -> int | None:
    """The output budget a body asks for, decoded (None: the core's default)."""
    if value is None:
        return None
    budget = require_int(value, name)
    if budget < 0 or (budget == 0 and not allow_zero):
        raise RequestError(f"{name} must be at least {0 if allow_zero else 1}", param=name)
    return budget


def resolve_max_tokens(requested: int | None, prompt_tokens: int, limits: Limits, *, name: str = "max_tokens") -> int:
    """The output budget: default or requested, bounded by the context left after the prompt."""
    context = limits.context_length
    if prompt_tokens > context:
        raise RequestError(
            f"the prompt has {prompt_tokens} tokens, more than this model's {context}-token context", param=name
        )
    budget = limits.default_max_tokens if requested is None else requested
    if budget == 0:
        return 0
    remaining = context - prompt_tokens
    if remaining < 1:
        raise RequestError(
            f"the prompt has {prompt_tokens} tokens and leaves no room for output in this model's "
            f"{context}-token context",
            param=name,
        )
    return min(budget, remaining)


def logprob_count(value: Any, name: str) -> int:
    """An alternatives count (top_logprobs, logprobs, prompt_logprobs): an integer 0..20 (api.md)."""
    k = require_int(value, name)
    if not 0 <= k <= MAX_TOP_LOGPROBS:
        raise RequestError(f"{name} must be between 0 and {MAX_TOP_LOGPROBS}", param=name)
    return k


def check_top_logprobs(k: Any, name: str, capacity: Logprobs) -> int:
    """A natural-alternatives count 0..20 that the loaded core can return."""
    k = logprob_count(k, name)
    if capacity.max_top_logprobs <= 0:
        raise RequestError("generation logprobs are not available in this model core", param=name)
    if k > capacity.max_top_logprobs:
        raise RequestError(
            f"{name}={k} exceeds this model core's capacity of {capacity.max_top_logprobs} alternatives", param=name
        )
    return k


@dataclass
class SamplingFields:
    """The sampling-related request fields, already pulled out of a protocol's JSON."""

    values: Mapping[str, Any]  # temperature, top_p, top_k, min_p, *_penalty
    seed: Any = None
    stop: Any = None
    stop_name: str = "stop"
    stop_token_ids: Any = None
    stop_token_sequences: Any = None
    ignore_eos: Any = None
    include_stop_str_in_output: Any = None
    logprobs: int | None = None  # already validated natural-alternative count, None for off
    logit_bias: Any = None  # OpenAI Chat and Completions only


def resolve_sampling(fields: SamplingFields, sampling: Sampling, vocab_size: int) -> SamplingParams:
    """Everything except max_tokens and the per-choice seed (those depend on the prompt/child)."""
    dist = resolve_distribution(fields.values, sampling)
    stops = parse_stop_strings(fields.stop, fields.stop_name)
    stop_ids, stop_runs = parse_token_stops(fields.stop_token_ids, fields.stop_token_sequences, vocab_size)
    if stops and (stop_ids or stop_runs):
        raise RequestError("a request cannot combine string stops with token stops", param=fields.stop_name)
    ignore_eos = False if fields.ignore_eos is None else require_bool(fields.ignore_eos, "ignore_eos")
    include_stop = (
        False
        if fields.include_stop_str_in_output is None
        else require_bool(fields.include_stop_str_in_output, "include_stop_str_in_output")
    )
    return SamplingParams(
        temperature=float(dist["temperature"]),
        top_p=float(dist["top_p"]),
        top_k=int(dist["top_k"]),
        min_p=float(dist["min_p"]),
        repetition_penalty=float(dist["repetition_penalty"]),
        presence_penalty=float(dist["presence_penalty"]),
        frequency_penalty=float(dist["frequency_penalty"]),
        seed=resolve_seed(fields.seed, sampling.defaults.seed),
        ignore_eos=ignore_eos,
        stop=stops,
        stop_token_ids=stop_ids,
        stop_token_sequences=stop_runs,
        logprobs=fields.logprobs,
        include_stop_str_in_output=include_stop,
        logit_bias=parse_logit_bias(fields.logit_bias, vocab_size),
    )

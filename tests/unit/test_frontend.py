"""Frontend units: sampling resolution, stops, output budgets, tokenizer, chat template,
conversation lowering, request bodies, metrics negotiation, admission and config."""

from __future__ import annotations

import asyncio
import gzip
import json
import math
import tracemalloc
import zlib

import brotli
import pytest
import zstandard
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from helios.manifest import Limits, Logprobs, Range, Sampling, SamplingDefaults, TokenizerSpec
from helios.neutral.conversation import (
    Conversation,
    Message,
    TextPart,
    ToolCallPart,
    ToolResultPart,
    merge_instructions,
    render_prompt,
    render_text,
)
from helios.neutral.errors import RequestError
from helios.neutral.sampling import (
    SEED_MODULUS,
    SamplingFields,
    check_top_logprobs,
    child_seed,
    parse_stop_strings,
    parse_token_stops,
    requested_max_tokens,
    resolve_distribution,
    resolve_max_tokens,
    resolve_sampling,
    resolve_seed,
)
from helios.neutral.template import ChatTemplate, TemplateError
from helios.neutral.tokenizer import Tokenizer, gpt2_unicode_to_byte
from helios.transport import bodies
from helios.transport.admission import Admission
from helios.transport.config import ConfigError, ServerConfig, read_api_key_file
from helios.transport.errors import ApiError, openai_error_body
from helios.transport.metrics import FirstResponseWindow, wants_json

# -- fixtures --------------------------------------------------------------------------------------

SAMPLING = Sampling(
    defaults=SamplingDefaults(temperature=0.7, top_p=0.8, top_k=20, min_p=0.0, repetition_penalty=1.05, seed=None),
    ranges={
        "temperature": Range(0.01, 2.0),
        "top_p": Range(0.05, 1.0),
        "top_k": Range(-1, 200),
        "presence_penalty": Range(-2.0, 2.0),
    },
)
LIMITS = Limits(
    context_length=100,
    max_concurrency=4,
    prefill_chunk_size=64,
    max_batch_tokens=128,
    default_max_tokens=30,
    kv_pages=16,
)
VOCAB = 1000

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
    "{% endif %}"
)


def _tokenizer(bos: int | None = 256, add_bos: bool = False) -> Tokenizer:
    """A tiny byte-level BPE (GPT-2 byte alphabet + two merges) with ChatML control tokens."""
    table = gpt2_unicode_to_byte()
    vocab = {ch: b for ch, b in table.items()}
    merges = [("Ġ", "w"), ("o", "r")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")])
    eot, start, end = (tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"))
    spec = TokenizerSpec(
        file="tokenizer.json",
        bos_token_id=eot if bos is not None else None,
        eos_token_ids=[end, eot],
        pad_token_id=None,
        add_bos=add_bos,
        special_tokens={"<|endoftext|>": eot, "<|im_start|>": start, "<|im_end|>": end},
    )
    return Tokenizer(tok.to_str(), spec, vocab_size=tok.get_vocab_size() + 8)


# -- sampling --------------------------------------------------------------------------------------


def test_omitted_fields_take_prepared_defaults():
    out = resolve_distribution({}, SAMPLING)
    assert out == {
        "temperature": 0.7,
        "top_p": 0.8,
        "top_k": 20,
        "min_p": 0.0,
        "repetition_penalty": 1.05,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
    }
    assert resolve_distribution({"temperature": None}, SAMPLING)["temperature"] == 0.7


def test_values_clamp_to_inclusive_ranges():
    out = resolve_distribution({"temperature": 5, "top_p": 0.0, "top_k": 1000, "presence_penalty": -9.5}, SAMPLING)
    assert out["temperature"] == 2.0 and out["top_p"] == 0.05 and out["top_k"] == 200
    assert out["presence_penalty"] == -2.0
    inside = resolve_distribution({"temperature": 1.3, "top_k": 0}, SAMPLING)
    assert inside["temperature"] == 1.3 and inside["top_k"] == 0
    below = resolve_distribution({"top_k": -7}, SAMPLING)["top_k"]
    assert below == -1 and type(below) is int


@pytest.mark.parametrize("zero", [0, 0.0, -0.0])
def test_temperature_zero_becomes_range_minimum(zero):
    assert resolve_distribution({"temperature": zero}, SAMPLING)["temperature"] == 0.01
    no_range = Sampling(defaults=SamplingDefaults(temperature=0.6), ranges={})
    assert resolve_distribution({"temperature": zero}, no_range)["temperature"] == 0.6


def test_parameter_without_range_is_fixed_at_default():
    out = resolve_distribution({"min_p": 0.3, "repetition_penalty": 1.2, "frequency_penalty": 1}, SAMPLING)
    assert out["min_p"] == 0.0 and out["repetition_penalty"] == 1.05 and out["frequency_penalty"] == 0.0


@pytest.mark.parametrize(
    "field,value",
    [
        ("top_k", 2.0),
        ("top_k", "5"),
        ("top_k", True),
        ("temperature", True),
        ("temperature", "1"),
        ("top_p", [0.5]),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("min_p", {}),
    ],
)
def test_malformed_types_are_rejected(field, value):
    with pytest.raises(RequestError) as info:
        resolve_distribution({field: value}, SAMPLING)
    assert field in info.value.message


def test_seed_is_request_controlled_and_advances_by_choice():
    assert resolve_seed(None, None) is None
    assert resolve_seed(None, 11) == 11
    assert resolve_seed(42, 11) == 42
    assert resolve_seed(-1, None) == SEED_MODULUS - 1
    for bad in (True, 1.5, "3", 1 << 64, -(1 << 63) - 1):
        with pytest.raises(RequestError):
            resolve_seed(bad, None)
    assert [child_seed(7, i) for i in range(3)] == [7, 8, 9]
    assert child_seed(None, 3) is None
    assert child_seed(SEED_MODULUS - 1, 1) == 0


def test_stop_strings():
    assert parse_stop_strings(None) == []
    assert parse_stop_strings("END") == ["END"]
    assert parse_stop_strings(["a", "b", "c", "d"]) == ["a", "b", "c", "d"]
    assert parse_stop_strings(["x" * 4096]) == ["x" * 4096]
    for bad in (["a", "b", "c", "d", "e"], [""], "", ["x" * 4097], ["é" * 2049], [1], 5, {"a": 1}):
        with pytest.raises(RequestError):
            parse_stop_strings(bad)


def test_stop_token_ids():
    assert parse_token_stops(None, None, VOCAB) == ([], [])
    assert parse_token_stops([0, 999], None, VOCAB) == ([0, 999], [])
    for bad in ([1000], [-1], [True], [1.0], list(range(17)), 3):
        with pytest.raises(RequestError):
            parse_token_stops(bad, None, VOCAB)


def test_stop_token_sequences():
    assert parse_token_stops(None, [[1, 2], [3]], VOCAB) == ([], [[1, 2], [3]])
    assert parse_token_stops(list(range(8)), [[9]] * 8, VOCAB)[1] == [[9]] * 8  # sixteen stops in all
    assert parse_token_stops(None, [list(range(64))], VOCAB)[1] == [list(range(64))]
    for ids, runs, message in (
        (None, [[]], "1 to 64"),
        (None, [list(range(65))], "1 to 64"),
        (list(range(8)), [[9]] * 9, "at most 16"),
        (None, [[1000]], "outside"),
        (None, [1, 2], "array of token ids"),
        (None, "x", "token-id arrays"),
    ):
        with pytest.raises(RequestError, match=message):
            parse_token_stops(ids, runs, VOCAB)


def test_string_and_token_stops_cannot_combine():
    with pytest.raises(RequestError, match="cannot combine"):
        resolve_sampling(SamplingFields(values={}, stop=["x"], stop_token_ids=[3]), SAMPLING, VOCAB)
    params = resolve_sampling(
        SamplingFields(values={"temperature": 0}, seed=5, stop="x", ignore_eos=True), SAMPLING, VOCAB
    )
    assert params.temperature == 0.01 and params.seed == 5 and params.stop == ["x"] and params.ignore_eos
    with pytest.raises(RequestError):
        resolve_sampling(SamplingFields(values={}, ignore_eos="yes"), SAMPLING, VOCAB)


def test_max_tokens_default_and_context_bounds():
    assert resolve_max_tokens(None, 10, LIMITS) == 30
    assert resolve_max_tokens(None, 90, LIMITS) == 10  # default bounded by context
    assert resolve_max_tokens(500, 10, LIMITS) == 90  # clamped, not rejected
    assert resolve_max_tokens(5, 10, LIMITS) == 5
    assert resolve_max_tokens(0, 10, LIMITS) == 0
    assert resolve_max_tokens(0, 100, LIMITS) == 0  # a full prompt can still echo
    with pytest.raises(RequestError, match="more than"):
        resolve_max_tokens(0, 101, LIMITS)
    with pytest.raises(RequestError, match="no room"):
        resolve_max_tokens(None, 100, LIMITS)
    assert requested_max_tokens(None, allow_zero=False) is None
    assert requested_max_tokens(0, allow_zero=True) == 0 and requested_max_tokens(7, allow_zero=False) == 7
    for bad in (0, -1, 1.5, True, "8"):
        with pytest.raises(RequestError):
            requested_max_tokens(bad, allow_zero=False)


def test_top_logprobs_capacity():
    full = Logprobs(max_top_logprobs=20, explicit_token_ids=True, prompt_logprobs=False)
    assert check_top_logprobs(20, "top_logprobs", full) == 20
    with pytest.raises(RequestError):
        check_top_logprobs(21, "top_logprobs", full)
    with pytest.raises(RequestError, match="exceeds"):
        check_top_logprobs(6, "top_logprobs", Logprobs(5, False, False))
    with pytest.raises(RequestError, match="not available in this model core"):
        check_top_logprobs(0, "top_logprobs", Logprobs(0, False, False))


# -- tokenizer -------------------------------------------------------------------------------------


def test_tokenizer_special_tokens_bos_and_bytes():
    tok = _tokenizer()
    end = tok.spec.special_tokens["<|im_end|>"]
    ids = tok.encode("hi<|im_end|> wor")
    assert end in ids and ids[0] != tok.spec.bos_token_id  # add_bos false
    assert tok.decode(ids) == "hi<|im_end|> wor"
    assert tok.decode(ids, skip_special_tokens=True) == "hi wor"
    text = "héllo 🎉 wörld"
    ids = tok.encode(text)
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()
    assert any(0xF0 == tok.token_bytes(i)[0] for i in ids)  # partial UTF-8 stays exact
    assert "\ufffd" in tok.token_string(next(i for i in ids if tok.token_bytes(i) == b"\xf0"))
    assert tok.token_bytes(end) == b"<|im_end|>" and tok.is_special(end)
    assert tok.bos_token == "<|endoftext|>" and tok.eos_token == "<|im_end|>"


def test_tokenizer_bos_policy_and_empty_prompt():
    with_bos = _tokenizer(add_bos=True)
    bos = with_bos.spec.bos_token_id
    assert with_bos.encode("hi")[0] == bos
    assert with_bos.encode("hi", add_bos=False)[0] != bos
    assert _tokenizer().encode_raw_prompt("") == [bos]
    assert _tokenizer(bos=None).encode_raw_prompt("") == []


# -- template --------------------------------------------------------------------------------------


def _chat(*pairs: tuple[str, str]) -> list[dict]:
    return [{"role": r, "content": c} for r, c in pairs]


def test_chatml_generation_prompt_and_kwargs():
    t = ChatTemplate(CHATML, bos_token="<s>", eos_token="<|im_end|>")
    msgs = _chat(("user", "Hi"))
    assert t.render(msgs, add_generation_prompt=True) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert t.render(msgs, add_generation_prompt=False) == "<|im_start|>user\nHi<|im_end|>\n"
    off = t.render(msgs, add_generation_prompt=True, template_kwargs={"enable_thinking": False})
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    with pytest.raises(TemplateError):
        t.render(msgs, template_kwargs={"messages": []})


def test_continue_final_message_cuts_after_content():
    t = ChatTemplate(CHATML)
    msgs = _chat(("user", "Choose A or B."), ("assistant", "Choice:"))
    out = t.render(msgs, add_generation_prompt=False, continue_final_message=True)
    assert out == "<|im_start|>user\nChoose A or B.<|im_end|>\n<|im_start|>assistant\nChoice:"
    with pytest.raises(TemplateError):
        t.render(msgs, add_generation_prompt=True, continue_final_message=True)
    trimming = ChatTemplate("{% for m in messages %}[{{ m['content'] | trim }}]{% endfor %}")
    assert (
        trimming.render(_chat(("assistant", "Answer: ")), add_generation_prompt=False, continue_final_message=True)
        == "[Answer:"
    )
    dropping = ChatTemplate("{% for m in messages %}{{ m['role'] }}{% endfor %}")
    with pytest.raises(TemplateError, match="continued"):
        dropping.render(_chat(("assistant", "x")), add_generation_prompt=False, continue_final_message=True)


def test_template_helpers_follow_hugging_face():
    t = ChatTemplate(
        "{{ bos_token }}{{ messages[0]['content'] | tojson }}|{{ {'b': 1, 'a': 'é'} | tojson(indent=1, "
        "sort_keys=true) }}|{{ strftime_now('%Y') | length }}",
        bos_token="<s>",
    )
    out = t.render(_chat(("user", "é<tag>")), add_generation_prompt=False)
    assert out == '<s>"é<tag>"|{\n "a": "é",\n "b": 1\n}|4'
    raising = ChatTemplate("{{ raise_exception('System role not supported') }}")
    with pytest.raises(TemplateError, match="System role not supported"):
        raising.render(_chat(("system", "x")))
    # trim_blocks / lstrip_blocks as in transformers
    blocks = ChatTemplate("  {% if true %}\nA\n  {% endif %}\nB")
    assert blocks.render([], add_generation_prompt=False) == "A\nB"


def test_template_sandbox_and_syntax_errors_are_request_errors():
    with pytest.raises(TemplateError):
        ChatTemplate("{{ ''.__class__.__mro__ }}").render([], add_generation_prompt=False)
    with pytest.raises(TemplateError):
        ChatTemplate("{% for %}")
    with pytest.raises(TemplateError):
        ChatTemplate("{{ messages[5]['content'] }}").render([], add_generation_prompt=False)


# -- conversation ----------------------------------------------------------------------------------


def test_developer_instructions_merge_into_one_leading_system_message():
    msgs = [
        Message("user", [TextPart("hi")]),
        Message("system", [TextPart("S")]),
        Message("developer", [TextPart("D1"), TextPart("D2")]),
    ]
    merged = merge_instructions(msgs)
    assert [m.role for m in merged] == ["system", "user"]
    assert merged[0].text() == "<system>\nS\n</system>\n\n<developer>\nD1\nD2\n</developer>"
    plain = [Message("user", [TextPart("a")]), Message("system", [TextPart("b")])]
    assert merge_instructions(plain) == plain  # template rules apply without developer messages


def test_render_prompt_lowers_tool_history_and_tokenizes_without_bos():
    tok = _tokenizer(add_bos=True)
    source = (
        "{% for m in messages %}{{ m.role }}:{{ m.content }}"
        "{% for c in m.tool_calls or [] %}[{{ c.function.name }} {{ c.function.arguments | tojson }}]{% endfor %}"
        "{% if m.tool_call_id %}<{{ m.tool_call_id }}>{% endif %};{% endfor %}"
    )
    conv = Conversation(
        [
            Message("user", [TextPart("go")]),
            Message("assistant", [ToolCallPart("c1", "lookup", '{"q": "é"}')]),
            Message("tool", [ToolResultPart("c1", [TextPart("42")])]),
        ]
    )
    text = render_text(conv, ChatTemplate(source), add_generation_prompt=False)
    assert text == 'user:go;assistant:[lookup {"q": "é"}];tool:42<c1>;'
    ids = render_prompt(conv, ChatTemplate(source), tok, add_generation_prompt=False)
    assert ids[0] != tok.spec.bos_token_id and tok.decode(ids) == text
    with pytest.raises(RequestError):
        render_text(conv, None)


# -- request bodies --------------------------------------------------------------------------------

PAYLOAD = json.dumps({"prompt": "héllo " * 100, "max_tokens": 3}).encode()


@pytest.mark.parametrize(
    "header,encode",
    [
        (None, lambda b: b),
        ("identity", lambda b: b),
        ("gzip", gzip.compress),
        ("x-gzip", gzip.compress),
        ("deflate", zlib.compress),
        ("br", brotli.compress),
        ("zstd", lambda b: zstandard.ZstdCompressor().compress(b)),
        ("gzip, br", lambda b: brotli.compress(gzip.compress(b))),
    ],
)
def test_every_content_encoding_decodes(header, encode):
    encodings = bodies.content_encodings(header)
    assert bodies.decode_json(encode(PAYLOAD), encodings, 1 << 20) == json.loads(PAYLOAD)


def test_gzip_multimember_and_corrupt_bodies():
    twice = gzip.compress(b'{"a": ') + gzip.compress(b"1}")
    assert bodies.decode_json(twice, ["gzip"], 1 << 20) == {"a": 1}
    for encoding, data in [
        ("gzip", b"not gzip"),
        ("br", b"\x00\x01junk"),
        ("zstd", b"junk"),
        ("gzip", gzip.compress(PAYLOAD)[:-12]),
        ("deflate", zlib.compress(PAYLOAD)[:-4]),
    ]:
        with pytest.raises(ApiError) as info:
            bodies.decode(data, [encoding], 1 << 20)
        assert info.value.status == 400


def test_unknown_encoding_is_415():
    with pytest.raises(ApiError) as info:
        bodies.content_encodings("gzip, compress")
    assert info.value.status == 415


@pytest.mark.parametrize(
    "encoding,compress",
    [
        ("gzip", gzip.compress),
        ("deflate", zlib.compress),
        ("br", brotli.compress),
        ("zstd", lambda b: zstandard.ZstdCompressor().compress(b)),
    ],
)
def test_compression_bomb_stops_at_the_limit(encoding, compress):
    limit = 1 << 20
    bomb = compress(b"\0" * (64 << 20))  # 64 MiB of zeros in a few dozen KiB
    assert len(bomb) < limit
    tracemalloc.start()
    try:
        with pytest.raises(ApiError) as info:
            bodies.decode(bomb, [encoding], limit)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert info.value.status == 413 and info.value.type == "request_too_large"
    assert peak < 4 * limit  # never inflates far past max_body_bytes


def test_strict_json():
    assert bodies.parse_json(b'{"a": [1, 2.5, "x"]}') == {"a": [1, 2.5, "x"]}
    for bad in (b"{", b'{"t": NaN}', b'{"t": Infinity}', b"\xff\xfe\x00", b"[" * 100000):
        with pytest.raises(ApiError) as info:
            bodies.parse_json(bad)
        assert info.value.status == 400


def test_encoded_body_limit_while_reading():
    async def scenario() -> list[int]:
        async def handler(request: web.Request) -> web.Response:
            try:
                data = await bodies.read_encoded(request, 1000)
            except ApiError as exc:
                return web.Response(status=exc.status)
            return web.Response(text=str(len(data)))

        app = web.Application(handler_args={"auto_decompress": False})
        app.router.add_post("/", handler)
        async with TestClient(TestServer(app)) as client:
            statuses = []
            for body in (b"x" * 1000, b"x" * 1001):
                statuses.append((await client.post("/", data=body)).status)

            async def chunks():  # no Content-Length: counted while streaming
                for _ in range(5):
                    yield b"y" * 300

            statuses.append((await client.post("/", data=chunks())).status)
            return statuses

    assert asyncio.run(scenario()) == [200, 413, 413]


# -- metrics negotiation ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fmt,accept,expected",
    [
        (None, None, False),
        (None, "*/*", False),
        (None, "application/json", True),
        (None, "text/plain", False),
        (None, "application/json, text/plain", True),  # equal quality: the earlier range wins
        (None, "text/plain, application/json", False),
        (None, "application/json;q=0.5, text/plain", False),
        (None, "text/plain;q=0.2, application/json;q=0.9", True),
        (None, "text/*;q=0.3, application/*;q=0.4", True),
        (
            None,
            "application/openmetrics-text;version=1.0.0;q=0.5,application/openmetrics-text;version=0.0.1;q=0.4,"
            "text/plain;version=0.0.4;q=0.3,*/*;q=0.2",
            False,
        ),  # a Prometheus scraper
        ("json", None, True),
        ("json", "text/plain", True),
        ("prometheus", "application/json", False),
    ],
)
def test_metrics_format_negotiation(fmt, accept, expected):
    assert wants_json(fmt, accept) is expected


def test_metrics_unknown_format_is_400():
    with pytest.raises(ApiError) as info:
        wants_json("xml", None)
    assert info.value.status == 400


def test_first_response_window():
    window = FirstResponseWindow(window=60, capacity=3)
    assert window.snapshot()["median_seconds"] is None
    for value in (0.1, 0.3, 0.2):
        window.record(value)
    snap = window.snapshot()
    assert snap["median_seconds"] == pytest.approx(0.2) and snap["samples"] == 3 and not snap["truncated"]
    window.record(0.5)
    assert window.snapshot()["truncated"] and window.snapshot()["samples"] == 3


# -- admission, errors, config ---------------------------------------------------------------------


def test_admission_slots():
    admission = Admission(4)
    first = admission.reserve(3)
    with pytest.raises(ApiError) as busy:
        admission.reserve(2)
    assert busy.value.status == 429 and busy.value.type == "rate_limit_error"
    with pytest.raises(ApiError) as oversized:
        admission.reserve(5)
    assert oversized.value.status == 400
    first.release()
    first.release()  # idempotent
    assert admission.used == 0
    queued = Admission(8, queue_size=2)
    with pytest.raises(ApiError) as full:
        queued.reserve(1, pending_in_engine=2)
    assert full.value.status == 503


def test_openai_error_shape():
    body = openai_error_body(ApiError(400, "invalid_request_error", "bad", None))
    assert body == {"error": {"type": "invalid_request_error", "message": "bad", "param": None, "code": None}}


def test_config_file_and_key_file(tmp_path):
    path = tmp_path / "helios.toml"
    path.write_text('[server]\nhost = "0.0.0.0"\nport = 9000\napi_key = "k1"\nhttp_admission_slots = 8\n')
    config = ServerConfig.load(path)
    assert (config.host, config.port, config.api_key, config.http_admission_slots) == ("0.0.0.0", 9000, "k1", 8)
    assert config.max_body_bytes == 32 << 20
    key = tmp_path / "key"
    key.write_text("secret\n")
    assert read_api_key_file(key) == "secret"
    for bad in (
        '[server]\nport = "x"\n',
        "[server]\nbogus = 1\n",
        "[other]\n",
        "[server]\nthinking_token_budget = 0\n",
        "not toml [",
    ):
        path.write_text(bad)
        with pytest.raises(ConfigError):
            ServerConfig.load(path)

"""Engine core: detokenization, stops and the step loop (pages and scheduling policy:
test_scheduler_policy.py; sampling: test_sampler.py).

No model is needed: the loop tests use `FakeRunner`, a deterministic test double of
helios.engine.runner.Runner whose "KV pool" stores token ids, so each row's history is read back
through its block table exactly as the real graph gathers K/V. Logits are a function of the full
context (history + new tokens): wrong page tables, lost history or cross-talk between sequences
change the output, which the equivalence tests below would catch.
"""

from __future__ import annotations

import threading
import time
import zlib
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from helios.engine.api import FinishReason, GenerationEvent, GenerationRequest, SamplingParams
from helios.engine.detokenizer import IncrementalDetokenizer
from helios.engine.engine import Engine
from helios.engine.runner import StepOutput
from helios.engine.stops import StopStringMatcher
from helios.manifest import (
    Architecture,
    Identity,
    KVLayout,
    Limits,
    Logprobs,
    Manifest,
    Parsers,
    Sampling,
    SamplingDefaults,
    TemplateSpec,
    TokenizerSpec,
)
from helios.neutral.tokenizer import gpt2_byte_alphabet

# -- a tiny byte-level BPE tokenizer: token id == byte value for single bytes ------------------


B2U = gpt2_byte_alphabet()
MERGES = [("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o"), ("Ġ", "w"), ("o", "r"), ("Ġw", "or")]
EOS = 256 + len(MERGES)  # <|endoftext|>
IM_END = EOS + 1  # <|im_end|>
VOCAB = IM_END + 1


def byte_ids(text: str | bytes) -> list[int]:
    data = text.encode() if isinstance(text, str) else text
    return list(data)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    vocab = {B2U[b]: b for b in range(256)}
    for a, b in MERGES:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=MERGES))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True), AddedToken("<|im_end|>", special=True)])
    assert tok.get_vocab_size() == VOCAB and tok.token_to_id("<|endoftext|>") == EOS
    return tok


@pytest.fixture(scope="module")
def core_dir(tmp_path_factory, tokenizer) -> Path:
    folder = tmp_path_factory.mktemp("core")
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


def make_manifest(
    *,
    page_tokens: int = 4,
    kv_pages: int = 256,
    context_length: int = 256,
    max_concurrency: int = 4,
    prefill_chunk_size: int = 16,
    max_batch_tokens: int = 32,
) -> Manifest:
    return Manifest(
        identity=Identity(recipe="test", checkpoint_id="fake", checkpoint_sha256="0" * 64),
        architecture=Architecture(
            family="qwen2",
            num_layers=1,
            hidden_size=8,
            intermediate_size=16,
            num_heads=1,
            num_kv_heads=1,
            head_dim=8,
            vocab_size=VOCAB,
            rope_theta=1e6,
            rms_norm_eps=1e-6,
            max_position_embeddings=context_length,
            tie_word_embeddings=True,
            attention_bias=True,
        ),
        precision="fp32",
        limits=Limits(
            context_length=context_length,
            max_concurrency=max_concurrency,
            prefill_chunk_size=prefill_chunk_size,
            max_batch_tokens=max_batch_tokens,
            default_max_tokens=16,
            kv_pages=kv_pages,
        ),
        kv=KVLayout(page_tokens=page_tokens, num_layers=1, kv_heads=1, head_dim=8),
        engines=[],
        tokenizer=TokenizerSpec(
            file="tokenizer.json",
            bos_token_id=None,
            eos_token_ids=[EOS, IM_END],
            pad_token_id=None,
            add_bos=False,
        ),
        template=TemplateSpec(file=None),
        sampling=Sampling(defaults=SamplingDefaults()),
        parsers=Parsers(),
        logprobs=Logprobs(max_top_logprobs=20, explicit_token_ids=False, prompt_logprobs=False),
        decode_weight_bytes=0,
    )


# -- the runner test double -------------------------------------------------------------------


class FakeRunner:
    """A StepRunner whose pool holds token ids instead of K/V: step reads history through block
    tables and writes new tokens into pages.

    Next-token logits: for a context that extends a scripted prompt, a one-hot (+100) on the
    script's next token; otherwise pseudo-random logits seeded by a hash of the whole context.
    What it lacks, said here: page copies (so no copy-on-write prefix checkpoints; CopyingRunner
    in test_prefix_cache adds them), page export (no host store), verification positions (no
    speculation), prompt scoring and recurrent state.
    """

    copies_pages = False
    exports_pages = False
    can_verify = False
    can_score_prompts = False
    num_state_slots = 0
    max_positions = None
    pool_dtype = "int64"
    decode_graph_launches = 0
    replay_gpu_ns = 0

    def __init__(self, num_pages: int, page_tokens: int, scripts: dict[tuple, list[int]] | None = None):
        self.num_pages = num_pages
        self.page_tokens = page_tokens
        self.kv = KVLayout(page_tokens=page_tokens, num_layers=1, kv_heads=1, head_dim=1)
        self.graph_seconds = 0.0
        self.pool = np.full((num_pages, page_tokens), -1, dtype=np.int64)
        self.scripts = scripts or {}
        self.steps: list[list] = []  # rows of every call, for scheduling assertions
        self.fail_next = False
        self.delay = 0.0

    def step(self, rows):
        self.steps.append([SimpleNamespace(**vars(r)) for r in rows])
        if self.delay:
            time.sleep(self.delay)
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("boom")
        logits = np.empty((len(rows), VOCAB), dtype=np.float32)
        for b, row in enumerate(rows):
            n = len(row.token_ids)
            assert n >= 1
            end = row.history_len + n
            assert len(row.block_table) == -(-end // self.page_tokens), "block table must cover exactly"
            table = np.asarray(row.block_table, dtype=np.int64)
            hist = self.pool[table].reshape(-1)[: row.history_len]
            assert (hist >= 0).all(), "history read from a page never written"
            pos = np.arange(row.history_len, end)
            self.pool[table[pos // self.page_tokens], pos % self.page_tokens] = row.token_ids
            logits[b] = self._logits(hist.tolist() + list(row.token_ids))
        mx = logits.max(axis=1)
        lse = (mx + np.log(np.exp(logits - mx[:, None]).sum(axis=1))).astype(np.float32)
        lp = logits - lse[:, None]
        ids = np.arange(VOCAB)
        order = np.stack([np.lexsort((ids, -row)) for row in lp])[:, :20]
        explicit = None
        if any(r.logprob_ids for r in rows):
            width = max(len(r.logprob_ids or ()) for r in rows)
            explicit = np.zeros((len(rows), width), dtype=np.float32)
            for b, row in enumerate(rows):
                if row.logprob_ids:
                    explicit[b, : len(row.logprob_ids)] = lp[b, row.logprob_ids]
        return StepOutput(
            logits=logits,
            logsumexp=lse,
            top_logprobs=np.take_along_axis(lp, order, axis=1),
            top_ids=order,
            token_logprobs=explicit,
        )

    @property
    def pool_bytes(self) -> int:
        return self.pool.nbytes

    def copy_page(self, src: int, dst: int) -> None:
        raise NotImplementedError("FakeRunner does not copy pages (copies_pages is False)")

    def read_pages(self, pages: list[int]) -> np.ndarray:
        raise NotImplementedError("FakeRunner keeps token ids, not K/V (exports_pages is False)")

    def write_pages(self, pages: list[int], data: np.ndarray) -> None:
        raise NotImplementedError("FakeRunner keeps token ids, not K/V (exports_pages is False)")

    def read_state(self, slot: int) -> np.ndarray:
        raise NotImplementedError("FakeRunner keeps no recurrent state")

    def write_state(self, slot: int, state: np.ndarray) -> None:
        raise NotImplementedError("FakeRunner keeps no recurrent state")

    def _logits(self, ctx: list[int]) -> np.ndarray:
        for prompt, cont in self.scripts.items():
            i = len(ctx) - len(prompt)
            if 0 <= i < len(cont) and tuple(ctx[: len(prompt)]) == prompt:
                out = np.zeros(VOCAB, dtype=np.float32)
                out[cont[i]] = 100.0
                return out
        seed = zlib.crc32(np.asarray(ctx, dtype=np.int64).tobytes())
        return (np.random.default_rng(seed).standard_normal(VOCAB) * 3).astype(np.float32)


def make_engine(core_dir, *, scripts=None, **limits) -> tuple[Engine, FakeRunner]:
    manifest = make_manifest(**limits)
    runner = FakeRunner(manifest.limits.kv_pages, manifest.kv.page_tokens, scripts)
    return Engine(core_dir, manifest, runner=runner), runner


def req(rid: str, prompt: list[int], **sampling) -> GenerationRequest:
    sampling.setdefault("max_tokens", 16)
    return GenerationRequest(request_id=rid, prompt_token_ids=list(prompt), sampling=SamplingParams(**sampling))


def collect(events: list[GenerationEvent]) -> tuple[list[int], str, GenerationEvent]:
    assert events and events[-1].finished and not any(e.finished for e in events[:-1])
    ids = [t for e in events for t in e.token_ids]
    assert events[-1].completion_tokens == len(ids)
    return ids, "".join(e.text for e in events), events[-1]


# -- detokenizer and stop strings -------------------------------------------------------------


def test_detokenizer_holds_incomplete_utf8(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, byte_ids("Say: "))
    emoji = byte_ids("😀")  # 4 one-byte tokens
    assert len(emoji) == 4
    deltas = [detok.push(t) for t in byte_ids("ab") + emoji + byte_ids("!")]
    assert deltas == ["a", "b", "", "", "", "😀", "!"]
    # Text before an incomplete character is released immediately.
    detok = IncrementalDetokenizer(tokenizer, [])
    assert detok.push(tokenizer.token_to_id("hello")) == "hello"
    assert detok.push(byte_ids("é")[0]) == ""
    assert detok.push(EOS) == ""  # special tokens produce no text
    assert detok.flush() == "\ufffd"  # generation ended inside a character


@pytest.fixture(scope="module")
def qwen_tokenizer() -> Tokenizer:
    try:
        from tests.unit.tiny_checkpoints import qwen_tokenizer_bundle

        return Tokenizer.from_str(qwen_tokenizer_bundle()["tokenizer_json"])
    except Exception as exc:  # the GGUF is not available here
        pytest.skip(f"real Qwen tokenizer unavailable: {exc}")


def test_detokenizer_on_the_real_qwen_tokenizer(qwen_tokenizer):
    tok = qwen_tokenizer
    text = "Hi 👋🏽 naïve café — 日本語テキスト 🧑‍💻 done"
    ids = tok.encode(text, add_special_tokens=False).ids + [tok.token_to_id("<|im_end|>")]
    assert any(tok.decode([i]).endswith("\ufffd") for i in ids)  # some emoji really are split
    detok = IncrementalDetokenizer(tok, tok.encode("<|im_start|>assistant\n", add_special_tokens=False).ids)
    deltas = [detok.push(i) for i in ids] + [detok.flush()]
    assert "".join(deltas) == text  # <|im_end|> produces no text
    assert not any("\ufffd" in d for d in deltas)
    # Arbitrary token streams (invalid UTF-8 included) decode like a one-shot decode.
    rng = np.random.default_rng(0)
    for _ in range(50):
        ids = rng.integers(0, tok.get_vocab_size(), 40).tolist()
        detok = IncrementalDetokenizer(tok, [1, 2, 3])
        out = "".join(detok.push(i) for i in ids) + detok.flush()
        assert out == tok.decode(ids, skip_special_tokens=True)


def test_stop_string_matcher_across_chunks():
    m = StopStringMatcher(["STOP", "END!"])
    assert m.feed("Hello S") == ("Hello ", None)  # "S" could start "STOP": held
    assert m.feed("T") == ("", None)
    assert m.feed("ART E") == ("START ", None)  # not a stop after all; "E" could start "END!"
    assert m.feed("ND! more") == ("", "END!")
    m = StopStringMatcher(["STOP"], include_stop=True)
    assert m.feed("xxSTO") == ("xx", None)
    assert m.feed("P tail") == ("STOP", "STOP")
    m = StopStringMatcher(["aab", "b"])  # the earliest occurrence wins
    assert m.feed("aa") == ("", None)
    assert m.feed("ab") == ("a", "aab")
    m = StopStringMatcher(["ab", "xyz"])
    assert m.feed("--xy") == ("--", None)
    assert m.feed("q") == ("xyq", None)
    assert m.feed("x") == ("", None)
    assert m.flush() == "x"  # ended for another reason: held text is released


# -- engine loop ------------------------------------------------------------------------------


def test_stop_string_split_across_tokens(core_dir):
    prompt = byte_ids("Q:")
    engine, _ = make_engine(core_dir, scripts={tuple(prompt): byte_ids("Hi there STOP and more")})
    ids, text, last = collect(engine.generate(req("a", prompt, stop=["STOP"], max_tokens=50)))
    assert text == "Hi there "
    assert last.finish_reason is FinishReason.STOP and last.stop_reason == "STOP"
    assert ids == byte_ids("Hi there STOP")  # the completing token is counted
    ids, text, last = collect(
        engine.generate(req("b", prompt, stop=["STOP"], include_stop_str_in_output=True, max_tokens=50))
    )
    assert text == "Hi there STOP" and last.stop_reason == "STOP"
    # A stop landing exactly on the final allowed token reports STOP, not LENGTH.
    ids, text, last = collect(engine.generate(req("c", prompt, stop=["STOP"], max_tokens=13)))
    assert last.finish_reason is FinishReason.STOP and len(ids) == 13
    ids, text, last = collect(engine.generate(req("d", prompt, stop=["STOP"], max_tokens=11)))
    assert last.finish_reason is FinishReason.LENGTH and text == "Hi there ST"  # held text flushed


def test_utf8_emoji_split_across_tokens_streams_whole(core_dir):
    prompt = byte_ids(">")
    engine, _ = make_engine(core_dir, scripts={tuple(prompt): byte_ids("a😀b") + [EOS]})
    events = engine.generate(req("a", prompt, max_tokens=20, logprobs=1))
    ids, text, last = collect(events)
    assert text == "a😀b" and last.finish_reason is FinishReason.STOP and last.stop_reason is None
    assert [e.text for e in events] == ["a", "", "", "", "😀", "b", ""]
    assert ids[-1] == EOS and len(ids) == 7
    # One logprob entry per token except the terminating EOS, even where no text was released.
    assert [len(e.logprobs) for e in events] == [1, 1, 1, 1, 1, 1, 0]


def test_stop_token_ids_eos_and_ignore_eos(core_dir):
    prompt = byte_ids("go")
    script = byte_ids("xy") + [EOS] + byte_ids("zw") + [IM_END] + byte_ids("tail")
    engine, _ = make_engine(core_dir, scripts={tuple(prompt): script})
    ids, text, last = collect(engine.generate(req("eos", prompt, max_tokens=50)))
    assert text == "xy" and ids == byte_ids("xy") + [EOS] and last.stop_reason is None
    ids, text, last = collect(engine.generate(req("stopid", prompt, max_tokens=50, stop_token_ids=[ord("z")])))
    assert text == "xy" and ids == byte_ids("xy") + [EOS] and last.stop_reason is None  # EOS came first
    events = engine.generate(req("ign", prompt, max_tokens=50, ignore_eos=True, stop_token_ids=[ord("w")], logprobs=0))
    ids, text, last = collect(events)
    assert text == "xyz" and ids == script[:5]
    assert last.finish_reason is FinishReason.STOP and last.stop_reason == ord("w")
    assert sum(len(e.logprobs) for e in events) == 4  # EOS under ignore_eos keeps its entry; w has none
    ids, text, last = collect(engine.generate(req("len", prompt, max_tokens=5, ignore_eos=True)))
    assert last.finish_reason is FinishReason.LENGTH and text == "xyzw" and len(ids) == 5
    # EOS on the last allowed token is STOP.
    ids, text, last = collect(engine.generate(req("eos-last", prompt, max_tokens=3)))
    assert last.finish_reason is FinishReason.STOP and len(ids) == 3


def test_stop_token_sequences_hold_then_release_or_drop(core_dir):
    prompt = byte_ids("go")
    engine, _ = make_engine(
        core_dir,
        scripts={
            tuple(prompt): byte_ids("abcabd") + [EOS],
            tuple(byte_ids("aa")): byte_ids("aaab") + [EOS],
            tuple(byte_ids("eos")): byte_ids("ab") + [EOS],
        },
    )
    stop = byte_ids("abd")
    events = engine.generate(req("seq", prompt, max_tokens=50, stop_token_sequences=[stop], logprobs=0))
    ids, text, last = collect(events)
    # "ab" could start the stop: held (no text, no entries) until "c" breaks the match.
    assert [e.text for e in events] == ["", "", "abc", "", "", ""]
    assert [len(e.logprobs) for e in events] == [0, 0, 3, 0, 0, 0]
    assert text == "abc" and ids == byte_ids("abcabd") and last.completion_tokens == 6
    assert last.finish_reason is FinishReason.STOP and last.stop_reason == stop
    # The budget ends a partial match: the held tokens are ordinary output.
    events = engine.generate(req("len", prompt, max_tokens=5, stop_token_sequences=[stop], logprobs=0))
    ids, text, last = collect(events)
    assert text == "abcab" and last.finish_reason is FinishReason.LENGTH and sum(len(e.logprobs) for e in events) == 5
    # Overlapping prefixes: only what can no longer start the stop is released.
    ids, text, last = collect(
        engine.generate(req("overlap", byte_ids("aa"), max_tokens=50, stop_token_sequences=[byte_ids("aab")]))
    )
    assert text == "a" and last.stop_reason == byte_ids("aab")
    # EOS while holding: the held tokens are released, the EOS ends it as usual.
    events = engine.generate(req("eos", byte_ids("eos"), max_tokens=50, stop_token_sequences=[stop], logprobs=0))
    ids, text, last = collect(events)
    assert text == "ab" and last.stop_reason is None and sum(len(e.logprobs) for e in events) == 2


def test_logprobs_are_raw_and_counts_are_cumulative(core_dir):
    engine, runner = make_engine(core_dir)
    prompt = byte_ids("logprobs please")
    events = engine.generate(req("a", prompt, max_tokens=6, logprobs=3, temperature=0.5, top_k=5, seed=3))
    assert [e.completion_tokens for e in events] == [1, 2, 3, 4, 5, 6]
    assert all(e.prompt_tokens == len(prompt) and e.cached_tokens == 0 for e in events)
    ctx = list(prompt)
    for e in events:
        (tok,) = e.token_ids
        raw = runner._logits(ctx).astype(np.float64)
        lse = np.log(np.exp(raw - raw.max()).sum()) + raw.max()
        (entry,) = e.logprobs
        assert entry.token_id == tok and entry.logprob == pytest.approx(raw[tok] - lse, abs=1e-4)
        assert [t for t, _ in entry.top] == np.argsort(-raw, kind="stable")[:3].tolist()
        ctx.append(tok)


def test_context_length_bounds_output(core_dir):
    engine, _ = make_engine(core_dir, context_length=16)
    ids, _, last = collect(engine.generate(req("a", [5] * 10, max_tokens=100, ignore_eos=True)))
    assert len(ids) == 6 and last.finish_reason is FinishReason.LENGTH


def test_submit_validation(core_dir):
    engine, _ = make_engine(core_dir, context_length=16)
    with pytest.raises(ValueError, match="context"):
        engine.submit(req("a", [5] * 16), lambda e: None)
    with pytest.raises(ValueError):
        engine.submit(req("b", []), lambda e: None)
    with pytest.raises(ValueError):
        engine.submit(req("c", [VOCAB]), lambda e: None)
    with pytest.raises(ValueError):
        engine.submit(req("d", [1], logprobs=21), lambda e: None)
    engine.submit(req("e", [1]), lambda e: None)
    with pytest.raises(ValueError, match="already active"):
        engine.submit(req("e", [1]), lambda e: None)


def test_pool_too_small_for_prompt_finishes_with_length(core_dir):
    engine, _ = make_engine(core_dir, kv_pages=3, page_tokens=4)
    ids, text, last = collect(engine.generate(req("a", [5] * 12)))
    assert ids == [] and last.finish_reason is FinishReason.LENGTH
    assert engine.stats().free_pages == 3


def _run_all(engine: Engine, requests: list[GenerationRequest]) -> dict[str, list[int]]:
    results: dict[str, list[GenerationEvent]] = {r.request_id: [] for r in requests}
    for r in requests:
        engine.submit(r, results[r.request_id].append)
    while any(not ev or not ev[-1].finished for ev in results.values()):
        engine.step()
    return {rid: collect(ev)[0] for rid, ev in results.items()}


def test_preempted_sequences_complete_with_the_same_output(core_dir):
    def reqs() -> list:  # fresh requests for each engine
        return [
            req(
                f"r{i}",
                byte_ids(f"prompt {i}!"),
                max_tokens=24,
                seed=100 + i,
                ignore_eos=True,
                temperature=0.8,
                top_p=0.95,
            )
            for i in range(4)
        ]

    roomy, _ = make_engine(core_dir, kv_pages=256)
    expected = _run_all(roomy, reqs())
    # Alone, each needs ceil((9 + 24) / 4) = 9 pages; four at once cannot fit in 12.
    tight, runner = make_engine(core_dir, kv_pages=12)
    got = _run_all(tight, reqs())
    stats = tight.stats()
    assert stats.preempted_total > 0
    assert got == expected
    assert stats.free_pages == 12 and stats.active == 0 and stats.pending == 0
    assert stats.completed_total == 4 and stats.admitted_total == 4
    assert stats.generated_tokens_total == 4 * 24
    # Each request alone gives the same output as in a batch (no cross-talk between rows).
    for r in reqs()[:2]:
        alone, _ = make_engine(core_dir, kv_pages=256)
        assert collect(alone.generate(r))[0] == expected[r.request_id]


def test_abort_waiting_and_running_requests(core_dir):
    engine, _ = make_engine(core_dir, max_concurrency=1)
    events: dict[str, list[GenerationEvent]] = {"run": [], "wait": []}
    engine.submit(req("run", [1, 2, 3], max_tokens=100, ignore_eos=True), events["run"].append)
    engine.submit(req("wait", [4, 5], max_tokens=100, ignore_eos=True), events["wait"].append)
    for _ in range(3):
        engine.step()
    assert engine.stats().active == 1 and engine.stats().pending == 1 and len(events["run"]) == 3
    assert engine.abort("wait") and engine.abort("run")
    engine.step()
    for rid in ("run", "wait"):
        last = events[rid][-1]
        assert last.finished and last.finish_reason is FinishReason.ABORT and last.token_ids == []
    stats = engine.stats()
    assert stats.free_pages == stats.total_pages and stats.active == stats.pending == 0
    assert stats.cancelled_total == 2 and stats.completed_total == 0
    assert not engine.abort("run")
    engine.submit(req("run", [1]), lambda e: None)  # the id is free again


def test_thread_loop_concurrent_submit_abort_and_errors(core_dir):
    engine, runner = make_engine(core_dir, max_concurrency=3)
    runner.delay = 0.002
    engine.start()
    try:
        expected = {}
        for i in range(3):
            solo, _ = make_engine(core_dir)
            expected[f"s{i}"] = collect(solo.generate(req(f"s{i}", byte_ids(f"t{i}"), seed=i, max_tokens=12)))[0]
        results: dict[str, list] = {}

        def client(i: int) -> None:
            request = req(f"s{i}", byte_ids(f"t{i}"), seed=i, max_tokens=12)
            results[f"s{i}"] = collect(engine.generate(request, timeout=20))[0]

        threads = [threading.Thread(target=client, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert results == expected

        # Abort: a final ABORT event, pages back, counted as cancelled.
        events: list[GenerationEvent] = []
        done = threading.Event()
        engine.submit(
            req("long", [3, 4], max_tokens=10_000, ignore_eos=True),
            lambda e: (events.append(e), e.finished and done.set()),
        )
        while not events:
            time.sleep(0.001)
        assert engine.abort("long")
        assert done.wait(10)
        assert events[-1].finish_reason is FinishReason.ABORT and events[-1].finished
        assert not engine.abort("long")  # no longer live

        # A failing step fails its requests with ERROR; the loop survives.
        runner.fail_next = True
        ev = engine.generate(req("bad", [1, 2]), timeout=10)
        assert ev[-1].finish_reason is FinishReason.ERROR and "boom" in ev[-1].error
        assert collect(engine.generate(req("good", [1, 2], max_tokens=3), timeout=10))[2].finished

        # Idle: the loop sleeps (no steps without work).
        time.sleep(0.05)
        steps = engine.stats().steps_total
        time.sleep(0.1)
        stats = engine.stats()
        assert stats.steps_total == steps
        assert stats.free_pages == stats.total_pages and stats.active == 0
        assert stats.cancelled_total == 1 and stats.failed_total == 1
        assert stats.step_seconds_total > stats.schedule_seconds_total > 0
    finally:
        engine.shutdown()
    with pytest.raises(RuntimeError):
        engine.submit(req("late", [1]), lambda e: None)


def test_shutdown_fails_unfinished_requests(core_dir):
    engine, runner = make_engine(core_dir)
    events: list[GenerationEvent] = []
    engine.submit(req("x", [1, 2, 3], max_tokens=10_000, ignore_eos=True), events.append)
    engine.step()
    engine.shutdown()
    assert events[-1].finished and events[-1].finish_reason is FinishReason.ERROR

"""The real Gemma 3 270M (its packaged GGUF, Q4_K_M) against transformers' own GGUF loader: the
SentencePiece tokenizer flare builds from the file encodes as transformers' does, and the served
fp32 core's greedy continuations equal transformers' on the same file (a divergence only at a
recorded near-tie). transformers' side is recorded once per GGUF, transformers and torch version
and set of texts (transformers_reference). The package installs on demand; the tests skip,
saying why, only where pip cannot install it."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from helios.launcher import HeliosProcess
from ignition.checkpoints.base import CheckpointError
from ignition.checkpoints.gguf import open_gguf
from ignition.checkpoints.packaged import PACKAGED_MODELS, resolve_packaged
from ignition.checkpoints.tokenizer import tokenizer_from_gguf
from tests.conftest import CACHE, code_digest, export

pytestmark = pytest.mark.e2e

PACKAGED = "gemma3-270m"
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village,",
    "1, 2, 3, 4, 5,",
]
NEW_TOKENS = 16
# A first divergence is a near-tie when transformers' two best logits there are this close:
# the fp32 engine and torch differ by ~1e-4 in a logit, so anything wider is a real disagreement.
NEAR_TIE = 0.02
# Greedy is top_k 1: temperature 0 is clamped to the core's minimum (0.01), which still samples,
# and at that temperature a gap of 0.03 between the two best logits is a 5% draw of the second.
GREEDY = {"temperature": 0, "top_k": 1}


@pytest.fixture(scope="module")
def gemma_gguf() -> Path:
    try:
        return resolve_packaged(PACKAGED)
    except CheckpointError as exc:
        pytest.skip(f"the {PACKAGED} packages cannot be installed here: {exc}")


def probe_texts() -> list[str]:
    """What the tokenizer test encodes: the prompts, hard cases, and this file's source in pieces."""
    source = Path(__file__).read_text()
    return [
        *PROMPTS,
        "  two leading spaces,   three inside, tabs\t\tand trailing  ",
        "naïve café, 日本語のテキスト, emoji 🙂👩‍👩‍👧, math ∑ ≈ ∞, zero\u200bwidth",
        "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
        "<table><tr><td>1</td></tr></table> and <b>bold</b>",
        "\n\n\n\n    indented\n\t\n",
        "12345 678.9e-10 0x1F",
        *(source[i : i + 400] for i in range(0, len(source), 400)),
    ]


def record_reference(gguf_path: Path) -> dict:
    """transformers' side of every comparison, from its own GGUF loader: the BOS id, each probe
    text's encoding, and each prompt's greedy continuation (the tokens, each one's text, each
    prefix's text, and the margin between the two best logits at every step)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    greedy = {}
    for prompt in PROMPTS:
        ids = torch.tensor([tokenizer.encode(prompt)])
        with torch.no_grad():
            out = model.generate(
                ids, max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True, return_dict_in_generate=True
            )
        tokens = out.sequences[0, ids.shape[1] :].tolist()
        best = torch.topk(torch.stack(out.logits)[:, 0], 2).values
        greedy[prompt] = {
            "tokens": tokens,
            "pieces": [tokenizer.decode([token]) for token in tokens],
            "prefix_texts": [tokenizer.decode(tokens[:n]) for n in range(len(tokens) + 1)],
            "margins": (best[:, 0] - best[:, 1]).tolist(),
        }
    return {
        "bos_token_id": tokenizer.bos_token_id,
        "encodings": [tokenizer.encode(text, add_special_tokens=False) for text in probe_texts()],
        "greedy": greedy,
    }


@pytest.fixture(scope="module")
def transformers_reference(gemma_gguf) -> dict:
    """record_reference, kept in the flare cache under a key of everything it depends on (the
    pinned GGUF, the transformers and torch versions, the texts and prompts): loading the GGUF in
    transformers takes ~50 s, and the same inputs give the same record."""
    import transformers

    material = [PACKAGED_MODELS[PACKAGED].sha256, transformers.__version__, torch.__version__, NEW_TOKENS]
    key = hashlib.sha256(json.dumps([*material, PROMPTS, probe_texts()]).encode()).hexdigest()[:16]
    path = CACHE / "references" / f"gemma3-transformers-{key}.json"
    if path.is_file():
        return json.loads(path.read_text())
    record = record_reference(gemma_gguf)
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob("gemma3-transformers-*.json"):
        stale.unlink()
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps(record))
    os.replace(partial, path)
    return record


@pytest.fixture(scope="module")
def gemma_server(gemma_gguf) -> Iterator[HeliosProcess]:
    target = CACHE / "cores" / f"gemma3-fp32-{code_digest()}"
    if not (target / "core.json").is_file():
        for stale in (CACHE / "cores").glob("gemma3-fp32-*"):
            if stale != target:
                shutil.rmtree(stale, ignore_errors=True)
        export("gemma3", PACKAGED, target, "fp32", force=True)
    server = HeliosProcess(target)
    yield server
    server.stop()


def test_sentencepiece_tokenizer_encodes_as_transformers(gemma_gguf, transformers_reference):
    from tokenizers import Tokenizer

    built = tokenizer_from_gguf(open_gguf(gemma_gguf))
    ours = Tokenizer.from_str(built.tokenizer_json)
    assert built.add_bos and built.bos_token_id == transformers_reference["bos_token_id"]
    for text, expected in zip(probe_texts(), transformers_reference["encodings"], strict=True):
        ids = ours.encode(text, add_special_tokens=False).ids
        assert ids == expected, text
        assert ours.decode(ids, skip_special_tokens=False) == text


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_continuations_equal_transformers(gemma_server, transformers_reference, prompt):
    reference = transformers_reference["greedy"][prompt]
    body = {"prompt": prompt, "max_tokens": NEW_TOKENS, "logprobs": 1, **GREEDY}
    answer = httpx.post(gemma_server.url + "/v1/completions", json=body, timeout=120).json()
    served = answer["choices"][0]["logprobs"]["tokens"]
    # Again, now from the prefix cache: greedy serves the same tokens however the prompt was computed.
    again = httpx.post(gemma_server.url + "/v1/completions", json=body, timeout=120).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, again
    assert again["choices"][0]["logprobs"]["tokens"] == served
    wanted = reference["pieces"]
    for step, (ours, theirs) in enumerate(zip(served, wanted, strict=False)):
        if ours != theirs:
            margin = reference["margins"][step]
            assert margin < NEAR_TIE, (
                f"{prompt!r}: step {step} served {ours!r}, transformers {theirs!r} (margin {margin})"
            )
            print(f"{prompt!r}: first divergence at step {step}, a near-tie (margin {margin:.4f})")
            return
    assert len(served) == len(wanted) or answer["choices"][0]["finish_reason"] == "stop", answer
    texts = reference["prefix_texts"]
    assert answer["choices"][0]["text"] == texts[min(len(served), len(texts) - 1)]


def test_a_chat_round_trip(gemma_server):
    """The recipe's Gemma template (the pretrained GGUF has none) and its stop tokens serve a chat."""
    answer = httpx.post(
        gemma_server.url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 12, **GREEDY},
        timeout=120,
    ).json()
    assert answer["object"] == "chat.completion" and answer["usage"]["completion_tokens"] >= 1, answer
    assert answer["choices"][0]["message"]["content"].strip(), answer

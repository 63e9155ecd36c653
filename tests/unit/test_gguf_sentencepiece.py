"""GGUF SentencePiece vocabularies and Gemma 2 / Gemma 3 GGUFs (issue 40, item 3).

The `tokenizers` document ignition builds from a "llama" vocabulary must encode exactly as
llama.cpp's SPM tokenizer does: checked against a plain re-statement of that algorithm (below) on
a vocabulary built here. A tiny Gemma 3 and Gemma 2, written as llama.cpp's converter writes
them (gguf's TensorNameMap, norms stored as 1 + w, Gemma 3's linear global rotary and Gemma 2's
soft-caps in the metadata), read back equal to their transformers models and export. The real Gemma 3 270M is tests/e2e/test_gemma3_real.py.
"""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from helios.manifest import Manifest
from ignition.checkpoints.base import CheckpointError
from ignition.checkpoints.load import load_checkpoint
from ignition.checkpoints.spm_vocab import BYTE, CONTROL, NORMAL, UNKNOWN, USER_DEFINED, build_sentencepiece_bpe
from ignition.export.pipeline import ExportOptions, export_core
from ignition.models import FAMILIES
from ignition.recipes import load_recipe
from tests.unit.family_checkpoints import SPECIALS, build_reference
from tests.unit.gguf_writing import add_dense_hyperparameters, add_named_tensors, finish

MARK = "\u2581"
CORPUS = (Path(__file__).read_text() + Path(gguf.__file__).read_text()[:20000]).replace("\r", "")


def llama_cpp_spm(text: str, tokens: list[str], types: list[int], scores: list[float], prefix: bool) -> list[int]:
    """llama.cpp's SPM tokenizer, restated plainly: cut out control and user-defined tokens
    (longest first), a space before each text fragment that follows one (when `prefix`), spaces as
    "▁", then join the best-scoring adjacent pair in the vocabulary (leftmost on a tie) until none
    is left, and spell pieces outside the vocabulary as byte tokens."""
    ids = {token: index for index, token in enumerate(tokens)}
    fragments: list[str | int] = [text]
    whole = sorted(
        (t for t, kind in zip(tokens, types) if kind in (CONTROL, USER_DEFINED) and t), key=len, reverse=True
    )
    for token in whole:
        cut: list[str | int] = []
        for fragment in fragments:
            if isinstance(fragment, int):
                cut.append(fragment)
                continue
            parts = fragment.split(token)
            for i, part in enumerate(parts):
                if i:
                    cut.append(ids[token])
                if part:
                    cut.append(part)
        fragments = cut
    out: list[int] = []
    after_token = True
    for fragment in fragments:
        if isinstance(fragment, int):
            out.append(fragment)
            after_token = True
            continue
        symbols = list(((" " if prefix and after_token else "") + fragment).replace(" ", MARK))
        while True:
            best = None
            for j in range(len(symbols) - 1):
                joined = symbols[j] + symbols[j + 1]
                if joined in ids and (best is None or scores[ids[joined]] > best[0]):
                    best = (scores[ids[joined]], j)
            if best is None:
                break
            j = best[1]
            symbols[j : j + 2] = [symbols[j] + symbols[j + 1]]
        for symbol in symbols:
            out.extend([ids[symbol]] if symbol in ids else [ids[f"<0x{b:02X}>"] for b in symbol.encode()])
        after_token = False
    return out


def corpus_vocabulary() -> tuple[list[str], list[int], list[float]]:
    """A SentencePiece-style vocabulary of the corpus: specials, bytes, every character, and the
    frequent word pieces, scored best-first by frequency (as SentencePiece orders them)."""
    words = [MARK + w for w in CORPUS.replace("\n", " ").split(" ") if w]
    counts: Counter[str] = Counter()
    for word in words:
        for i in range(len(word)):
            for j in range(i + 2, min(len(word), i + 7) + 1):
                counts[word[i:j]] += 1
    chars = sorted(set(CORPUS.replace(" ", MARK)) - {"\n"})
    pieces = [piece for piece, n in counts.most_common() if n >= 3][:3000]
    specials = [("<pad>", CONTROL), ("<eos>", CONTROL), ("<bos>", CONTROL), ("<unk>", UNKNOWN)]
    specials += [("<start_of_turn>", CONTROL), ("<end_of_turn>", CONTROL), ("\n", USER_DEFINED), ("  ", USER_DEFINED)]
    tokens = [t for t, _ in specials] + [f"<0x{b:02X}>" for b in range(256)]
    types = [k for _, k in specials] + [BYTE] * 256
    scores = [0.0] * len(tokens)
    for rank, piece in enumerate([*chars, *pieces]):
        if piece not in tokens:
            tokens.append(piece)
            types.append(NORMAL)
            scores.append(-float(rank) if len(piece) > 1 else -1e6 - rank)
    return tokens, types, scores


@pytest.mark.parametrize("prefix", [False, True])
def test_sentencepiece_bpe_encodes_as_llama_cpp(prefix):
    tokens, types, scores = corpus_vocabulary()
    tokenizer = build_sentencepiece_bpe(tokens, types, scores, add_space_prefix=prefix)
    rng = random.Random(7)
    texts = ["", " ", "hello world", "  two  spaces", "a\nb\n\nc", "<start_of_turn>user\nhi<end_of_turn>", "é ☃ 🙂 ü"]
    texts += [CORPUS[i : i + rng.randrange(1, 200)] for i in (rng.randrange(len(CORPUS) - 200) for _ in range(300))]
    for text in texts:
        ours = tokenizer.encode(text, add_special_tokens=False).ids
        assert ours == llama_cpp_spm(text, tokens, types, scores, prefix), repr(text)
        if not prefix and MARK not in text:  # a literal "▁" decodes as the space it stands for
            assert tokenizer.decode(ours, skip_special_tokens=False) == text


def add_byte_sentencepiece(writer: gguf.GGUFWriter, specials: list[str], bos: str, eos: str) -> None:
    """A SentencePiece ("llama") vocabulary of the 256 byte tokens and the family's specials, as
    the tiny checkpoints' byte tokenizer has them."""
    tokens = [f"<0x{b:02X}>" for b in range(256)] + specials
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_types([BYTE] * 256 + [CONTROL] * len(specials))
    writer.add_bos_token_id(256 + specials.index(bos))
    writer.add_eos_token_id(256 + specials.index(eos))
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(False)


def write_gemma_gguf(model, family: str, path: Path) -> None:
    """A tiny Gemma 2 or 3 as llama.cpp's converter writes it: byte tokens and the model's specials
    as a SentencePiece vocabulary, (1 + w) norm weights; Gemma 3's linear global rotary and
    Gemma 2's soft-caps as metadata."""
    config = model.config
    specials = SPECIALS[family]
    writer = gguf.GGUFWriter(path, family)
    add_dense_hyperparameters(writer, config)
    if family == "gemma3":
        writer.add_rope_freq_base(config.rope_parameters["full_attention"]["rope_theta"])
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(config.rope_parameters["full_attention"]["factor"])
    else:
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_sliding_window(config.sliding_window)
    add_byte_sentencepiece(writer, specials, "<bos>", "<eos>")
    tensors = {}
    for name, value in model.state_dict().items():
        array = value.numpy()
        tensors[name] = array + np.float32(1.0) if name.endswith("norm.weight") else array
    tensors.pop("lm_head.weight", None)  # tied: llama.cpp writes the embedding only
    arch = gguf.MODEL_ARCH.GEMMA3 if family == "gemma3" else gguf.MODEL_ARCH.GEMMA2
    add_named_tensors(writer, arch, config.num_hidden_layers, tensors)
    finish(writer)


@pytest.mark.parametrize("family,model_type", [("gemma3", "gemma3_text"), ("gemma2", "gemma2")])
def test_gemma_gguf_reads_back_equal_and_matches_transformers(tmp_path, family, model_type):
    model = build_reference(family, overrides={"query_pre_attn_scalar": 32})
    path = tmp_path / f"tiny-{family}.gguf"
    write_gemma_gguf(model, family, path)

    checkpoint = load_checkpoint(str(path))
    assert checkpoint.architecture.family == family and checkpoint.model_config["model_type"] == model_type
    expected = {k: v.numpy() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    assert sorted(checkpoint.tensors) == sorted(expected)
    for name, value in expected.items():
        # A norm comes back as (1 + w) - 1 in float32: w within one float32 step of 1 + w (2.4e-7).
        np.testing.assert_allclose(checkpoint.tensors[name], value, rtol=0, atol=2.4e-7, err_msg=name)
    ids = torch.from_numpy(np.random.default_rng(3).integers(0, 256, 60))  # past the 24-token window
    ours = FAMILIES[family].build(checkpoint.architecture, checkpoint.model_config, checkpoint.tensors).reference(ids)
    with torch.no_grad():
        theirs = model(ids.unsqueeze(0)).logits[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=2e-4)

    out = tmp_path / "core"
    export_core(ExportOptions(recipe=load_recipe(family), checkpoint=str(path), out=out, precision="fp32"))
    manifest = Manifest.load(out)
    assert manifest.architecture.family == family and manifest.identity.checkpoint_id == f"tiny-{family}"


def test_phi3_gguf_reads_its_fused_tensors_and_matches_transformers(tmp_path):
    """A tiny Phi-3 as llama.cpp's converter writes it: fused attn_qkv and ffn_up (gate and up)
    as the Hugging Face checkpoint stores them, partial rotary as the rotary width, the window as
    metadata, a SentencePiece vocabulary; read back equal, logits equal to transformers', exported."""
    model = build_reference("phi3")
    config = model.config
    specials = SPECIALS["phi3"]
    path = tmp_path / "tiny-phi3.gguf"
    writer = gguf.GGUFWriter(path, "phi3")
    add_dense_hyperparameters(writer, config)
    head_dim = config.hidden_size // config.num_attention_heads
    writer.add_rope_dimension_count(int(head_dim * config.rope_parameters["partial_rotary_factor"]))
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_sliding_window(config.sliding_window)
    add_byte_sentencepiece(writer, specials, "<s>", "<|end|>")
    tensors = {name: value.numpy() for name, value in model.state_dict().items()}
    add_named_tensors(writer, gguf.MODEL_ARCH.PHI3, config.num_hidden_layers, tensors)
    finish(writer)

    checkpoint = load_checkpoint(str(path))
    assert checkpoint.architecture.family == "phi3" and checkpoint.model_config["partial_rotary_factor"] == 0.5
    assert sorted(checkpoint.tensors) == sorted(tensors)
    for name, value in tensors.items():
        np.testing.assert_array_equal(checkpoint.tensors[name], value, err_msg=name)
    ids = torch.from_numpy(np.random.default_rng(3).integers(0, 256, 60))  # past the 24-token window
    ours = FAMILIES["phi3"].build(checkpoint.architecture, checkpoint.model_config, checkpoint.tensors).reference(ids)
    with torch.no_grad():
        theirs = model(ids.unsqueeze(0)).logits[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=2e-4)

    out = tmp_path / "core"
    export_core(ExportOptions(recipe=load_recipe("phi3"), checkpoint=str(path), out=out, precision="fp32"))
    manifest = Manifest.load(out)
    assert manifest.architecture.family == "phi3" and manifest.kv.window == config.sliding_window


@pytest.mark.parametrize("arch", ["gemma2", "phi3", "smollm3"])
def test_gguf_rope_scaling_is_refused_where_the_family_does_not_read_it(tmp_path, arch):
    """Only Gemma 3's GGUF config reads the file's rope scaling; a scaled file of another
    configured family is refused rather than served with the plain rotary."""
    path = tmp_path / f"scaled-{arch}.gguf"
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(1)
    writer.add_embedding_length(8)
    writer.add_head_count(2)
    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    writer.add_rope_scaling_factor(4.0)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    finish(writer)
    with pytest.raises(CheckpointError, match="rope scaling"):
        load_checkpoint(str(path))

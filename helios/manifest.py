"""The core manifest (`core.json`): one typed, versioned schema shared by ignition and helios.

ignition writes it, helios reads nothing else to serve. Everything here is plain data: no
torch, no onnxruntime, so the runtime can import it cheaply.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints

# major.minor: helios refuses a core whose major version it does not know; a minor version only
# adds optional fields (an older 1.x helios ignores them, a newer one defaults them for older 1.x),
# though its graphs may need what an older helios lacks (1.4's MatMulInt4, 1.16's float16 scales).
# docs/cores.md (`format_version`) says what each minor version added.
FORMAT_VERSION = "1.16"
ENGINE_TARGETS = ("cpu", "cuda")
KV_DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")
TEMPLATE_REJECTS = ("drop_thinking", "continuation", "add_generation_prompt_false")
CONTENT_DIGEST_SINCE = (1, 5)
MANIFEST_NAME = "core.json"


class ManifestError(ValueError):
    """A core that helios cannot serve, with a message naming what is wrong."""


@dataclass
class Identity:
    recipe: str
    checkpoint_id: str  # e.g. "qwen2.5-coder-0.5b" or a path's basename
    checkpoint_sha256: str  # of the GGUF file, or of the safetensors files concatenated in name order
    aliases: list[str] = field(default_factory=list)  # served names; the first nonempty is the model id
    # (1.14) Where the weights came from: "gguf" / "safetensors", and how the source stored them
    # ("Q4_K_M", "bfloat16", "gptq-int4-g128", "fp8-e4m3"...); empty in older cores.
    source_format: str = ""
    source_quantization: str = ""


@dataclass
class RopeScaling:
    """(1.13) A dense checkpoint's RoPE scaling (ROPE_SCALING_KINDS) as transformers reads it:
    factor and pretraining context; llama3's frequency band; YaRN's betas, correction-range
    truncation and cos/sin attention factor; per-frequency divisors of the plain rotary
    (`freq_factors`: a GGUF's rope_freqs, llama3's band resolved by the reader, or longrope's
    long factors with its attention factor)."""

    kind: str
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    attention_factor: float = 1.0
    truncate: bool = True
    freq_factors: list[float] | None = None


ROPE_SCALING_KINDS = ("linear", "dynamic", "yarn", "llama3", "longrope", "factors")


@dataclass
class Architecture:
    family: str  # "qwen2" | "llama"
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # qkv projection bias (qwen2)
    rope_scaling: RopeScaling | None = None  # (1.13) None: plain rotary


@dataclass
class Limits:
    context_length: int  # prompt + output tokens per request
    max_concurrency: int  # active sequences the engine batches together
    prefill_chunk_size: int  # max prompt tokens of one sequence in one step
    max_batch_tokens: int  # max tokens (prefill + decode) in one engine step
    default_max_tokens: int  # output budget when a request omits it
    kv_pages: int  # default KV pool size in pages (overridable at serve time)
    kv_dtype: str = "auto"  # default KV pool element type (KV_DTYPE_NAMES; overridable at serve time)


@dataclass
class KVLayout:
    """Geometry of the paged KV pool the engine graph reads and the runner writes.

    The pool is one float tensor of shape [num_layers * 2 * num_pages, page_tokens, kv_heads,
    head_dim]; row (layer * 2 + kind) * num_pages + page holds K (kind 0) or V (kind 1).
    """

    page_tokens: int
    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: str = "float32"
    # (1.15) Every layer attends at most this many positions back (a sliding window on all of
    # them; None: some layer sees the whole history). The graph never reads a sequence's pages
    # wholly before its window, so helios gives them back.
    window: int | None = None


@dataclass
class StateLayer:
    """One recurrent layer's slice of a sequence's state row."""

    layer: int  # model layer index
    kind: str  # the mixer: "gated_deltanet", "mamba2", ...
    offset: int  # first float of the slice in the row
    size: int  # floats


@dataclass
class StateLayout:
    """Per-sequence recurrent state of the layers that keep one instead of K/V rows
    (docs/architecture.md, "Recurrent state"). The runner holds a pool [slots, width] of `dtype`;
    each running sequence owns one slot; the step graph reads `state_pool[state_slots[b]]` (zeros
    for a row without history) and returns `new_state` [B, width]."""

    width: int  # floats per sequence slot
    layers: list[StateLayer]
    dtype: str = "float32"

    def check(self, num_layers: int) -> None:
        """Raise ManifestError unless the slices tile [0, width) in layer order."""
        if self.dtype != "float32":
            raise ManifestError(f"core.state.dtype {self.dtype!r} is not supported (float32 only)")
        if not self.layers or self.width <= 0:
            raise ManifestError("core.state must list at least one layer and have a positive width")
        at, previous = 0, -1
        for i, layer in enumerate(self.layers):
            where = f"core.state.layers[{i}]"
            if not previous < layer.layer < num_layers:
                raise ManifestError(f"{where}.layer {layer.layer} is out of order or not a layer (0..{num_layers - 1})")
            if layer.offset != at or layer.size <= 0:
                raise ManifestError(
                    f"{where} covers [{layer.offset}, {layer.offset + layer.size}), expected to start at {at}"
                )
            if not layer.kind:
                raise ManifestError(f"{where}.kind is empty")
            at, previous = at + layer.size, layer.layer
        if at != self.width:
            raise ManifestError(f"core.state layers cover {at} floats, width says {self.width}")


@dataclass
class TensorSpec:
    name: str
    dtype: str  # numpy dtype name
    shape: list[int | str]  # ints are fixed, strings are symbolic dims


@dataclass
class Parity:
    """What export validation measured: engine vs the torch reference on a fixed prompt."""

    max_abs_logit_error: float
    tolerance: float
    prompt_tokens: int
    decode_steps: int
    top1_agreement: float  # fraction of positions where argmax agrees
    # Mean KL(reference || engine) of the next-token distributions, nats (None: older cores).
    mean_kl: float | None = None


@dataclass
class Engine:
    name: str  # "step": the packed paged-KV step graph
    file: str  # relative to the core folder
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    data_files: list[str] = field(default_factory=list)  # external weight files
    # (1.11) "cpu": an ONNX graph (onnxruntime); "cuda": a torch.export program (helios' torch
    # runner, on a GPU or on CPU torch), with its weights' dtype, its writer's torch version and
    # its own parity with the torch reference.
    target: str = "cpu"
    dtype: str | None = None
    torch_version: str | None = None
    parity: Parity | None = None


@dataclass
class TokenizerSpec:
    file: str  # tokenizer.json (Hugging Face tokenizers format)
    bos_token_id: int | None
    eos_token_ids: list[int]  # every id that ends generation (EOS, <|im_end|>, ...)
    pad_token_id: int | None
    add_bos: bool  # whether raw text prompts get BOS prepended
    special_tokens: dict[str, int] = field(default_factory=dict)


@dataclass
class TemplateSpec:
    file: str | None  # chat_template.jinja, or None for a core without chat support
    supports_system: bool = True
    supports_tools: bool = False
    # [min, max]: the template also takes an integer `reasoning_effort` in this range, which
    # Chat Completions passes through from its top-level field (DeepSeek V4.1: 1..100); None: named
    # levels only (optional, absent in older 1.3 cores).
    numeric_effort: list[int] | None = None
    # (1.6) TEMPLATE_REJECTS entries: what the core's native encoder refuses (DeepSeek V4/V4.1).
    rejects: list[str] = field(default_factory=list)


@dataclass
class SamplingDefaults:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 disables top-k
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None


@dataclass
class Range:
    min: float
    max: float


@dataclass
class Sampling:
    defaults: SamplingDefaults
    # Inclusive bounds per parameter name; a parameter absent here is fixed at its default.
    ranges: dict[str, Range] = field(default_factory=dict)


@dataclass
class Parsers:
    tool: str | None = None  # tool-call syntax name, e.g. "qwen25_coder_json"
    reasoning: str | None = None  # reasoning syntax name, None when the model has none


@dataclass
class Logprobs:
    max_top_logprobs: int  # natural alternatives the graph returns (0..20)
    explicit_token_ids: bool  # whether full-vocabulary gathers of caller ids are possible
    prompt_logprobs: bool  # scored prefill graphs present (--prompt-logprobs): the "score" engine
    # Caller ids one request may name (api.md: 128; the step graph takes one more, the sampled id).
    max_explicit_token_ids: int = 0


@dataclass
class Quantization:
    """How the weights of a quantized core were stored (MatMulNBits block quantization,
    symmetric); the parity it measured is `Manifest.parity`."""

    layers_bits: int  # transformer-block matmuls
    layers_block: int  # weights per scale along K
    accuracy_level: int  # MatMulNBits compute type: 4 = int8 activations
    lm_head_bits: int | None = None  # None: the lm_head stays fp32
    lm_head_block: int | None = None
    embedding_bits: int | None = None  # None: the token table stays fp32
    embedding_block: int | None = None
    # (1.4) the operator holding the 4-bit matmuls: "ai.flare.MatMulInt4" (flare's tiled layout,
    # helios/kernels; rewritten to MatMulNBits where that kernel cannot run) or MatMulNBits.
    matmul_op: str = "com.microsoft.MatMulNBits"
    # (1.10) PagedAttention's arithmetic: "float32", or "bfloat16" (AMX tiles where the CPU has
    # them, fp32 elsewhere).
    attention: str = "float32"
    # (1.16) The dense 4-bit matmuls' scales: "float16" (rounded to half floats at quantization,
    # which MatMulInt4 stores as float16 wherever a whole matrix's are normal halves) or "float32".
    # Routed experts' MoEInt4 tables keep float32 scales.
    scales: str = "float32"


@dataclass
class Drafter:
    """(1.8) The learned drafter: a smaller model with the target's tokenizer whose greedy
    continuations a speculative round verifies. Its step graph (the engine named `engine`) has the
    target's graph contract; its KV pool has as many pages as the target's, of the same
    page_tokens, and shares the target's block tables (docs/architecture.md, "Learned drafter")."""

    engine: str  # the Engine entry holding its step graph
    checkpoint_id: str
    checkpoint_sha256: str
    architecture: Architecture
    kv: KVLayout
    decode_weight_bytes: int  # weights one drafter step reads (its cost beside the target's)
    parity: Parity | None = None  # its own graph against its torch reference, at export

    def check(self, manifest: Manifest) -> None:
        """Raise ManifestError unless the drafter can share the target's pages and token ids."""
        manifest.engine(self.engine)
        if self.engine == "step":
            raise ManifestError("core.drafter.engine must name an engine other than the step graph")
        if self.kv.page_tokens != manifest.kv.page_tokens:
            raise ManifestError(
                f"core.drafter.kv.page_tokens {self.kv.page_tokens} differs from the target's "
                f"{manifest.kv.page_tokens} (the drafter shares the target's block tables)"
            )
        if self.architecture.vocab_size > manifest.architecture.vocab_size:
            raise ManifestError("core.drafter proposes token ids past the target's vocabulary")


@dataclass
class Vision:
    """(1.9) Image input: how helios turns an image into patches (the profile), what the vision
    graph (engine `engine`) makes of them, and how the step graph places the features.

    The profile follows the checkpoint's image processor: resize (Pillow, `resample`) so height
    and width are multiples of patch_size * merge_size and the area lies in [min_pixels,
    max_pixels], scale to [0, 1], normalize by image_mean / image_std, cut into patch_size squares
    repeated temporal_patch_size times; merge_size x merge_size patches make one image token."""

    engine: str  # the Engine entry holding the vision graph
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int
    image_mean: list[float]
    image_std: list[float]
    resample: str  # Pillow filter name: "bicubic"
    position_grid: int  # side of the learned square position table the graph resamples per image
    image_token_id: int  # the placeholder id each image token occupies in the prompt
    placeholder: str  # text the conversation writes per image (it holds the image token once)
    mrope_section: list[int]  # rotary frequencies per (t, h, w) axis, interleaved
    max_image_tokens_per_image: int
    max_image_pixels: int  # decoded width x height accepted before resizing
    max_image_bytes: int  # encoded size accepted
    image_feature_window_tokens: int  # feature storage one active image request holds

    def check(self, manifest: Manifest) -> None:
        manifest.engine(self.engine)
        if self.engine == "step":
            raise ManifestError("core.vision.engine must name an engine other than the step graph")
        if min(self.patch_size, self.temporal_patch_size, self.merge_size) < 1 or self.min_pixels > self.max_pixels:
            raise ManifestError("core.vision has an invalid image profile")
        if len(self.image_mean) != 3 or len(self.image_std) != 3 or min(self.image_std) <= 0:
            raise ManifestError("core.vision.image_mean / image_std need 3 channels (std > 0)")
        if not 0 <= self.image_token_id < manifest.architecture.vocab_size:
            raise ManifestError("core.vision.image_token_id is outside the vocabulary")
        if len(self.mrope_section) != 3:
            raise ManifestError("core.vision.mrope_section needs (t, h, w) sizes")


@dataclass
class Manifest:
    identity: Identity
    architecture: Architecture
    precision: str  # "int4" | "int8" | "fp32"
    limits: Limits
    kv: KVLayout
    engines: list[Engine]
    tokenizer: TokenizerSpec
    template: TemplateSpec
    sampling: Sampling
    parsers: Parsers
    logprobs: Logprobs
    decode_weight_bytes: int
    parity: Parity | None = None
    toolchain: dict[str, str] = field(default_factory=dict)  # package -> version, "flare-exporter" -> code digest
    files: dict[str, str] = field(default_factory=dict)  # relative path -> sha256, every file but core.json
    digest: str = ""  # sha256 of listing_text(files): one id for the core's files ("" before 1.1)
    content_digest: str = ""  # (1.5) content_digest(core.json): every field, `digest` included
    format_version: str = FORMAT_VERSION
    state: StateLayout | None = None  # recurrent per-sequence state (1.3); None: attention only
    quantization: Quantization | None = None  # (1.3) weight storage of a quantized core; None: fp32 or older
    drafter: Drafter | None = None  # (1.8) the learned drafter; None: history drafts only
    vision: Vision | None = None  # (1.9) prepared image input; None: a text-only core

    @property
    def model_id(self) -> str:
        return next((a for a in self.identity.aliases if a), self.identity.checkpoint_id)

    def engine(self, name: str, target: str = "cpu") -> Engine:
        for engine in self.engines:
            if engine.name == name and engine.target == target:
                return engine
        where = "" if target == "cpu" else f" for target {target!r}"
        raise ManifestError(f"core has no engine named {name!r}{where}")

    def has_engine(self, name: str, target: str = "cpu") -> bool:
        return any(e.name == name and e.target == target for e in self.engines)

    def referenced_files(self) -> list[str]:
        """Every file the manifest points at (engines and their weights, tokenizer, template)."""
        names = [name for engine in self.engines for name in (engine.file, *engine.data_files)]
        names.append(self.tokenizer.file)
        if self.template.file:
            names.append(self.template.file)
        return list(dict.fromkeys(names))

    def seal(self, folder: Path) -> None:
        """List every file under `folder` but core.json with its sha256, and set `digest`."""
        folder = Path(folder)
        self.files = {
            p.relative_to(folder).as_posix(): file_sha256(p)
            for p in sorted(folder.rglob("*"))
            if p.is_file() and p.relative_to(folder).as_posix() != MANIFEST_NAME
        }
        self.digest = listing_digest(self.files)
        self.content_digest = content_digest(dataclasses.asdict(self))

    def to_json(self) -> str:
        # sort_keys keeps the file byte-stable across runs (reproducible cores).
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True) + "\n"

    def save(self, folder: Path) -> None:
        (Path(folder) / MANIFEST_NAME).write_text(self.to_json())

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Manifest:
        manifest = _build(cls, data, "core")
        if manifest.limits.kv_dtype not in KV_DTYPE_NAMES:
            raise ManifestError(
                f"core.limits.kv_dtype {manifest.limits.kv_dtype!r} is not one of {', '.join(KV_DTYPE_NAMES)}"
            )
        for i, engine in enumerate(manifest.engines):
            if engine.target not in ENGINE_TARGETS:
                raise ManifestError(
                    f"core.engines[{i}].target {engine.target!r} is not one of {', '.join(ENGINE_TARGETS)}"
                )
        if manifest.state is not None:
            manifest.state.check(manifest.architecture.num_layers)
        if manifest.drafter is not None:
            manifest.drafter.check(manifest)
        if manifest.vision is not None:
            manifest.vision.check(manifest)
        return manifest

    @classmethod
    def load(cls, folder: Path, verify_files: bool = True) -> Manifest:
        """Read and check a core folder; raise ManifestError naming the first problem."""
        folder = Path(folder)
        path = folder / MANIFEST_NAME
        if not path.is_file():
            raise ManifestError(f"{folder} is not a core: {MANIFEST_NAME} is missing")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ManifestError(f"{path} is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ManifestError(f"{path} is not a JSON object")
        version = str(data.get("format_version", ""))
        major = version.split(".")[0]
        if major != FORMAT_VERSION.split(".")[0]:
            raise ManifestError(
                f"{path} has format version {version!r}; this helios reads {FORMAT_VERSION.split('.')[0]}.x"
            )
        manifest = cls.from_dict(data)
        if verify_files:
            manifest.verify_files(folder)
        return manifest

    def verify_files(self, folder: Path) -> None:
        """Check the listing, then every listed file's presence and sha256, in name order.

        Raises ManifestError naming the first file that is unsafe, unlisted, missing or altered.
        """
        folder = Path(folder)
        for rel in self.files:
            if not _safe_relative(rel):
                raise ManifestError(f"core file {rel!r} in {MANIFEST_NAME} is not a plain relative path")
        if self.digest and listing_digest(self.files) != self.digest:
            raise ManifestError(
                f"the file listing in {folder / MANIFEST_NAME} does not match its digest (files were edited)"
            )
        if self.content_matches(folder) is False:
            raise ManifestError(
                f"{folder / MANIFEST_NAME} does not match its content_digest: its fields were edited after "
                "export (restore the original core.json or export the core again)"
            )
        for rel in self.referenced_files():
            if not _safe_relative(rel):
                raise ManifestError(f"core file {rel!r} in {MANIFEST_NAME} is not a plain relative path")
            if self.files and rel not in self.files:
                raise ManifestError(f"core file {rel} is used by {MANIFEST_NAME} but not listed in its files")
            if not (folder / rel).is_file():
                raise ManifestError(f"core file {rel} is missing from {folder}")
        for rel, digest in sorted(self.files.items()):
            target = folder / rel
            if not target.is_file():
                raise ManifestError(f"core file {rel} is missing from {folder}")
            if file_sha256(target) != digest:
                raise ManifestError(f"core file {rel} does not match its digest in {MANIFEST_NAME}")

    def content_matches(self, folder: Path) -> bool | None:
        """Whether core.json on disk matches `content_digest`; None for a core older than 1.5
        (which has none). A 1.5 or later core without one does not match."""
        if not _at_least(self.format_version, CONTENT_DIGEST_SINCE):
            return None
        try:
            data = json.loads((Path(folder) / MANIFEST_NAME).read_text())
        except (OSError, ValueError):
            return False
        return bool(self.content_digest) and content_digest(data) == self.content_digest


def _at_least(format_version: str, version: tuple[int, int]) -> bool:
    try:
        major, minor = (int(part) for part in format_version.split(".")[:2])
    except ValueError:
        return True
    return (major, minor) >= version


def content_digest(data: dict[str, Any]) -> str:
    """sha256 of a manifest's fields but `content_digest`, as canonical JSON (sorted keys, no
    spaces, UTF-8)."""
    body = {key: value for key, value in data.items() if key != "content_digest"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def listing_text(files: dict[str, str]) -> str:
    """The `files` listing in `sha256sum` format ("<sha256>  <path>" per line, by path): the
    text `digest` hashes, and what `sha256sum -c` checks in the core folder."""
    return "".join(f"{digest}  {rel}\n" for rel, digest in sorted(files.items()))


def listing_digest(files: dict[str, str]) -> str:
    return hashlib.sha256(listing_text(files).encode()).hexdigest()


def _safe_relative(rel: str) -> bool:
    parts = rel.split("/")
    return bool(rel) and not rel.startswith("/") and "\\" not in rel and all(p not in ("", ".", "..") for p in parts)


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _build(tp: Any, data: Any, where: str) -> Any:
    """Build dataclass `tp` from JSON data, checking field presence and basic types."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if data is None:
            return None
        for arg in args[:-1]:
            try:
                return _build(arg, data, where)
            except ManifestError:
                pass
        return _build(args[-1], data, where)
    if origin is list:
        if not isinstance(data, list):
            raise ManifestError(f"{where} must be a list")
        (item,) = typing.get_args(tp)
        return [_build(item, v, f"{where}[{i}]") for i, v in enumerate(data)]
    if origin is dict:
        if not isinstance(data, dict):
            raise ManifestError(f"{where} must be an object")
        _, value = typing.get_args(tp)
        return {k: _build(value, v, f"{where}.{k}") for k, v in data.items()}
    if dataclasses.is_dataclass(tp):
        if not isinstance(data, dict):
            raise ManifestError(f"{where} must be an object")
        hints = get_type_hints(tp)
        kwargs = {}
        for f in dataclasses.fields(tp):
            if f.name in data:
                kwargs[f.name] = _build(hints[f.name], data[f.name], f"{where}.{f.name}")
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ManifestError(f"{where}.{f.name} is missing")
        return tp(**kwargs)
    if tp is float:
        if isinstance(data, bool) or not isinstance(data, (int, float)):
            raise ManifestError(f"{where} must be a number")
        return float(data)
    if tp is int:
        if isinstance(data, bool) or not isinstance(data, int):
            raise ManifestError(f"{where} must be an integer")
        return data
    if tp is str:
        if not isinstance(data, str):
            raise ManifestError(f"{where} must be a string")
        return data
    if tp is bool:
        if not isinstance(data, bool):
            raise ManifestError(f"{where} must be a boolean")
        return data
    if tp is Any:
        return data
    return data

"""Cores as release artifacts: reproducible bytes, the export cache, atomic output, helios's
refusal of a tampered core before it binds a port, and `ignition inspect` / `ignition verify`.

Everything runs on the tiny random qwen2 checkpoint (fp32 exports of ~10 s, cache hits of ~3 s).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from typer.testing import CliRunner

from helios.launcher import free_port
from helios.manifest import FORMAT_VERSION, MANIFEST_NAME, Manifest, ManifestError, content_digest, file_sha256
from ignition.cli import app
from ignition.export import cache as export_cache
from ignition.export.pipeline import ExportError, ExportOptions, export_core
from ignition.recipes import load_recipe
from tests.conftest import REPO

RECIPE = "qwen25_coder"
WIDE = {"COLUMNS": "200"}  # rich wraps at 80 columns off a terminal
AS_TINY_CORE = {"prompt_logprobs": True, "targets": ("cpu", "cuda"), "torch_dtype": "float32"}  # tests/conftest.py


def digests(core: Path) -> dict[str, str]:
    """sha256 of every file of a core, core.json included."""
    return {p.name: file_sha256(p) for p in sorted(core.iterdir()) if p.is_file()}


Events = list[tuple[str, str, float]]  # (stage, detail, time.monotonic())


def export(checkpoint: Path, out: Path, precision: str = "fp32", **kwargs) -> tuple[Manifest, Events]:
    events: Events = []
    options = ExportOptions(
        recipe=load_recipe(RECIPE), checkpoint=str(checkpoint), out=out, precision=precision, **kwargs
    )
    manifest = export_core(options, lambda stage, detail: events.append((stage, detail, time.monotonic())))
    events.append(("done", "", time.monotonic()))
    return manifest, events


def stage_seconds(events: Events) -> dict[str, float]:
    """Seconds from each stage's first report to the next stage's."""
    firsts: dict[str, float] = {}
    for stage, _, at in events:
        firsts.setdefault(stage, at)
    order = list(firsts)
    return {stage: firsts[nxt] - firsts[stage] for stage, nxt in zip(order, order[1:])}


def copy_core(core: Path, to: Path) -> Path:
    shutil.copytree(core, to)
    return to


def scale_float_weights(core: Path, factor: float) -> None:
    """Multiply every float32 weight in the engine's external data file by `factor`, in place."""
    import onnx

    model = onnx.load(str(core / "step.onnx"), load_external_data=False)
    data = np.memmap(core / "step.onnx.data", dtype=np.uint8, mode="r+")
    for init in model.graph.initializer:
        info = {e.key: e.value for e in init.external_data}
        if init.data_type == onnx.TensorProto.FLOAT and "offset" in info:
            start, length = int(info["offset"]), int(info["length"])
            view = data[start : start + length].view(np.float32)
            view *= np.float32(factor)
    data.flush()
    del data


def reseal(core: Path) -> None:
    """Rewrite core.json's digests for the files as they are now (a consistent, altered core)."""
    manifest = Manifest.load(core, verify_files=False)
    manifest.seal(core)
    manifest.save(core)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory, tiny_checkpoint_dir) -> Path:
    # tiny_checkpoint_dir first: writing it reads the real tokenizer from the default cache.
    return tmp_path_factory.mktemp("flare-cache")


@pytest.fixture
def flare_cache(monkeypatch, cache_dir: Path) -> Path:
    monkeypatch.setenv("FLARE_CACHE", str(cache_dir))
    return cache_dir


@pytest.fixture(scope="module")
def cached_export(tmp_path_factory, tiny_checkpoint_dir, cache_dir: Path):
    """A fresh fp32 export with the export cache on (a miss that fills the cache)."""
    old = os.environ.get("FLARE_CACHE")
    os.environ["FLARE_CACHE"] = str(cache_dir)
    try:
        out = tmp_path_factory.mktemp("cached") / "core"
        manifest, events = export(tiny_checkpoint_dir, out, **AS_TINY_CORE)
    finally:
        if old is None:
            os.environ.pop("FLARE_CACHE", None)
        else:
            os.environ["FLARE_CACHE"] = old
    return out, manifest, events


def stage_details(events: Events, stage: str) -> str:
    return " | ".join(detail for s, detail, _ in events if s == stage)


# -- reproducibility and the export cache ------------------------------------------------------


def test_exports_are_byte_identical_with_and_without_the_cache(
    tiny_core, tiny_checkpoint_dir, cached_export, flare_cache, tmp_path, monkeypatch
):
    cached_core, manifest, events = cached_export
    assert "reading" in stage_details(events, "read")  # a miss: it really read and traced
    entries = export_cache.ExportCache().entries()
    assert len(entries) == 1

    # A separate process (another hash seed), --no-cache: nothing read from or written to the cache.
    fresh = tmp_path / "fresh"
    env = {**os.environ, "PYTHONHASHSEED": "12345", **WIDE}
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "ignition.cli",
            "export",
            "--recipe",
            RECIPE,
            "--checkpoint",
            str(tiny_checkpoint_dir),
            "--out",
            str(fresh),
            "--precision",
            "fp32",
            "--no-cache",
            "--prompt-logprobs",
            "--target",
            "cpu,cuda",
            "--torch-dtype",
            "float32",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert "export cache off" in run.stderr
    assert [e.key for e in export_cache.ExportCache().entries()] == [entries[0].key]

    # A cache hit must not read the checkpoint, build the model or trace the graph.
    def forbidden(*args, **kwargs):
        raise AssertionError("a cache hit repeated work it should have skipped")

    monkeypatch.setattr("ignition.export.stages.load_checkpoint", forbidden)
    monkeypatch.setattr("ignition.export.stages.build_model", forbidden)
    monkeypatch.setattr("ignition.export.stages.export_step_graph", forbidden)
    hit, hit_events = export(tiny_checkpoint_dir, tmp_path / "hit", **AS_TINY_CORE)
    assert "export cache hit" in stage_details(hit_events, "read")
    assert "skipped" in stage_details(hit_events, "convert")
    assert "skipped" in stage_details(hit_events, "export")
    assert "cached torch reference" in stage_details(hit_events, "validate")

    # tiny_core (conftest), the cache-filling export, the --no-cache process and the cache hit.
    expected = digests(tiny_core)
    assert set(expected) == {
        MANIFEST_NAME,
        "step.onnx",
        "step.onnx.data",
        "score.onnx",
        "score.onnx.data",
        "step.cuda.pt2",
        "tokenizer.json",
        "chat_template.jinja",
    }
    assert "cached float32 torch step program" in stage_details(hit_events, "export")
    for core in (cached_core, fresh, tmp_path / "hit"):
        assert digests(core) == expected, core
    assert hit.digest == manifest.digest == Manifest.load(tiny_core).digest

    # Nothing in the graph says where it was built.
    graph = (tmp_path / "hit" / "step.onnx").read_bytes()
    assert str(REPO).encode() not in graph and b"site-packages" not in graph and b"stack_trace" not in graph
    program = (tmp_path / "hit" / "step.cuda.pt2").read_bytes()  # an uncompressed zip: names are plain bytes
    assert str(REPO).encode() not in program and b"site-packages" not in program and b"stack_trace" not in program


def test_manifest_records_toolchain_and_digest(tiny_core):
    manifest = Manifest.load(tiny_core)
    chain = manifest.toolchain
    assert {"flare", "flare-exporter", "torch", "onnx", "onnxscript", "onnxruntime", "numpy"} <= set(chain)
    assert chain["flare-exporter"] == export_cache.exporter_version()
    assert manifest.format_version == FORMAT_VERSION
    assert set(manifest.files) == {
        "step.onnx",
        "step.onnx.data",
        "score.onnx",
        "score.onnx.data",
        "step.cuda.pt2",
        "tokenizer.json",
        "chat_template.jinja",
    }
    for rel, digest in manifest.files.items():
        assert file_sha256(tiny_core / rel) == digest
    # The digest is the sha256 of the listing in sha256sum format: `sha256sum -c` checks a core.
    listing = "".join(f"{manifest.files[rel]}  {rel}\n" for rel in sorted(manifest.files))
    assert manifest.digest == hashlib.sha256(listing.encode()).hexdigest()
    text = (tiny_core / MANIFEST_NAME).read_text()
    assert text == manifest.to_json()  # sorted keys, stable formatting
    # content_digest covers every other field of core.json, as canonical JSON.
    fields = {k: v for k, v in json.loads(text).items() if k != "content_digest"}
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert manifest.content_digest == hashlib.sha256(canonical.encode()).hexdigest()


def test_other_precision_from_cache_skips_read_convert_export(
    tiny_checkpoint_dir, cached_export, flare_cache, tmp_path
):
    _, fp32, events = cached_export
    manifest, hit_events = export(tiny_checkpoint_dir, tmp_path / "int8", precision="int8")
    assert manifest.precision == "int8" and manifest.parity is not None
    assert (manifest.quantization.layers_bits, manifest.quantization.layers_block) == (8, 128)
    assert manifest.quantization.embedding_bits is None and fp32.quantization is None
    assert manifest.digest != fp32.digest
    assert "export cache hit" in stage_details(hit_events, "read")
    assert [s for s, _, _ in hit_events][:4] == ["read", "read", "convert", "export"]
    skipped = ("read", "convert", "export")
    miss_seconds = sum(stage_seconds(events)[s] for s in skipped)
    hit_seconds = sum(stage_seconds(hit_events)[s] for s in skipped)
    assert hit_seconds < miss_seconds / 3, (hit_seconds, miss_seconds)
    entry = export_cache.ExportCache().entries()
    assert len(entry) == 1  # the same entry served both precisions
    meta = json.loads((entry[0].path / export_cache.ENTRY_NAME).read_text())
    assert set(meta["seconds"]) == {"read", "convert", "export"} and sum(meta["seconds"].values()) > 0
    result = CliRunner().invoke(
        app,
        [
            "export",
            "--recipe",
            RECIPE,
            "--checkpoint",
            str(tiny_checkpoint_dir),
            "--out",
            str(tmp_path / "cli"),
            "--precision",
            "int8",
        ],
        env={**WIDE, "FLARE_CACHE": str(flare_cache)},
    )
    assert result.exit_code == 0, result.output
    assert "export cache hit" in result.output and "skipped: cached" in result.output
    assert digests(tmp_path / "cli") == digests(tmp_path / "int8")


def test_corrupted_cache_entry_is_a_miss(tiny_checkpoint_dir, cached_export, flare_cache, tmp_path, monkeypatch):
    (entry,) = export_cache.ExportCache().entries()
    key = entry.key
    cache = export_cache.ExportCache(tmp_path / "private")
    shutil.copytree(entry.path, cache.root / key)
    with open(cache.root / key / "step.onnx.data", "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert cache.lookup(key) is None
    assert not (cache.root / key).exists()  # removed, so the next export refills it


def test_cache_is_bounded_and_can_be_cleared(tmp_path, monkeypatch):
    cache = export_cache.ExportCache(tmp_path / "export")
    cache.root.mkdir()
    for i, key in enumerate(["a" * 64, "b" * 64, "c" * 64]):
        folder = cache.root / key
        folder.mkdir()
        (folder / "blob").write_bytes(b"x" * 1000)
        (folder / export_cache.ENTRY_NAME).write_text("{}")
        (folder / export_cache.USED_NAME).touch()
        os.utime(folder / export_cache.USED_NAME, (1000 + i, 1000 + i))
    removed = cache.evict(keep="a" * 64, limit=2100)
    assert removed == ["b" * 64]  # least recently used first, never the one being kept
    assert {e.key for e in cache.entries()} == {"a" * 64, "c" * 64}
    monkeypatch.setenv("FLARE_CACHE", str(tmp_path))
    result = CliRunner().invoke(app, ["cache"], env=WIDE)
    assert result.exit_code == 0 and "2 entries" in result.output
    result = CliRunner().invoke(app, ["cache", "--clear"], env=WIDE)
    assert result.exit_code == 0
    assert cache.entries() == [] and list(cache.root.iterdir()) == []


# -- atomic output -----------------------------------------------------------------------------


@pytest.mark.parametrize("failure", [RuntimeError("validation exploded"), KeyboardInterrupt()])
def test_failed_export_leaves_nothing(tiny_checkpoint_dir, cached_export, flare_cache, tmp_path, monkeypatch, failure):
    def explode(*args, **kwargs):
        raise failure

    monkeypatch.setattr("ignition.export.stages.validate", explode)
    parent = tmp_path / "cores"
    with pytest.raises(type(failure)):
        export(tiny_checkpoint_dir, parent / "core")
    assert list(parent.iterdir()) == []  # no core, no partial folder


def test_parity_failure_is_an_export_error_and_leaves_nothing(
    tiny_checkpoint_dir, cached_export, flare_cache, tmp_path, monkeypatch
):
    from ignition.export.validate import ParityError

    def disagree(*args, **kwargs):
        raise ParityError("int4 engine disagrees with the torch reference")

    monkeypatch.setattr("ignition.export.stages.validate", disagree)
    with pytest.raises(ExportError, match="disagrees"):
        export(tiny_checkpoint_dir, tmp_path / "core")
    assert list(tmp_path.iterdir()) == []


def test_leftovers_of_dead_exports_are_removed(tiny_checkpoint_dir, cached_export, flare_cache, tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = socket.gethostname()
    leftover = tmp_path / f".core.partial-{dead.pid}-{host}-abc123"
    (leftover / "core").mkdir(parents=True)
    (leftover / "core" / "step.onnx").write_bytes(b"half")
    alive = tmp_path / f".core.partial-{os.getpid()}-{host}-def456"  # a live export's: kept
    alive.mkdir()
    export(tiny_checkpoint_dir, tmp_path / "core")
    assert not leftover.exists() and alive.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["core", alive.name])


def test_out_over_an_existing_core_needs_force(tiny_checkpoint_dir, cached_export, flare_cache, tmp_path):
    core = copy_core(cached_export[0], tmp_path / "core")
    before = digests(core)
    args = [
        "export",
        "--recipe",
        RECIPE,
        "--checkpoint",
        str(tiny_checkpoint_dir),
        "--out",
        str(core),
        "--precision",
        "int8",
    ]
    env = {**WIDE, "FLARE_CACHE": str(flare_cache)}
    result = CliRunner().invoke(app, args, env=env)
    assert result.exit_code == 2
    assert "already exists; pass --force to replace it" in result.output
    assert digests(core) == before

    result = CliRunner().invoke(app, [*args, "--force"], env=env)
    assert result.exit_code == 0, result.output
    assert Manifest.load(core).precision == "int8"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["core"]  # the old core is gone, nothing aside

    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("not a core")
    args[args.index("--out") + 1] = str(precious)
    result = CliRunner().invoke(app, [*args, "--force"], env=env)
    assert result.exit_code == 2
    assert "not a core" in result.output
    assert (precious / "notes.txt").read_text() == "not a core"


# -- helios refuses a bad core before it binds a port -----------------------------------------


def flip_byte(path: Path, offset: int = 4096) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def test_helios_serve_refuses_a_tampered_core_before_binding(tiny_core, tmp_path):
    core = copy_core(tiny_core, tmp_path / "core")
    flip_byte(core / "step.onnx.data")
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "helios.cli", "serve", str(core), "--port", str(port)],
        cwd=REPO,
        env={**os.environ, **WIDE},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    listened = False
    while process.poll() is None:  # probe the port for as long as helios runs
        with socket.socket() as probe:
            probe.settimeout(0.2)
            listened |= probe.connect_ex(("127.0.0.1", port)) == 0
        time.sleep(0.02)
    stdout, stderr = process.communicate(timeout=60)
    assert process.returncode == 2, stdout + stderr
    assert "core file step.onnx.data does not match its digest in core.json" in " ".join(stderr.split())
    assert "serving" not in stdout
    assert not listened  # it never bound the port


@pytest.mark.parametrize(
    "tamper, message",
    [
        ("flip", "core file step.onnx.data does not match its digest"),
        ("missing", "core file tokenizer.json is missing"),
        ("major", "has format version '2.0'; this helios reads 1.x"),
        ("listing", "file listing"),
        ("limits", "core.json does not match its content_digest: its fields were edited"),
        ("no digest", "core.json does not match its content_digest"),
        ("unlisted", "core file chat_template.jinja is used by core.json but not listed"),
        ("escape", "not a plain relative path"),
    ],
)
def test_helios_refuses_bad_cores_without_starting_anything(tiny_core, tmp_path, monkeypatch, tamper, message):
    from helios.cli import app as helios_app

    core = copy_core(tiny_core, tmp_path / "core")
    data = json.loads((core / MANIFEST_NAME).read_text())
    if tamper == "flip":
        flip_byte(core / "step.onnx.data")
    elif tamper == "missing":
        (core / "tokenizer.json").unlink()
    elif tamper == "major":
        data["format_version"] = "2.0"
    elif tamper == "listing":  # a file swapped with its listed digest updated, the core digest not
        (core / "chat_template.jinja").write_text("{{ messages }}")
        data["files"]["chat_template.jinja"] = file_sha256(core / "chat_template.jinja")
    elif tamper == "limits":  # a copied core edited by hand to claim more than it was built for
        data["limits"]["context_length"] *= 2
        data["limits"]["kv_pages"] *= 2
    elif tamper == "no digest":
        data.pop("content_digest")
    elif tamper == "unlisted":  # re-sealed, so the listing rule itself is what refuses it
        del data["files"]["chat_template.jinja"]
        data.pop("digest")
        data["content_digest"] = content_digest(data)
    elif tamper == "escape":
        data["files"]["../outside"] = "0" * 64
        data.pop("digest")
        data["content_digest"] = content_digest(data)
    (core / MANIFEST_NAME).write_text(json.dumps(data))
    with pytest.raises(ManifestError, match=re.escape(message)):
        Manifest.load(core)

    def never(*args, **kwargs):
        raise AssertionError("helios went on after a bad core")

    monkeypatch.setattr("helios.transport.lifecycle.serve", never)
    monkeypatch.setattr("helios.engine.engine.Engine", never)
    result = CliRunner().invoke(helios_app, ["serve", str(core), "--port", str(free_port())], env=WIDE)
    assert result.exit_code == 2
    assert message in " ".join(result.output.split())


def test_older_and_newer_minor_versions_load(tiny_core, tmp_path):
    core = copy_core(tiny_core, tmp_path / "core")
    data = json.loads((core / MANIFEST_NAME).read_text())
    old = {k: v for k, v in data.items() if k != "digest"} | {"format_version": "1.0"}  # before digests
    (core / MANIFEST_NAME).write_text(json.dumps(old))
    assert Manifest.load(core).digest == ""
    newer = data | {"format_version": "1.99", "some_future_field": {"x": 1}}  # minor: optional additions
    newer["content_digest"] = content_digest(newer)  # it covers fields this helios does not know
    (core / MANIFEST_NAME).write_text(json.dumps(newer))
    assert Manifest.load(core).digest == data["digest"]
    older = {k: v for k, v in data.items() if k != "content_digest"} | {"format_version": "1.4"}
    older["limits"] = data["limits"] | {"max_concurrency": 3}  # 1.1-1.4: only the listing is covered
    (core / MANIFEST_NAME).write_text(json.dumps(older))
    assert Manifest.load(core).limits.max_concurrency == 3


# -- inspect and verify ------------------------------------------------------------------------


def test_inspect_json_and_rich(tiny_core):
    result = CliRunner().invoke(app, ["inspect", str(tiny_core), "--json"], env=WIDE)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    manifest = Manifest.load(tiny_core)
    assert (
        data["digest"] == manifest.digest
        and data["listing_ok"] is True
        and data["content_ok"] is True
        and data["files_present"] is True
    )
    assert data["model_id"] == manifest.model_id == "qwen2.5-coder"
    assert data["identity"]["recipe"] == RECIPE and data["precision"] == "fp32"
    step = data["engines"][0]
    assert step["bytes"] == sum((tiny_core / f).stat().st_size for f in [step["file"], *step["data_files"]])
    assert data["total_bytes"] == sum(p.stat().st_size for p in tiny_core.iterdir() if p.name != MANIFEST_NAME)
    assert data["sampling"]["ranges"]["temperature"] == {"min": 0.01, "max": 0.7}
    assert data["parity"]["max_abs_logit_error"] <= data["parity"]["tolerance"]
    assert data["logprobs"]["max_top_logprobs"] == 20 and data["parsers"]["tool"] == "qwen25_coder_json"
    assert data["limits"]["context_length"] == 32768 and data["toolchain"]["onnx"]  # the checkpoint's native context

    result = CliRunner().invoke(app, ["inspect", str(tiny_core)], env=WIDE)
    assert result.exit_code == 0, result.output
    for needle in (
        "qwen2.5-coder",
        "recipe",
        "fp32",
        "engine step",
        "limits",
        "temperature",
        "[0.01, 0.7]",
        "qwen25_coder_json",
        "top 20 alternatives",
        "parity",
        "tolerance 0.001",
        manifest.digest,
    ):
        assert needle in result.output, needle

    result = CliRunner().invoke(app, ["inspect", str(tiny_core.parent)], env=WIDE)
    assert result.exit_code == 2 and "core.json is missing" in result.output


def test_verify_against_the_checkpoint(tiny_core, tiny_checkpoint_dir, tmp_path):
    runner = CliRunner()
    result = runner.invoke(app, ["verify", str(tiny_core), "--checkpoint", str(tiny_checkpoint_dir)], env=WIDE)
    assert result.exit_code == 0, result.output
    assert "✓ parity" in result.output and "verified" in result.output

    # The same core, but its weights altered and its digests rewritten to match: only parity can tell.
    altered = copy_core(tiny_core, tmp_path / "altered")
    scale_float_weights(altered, 1.5)
    reseal(altered)
    result = runner.invoke(app, ["verify", str(altered), "--checkpoint", str(tiny_checkpoint_dir)], env=WIDE)
    assert result.exit_code == 1, result.output
    assert "✓ digests" in result.output and "✗ parity" in result.output and "disagrees" in result.output

    from tests.unit.tiny_checkpoints import write_tiny_checkpoint

    other = write_tiny_checkpoint(tmp_path / "other", "qwen2", seed=1)
    result = runner.invoke(app, ["verify", str(tiny_core), "--checkpoint", str(other)], env=WIDE)
    assert result.exit_code == 1
    assert "but the core was exported from" in " ".join(result.output.split())


def test_verify_without_the_checkpoint(tiny_core, tmp_path):
    runner = CliRunner()
    result = runner.invoke(app, ["verify", str(tiny_core), "--json"], env=WIDE)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    checks = {c["name"]: c for c in report["checks"]}
    assert report["ok"] and checks["digests"]["ok"] and checks["smoke"]["ok"]
    assert checks["reference"]["ok"] is None and "not available" in checks["reference"]["detail"]

    result = runner.invoke(app, ["verify", str(tiny_core), "--require-reference"], env=WIDE)
    assert result.exit_code == 1 and "not available" in result.output

    tampered = copy_core(tiny_core, tmp_path / "tampered")
    flip_byte(tampered / "step.onnx.data")
    result = runner.invoke(app, ["verify", str(tampered)], env=WIDE)
    assert result.exit_code == 1
    assert "step.onnx.data does not match its digest" in " ".join(result.output.split())


def test_inspect_names_the_int4_matmul_operator():
    from ignition.export.quantize import manifest_quantization
    from ignition.inspect_core import _quantization_text

    current = dataclasses.asdict(manifest_quantization("int4"))
    assert _quantization_text(current).endswith("float16 scales, accuracy level 4, MatMulInt4)")
    older = {k: v for k, v in current.items() if k not in ("matmul_op", "scales")}  # a 1.3 core: MatMulNBits
    assert _quantization_text(older).endswith("block 64, accuracy level 4, MatMulNBits)")
    assert dataclasses.asdict(manifest_quantization("int8"))["matmul_op"] == "com.microsoft.MatMulNBits"


def test_int4_cores_attend_in_bfloat16_and_say_so():
    """quantize_weights gives an int4 step graph's PagedAttention nodes precision="bfloat16" and the
    manifest records it; int8 (the quality precision) keeps fp32 attention."""
    from helios.kernels.attention import set_precision
    from ignition.export.quantize import SETTINGS, manifest_quantization

    assert manifest_quantization("int4").attention == SETTINGS["int4"].attention == "bfloat16"
    assert manifest_quantization("int8").attention == "float32"
    node = onnx.helper.make_node("PagedAttention", ["x"], ["y"], domain="ai.flare", num_heads=2)
    model = onnx.helper.make_model(onnx.helper.make_graph([node], "g", [], []))
    assert set_precision(model, "bfloat16") == 1
    assert onnx.helper.get_attribute_value(model.graph.node[0].attribute[-1]) == b"bfloat16"
    set_precision(model, "float32")  # the kernel's default: no attribute at all
    assert [a.name for a in model.graph.node[0].attribute] == ["num_heads"]
    with pytest.raises(ValueError, match="unknown attention precision"):
        set_precision(model, "float16")

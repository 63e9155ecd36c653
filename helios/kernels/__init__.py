"""Flare's own CPU kernels: an onnxruntime custom-operator library built from
`cpu_kernels.cc`, `attention_kernels.cc`, `moe_kernels.cc` and `head_kernels.cc` (and the runner's host
helpers, `host_kernels.cc`: helios.kernels.host) on first use and cached by source
digest under `$FLARE_KERNEL_CACHE` (default `$FLARE_CACHE/kernels`).

Building needs g++ and onnxruntime's C/C++ API headers, which no onnxruntime wheel ships: they
come from Debian's `libonnxruntime-dev` package (pinned by version and sha256; the custom-op
ABI is versioned, so headers of API 21 work with any later runtime), or from a directory named
by `$FLARE_ORT_INCLUDE`. `FLARE_KERNELS=off` disables the library; where it cannot be built or
run (no AVX512-VNNI, no compiler, no headers), `available()` says why and helios.kernels.session
falls back to onnxruntime's own kernels (int4_layout.to_matmul_nbits,
attention.to_group_query_attention).
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import shutil
import subprocess
import tarfile
import tempfile
import threading
import urllib.request
from pathlib import Path

from helios.cache_dir import cache_root

log = logging.getLogger(__name__)

DOMAIN = "ai.flare"  # the ONNX domain of flare's operators

SOURCES = tuple(
    Path(__file__).with_name(n)
    for n in ("cpu_kernels.cc", "attention_kernels.cc", "moe_kernels.cc", "head_kernels.cc", "host_kernels.cc")
)
LOCAL_HEADERS = tuple(
    Path(__file__).with_name(n)
    for n in (
        "int4_gemm.h",
        "simd_math.h",
        "attention_pool.h",
        "attention_fp32.h",
        "attention_amx.h",
        "attention_dpbf16.h",
    )
)  # included
CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni")
HEADERS_DEB = (
    "http://deb.debian.org/debian/pool/main/o/onnxruntime/libonnxruntime-dev_1.21.0+dfsg-1_amd64.deb",
    "14f7d959d5deacbcf1504830d4189f91fc67382b399ed9ae9d3aa9c4050ced08",
)
HEADERS = ("onnxruntime_c_api.h", "onnxruntime_cxx_api.h", "onnxruntime_cxx_inline.h", "onnxruntime_float16.h")
# AMX-BF16 and AVX512-BF16 are compiled in but optional: attention_amx.h and attention_dpbf16.h check
# for them at run time.
OPTIONAL_FLAGS = ("-mamx-tile", "-mamx-bf16", "-mavx512bf16")
COMPILE_FLAGS = [
    "-O3",
    "-std=c++17",
    "-shared",
    "-fPIC",
    "-mavx2",
    "-mfma",
    "-mf16c",  # every AVX-512 CPU has it: fp16 KV pools
    *(f"-m{f.replace('_', '')}" for f in CPU_FLAGS),
    *OPTIONAL_FLAGS,
]

_lock = threading.Lock()
_library: Path | None = None
_reason: str | None = None
_checked = False


def _cache_root() -> Path:
    named = os.environ.get("FLARE_KERNEL_CACHE")
    if named:
        return Path(named)
    return cache_root() / "kernels"


def cpu_flags() -> set[str] | None:
    """The CPU's feature flags from /proc/cpuinfo (None where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    return set(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))


def cpu_missing_flags() -> list[str]:
    flags = cpu_flags()
    return [f for f in CPU_FLAGS if flags is None or f not in flags]


def _deb_member(deb: bytes, prefix: str) -> bytes:
    """One member of a .deb (an `ar` archive) by name prefix."""
    if not deb.startswith(b"!<arch>\n"):
        raise ValueError("not a Debian package")
    at = 8
    while at + 60 <= len(deb):
        name = deb[at : at + 16].decode().strip().rstrip("/")
        size = int(deb[at + 48 : at + 58].decode().strip())
        if name.startswith(prefix):
            return deb[at + 60 : at + 60 + size]
        at += 60 + size + (size & 1)
    raise ValueError(f"no {prefix} in the package")


def _headers() -> Path:
    """A directory holding onnxruntime's C/C++ API headers."""
    named = os.environ.get("FLARE_ORT_INCLUDE")
    if named:
        return Path(named)
    for system in (Path("/usr/include/onnxruntime"), Path("/usr/local/include/onnxruntime")):
        if all((system / h).is_file() for h in HEADERS):
            return system
    url, sha256 = HEADERS_DEB
    target = _cache_root() / ("ort-headers-" + sha256[:12])
    if all((target / h).is_file() for h in HEADERS):
        return target
    log.info("fetching onnxruntime API headers from %s", url)
    with urllib.request.urlopen(url, timeout=60) as response:
        deb = response.read()
    if hashlib.sha256(deb).hexdigest() != sha256:
        raise ValueError(f"{url} does not have the pinned sha256")
    data = _deb_member(deb, "data.tar")
    tmp = Path(tempfile.mkdtemp(dir=_cache_root()))
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        for member in tar.getmembers():
            if Path(member.name).name in HEADERS:
                (tmp / Path(member.name).name).write_bytes(tar.extractfile(member).read())
    try:
        tmp.rename(target)
    except OSError:  # another process got there first
        shutil.rmtree(tmp, ignore_errors=True)
        if not all((target / h).is_file() for h in HEADERS):
            raise
    return target


def _build() -> Path:
    source = b"".join(path.read_bytes() for path in (*SOURCES, *LOCAL_HEADERS))
    digest = hashlib.sha256(source + " ".join(COMPILE_FLAGS).encode()).hexdigest()[:16]
    out = _cache_root() / f"flare_kernels-{digest}.so"
    if out.is_file():
        return out
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++) on PATH")
    _cache_root().mkdir(parents=True, exist_ok=True)
    include = _headers()
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    result = subprocess.run(
        [compiler, *COMPILE_FLAGS, f"-I{include}", *map(str, SOURCES), "-o", str(tmp)], capture_output=True, text=True
    )
    if result.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"compiling {', '.join(p.name for p in SOURCES)} failed:\n{result.stderr[-2000:]}")
    tmp.rename(out)
    log.info("built %s", out)
    return out


def available() -> tuple[Path | None, str | None]:
    """(library path, None) when flare's kernels can run here, else (None, why not)."""
    global _library, _reason, _checked
    if os.environ.get("FLARE_KERNELS", "").lower() in ("0", "off", "false", "no"):
        return None, "disabled by FLARE_KERNELS"
    with _lock:
        if not _checked:
            _checked = True
            missing = cpu_missing_flags()
            if missing:
                _reason = "this CPU lacks " + ", ".join(missing)
            else:
                try:
                    _library = _build()
                except Exception as exc:
                    _reason = f"could not build the kernel library: {exc}"
        return _library, _reason

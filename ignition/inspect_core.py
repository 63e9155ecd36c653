"""`ignition inspect`: a core seen as a release artifact (ignition/verify_core.py re-checks one).

inspect reads core.json (and the files' sizes) and shows what a release engineer checks;
`--json` gives the same as one JSON object (core.json's fields plus sizes). It imports no
torch or onnxruntime, so it answers at once.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from rich.table import Table
from rich.text import Text

from helios.manifest import Manifest, listing_digest

# -- inspect -----------------------------------------------------------------------------------


def inspect_data(core: Path) -> dict[str, Any]:
    """core.json's fields, plus: core (the folder), model_id, file_bytes (per listed file),
    total_bytes, listing_ok (the listing matches `digest`), content_ok (core.json matches
    `content_digest`; None before 1.5), files_present, and bytes per engine."""
    core = Path(core)
    manifest = Manifest.load(core, verify_files=False)
    data: dict[str, Any] = {"core": str(core), "model_id": manifest.model_id}
    data |= dataclasses.asdict(manifest)
    sizes = {}
    for rel in sorted(set(manifest.files) | set(manifest.referenced_files())):
        path = core / rel
        sizes[rel] = path.stat().st_size if path.is_file() else None
    data["file_bytes"] = sizes
    data["files_present"] = all(size is not None for size in sizes.values())
    data["total_bytes"] = sum(size or 0 for size in sizes.values())
    data["listing_ok"] = (listing_digest(manifest.files) == manifest.digest) if manifest.digest else None
    data["content_ok"] = manifest.content_matches(core)
    for engine in data["engines"]:
        engine["bytes"] = sum(sizes.get(name) or 0 for name in [engine["file"], *engine["data_files"]])
    return data


def _mb(n: int | None) -> str:
    if n is None:
        return "missing"
    return f"{n / 1e6:.1f} MB" if n >= 100_000 else f"{n / 1e3:.1f} kB"


def _num(value: float) -> str:
    return f"{value:g}"


def _quantization_text(q: dict[str, Any] | None) -> str:
    if not q:
        return ""
    parts = [f"layers int{q['layers_bits']} block {q['layers_block']}"]
    if q.get("lm_head_bits"):
        parts.append(f"lm_head int{q['lm_head_bits']} block {q['lm_head_block']}")
    if q.get("embedding_bits"):
        parts.append(f"embedding int{q['embedding_bits']} block {q['embedding_block']}")
    if q.get("scales", "float32") == "float16":
        parts.append("float16 scales")
    op = q.get("matmul_op", "com.microsoft.MatMulNBits").rsplit(".", 1)[-1]
    return f" ({', '.join(parts)}, accuracy level {q['accuracy_level']}, {op})"


def render_inspect(data: dict[str, Any]) -> Table:
    table = Table(title=f"core {data['core']}", show_header=False, title_justify="left")
    table.add_column(style="bold", no_wrap=True)
    table.add_column()
    ident, arch = data["identity"], data["architecture"]
    aliases = ", ".join(a for a in ident["aliases"] if a) or "none"
    table.add_row("model", f"{data['model_id']}  (aliases: {aliases})")
    table.add_row("recipe", ident["recipe"])
    table.add_row("checkpoint", f"{ident['checkpoint_id']}  sha256 {ident['checkpoint_sha256']}")
    table.add_row("format", data["format_version"])
    table.add_row("precision", data["precision"] + _quantization_text(data.get("quantization")))
    table.add_row(
        "architecture",
        f"{arch['family']}: {arch['num_layers']} layers, hidden {arch['hidden_size']}, "
        f"{arch['num_heads']} heads / {arch['num_kv_heads']} KV x {arch['head_dim']}, vocab {arch['vocab_size']}, "
        f"rope theta {_num(arch['rope_theta'])}, {'tied' if arch['tie_word_embeddings'] else 'untied'} embeddings",
    )
    for engine in data["engines"]:
        parts = ", ".join(
            f"{name} {_mb(data['file_bytes'].get(name))}" for name in [engine["file"], *engine["data_files"]]
        )
        label = f"engine {engine['name']}"
        if engine.get("target", "cpu") != "cpu":  # a torch program (1.11): target, dtype, writer, parity
            label += f" ({engine['target']})"
            parts += f"; {engine.get('dtype')} torch program written by torch {engine.get('torch_version')}"
            if engine.get("parity"):
                parts += f"; parity max |Δlogit| {engine['parity']['max_abs_logit_error']:.2e}"
        table.add_row(label, f"{_mb(engine['bytes'])}: {parts}")
    table.add_row("decode weights", f"{_mb(data['decode_weight_bytes'])} read per decode token")
    lim, kv = data["limits"], data["kv"]
    table.add_row(
        "limits",
        f"context {lim['context_length']}, concurrency {lim['max_concurrency']}, prefill chunk "
        f"{lim['prefill_chunk_size']}, batch tokens {lim['max_batch_tokens']}, default max tokens "
        f"{lim['default_max_tokens']}",
    )
    table.add_row(
        "kv cache",
        f"{lim['kv_pages']} pages x {kv['page_tokens']} tokens ({kv['dtype']}, {kv['num_layers']} layers x "
        f"{kv['kv_heads']} heads x {kv['head_dim']})",
    )
    state = data.get("state")
    if state:
        kinds = sorted({layer["kind"] for layer in state["layers"]})
        table.add_row(
            "recurrent state",
            f"{state['width']} {state['dtype']} per sequence slot: {len(state['layers'])} layers "
            f"({', '.join(kinds)}: {', '.join(str(layer['layer']) for layer in state['layers'])})",
        )
    drafter = data.get("drafter")
    if drafter:
        darch = drafter["architecture"]
        table.add_row(
            "drafter",
            f"{drafter['checkpoint_id']}: {darch['family']}, {darch['num_layers']} layers, hidden "
            f"{darch['hidden_size']}; engine {drafter['engine']}, {_mb(drafter['decode_weight_bytes'])} "
            "read per draft token",
        )
    table.add_row("sampling", _sampling_table(data["sampling"]))
    parsers = data["parsers"]
    table.add_row("parsers", f"tool {parsers['tool'] or 'none'}, reasoning {parsers['reasoning'] or 'none'}")
    lp = data["logprobs"]
    table.add_row(
        "logprobs",
        f"top {lp['max_top_logprobs']} alternatives, explicit token ids {'yes' if lp['explicit_token_ids'] else 'no'}, "
        f"prompt logprobs {'yes' if lp['prompt_logprobs'] else 'no'}",
    )
    tok, tpl = data["tokenizer"], data["template"]
    table.add_row(
        "tokenizer",
        f"{tok['file']}: bos {tok['bos_token_id']}, eos {tok['eos_token_ids']}, pad {tok['pad_token_id']}, "
        f"add bos {'yes' if tok['add_bos'] else 'no'}",
    )
    table.add_row(
        "template",
        f"{tpl['file']}: system {'yes' if tpl['supports_system'] else 'no'}, tools {'yes' if tpl['supports_tools'] else 'no'}"
        if tpl["file"]
        else "none (no chat)",
    )
    parity = data["parity"]
    if parity:
        table.add_row(
            "parity",
            f"max |Δlogit| {parity['max_abs_logit_error']:.3g} (tolerance {_num(parity['tolerance'])}), top-1 agreement "
            f"{parity['top1_agreement']:.0%}"
            + (f", mean KL {parity['mean_kl']:.2g} nats" if parity.get("mean_kl") is not None else "")
            + f" over {parity['prompt_tokens']} prompt + {parity['decode_steps']} decode positions",
        )
    else:
        table.add_row("parity", Text("not measured", style="yellow"))
    table.add_row("toolchain", ", ".join(f"{k} {v}" for k, v in data["toolchain"].items()) or "not recorded")
    listing = {True: "", False: "  [red](listing does not match: run ignition verify)[/]", None: ""}[data["listing_ok"]]
    if data["content_ok"] is False:
        listing += "  [red](core.json fields do not match content_digest: run ignition verify)[/]"
    missing = [rel for rel, size in data["file_bytes"].items() if size is None]
    present = f"  [red](missing: {', '.join(missing)})[/]" if missing else ""
    table.add_row(
        "digest",
        f"{data['digest'] or 'none (format < 1.1)'}  ({len(data['files'])} files, {_mb(data['total_bytes'])}){listing}{present}",
    )
    return table


def _sampling_table(sampling: dict[str, Any]) -> Table:
    table = Table(show_edge=False, box=None, pad_edge=False)
    table.add_column("parameter")
    table.add_column("default", justify="right")
    table.add_column("range")
    ranges = sampling["ranges"]
    for name, default in sampling["defaults"].items():
        bounds = ranges.get(name)
        shown = "any" if default is None and name == "seed" else str(default)
        if bounds:
            span = f"[{_num(bounds['min'])}, {_num(bounds['max'])}]"
        else:
            span = "per request" if name == "seed" else "fixed"
        table.add_row(name, shown, span)
    return table

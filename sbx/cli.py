"""The ``sbx`` command line (typer). Each subcommand is a thin call into a module."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from sbx import stack
from sbx_client import cli as client_cli
from shared.contract import errors

app = typer.Typer(
    name="sbx",
    help="Cloud Agent Sandbox: run a stack locally and inspect any stack.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(shown: bool) -> None:
    if shown:
        import importlib.metadata

        try:
            version = importlib.metadata.version("cloud-agent-sandbox")
        except importlib.metadata.PackageNotFoundError:
            version = "dev"
        typer.echo(f"sbx {version}")
        raise typer.Exit(0)


@app.callback()
def _main(
    version: Annotated[
        bool,
        typer.Option("--version", "-V", help="Print the version and exit.", callback=_version, is_eager=True),
    ] = False,
) -> None:
    """Cloud Agent Sandbox: run a stack locally and inspect any stack."""


T = TypeVar("T")
StateDir = Annotated[
    Path | None,
    typer.Option("--state-dir", help="State directory of the stack (default: $SBX_STATE_DIR or .sbx/)."),
]
Json = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]


def _run(coro: Coroutine[Any, Any, int]) -> None:
    from shared.infrastructure import logs  # imported here: `sbx exec` never needs it

    # Library chatter (reconnect attempts while NATS starts) is not for the operator.
    logs.configure(service="sbx", instance=str(os.getpid()), level="error", fmt="console")
    try:
        code = asyncio.run(coro)
    except errors.SandboxError as exc:
        typer.echo(f"sbx: error: {exc.message}", err=True)
        raise typer.Exit(2 if isinstance(exc, errors.ConfigError | errors.Conflict) else 1) from None
    except KeyboardInterrupt:
        code = 130
    except BrokenPipeError:  # `sbx events | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
        code = 0
    raise typer.Exit(code)


def _with_stack(state_dir: Path | None, action: Callable[..., Awaitable[int]], **kwargs: object) -> None:
    from sbx import observe  # (NATS client) imported only by the commands that use it

    async def go() -> int:
        nc, topology = await observe.connect(
            stack.bus_settings(stack.state_dir(state_dir, os.environ), os.environ)
        )
        try:
            return await action(nc, topology, **kwargs)
        finally:
            await nc.close()

    _run(go())


@app.command("up")
def up_command(
    host: Annotated[str, typer.Option(help="Address the gateway listens on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Gateway port (0 picks a free one).", min=0, max=65535)] = 8080,
    state_dir: StateDir = None,
    nats_port: Annotated[
        int, typer.Option(help="Port of the embedded NATS server.", min=1, max=65535)
    ] = 4222,
) -> None:
    """Start NATS (unless NATS_URL is set) and all six services; stop them on Ctrl-C."""
    from sbx import up

    options = up.Options(
        host=host, port=port, state_dir=stack.state_dir(state_dir, os.environ), nats_port=nats_port
    )
    _run(up.run(options, dict(os.environ)))


@app.command("down")
def down_command(
    state_dir: StateDir = None,
    purge: Annotated[
        bool,
        typer.Option(
            "--purge", help="Then delete every sandbox (sessions' too) and remove the state directory."
        ),
    ] = False,
) -> None:
    """Stop a stack: its running `sbx up` (as Ctrl-C does), or what one that crashed left
    behind. Sessions' sandboxes stop with their files kept; the rest is removed."""
    from sbx import down

    _run(down.run(stack.state_dir(state_dir, os.environ), os.environ, purge=purge))


@app.command("status")
def status_command(state_dir: StateDir = None, json: Json = False) -> None:
    """Health and pid of every service instance, and session counts. Exit 1 if a service is down."""
    from sbx import observe

    local = not os.environ.get("NATS_URL")
    info = stack.StackInfo.read(stack.state_dir(state_dir, os.environ)) if local else None
    _with_stack(state_dir, observe.status, as_json=json, phase=info.phase if info else None)


@app.command("events")
def events_command(
    session: Annotated[str | None, typer.Option(help="Only this session's events.")] = None,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new events.")] = False,
    since: Annotated[int, typer.Option(help="Start at this stream sequence.", min=1)] = 1,
    state_dir: StateDir = None,
    json: Json = False,
) -> None:
    """Print the audit stream (one JSON object a line with --json)."""
    from sbx import observe

    _with_stack(state_dir, observe.follow_events, session=session, follow=follow, as_json=json, since=since)


@app.command("replay")
def replay_command(
    verify: Annotated[
        bool, typer.Option("--verify", help="Compare (default): exit 0 only if KV equals the fold.")
    ] = False,
    rebuild: Annotated[
        bool, typer.Option("--rebuild", help="Rewrite every projection from the stream.")
    ] = False,
    state_dir: StateDir = None,
    json: Json = False,
) -> None:
    """Fold the whole event stream into fresh projections and compare with (or rewrite) the live KV."""
    if verify and rebuild:
        typer.echo("sbx: error: choose one of --verify and --rebuild", err=True)
        raise typer.Exit(2)
    from sbx import observe

    _with_stack(state_dir, observe.replay_projections, rebuild=rebuild, as_json=json)


@app.command("replicas")
def replicas_command(
    copies: Annotated[int, typer.Argument(help="Copies of every stream and bucket (1-5).", min=1, max=5)],
    state_dir: StateDir = None,
    json: Json = False,
) -> None:
    """Change how many copies a NATS cluster keeps of the event stream, the pool stream and
    every bucket (services never change it themselves; SBX_NATS_REPLICAS applies at creation)."""
    from sbx import observe

    _with_stack(state_dir, observe.set_replicas, copies=copies, as_json=json)


image_app = typer.Typer(
    help="Images of the local runtime: pulled from registries, registered, and the built-in default.",
    no_args_is_help=True,
)
app.add_typer(image_app, name="image")


def _image_action(action: Callable[[], T]) -> T:
    try:
        return action()
    except errors.SandboxError as exc:
        typer.echo(f"sbx: error: {exc.message}", err=True)
        raise typer.Exit(2) from None


def _image_store(state_dir: Path | None):
    from sbx import images

    return images.open_local(stack.state_dir(state_dir, os.environ), dict(os.environ)).images


@image_app.command("pull")
def image_pull(
    reference: Annotated[
        str, typer.Argument(help="An image reference: python:3.12-slim, ghcr.io/org/img:tag, ...")
    ],
    refresh: Annotated[
        bool, typer.Option(help="Resolve a tag at its registry again even if pulled before.")
    ] = True,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar.")] = False,
    state_dir: StateDir = None,
) -> None:
    """Pull an image into this machine's layer store (registry settings: SBX_REGISTRIES_FILE)."""
    from sbx import images

    _run(
        images.pull(
            stack.state_dir(state_dir, os.environ), dict(os.environ), reference, refresh=refresh, quiet=quiet
        )
    )


@image_app.command("list")
def image_list(state_dir: StateDir = None, json: Json = False) -> None:
    """Images here: pulled (reference, digest, size, last used, sandboxes using it),
    registered, and ``default`` (the host's system directories)."""
    from sbx import images

    rows = _image_action(lambda: images.listing(stack.state_dir(state_dir, os.environ), dict(os.environ)))
    images.print_listing(rows, json)


@image_app.command("prune")
def image_prune(
    keep: Annotated[
        str,
        typer.Option(
            help="Keep unused images up to this much unpacked (e.g. 20GiB); 0 removes every unused one."
        ),
    ] = "0",
    state_dir: StateDir = None,
) -> None:
    """Remove pulled images no sandbox uses, least recently used first, and their layers
    no other image has. An image a sandbox uses is never removed."""
    from sbx import images
    from shared.infrastructure import settings

    keep_bytes = _image_action(lambda: settings.parse_size(keep, name="--keep"))
    _image_action(lambda: images.prune(stack.state_dir(state_dir, os.environ), dict(os.environ), keep_bytes))


@image_app.command("add")
def image_add(name: str, rootfs: Path, state_dir: StateDir = None) -> None:
    """Register a root filesystem directory under NAME (used in place, never modified)."""
    _image_action(lambda: _image_store(state_dir).add_rootfs(name, rootfs))
    typer.echo(f"registered {name} -> {rootfs}")


@image_app.command("import")
def image_import(name: str, archive: Path, state_dir: StateDir = None) -> None:
    """Unpack a `docker save` or OCI layout archive and register it under NAME."""
    _image_action(lambda: _image_store(state_dir).import_archive(name, archive))
    typer.echo(f"imported {name} from {archive}")


# exec, release, route: the agent-host client's commands (sbx_client.cli, the light
# distribution's own `sbx-host`); `sbx.entry` starts them without importing this module.
client_cli.register(app)


if __name__ == "__main__":
    from sbx.entry import main

    main()

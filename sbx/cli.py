"""The ``sbx`` command line (typer). Each subcommand is a thin call into a module."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated, TypeVar

import typer

from sbx import observe, stack, up
from shared import errors, logs

app = typer.Typer(
    name="sbx",
    help="Cloud Agent Sandbox: run a stack locally and inspect any stack.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

T = TypeVar("T")
StateDir = Annotated[
    Path | None,
    typer.Option("--state-dir", help="State directory of the stack (default: $SBX_STATE_DIR or .sbx/)."),
]
Json = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]


def _run(coro: Awaitable[int]) -> None:
    # Library chatter (reconnect attempts while NATS starts) is not for the operator.
    logs.configure(service="sbx", instance=str(os.getpid()), level="error", fmt="console")
    try:
        code = asyncio.run(coro)  # type: ignore[arg-type]
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
    options = up.Options(
        host=host, port=port, state_dir=stack.state_dir(state_dir, os.environ), nats_port=nats_port
    )
    _run(up.run(options, dict(os.environ)))


@app.command("status")
def status_command(state_dir: StateDir = None, json: Json = False) -> None:
    """Health and pid of every service instance, and session counts. Exit 1 if a service is down."""
    _with_stack(state_dir, observe.status, as_json=json)


@app.command("events")
def events_command(
    session: Annotated[str | None, typer.Option(help="Only this session's events.")] = None,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new events.")] = False,
    since: Annotated[int, typer.Option(help="Start at this stream sequence.", min=1)] = 1,
    state_dir: StateDir = None,
    json: Json = False,
) -> None:
    """Print the audit stream (one JSON object a line with --json)."""
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
    _with_stack(state_dir, observe.replay_projections, rebuild=rebuild, as_json=json)


image_app = typer.Typer(
    help="Images the local runtime can start (no registry pulls yet).", no_args_is_help=True
)
app.add_typer(image_app, name="image")


def _images(state_dir: Path | None):  # type: ignore[no-untyped-def]
    from shared.runtime import backends

    return backends.image_store("local", stack.state_dir(state_dir, os.environ))


def _image_action(action: Callable[[], object]) -> None:
    try:
        action()
    except errors.SandboxError as exc:
        typer.echo(f"sbx: error: {exc.message}", err=True)
        raise typer.Exit(2) from None


@image_app.command("list")
def image_list(state_dir: StateDir = None) -> None:
    """Registered images (``default`` is always there: the host's system directories)."""
    for name in ["default", *_images(state_dir).names()]:
        typer.echo(name)


@image_app.command("add")
def image_add(name: str, rootfs: Path, state_dir: StateDir = None) -> None:
    """Register a root filesystem directory under NAME (used in place, never modified)."""
    _image_action(lambda: _images(state_dir).add_rootfs(name, rootfs))
    typer.echo(f"registered {name} -> {rootfs}")


@image_app.command("import")
def image_import(name: str, archive: Path, state_dir: StateDir = None) -> None:
    """Unpack a `docker save` or OCI layout archive and register it under NAME."""
    _image_action(lambda: _images(state_dir).import_archive(name, archive))
    typer.echo(f"imported {name} from {archive}")


@app.command("route")
def route_command(
    command: Annotated[list[str], typer.Argument(help="The command, e.g. -- 'git push origin HEAD'")],
    code_dir: Annotated[
        list[Path] | None, typer.Option("--code-dir", help="A code dir (default: the current directory)")
    ] = None,
) -> None:
    """Print where a command would run (host or sandbox) and why: the agent-host client's router."""
    from sbx.client import route

    text = " ".join(command)
    cwd = Path.cwd()
    decided = route.route(text, code_dir or [cwd], cwd)
    typer.echo(f"{decided.where}: {decided.why}")
    if decided.plan is not None:
        typer.echo(f"  in {decided.plan.cwd}")
        for segment in decided.plan.segments:
            typer.echo("  run " + " | ".join(" ".join(step.argv) for step in segment))


Session = Annotated[
    str, typer.Option("--session", help="The session: calls with the same name share a sandbox")
]


@app.command("exec")
def exec_command(
    command: Annotated[list[str], typer.Argument(help="The command, e.g. -- 'make test'")],
    session: Session,
    keep: Annotated[
        bool, typer.Option("--keep", help="Keep the sandbox for later calls (until `sbx release`)")
    ] = False,
    timeout: Annotated[
        float | None, typer.Option("--timeout", help="Seconds before the command is killed")
    ] = None,
) -> None:
    """Run COMMAND for the current directory's code in the session's sandbox (git network
    commands run on this host): files go up before it and come back after it."""
    import signal
    import sys
    import threading

    from sbx.client import Sandbox, SyncError
    from sbx.client.transport import ApiError

    text = " ".join(command)
    try:
        sandbox = Sandbox(session=session, keep=keep)
    except SyncError as exc:
        typer.echo(f"sbx exec: {exc}", err=True)
        raise typer.Exit(2) from None
    interrupted = threading.Event()

    def on_interrupt(signum: int, frame: object) -> None:
        if interrupted.is_set():
            raise KeyboardInterrupt  # a second Ctrl-C: stop waiting
        interrupted.set()
        typer.echo("\nsbx exec: stopping the command in the sandbox (Ctrl-C again to stop waiting)", err=True)
        threading.Thread(target=sandbox.stop, daemon=True).start()

    def write(stream: str, data: bytes) -> None:
        out = sys.stdout.buffer if stream == "stdout" else sys.stderr.buffer
        out.write(data)
        out.flush()

    previous = signal.signal(signal.SIGINT, on_interrupt)
    code = 1
    try:
        result = sandbox.stream(text, timeout=timeout, output=write)
        code = 130 if interrupted.is_set() else result.exit_code
        _report_refused(result.refused)
    except (ApiError, SyncError) as exc:
        typer.echo(f"sbx exec: {exc}", err=True)
        code = 2 if not isinstance(exc, ApiError) or not exc.retriable else 75
    except KeyboardInterrupt:
        code = 130
    finally:
        signal.signal(signal.SIGINT, previous)
        try:
            sandbox.close()
        except (ApiError, OSError) as exc:
            typer.echo(f"sbx exec: could not release the sandbox: {exc}", err=True)
    raise typer.Exit(code)


def _report_refused(refused: list[tuple[str, str]], shown: int = 10) -> None:
    """What did not come back: changes inside .git are counted, the rest listed (up to ``shown``)."""
    inside_git = [path for path, why in refused if "stays as the host has it" in why]
    others = [(path, why) for path, why in refused if "stays as the host has it" not in why]
    for path, why in others[:shown]:
        typer.echo(f"sbx exec: not brought back: {path or '(all)'}: {why}", err=True)
    if len(others) > shown:
        typer.echo(f"sbx exec: ... and {len(others) - shown} more not brought back", err=True)
    if inside_git:
        typer.echo(
            f"sbx exec: {len(inside_git)} change(s) inside .git (config, hooks, info, ...) stay as the host "
            "has them: only history and the index come back",
            err=True,
        )


@app.command("release")
def release_command(session: Session) -> None:
    """Release a session's sandbox kept with `sbx exec --keep`."""
    from sbx.client import Sandbox, SyncError
    from sbx.client.transport import ApiError

    try:
        had = Sandbox(session=session, keep=True).release()
    except (ApiError, SyncError) as exc:
        typer.echo(f"sbx release: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"released {session}" if had else f"{session} had no sandbox")


if __name__ == "__main__":
    app()

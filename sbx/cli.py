"""The ``sbx`` command line: one typer app for every command (docs/cli.md). Each command is
a thin call into a module; what every command shares is here and in :mod:`sbx.exits`
(exit codes) and :mod:`sbx.bars` (progress bars)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Annotated, Any

import typer
import typer.core

from sbx import exits, stack
from sbx_client import cli as client_cli


class _Commands(typer.core.TyperGroup):
    """Runs every command (and the parsing of ``sbx``'s own options, where ``-h`` and ``-V``
    print) inside :func:`exits.guard`: one place turns errors, Ctrl-C and a closed pipe
    into a line on stderr and an exit code."""

    def make_context(self, *args: Any, **kwargs: Any) -> Any:
        with exits.guard():
            return super().make_context(*args, **kwargs)

    def invoke(self, ctx: Any) -> Any:
        with exits.guard():
            return super().invoke(ctx)


_SETTINGS: dict[str, Any] = {
    "no_args_is_help": True,
    # Plain help, as click prints it: typer's rich help panel prints a type for every
    # option, `<bool>` for flags (--json, --follow, -h itself), which take no value; the
    # plain formatter leaves flags bare (typer/rich_utils.py::_print_options_panel versus
    # TyperOption.get_help_record, typer 0.29).
    "rich_markup_mode": None,
    "context_settings": {"help_option_names": ["-h", "--help"]},
}
app = typer.Typer(
    name="sbx",
    cls=_Commands,
    add_completion=False,
    pretty_exceptions_enable=False,
    **_SETTINGS,
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
    """Cloud Agent Sandbox: run a stack locally and inspect any stack.

    Exit codes: 0 success, 1 failure, 2 usage or configuration error, 75 temporary
    failure (NATS or a registry did not answer: retry), 130 Ctrl-C, 141 output closed.
    """


StateDir = Annotated[
    Path | None,
    typer.Option(
        "--state-dir", metavar="DIR", help="State directory of the stack (default: $SBX_STATE_DIR or .sbx/)."
    ),
]
Json = Annotated[bool, typer.Option("--json", help="Print one JSON object (docs/cli.md).")]


def _run(coro: Coroutine[Any, Any, int]) -> None:
    from shared.infrastructure import logs  # imported here: only the commands that run a loop

    # Library chatter (reconnect attempts while NATS starts) is not for the operator.
    logs.configure(service="sbx", instance=str(os.getpid()), level="error", fmt="console")
    raise typer.Exit(asyncio.run(coro))


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
    host: Annotated[
        str, typer.Option(metavar="ADDRESS", help="Address the gateway listens on.")
    ] = "127.0.0.1",
    port: Annotated[
        int, typer.Option(metavar="PORT", help="Gateway port (0 picks a free one).", min=0, max=65535)
    ] = 8080,
    state_dir: StateDir = None,
    nats_port: Annotated[
        int, typer.Option(metavar="PORT", help="Port of the embedded NATS server.", min=1, max=65535)
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
    json: Json = False,
) -> None:
    """Stop a stack: its running `sbx up` (as Ctrl-C does), or what one that crashed left
    behind. Sessions' sandboxes stop with their files kept; the rest is removed."""
    from sbx import down

    _run(down.run(stack.state_dir(state_dir, os.environ), os.environ, purge=purge, as_json=json))


@app.command("status")
def status_command(state_dir: StateDir = None, json: Json = False) -> None:
    """Health and pid of every service instance, and session counts. Exit 1 if a service is down."""
    from sbx import observe

    local = not os.environ.get("NATS_URL")
    info = stack.StackInfo.read(stack.state_dir(state_dir, os.environ)) if local else None
    _with_stack(state_dir, observe.status, as_json=json, phase=info.phase if info else None)


events_app = typer.Typer(
    help="Print the audit stream (then exit, or keep following it with --follow); export it.",
    **{**_SETTINGS, "no_args_is_help": False},
    invoke_without_command=True,
)
app.add_typer(events_app, name="events")


@events_app.callback()
def events_command(
    ctx: typer.Context,
    session: Annotated[str | None, typer.Option(metavar="ID", help="Only this session's events.")] = None,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new events.")] = False,
    since: Annotated[int, typer.Option(metavar="SEQ", help="Start at this stream sequence.", min=1)] = 1,
    state_dir: StateDir = None,
    json: Annotated[bool, typer.Option("--json", help="One JSON object a line (NDJSON).")] = False,
) -> None:
    """Print the audit stream (then exit, or keep following it with --follow)."""
    if ctx.invoked_subcommand is not None:
        return
    from sbx import observe

    _with_stack(state_dir, observe.follow_events, session=session, follow=follow, as_json=json, since=since)


@events_app.command("export")
def events_export(
    output: Annotated[
        Path | None,
        typer.Option("--output", "-o", metavar="FILE", help="Append to FILE (default: stdout)."),
    ] = None,
    cursor: Annotated[
        Path | None,
        typer.Option(metavar="FILE", help="Resume after the sequence FILE holds; update it as records go."),
    ] = None,
    since_seq: Annotated[
        int, typer.Option("--since-seq", metavar="SEQ", help="Start at this stream sequence.", min=1)
    ] = 1,
    kind: Annotated[
        list[str] | None,
        typer.Option(metavar="KIND", help="Only these kinds (repeat it; default: exec, image, egress)."),
    ] = None,
    all_kinds: Annotated[bool, typer.Option("--all", help="Every event, not only audit records.")] = False,
    state_dir: StateDir = None,
) -> None:
    """Write audit records as JSON lines, from where the last export stopped to the stream's
    end: archive them before retention removes them (SBX_AUDIT_MAX_AGE, SBX_EVENTS_MAX_BYTES)."""
    from sbx import export
    from shared.infrastructure.settings import bus

    kinds = export.kinds_of(kind or [], all_kinds)  # before connecting: a bad kind touches nothing
    _with_stack(
        state_dir,
        export.export,
        kinds=kinds,
        since=since_seq,
        cursor=cursor,
        output=output,
        retention=bus.RetentionSettings.from_env(os.environ),
    )


@app.command("timeline")
def timeline_command(
    session: Annotated[str, typer.Argument(metavar="SESSION", help="The session id.")],
    kind: Annotated[
        list[str] | None,
        typer.Option(metavar="KIND", help="Only lifecycle, command, edit or egress entries (repeat it)."),
    ] = None,
    after: Annotated[int, typer.Option(metavar="SEQ", help="Only entries after this sequence.", min=0)] = 0,
    limit: Annotated[
        int | None, typer.Option(metavar="N", help="At most N entries (default: all).", min=1)
    ] = None,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new entries.")] = False,
    state_dir: StateDir = None,
    json: Annotated[bool, typer.Option("--json", help="One JSON object a line (NDJSON).")] = False,
) -> None:
    """Print what happened to a session and in its sandboxes, in order: lifecycle, commands, edits, egress."""
    from sbx import observe

    _with_stack(
        state_dir,
        observe.show_timeline,
        session=session,
        kinds=kind or [],
        after=after,
        limit=limit,
        follow=follow,
        as_json=json,
    )


@app.command("replay")
def replay_command(
    verify: Annotated[
        bool, typer.Option("--verify", help="Compare (default): exit 0 only if KV equals the fold.")
    ] = False,
    rebuild: Annotated[
        bool, typer.Option("--rebuild", help="Rewrite every projection from the stream.")
    ] = False,
    checkpoint: Annotated[
        bool,
        typer.Option(
            "--checkpoint", help="Store the fold as the new checkpoint (folds only what came since the last)."
        ),
    ] = False,
    full: Annotated[
        bool, typer.Option("--full", help="Fold from the first event, not from the latest checkpoint.")
    ] = False,
    state_dir: StateDir = None,
    json: Json = False,
) -> None:
    """Fold the event stream (from the latest checkpoint) into fresh projections and compare
    with (or rewrite) the live KV, or store the fold as a new checkpoint."""
    if sum((verify, rebuild, checkpoint)) > 1:
        raise exits.fail("choose one of --verify, --rebuild and --checkpoint", exits.USAGE)
    if full and checkpoint:
        raise exits.fail("--full applies to --verify and --rebuild", exits.USAGE)
    from sbx import observe

    mode = "rebuild" if rebuild else "checkpoint" if checkpoint else "verify"
    _with_stack(state_dir, observe.replay_projections, mode=mode, full=full, as_json=json)


@app.command("replicas")
def replicas_command(
    copies: Annotated[
        int, typer.Argument(metavar="COPIES", help="Copies of every stream and bucket (1-5).", min=1, max=5)
    ],
    state_dir: StateDir = None,
    json: Json = False,
) -> None:
    """Change how many copies a NATS cluster keeps of the event stream, the pool stream and
    every bucket (services never change it themselves; SBX_NATS_REPLICAS applies at creation)."""
    from sbx import observe

    _with_stack(state_dir, observe.set_replicas, copies=copies, as_json=json)


image_app = typer.Typer(
    help="Images of the local runtime: pulled from registries, registered, and the built-in default.",
    **_SETTINGS,
)
app.add_typer(image_app, name="image")


def _state(state_dir: Path | None) -> Path:
    return stack.state_dir(state_dir, os.environ)


@image_app.command("pull")
def image_pull(
    reference: Annotated[
        str,
        typer.Argument(
            metavar="REFERENCE", help="An image reference: python:3.12-slim, ghcr.io/org/img:tag, ..."
        ),
    ],
    refresh: Annotated[
        bool, typer.Option(help="Resolve a tag at its registry again even if pulled before.")
    ] = True,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar.")] = False,
    state_dir: StateDir = None,
    json: Json = False,
) -> None:
    """Pull an image into this machine's layer store (registry settings: SBX_REGISTRIES_FILE)."""
    from sbx import images

    env = dict(os.environ)
    _run(images.pull(_state(state_dir), env, reference, refresh=refresh, quiet=quiet, as_json=json))


@image_app.command("list")
def image_list(state_dir: StateDir = None, json: Json = False) -> None:
    """Images here: pulled (reference, digest, size, last used, sandboxes using it),
    registered, and ``default`` (the host's system directories)."""
    from sbx import images

    images.print_listing(images.listing(_state(state_dir), dict(os.environ)), json)


@image_app.command("prune")
def image_prune(
    keep: Annotated[
        str,
        typer.Option(
            metavar="SIZE",
            help="Keep unused images up to this much unpacked (e.g. 20GiB); 0 removes every unused one.",
        ),
    ] = "0",
    state_dir: StateDir = None,
    json: Json = False,
) -> None:
    """Remove pulled images no sandbox uses, least recently used first, and their layers
    no other image has. An image a sandbox uses is never removed."""
    from sbx import images
    from shared.infrastructure.settings import values

    keep_bytes = values.parse_size(keep, name="--keep")
    images.prune(_state(state_dir), dict(os.environ), keep_bytes, as_json=json)


@image_app.command("add")
def image_add(
    name: Annotated[str, typer.Argument(metavar="NAME", help="The name sandboxes ask for.")],
    rootfs: Annotated[
        Path, typer.Argument(metavar="ROOTFS", help="A root filesystem directory (with bin/sh).")
    ],
    state_dir: StateDir = None,
    json: Json = False,
) -> None:
    """Register a root filesystem directory under NAME (used in place, never modified)."""
    from sbx import images

    images.add(_state(state_dir), dict(os.environ), name, rootfs, as_json=json)


@image_app.command("import")
def image_import(
    name: Annotated[str, typer.Argument(metavar="NAME", help="The name sandboxes ask for.")],
    archive: Annotated[
        Path, typer.Argument(metavar="ARCHIVE", help="A `docker save` tar, an OCI layout tar or directory.")
    ],
    state_dir: StateDir = None,
    json: Json = False,
) -> None:
    """Unpack a `docker save` or OCI layout archive and register it under NAME."""
    from sbx import images

    images.import_archive(_state(state_dir), dict(os.environ), name, archive, as_json=json)


# exec, release, route: the agent-host client's commands (sbx_client.cli, the light
# distribution's own `sbx-host`); `sbx.entry` starts them without importing this module.
client_cli.register(app)


# ---- pause, resume: a session's sandbox, for operators (issue 22) ---------------------------


async def _pause_or_resume(nc: Any, topology: Any, *, session: str, pause: bool, as_json: bool) -> int:
    from sbx_client import terminal
    from shared.contract import codec, commands, ids
    from shared.infrastructure import rpc

    kind = commands.PauseSession if pause else commands.ResumeSession
    reply = await rpc.SessionClient(nc, topology).call(
        kind(command_id=ids.new_id(), session_id=session, actor=commands.Actor(via="cli"))
    )
    sandbox = reply.sandbox
    if as_json:
        typer.echo(terminal.json_line({"changed": reply.appended > 0, "sandbox": codec.to_builtins(sandbox)}))
    elif sandbox is not None:
        done = ("paused" if pause else "resumed") if reply.appended else f"already {sandbox.status}"
        typer.echo(terminal.escape(f"{session}: sandbox {sandbox.sandbox_id} {done}"))
    return 0


def _pause_command(session: str, state_dir: Path | None, json: bool, *, pause: bool) -> None:
    from shared.contract import ids

    ids.validate_session_id(session)  # before connecting: a bad id touches nothing
    _with_stack(state_dir, _pause_or_resume, session=session, pause=pause, as_json=json)


@app.command("pause")
def pause_command(session: str, state_dir: StateDir = None, json: Json = False) -> None:
    """Pause SESSION's sandbox: every process frozen, memory kept; its next call resumes it."""
    _pause_command(session, state_dir, json, pause=True)


@app.command("resume")
def resume_command(session: str, state_dir: StateDir = None, json: Json = False) -> None:
    """Resume SESSION's paused sandbox (its next call would too)."""
    _pause_command(session, state_dir, json, pause=False)


# ---- snapshots: take, list, fork, restore (issue 22) -------------------------------------

snapshot_app = typer.Typer(
    help="Snapshots of sessions' files: take, list, show, delete, keep warm, fork sessions, restore one.",
    **_SETTINGS,
)
app.add_typer(snapshot_app, name="snapshot")
SnapshotId = Annotated[str, typer.Argument(metavar="SNAPSHOT", help="A snapshot id.")]
SessionArg = Annotated[str, typer.Argument(metavar="SESSION", help="A session id.")]


def _snapshot_action(state_dir: Path | None, action: str, **kwargs: Any) -> None:
    from sbx import snapshots
    from shared.contract import ids

    for name in ("session", "snapshot_id"):  # before connecting: a bad id touches nothing
        if kwargs.get(name):
            ids.validate_session_id(kwargs[name], what=name.replace("_", " "))
    for sid in kwargs.get("session_ids", ()):
        ids.validate_session_id(sid)
    _with_stack(state_dir, getattr(snapshots, action), **kwargs)


@snapshot_app.command("create")
def snapshot_create(
    session: SessionArg,
    snapshot_id: Annotated[str | None, typer.Option("--id", metavar="ID", help="The snapshot's id.")] = None,
    state_dir: StateDir = None,
    json: Json = False,
) -> None:
    """Snapshot SESSION's files (workspace, installed packages, shell directory and
    exports): its processes frozen while they are copied."""
    _snapshot_action(state_dir, "create", session=session, snapshot_id=snapshot_id, as_json=json)


@snapshot_app.command("list")
def snapshot_list(
    session: Annotated[
        str | None, typer.Option("--session", metavar="SESSION", help="Only this session's.")
    ] = None,
    all_: Annotated[bool, typer.Option("--all", help="Deleted snapshots too.")] = False,
    state_dir: StateDir = None,
    json: Json = False,
) -> None:
    """Snapshots, oldest first (NDJSON with --json)."""
    _snapshot_action(state_dir, "listing", session=session, include_deleted=all_, as_json=json)


@snapshot_app.command("show")
def snapshot_show(snapshot: SnapshotId, state_dir: StateDir = None, json: Json = False) -> None:
    """One snapshot: its session, digest, sizes, layers, parent."""
    _snapshot_action(state_dir, "show", snapshot_id=snapshot, as_json=json)


@snapshot_app.command("delete")
def snapshot_delete(snapshot: SnapshotId, state_dir: StateDir = None, json: Json = False) -> None:
    """Delete SNAPSHOT; sessions forked or restored from it keep their files."""
    _snapshot_action(state_dir, "delete", snapshot_id=snapshot, as_json=json)


@snapshot_app.command("fork")
def snapshot_fork(
    snapshot: SnapshotId,
    count: Annotated[int, typer.Option("--count", "-n", min=1, max=100, help="How many sessions.")] = 1,
    session_ids: Annotated[
        list[str] | None, typer.Option("--session-id", metavar="ID", help="Name the new sessions (repeat).")
    ] = None,
    state_dir: StateDir = None,
    json: Json = False,
) -> None:
    """Create sessions whose sandboxes start from SNAPSHOT (exit 1 if any was not made)."""
    from shared.contract import ids

    wanted = list(session_ids or []) or [f"{snapshot[:90]}-{ids.new_id()[:8]}" for _ in range(count)]
    _snapshot_action(state_dir, "fork", snapshot_id=snapshot, session_ids=wanted, as_json=json)


@snapshot_app.command("warm")
def snapshot_warm(
    snapshot: SnapshotId,
    count: Annotated[
        int, typer.Argument(metavar="COUNT", min=0, max=100, help="Idle sandboxes to keep (0: none).")
    ],
    state_dir: StateDir = None,
    json: Json = False,
) -> None:
    """Keep COUNT idle sandboxes started from SNAPSHOT ready: its forks and restores claim
    one instead of starting one (they count against max_running)."""
    _snapshot_action(state_dir, "warm", snapshot_id=snapshot, count=count, as_json=json)


@snapshot_app.command("restore")
def snapshot_restore(
    session: SessionArg, snapshot: SnapshotId, state_dir: StateDir = None, json: Json = False
) -> None:
    """Put SESSION back to SNAPSHOT: a new sandbox from it replaces the session's."""
    _snapshot_action(state_dir, "restore", session=session, snapshot_id=snapshot, as_json=json)


if __name__ == "__main__":
    from sbx.entry import main

    main()

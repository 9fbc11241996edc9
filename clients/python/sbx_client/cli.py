"""The agent-host commands: ``exec``, ``release`` and ``route`` (typer, like the rest of
``sbx``). ``sbx-host`` is this app alone (what an agent host with only this package has);
the server's ``sbx`` registers the same commands (:func:`register`) and starts them without
importing the rest of its CLI, as they run once per agent tool call.

Exit codes (as the rest of ``sbx``, docs/cli.md): the command's own for ``exec``; 2 a
usage error (or a code dir that cannot be synced); 75 (EX_TEMPFAIL) the gateway said it is
worth retrying; 130 interrupted; 141 the output's reader went away.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ParamSpec

import typer

if TYPE_CHECKING:
    from rich.console import Console

from sbx_client import route as router
from sbx_client import terminal
from sbx_client.sandbox import Sandbox, SyncError
from sbx_client.transport import ApiError

P = ParamSpec("P")
EXIT_USAGE = 2
EXIT_RETRY = 75  # EX_TEMPFAIL: the gateway said it is worth retrying
EXIT_INTERRUPTED = 130
SHOWN = 10

Session = Annotated[
    str, typer.Option("--session", metavar="NAME", help="Calls with the same session share a sandbox.")
]


def exec_command(
    ctx: typer.Context,
    session: Session,
    words: Annotated[
        list[str] | None,
        typer.Argument(metavar="-- COMMAND", help="One shell command line.", show_default=False),
    ] = None,
    keep: Annotated[
        bool,
        typer.Option(
            "--keep", help="Keep the sandbox for later calls (until `release`).", show_default=False
        ),
    ] = False,
    timeout: Annotated[
        float | None,
        typer.Option("--timeout", metavar="SECONDS", help="Seconds before the command is killed."),
    ] = None,
) -> None:
    """Run COMMAND for the current directory's code in the session's sandbox.

    Changed files go up before it; files it created, changed or deleted come back after it.
    Git network commands (push, fetch, pull, clone, ls-remote) run on this host, with its
    credentials (`route` tells where a command runs). Output streams as it comes; the exit
    code is the command's; Ctrl-C stops it in the sandbox. Gateway: SBX_URL, SANDBOX_API_KEY.
    """
    if not words:
        typer.echo(
            f"{ctx.command_path}: no command given ({ctx.command_path} --session NAME -- 'COMMAND')", err=True
        )
        raise typer.Exit(EXIT_USAGE)
    raise typer.Exit(run(" ".join(words), session, keep, timeout, name=ctx.command_path))


def release_command(ctx: typer.Context, session: Session) -> None:
    """Release a session's sandbox kept with `exec --keep`."""
    try:
        had = Sandbox(session=session, keep=True).release()
    except (ApiError, SyncError) as exc:
        typer.echo(terminal.escape(f"{ctx.command_path}: {exc}"), err=True)
        raise typer.Exit(EXIT_USAGE) from None
    typer.echo(terminal.escape(f"released {session}" if had else f"{session} had no sandbox"))


def route_command(
    command: Annotated[
        list[str], typer.Argument(metavar="-- COMMAND", help="The command, e.g. -- 'git push origin HEAD'.")
    ],
    code_dir: Annotated[
        list[Path] | None,
        typer.Option("--code-dir", metavar="DIR", help="A code dir (default: the current directory)."),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object.", show_default=False)] = False,
) -> None:
    """Print where a command would run (host or sandbox) and why."""
    text = " ".join(command)
    cwd = Path.cwd()
    decided = router.route(text, code_dir or [cwd], cwd)
    if as_json:
        import json

        plan = decided.plan
        shown = {
            "where": decided.where,
            "why": decided.why,
            "cwd": str(plan.cwd) if plan else None,
            "segments": [[list(step.argv) for step in segment] for segment in plan.segments] if plan else [],
        }
        typer.echo(json.dumps(shown))
        return
    typer.echo(f"{decided.where}: {decided.why}")
    if decided.plan is not None:
        typer.echo(f"  in {decided.plan.cwd}")
        for segment in decided.plan.segments:
            typer.echo("  run " + " | ".join(" ".join(step.argv) for step in segment))


_EXEC_SETTINGS = {"allow_interspersed_args": False, "help_option_names": ["-h", "--help"]}
_SETTINGS = {"help_option_names": ["-h", "--help"]}
EXIT_PIPE_CLOSED = 141


def guarded(command: Callable[P, None]) -> Callable[P, None]:
    """The command, with Ctrl-C as exit 130 and a closed output as 141 (nothing on stderr)."""

    @functools.wraps(command)
    def run_guarded(*args: P.args, **kwargs: P.kwargs) -> None:
        try:
            command(*args, **kwargs)
        except KeyboardInterrupt:
            raise typer.Exit(EXIT_INTERRUPTED) from None
        except BrokenPipeError:
            devnull = os.open(os.devnull, os.O_WRONLY)  # the interpreter's last flush goes nowhere
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
            raise typer.Exit(EXIT_PIPE_CLOSED) from None

    return run_guarded


def register(app: typer.Typer) -> None:
    """Add ``exec``, ``release`` and ``route`` to ``app``."""
    app.command("exec", context_settings=_EXEC_SETTINGS)(guarded(exec_command))
    app.command("release", context_settings=_SETTINGS)(guarded(release_command))
    app.command("route", context_settings=_SETTINGS)(guarded(route_command))


def run(command: str, session: str, keep: bool, timeout: float | None, name: str = "exec") -> int:
    """``exec``'s work: the exit code to leave with."""
    bar = UploadBar() if sys.stderr.isatty() else None
    try:
        sandbox = Sandbox(session=session, keep=keep, progress=bar)
    except (SyncError, ApiError) as exc:
        print(terminal.escape(f"{name}: {exc}"), file=sys.stderr)
        return EXIT_USAGE
    interrupted = threading.Event()

    def on_interrupt(signum: int, frame: object) -> None:
        if interrupted.is_set():
            raise KeyboardInterrupt  # a second Ctrl-C: stop waiting
        interrupted.set()
        print(
            f"\n{name}: stopping the command in the sandbox (Ctrl-C again to stop waiting)", file=sys.stderr
        )
        threading.Thread(target=sandbox.stop, daemon=True).start()

    def write(stream: str, data: bytes) -> None:
        out = sys.stdout.buffer if stream == "stdout" else sys.stderr.buffer
        out.write(data)
        out.flush()

    previous = signal.signal(signal.SIGINT, on_interrupt)
    code = 1
    try:
        result = sandbox.stream(command, timeout=timeout, output=write)
        code = EXIT_INTERRUPTED if interrupted.is_set() else result.exit_code
        report_refused(result.refused, name=name)
    except (ApiError, SyncError) as exc:
        print(terminal.escape(f"{name}: {exc}"), file=sys.stderr)
        code = EXIT_RETRY if isinstance(exc, ApiError) and exc.retriable else EXIT_USAGE
    except KeyboardInterrupt:
        code = EXIT_INTERRUPTED
    except BrokenPipeError:
        code = EXIT_PIPE_CLOSED  # our output's reader went away (128 + SIGPIPE, as a shell reports it)
    finally:
        signal.signal(signal.SIGINT, previous)
        if bar is not None:
            bar.close()
        try:
            sandbox.close()
        except (ApiError, OSError) as exc:
            print(terminal.escape(f"{name}: could not release the sandbox: {exc}"), file=sys.stderr)
    return code


class UploadBar:
    """A progress bar on stderr (rich, transient) for an upload worth waiting for: a first
    sync of a large code dir. Smaller ones show nothing."""

    MIN_BYTES = 8 * 1024 * 1024

    def __init__(self, console: Console | None = None) -> None:
        self.console = console
        self.bar: Any = None
        self.task: Any = None

    def __call__(self, what: str, sent: int, total: int) -> None:
        if self.bar is None:
            if total < self.MIN_BYTES or sent >= total:
                return
            from rich import console, progress

            self.bar = progress.Progress(
                progress.TextColumn("syncing up {task.description}"),
                progress.BarColumn(),
                progress.DownloadColumn(),
                progress.TransferSpeedColumn(),
                console=self.console or console.Console(stderr=True),
                transient=True,
            )
            self.bar.start()
            self.task = self.bar.add_task(Path(what).name, total=total)
        self.bar.update(self.task, completed=sent)
        if sent >= total:
            self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


def report_refused(refused: list[tuple[str, str]], shown: int = SHOWN, name: str = "exec") -> None:
    """What did not come back: changes inside .git are counted, the rest listed (up to ``shown``)."""
    kept = "stays as the host has it"
    inside_git = [path for path, why in refused if kept in why]
    others = [(path, why) for path, why in refused if kept not in why]
    for path, why in others[:shown]:
        print(terminal.escape(f"{name}: not brought back: {path or '(all)'}: {why}"), file=sys.stderr)
    if len(others) > shown:
        print(f"{name}: ... and {len(others) - shown} more not brought back", file=sys.stderr)
    if inside_git:
        print(
            f"{name}: {len(inside_git)} change(s) inside .git (config, hooks, info, ...) stay as the host "
            "has them: only history and the index come back",
            file=sys.stderr,
        )


app = typer.Typer(
    name="sbx-host",
    help="The agent-host client: run commands in a session's sandbox with this host's code.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain help, as sbx's (rich's panels show flags as "<bool>")
    context_settings=_SETTINGS,
)
register(app)


def main(prog: str = "sbx-host") -> None:
    app(prog_name=prog)

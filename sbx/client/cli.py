"""``sbx exec`` and ``sbx release``: the agent-host client's command line (argparse, so
it starts fast; see :mod:`sbx.entry`)."""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from sbx.client.sandbox import Sandbox, SyncError
from sbx.client.transport import ApiError

EXIT_USAGE = 2
EXIT_RETRY = 75  # EX_TEMPFAIL: the gateway said it is worth retrying
EXIT_INTERRUPTED = 130
SHOWN = 10


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sbx", description="The agent-host client.")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser(
        "exec",
        help="Run COMMAND in the session's sandbox",
        description=(
            "Run COMMAND for the current directory's code (the repository it is in) in the session's "
            "sandbox: changed files go up before it, files it created, changed or deleted come back after "
            "it. Git network commands (push, fetch, pull, clone, ls-remote) run on this host, with its "
            "credentials (`sbx route` tells where a command runs). Output streams as it comes; the exit "
            "code is the command's; Ctrl-C stops it in the sandbox. Gateway: SBX_URL, SANDBOX_API_KEY."
        ),
    )
    run.add_argument("--session", required=True, help="Calls with the same session share a sandbox")
    run.add_argument(
        "--keep", action="store_true", help="Keep the sandbox for later calls (until `sbx release`)"
    )
    run.add_argument("--timeout", type=float, default=None, help="Seconds before the command is killed")
    run.add_argument("words", nargs=argparse.REMAINDER, help="-- COMMAND (one shell command line)")
    release = commands.add_parser("release", help="Release a session's sandbox kept with --keep")
    release.add_argument("--session", required=True)
    return parser


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.command == "release":
        return _release(args.session)
    words = args.words[1:] if args.words[:1] == ["--"] else args.words
    if not words:
        print("sbx exec: no command given (sbx exec --session NAME -- 'COMMAND')", file=sys.stderr)
        return EXIT_USAGE
    return _exec(" ".join(words), args.session, args.keep, args.timeout)


def _exec(command: str, session: str, keep: bool, timeout: float | None) -> int:
    try:
        sandbox = Sandbox(session=session, keep=keep)
    except (SyncError, ApiError) as exc:
        print(f"sbx exec: {exc}", file=sys.stderr)
        return EXIT_USAGE
    interrupted = threading.Event()

    def on_interrupt(signum: int, frame: object) -> None:
        if interrupted.is_set():
            raise KeyboardInterrupt  # a second Ctrl-C: stop waiting
        interrupted.set()
        print(
            "\nsbx exec: stopping the command in the sandbox (Ctrl-C again to stop waiting)", file=sys.stderr
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
        report_refused(result.refused)
    except (ApiError, SyncError) as exc:
        print(f"sbx exec: {exc}", file=sys.stderr)
        code = EXIT_RETRY if isinstance(exc, ApiError) and exc.retriable else EXIT_USAGE
    except KeyboardInterrupt:
        code = EXIT_INTERRUPTED
    finally:
        signal.signal(signal.SIGINT, previous)
        try:
            sandbox.close()
        except (ApiError, OSError) as exc:
            print(f"sbx exec: could not release the sandbox: {exc}", file=sys.stderr)
    return code


def report_refused(refused: list[tuple[str, str]], shown: int = SHOWN) -> None:
    """What did not come back: changes inside .git are counted, the rest listed (up to ``shown``)."""
    kept = "stays as the host has it"
    inside_git = [path for path, why in refused if kept in why]
    others = [(path, why) for path, why in refused if kept not in why]
    for path, why in others[:shown]:
        print(f"sbx exec: not brought back: {path or '(all)'}: {why}", file=sys.stderr)
    if len(others) > shown:
        print(f"sbx exec: ... and {len(others) - shown} more not brought back", file=sys.stderr)
    if inside_git:
        print(
            f"sbx exec: {len(inside_git)} change(s) inside .git (config, hooks, info, ...) stay as the host "
            "has them: only history and the index come back",
            file=sys.stderr,
        )


def _release(session: str) -> int:
    try:
        had = Sandbox(session=session, keep=True).release()
    except (ApiError, SyncError) as exc:
        print(f"sbx release: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(f"released {session}" if had else f"{session} had no sandbox")
    return 0

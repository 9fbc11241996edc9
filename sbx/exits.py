"""Exit codes of every ``sbx`` command, and the one place where an error, Ctrl-C or a
closed pipe becomes one of them (listed in docs/cli.md).

Every error is one line on stderr (``sbx: error: ...``), never a traceback.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

import typer

from sbx_api import errors
from sbx_client import terminal

OK = 0
FAILURE = 1
"""The command ran and the answer is no (a service is down, projections differ), or the
work failed (an image the registry refused, a stack that did not stop)."""
USAGE = 2
"""The command line or the configuration is wrong: an unknown option, a bad value, no
stack to talk to, a bad setting, a state dir another ``sbx up`` holds. Fix, then retry."""
TEMPFAIL = 75
"""EX_TEMPFAIL: something the command needs did not answer (NATS unreachable, a timeout,
a registry down): worth retrying as is, later. ``sbx exec`` uses it the same way."""
INTERRUPTED = 130
"""128 + SIGINT: stopped by Ctrl-C."""
PIPE_CLOSED = 141
"""128 + SIGPIPE: the reader of the output went away (``sbx events | head -1``), as for
any Unix tool a closed pipe stops."""

_USAGE_ERRORS = (errors.ConfigError, errors.InvalidInput, errors.Conflict)


def of_error(exc: errors.SandboxError) -> int:
    """The exit code for a failure the command could name."""
    if exc.retriable:
        return TEMPFAIL
    if isinstance(exc, _USAGE_ERRORS) and not isinstance(exc, errors.ImageUnavailable):
        return USAGE
    return FAILURE


def fail(message: str, code: int = FAILURE) -> typer.Exit:
    """Say ``message`` on stderr; the exception to raise to exit with ``code``."""
    with contextlib.suppress(OSError):  # stderr closed too: the exit code still says it
        print(f"sbx: error: {terminal.escape(message)}", file=sys.stderr, flush=True)
    return typer.Exit(code)


def _silence_stdout() -> None:
    """Later writes (the interpreter's last flush) go nowhere instead of failing again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _nats_code(exc: Exception) -> int | None:
    """The exit code for an error of the NATS client, or None if it is not one. (Looked up
    only if loaded: the commands that never talk to NATS never import it.)"""
    nats_errors = sys.modules.get("nats.errors")
    if nats_errors is None or not isinstance(exc, nats_errors.Error):
        return None
    unanswered = (nats_errors.TimeoutError, nats_errors.NoServersError, nats_errors.ConnectionClosedError)
    return TEMPFAIL if isinstance(exc, unanswered) else FAILURE


@contextlib.contextmanager
def guard() -> Iterator[None]:
    """Around every command: its errors become a line on stderr and an exit code."""
    try:
        yield
    except errors.SandboxError as exc:
        raise fail(exc.message, of_error(exc)) from None
    except KeyboardInterrupt:
        raise typer.Exit(INTERRUPTED) from None
    except BrokenPipeError:
        _silence_stdout()
        raise typer.Exit(PIPE_CLOSED) from None
    except Exception as exc:
        code = _nats_code(exc)
        if code is None:
            raise  # a bug: its traceback is what a report needs
        raise fail(f"NATS: {type(exc).__name__}: {exc}", code) from None

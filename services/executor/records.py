"""What an executor call's audit record says (pure): which calls are audited, the text,
path and size a record carries, the outcome it names, and the reply of a call whose
record could not be written (audit fails closed)."""

from __future__ import annotations

from sbx_api import errors
from shared.contract import commands, execution

AUDIT_COMMAND_MAX = 4096
"""Characters of a command's text an audit record keeps."""


def outcome(request: execution.Request, reply: execution.Reply) -> str:
    """The outcome a finished call's record names."""
    if reply.error is not None and reply.error.code == errors.Cancelled.code:
        return "cancelled"
    if not reply.ok:
        return "error"
    if reply.timed_out:
        return "timeout"
    return "started" if isinstance(request, execution.ShellAsync) else "ok"


def described(request: execution.Request) -> tuple[str, str | None, int | None]:
    """What a call's audit record says it did: its command text (at most
    :data:`AUDIT_COMMAND_MAX` characters), the path it edited and the size written."""
    path: str | None = None
    size: int | None = None
    match request:
        case execution.Shell() | execution.ShellAsync() | execution.Run():
            what = request.command
        case execution.Edit():
            what = f"{request.command} {request.path}"
            path = request.path
            text = {"create": request.file_text, "str_replace": request.new_str}.get(
                request.command, request.insert_text
            )
            size = len(text.encode()) if text is not None else None
        case execution.ShellStop():
            what = f"stop {request.job_id}"
        case execution.ShellInput():
            given = "close input of" if request.close else f"{len(request.data)} bytes of input to"
            what = f"{given} {request.job_id}"
        case execution.ShellSignal():
            what = f"signal {request.signal} {request.job_id}"
        case execution.PutFiles():
            what = f"put into {request.root}" + (f", {len(request.delete)} deleted" if request.delete else "")
        case execution.GetFiles():
            what = f"get from {request.root}"
        case execution.ReadFile() | execution.WriteFile():
            what = f"{'read' if isinstance(request, execution.ReadFile) else 'write'} {request.path}"
            path = request.path
        case execution.Watch():
            what = f"watch {request.action} {request.path or request.watcher_id}"
            path = request.path or None
        case execution.WatchDir():
            what = f"watch {request.path}"
            path = request.path
        case execution.Files():
            what = f"{request.action} {request.path}" + (
                f" to {request.destination}" if request.destination is not None else ""
            )
            path = request.path
        case _:
            what = ""
    return what[:AUDIT_COMMAND_MAX], path, size


def acts(request: execution.Request) -> bool:
    """Whether the request does something in the sandbox (audited), not only reads a job."""
    return not isinstance(
        request,
        execution.ShellPoll
        | execution.ShellWait
        | execution.ShellJobs
        | execution.ShellFollow
        | execution.SandboxUsage,
    ) and not (isinstance(request, execution.Watch) and request.action == "poll")


def active(request: execution.Request) -> bool:
    """Whether the call counts as the session's activity (the idle rule's clock): every
    tool call does, not a usage reading (a dashboard polling it must not keep a sandbox
    from its idle pause)."""
    return not isinstance(request, execution.SandboxUsage)


def unaudited(reply: execution.Reply, problem: str) -> execution.Reply:
    """Audit fails closed: a call whose record could not be written is reported as an
    error (saying what ran, so the caller does not run it again blindly)."""
    did = f"it ran (exit code {reply.exit_code})" if reply.ok and reply.exit_code is not None else "it ran"
    return execution.Reply(
        ok=False,
        error=commands.ErrorInfo(
            "infrastructure",
            f"{did}, but its audit record could not be written ({problem[:200]}); "
            "its result is withheld until the event store accepts records again",
        ),
    )

"""Commands (what a caller asks for) and the reply every command gets.

Commands travel by NATS request/reply to the service that owns the decision.
``command_id`` makes them idempotent: a redelivered or retried command with the
same id leads to at most one transition.
"""

from __future__ import annotations

from datetime import datetime

import msgspec

from shared.contract import states


class Actor(msgspec.Struct, frozen=True, kw_only=True):
    """Who asked, recorded on the events the command causes."""

    via: str = "rest"
    """The surface the request came through: ``rest``, ``mcp`` or ``cli``."""
    org_id: str | None = None
    user_id: str | None = None


class Command(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    command_id: str
    correlation_id: str | None = None
    actor: Actor = Actor()


class CreateSession(Command, frozen=True, kw_only=True, tag="session.create"):
    session_id: str
    image: str | None = None


class StopSession(Command, frozen=True, kw_only=True, tag="session.stop"):
    session_id: str
    reason: str = "requested"
    """Why (``requested``, ``idle``, ``lifetime``): recorded on the event."""
    if_last_seq: int | None = None
    """Only if the session is still as the sender saw it (its ``last_seq``); else a no-op.
    The reaper sets it, so a session used since its snapshot is not stopped."""


class DeleteSession(Command, frozen=True, kw_only=True, tag="session.delete"):
    session_id: str
    reason: str = "requested"
    """Why (``requested``, ``retention``, ``max_stopped``): recorded on the event."""
    if_last_seq: int | None = None
    """As for ``StopSession``: a no-op if the session changed since the sender looked."""


class EnsureSession(Command, frozen=True, kw_only=True, tag="session.ensure"):
    """Get-or-create: make sure the session exists and has a running sandbox (MCP first use)."""

    session_id: str
    image: str | None = None
    metadata: dict[str, str] = {}
    """Kept on a session this creates (ignored for an existing one): the caller's labels."""
    env: dict[str, str] = {}
    """Kept on a session this creates: environment variables for the commands run in it."""
    end_at: datetime | None = None
    """Kept on a session this creates: when the reaper deletes it (``None``: lifetimes only)."""


class ProvisionSandbox(Command, frozen=True, kw_only=True, tag="session.provision"):
    """``create_sandbox``: (re-)provision the session's sandbox with these options; an
    existing sandbox is deleted first (its workspace with it)."""

    session_id: str
    image: str | None = None
    use_kata: bool = False
    run_as_root: bool = True
    writable_root: bool = True


class ClearSession(Command, frozen=True, kw_only=True, tag="session.clear"):
    """``clear_session``: delete the sandbox and workspace; unknown sessions are fine."""

    session_id: str


class PauseSession(Command, frozen=True, kw_only=True, tag="session.pause"):
    """Freeze every process of the session's running sandbox (memory kept); its next call,
    or ``session.resume``, resumes it. Already paused: nothing changes."""

    session_id: str
    reason: str = "requested"
    """Why (``requested``, ``idle``): recorded on ``sandbox.paused``."""
    if_last_seq: int | None = None
    """As for ``StopSession``: a no-op if the session changed since the sender looked."""
    quiet_since: datetime | None = None
    """The session's last call as the sender saw it (the reaper): a call after this, seen
    once the sandbox is frozen, resumes it at once (``sandbox.resumed``, ``activity``)."""
    unless_jobs: bool = False
    """Leave it running while one of its async jobs runs (the reaper's idle pause)."""


class ResumeSession(Command, frozen=True, kw_only=True, tag="session.resume"):
    """Let the session's paused sandbox run again. Running already: nothing changes. It
    never starts a stopped one (a download resumes a paused sandbox with it)."""

    session_id: str
    reason: str = "requested"
    """Why (``requested``: an operator; ``call``: a host API download): on ``sandbox.resumed``."""


class HibernateSession(Command, frozen=True, kw_only=True, tag="session.hibernate"):
    """Stop the session's running or paused sandbox, its files kept, while the session stays
    active (the reaper, after a longer idle): its next call starts it again. Stopped
    already: nothing changes."""

    session_id: str
    reason: str = "idle"
    if_last_seq: int | None = None
    """As for ``StopSession``: a no-op if the session changed since the sender looked."""
    quiet_since: datetime | None = None
    """The session's last call as the sender saw it: a later call leaves it running."""
    unless_jobs: bool = False
    """Leave it running while one of its async jobs runs."""


class SnapshotSession(Command, frozen=True, kw_only=True, tag="session.snapshot"):
    """Take a snapshot of the session's sandbox files (``snapshot.created``): its processes
    are frozen while they are copied. ``snapshot_id`` is chosen by the sender (the same
    id again: the same snapshot)."""

    session_id: str
    snapshot_id: str


class ForkSession(Command, frozen=True, kw_only=True, tag="session.fork"):
    """Create session ``session_id`` (a new id) whose sandbox starts from a snapshot."""

    session_id: str
    snapshot_id: str
    metadata: dict[str, str] = {}
    env: dict[str, str] = {}
    end_at: datetime | None = None
    """As for ``EnsureSession``: kept on the session the fork creates."""


class SetDeadline(Command, frozen=True, kw_only=True, tag="session.deadline"):
    """Move the time at which the reaper deletes the session (``None``: no deadline)."""

    session_id: str
    end_at: datetime | None


class RestoreSession(Command, frozen=True, kw_only=True, tag="session.restore"):
    """Give the session a new sandbox that starts from a snapshot (the session's files go
    back to the snapshot's); its current sandbox is deleted, its processes with it."""

    session_id: str
    snapshot_id: str
    own: bool = False
    """Only a snapshot of this session (an agent's own checkpoints, over MCP)."""


class DeleteSnapshot(Command, frozen=True, kw_only=True, tag="snapshot.delete"):
    """Delete a snapshot (``session_id``: the session it was taken of). Sandboxes started
    from it keep its files."""

    session_id: str
    snapshot_id: str
    reason: str = "requested"


class WarmSnapshot(Command, frozen=True, kw_only=True, tag="snapshot.warm"):
    """Keep ``count`` idle sandboxes started from the snapshot ready (0: none), so its forks
    and restores claim one instead of starting one (``session_id``: the session it was
    taken of)."""

    session_id: str
    snapshot_id: str
    count: int


SnapshotCommand = SnapshotSession | ForkSession | RestoreSession | DeleteSnapshot | WarmSnapshot

SessionCommand = (
    CreateSession
    | StopSession
    | DeleteSession
    | EnsureSession
    | ProvisionSandbox
    | ClearSession
    | PauseSession
    | ResumeSession
    | HibernateSession
    | SnapshotSession
    | ForkSession
    | RestoreSession
    | DeleteSnapshot
    | WarmSnapshot
    | SetDeadline
)
COMMAND_TYPES: tuple[type[Command], ...] = (
    CreateSession,
    StopSession,
    DeleteSession,
    EnsureSession,
    ProvisionSandbox,
    ClearSession,
    PauseSession,
    ResumeSession,
    HibernateSession,
    SnapshotSession,
    ForkSession,
    RestoreSession,
    DeleteSnapshot,
    WarmSnapshot,
    SetDeadline,
)


class ErrorInfo(msgspec.Struct, frozen=True):
    code: str
    message: str


class CommandReply(msgspec.Struct, frozen=True, kw_only=True):
    """What the deciding service answers. Exactly one of ``session``/``error`` is set
    on success/failure (``session`` may be ``None`` after a delete)."""

    ok: bool
    appended: int = 0
    """How many events this command appended (0 when it was a duplicate or a no-op)."""
    session: states.SessionState | None = None
    error: ErrorInfo | None = None
    sandbox: states.SandboxState | None = None
    """The session's sandbox as the command left it (``session.pause``/``session.resume``)."""
    snapshot: states.SnapshotState | None = None
    """The snapshot a snapshot command made or deleted."""

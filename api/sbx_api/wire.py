"""The REST API's answers (``/v1/sessions``, ``/healthz``, every error's body): what the
gateway writes and the clients read. The gateway's OpenAPI document is generated from
these (with its request bodies, which stay with the server's checks)."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

import msgspec

SessionStatus = Literal["active", "stopped", "deleted"]


class Session(msgspec.Struct, kw_only=True):
    session_id: str
    status: SessionStatus
    image: str | None
    org_id: str | None
    user_id: str | None
    created_at: datetime
    updated_at: datetime
    incarnation: int
    """1 for the first life of this id, +1 each time it is created again after deletion."""
    version: int
    """Number of events recorded for this id."""
    forked_from: str | None
    """The snapshot this session was forked from (null: it was not)."""


class SessionList(msgspec.Struct, kw_only=True):
    sessions: list[Session]
    count: int
    """How many sessions matched, on every page (``sessions`` holds at most ``limit``)."""
    next_cursor: str | None = None
    """Pass as ``cursor`` (same filters) for the next page; None: this is the last."""


SnapshotStatus = Literal["ready", "deleted"]


class Snapshot(msgspec.Struct, kw_only=True):
    """An immutable, consistent copy of a session's sandbox files: ``/workspace``, its
    copy-on-write root (installed packages), the shell's directory and exported variables.
    Not its processes: a fork or restore starts a new shell there."""

    snapshot_id: str
    status: SnapshotStatus
    """``deleted``: no new fork or restore can use it (sessions made from it keep its files)."""
    session_id: str
    """The session it was taken of."""
    org_id: str | None
    user_id: str | None
    digest: str
    """``sha256:…`` of its content: equal files, equal digest."""
    parent: str | None
    """The snapshot its session's sandbox started from (a fork's, a restored session's)."""
    size: int
    """Bytes it added to the snapshot store (0: an equal copy was there already)."""
    total_size: int
    """Bytes a fork of it shows (its layers and its parents')."""
    files: int
    """Files, directories and links it added."""
    layers: int
    """How many layers it is made of (one per snapshot in its line, itself included)."""
    image: str
    frozen_ms: float
    """How long the sandbox's processes were frozen while its files were copied."""
    created_at: datetime
    delete_reason: str | None
    """Why it was deleted (``requested``, ``retention``), while ``deleted``."""
    warm: int = 0
    """Idle sandboxes started from it kept ready (``PUT /v1/snapshots/{id}/warm``): a fork or
    restore claims one (milliseconds) instead of starting one."""
    warm_ready: int = 0
    """Of those, how many are ready now."""


class SnapshotList(msgspec.Struct, kw_only=True):
    snapshots: list[Snapshot]
    count: int
    """How many snapshots matched, on every page (``snapshots`` holds at most ``limit``)."""
    next_cursor: str | None = None
    """Pass as ``cursor`` (same filters) for the next page; None: this is the last."""


class ForkFailure(msgspec.Struct, kw_only=True):
    session_id: str
    error: str
    message: str


class Forks(msgspec.Struct, kw_only=True):
    """The sessions a fork made, each with its own sandbox started from the snapshot."""

    snapshot_id: str
    sessions: list[Session]
    failed: list[ForkFailure]
    """Forks that were not made (e.g. ``limit_exceeded`` at ``max_running``), each said why."""


class Problem(msgspec.Struct, kw_only=True):
    """Every error response."""

    error: str
    """Stable machine-readable code (``invalid_input``, ``not_found``, ``conflict``...)."""
    message: str
    status: int
    retriable: bool = False


class Health(msgspec.Struct, kw_only=True):
    status: Literal["ok", "starting", "draining"]
    instance: str
    version: str


TimelineKind = Literal["lifecycle", "command", "edit", "egress"]
TIMELINE_KINDS: tuple[TimelineKind, ...] = ("lifecycle", "command", "edit", "egress")


class EgressConnection(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A connection the sandbox made through its proxy (``connections`` > 1: several
    aggregated, same destination and verdict). Never a header, a path or a secret."""

    host: str | None = None
    port: int | None = None
    verdict: str
    """``tunnelled``, ``intercepted`` (a rule added its credential), ``forwarded`` (plain
    HTTP), ``refused`` or ``empty``."""
    rule: str | None = None
    reason: str | None = None
    """Why it was refused (``private_address``, ``host_mismatch``...)."""
    detail: str | None = None
    started: datetime
    duration_ms: int = 0
    requests: int = 0
    injected: int = 0
    """Requests that got a credential."""
    refused: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    connections: int = 1


class TimelineEntry(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One thing that happened to a session or in its sandbox, from one event of the
    audit stream (``seq`` is its position there: entries are in ``seq`` order)."""

    seq: int
    time: datetime
    kind: TimelineKind
    """``lifecycle`` (the session's and its sandboxes' transitions), ``command`` (a tool
    call or host API operation that ran something), ``edit`` (a file edit) or ``egress``
    (connections through the proxy, one batch)."""
    type: str
    """The event's type (``session.created``, ``sandbox.started``, ``exec.completed``...)."""
    summary: str
    """One line for people."""
    sandbox_id: str | None = None
    org_id: str | None = None
    user_id: str | None = None
    request_id: str | None = None
    """The request that caused it (X-Request-Id or the gateway's own)."""
    tool: str | None = None
    """What ran: ``shell``, ``shell_async``, ``edit``, ``run``, ``put_files``... (commands, edits)."""
    command: str | None = None
    """The command text (cut at 4 KiB), or what an edit or transfer did."""
    exit_code: int | None = None
    duration_ms: int | None = None
    outcome: str | None = None
    """``ok``, ``timeout``, ``error``, ``cancelled`` or ``started``."""
    error: str | None = None
    """The error code when the outcome is ``error``."""
    path: str | None = None
    """The file an edit touched."""
    operation: str | None = None
    """An edit's operation: ``create``, ``str_replace``, ``insert``."""
    size: int | None = None
    """Bytes an edit wrote (the new text)."""
    connections: list[EgressConnection] | None = None
    """Egress entries: the connections of the batch, in the order they closed."""
    lost: int | None = None
    """Egress entries: connections the proxy could not record (too many at once)."""
    incarnation: int | None = None
    """Which life of the session id it is of (1, then +1 each time the id is created again
    after a deletion; as ``Session.incarnation``). A key bound to an organisation sees only
    the incarnations its organisation created; the operator's key sees every one."""


class Timeline(msgspec.Struct, kw_only=True):
    """A page of a session's timeline."""

    session_id: str
    entries: list[TimelineEntry]
    next_after: int
    """Pass as ``after`` for the next page (the last entry's ``seq``, or the ``after`` given)."""
    more: bool
    """Whether entries after this page existed when it was read."""

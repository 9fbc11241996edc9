"""Every event type: immutable, tagged, versioned, carrying who caused it and when.

Rules (see docs/events.md, generated from this module):

* The ``type`` tag of a class is its stable wire name; renaming the class never
  changes it, and a tag is never reused for a different meaning.
* ``v`` is the schema version of that type. Adding a field with a default is
  compatible and keeps ``v``. Removing, renaming or retyping a field bumps ``v``
  and registers an upcaster in :mod:`shared.contract.codec` from the old shape.
* Unknown fields are ignored when decoding, so older readers survive newer
  optional fields.
"""

from __future__ import annotations

from datetime import datetime
from typing import ClassVar

import msgspec

from shared.contract import subjects


class Meta(msgspec.Struct, frozen=True, kw_only=True):
    """Causation and attribution, on every event."""

    event_id: str
    """Unique id of this event (32 hex characters)."""
    time: datetime
    """When the deciding service produced it (UTC)."""
    service: str
    """The service that appended it."""
    instance: str
    """The service instance that appended it."""
    command_id: str | None = None
    """The command that caused it (also its de-duplication key)."""
    correlation_id: str | None = None
    """The request that started the chain (the gateway's request id)."""
    org_id: str | None = None
    user_id: str | None = None
    session_id: str | None = None


class Event(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    """Base of every event. Subclasses set ``tag=`` and ``kind``."""

    kind: ClassVar[str]
    v: int = 1
    """Schema version of this event type."""
    meta: Meta


# ---- sessions ----------------------------------------------------------------


class SessionEvent(Event, frozen=True, kw_only=True):
    kind: ClassVar[str] = subjects.SESSION
    session_id: str

    @property
    def aggregate_id(self) -> str:
        return self.session_id


class SessionCreated(SessionEvent, frozen=True, kw_only=True, tag="session.created"):
    """A session id was registered (first use, or again after it was deleted): an incarnation
    starts, whose history (until its ``session.deleted``) only ``org_id`` and the operator see."""

    image: str | None = None
    """Image the session's sandbox should use; ``None`` means the default."""
    org_id: str | None = None
    user_id: str | None = None
    forked_from: str | None = None
    """The snapshot it was forked from (its sandbox starts with that snapshot's files)."""
    metadata: dict[str, str] = {}
    """The creator's labels (E2B ``metadata``): listed and filtered on, never interpreted."""
    env: dict[str, str] = {}
    """Environment variables for commands run in the session (E2B ``envVars``)."""
    end_at: datetime | None = None
    """When the reaper deletes the session (E2B ``timeout``); ``None``: lifetimes only."""


class SessionDeadlineSet(SessionEvent, frozen=True, kw_only=True, tag="session.deadline_set"):
    """The time at which the reaper deletes the session moved (``None``: no deadline)."""

    end_at: datetime | None = None


class SessionStopped(SessionEvent, frozen=True, kw_only=True, tag="session.stopped"):
    """The session was stopped; it keeps its record until deleted."""

    reason: str = "requested"


class SessionDeleted(SessionEvent, frozen=True, kw_only=True, tag="session.deleted"):
    """The session was deleted; the id may be created again as a new incarnation."""

    reason: str = "requested"


class SessionResumed(SessionEvent, frozen=True, kw_only=True, tag="session.resumed"):
    """A stopped session was used again: it is active, with the same sandbox and workspace."""


class SessionSandboxAssigned(SessionEvent, frozen=True, kw_only=True, tag="session.sandbox_assigned"):
    """The session now runs in this sandbox."""

    sandbox_id: str
    image: str


class SessionSandboxReleased(SessionEvent, frozen=True, kw_only=True, tag="session.sandbox_released"):
    """The session's sandbox was taken away (re-provisioning); its workspace is gone."""

    sandbox_id: str
    reason: str = "reprovision"


# ---- sandboxes ---------------------------------------------------------------


class SandboxEvent(Event, frozen=True, kw_only=True):
    kind: ClassVar[str] = subjects.SANDBOX
    sandbox_id: str

    @property
    def aggregate_id(self) -> str:
        return self.sandbox_id


class SandboxRequested(SandboxEvent, frozen=True, kw_only=True, tag="sandbox.requested"):
    """Recorded before the runtime is asked, so a crash mid-provisioning leaves a trace."""

    session_id: str | None = None
    image: str = "default"
    run_as_root: bool = True
    writable_root: bool = True
    use_kata: bool = False
    backend: str = "local"
    pool: str | None = None
    """The warm pool this sandbox is made for (then ``session_id`` is None until claimed)."""
    cache_org: str | None = None
    """The organisation whose package cache it shows from its start (an organisation's
    pool or session, where the runtime has caches); else shown on a session's first call
    (``sandbox.cache_attached``) where the runtime can, or never."""
    snapshot: str | None = None
    """The snapshot it starts from (a fork, or a restore): its files shown read-only below
    the sandbox's own writes."""


class SandboxClaimed(SandboxEvent, frozen=True, kw_only=True, tag="sandbox.claimed"):
    """A warm pool sandbox was taken by a session (a CAS on the sandbox: one claim wins)."""

    session_id: str


class SandboxRefused(SandboxEvent, frozen=True, kw_only=True, tag="sandbox.refused"):
    """A sandbox was not made because a limit was reached; the requester got a retriable error."""

    session_id: str | None = None
    reason: str
    running: int = 0
    limit: int = 0


class SandboxLost(SandboxEvent, frozen=True, kw_only=True, tag="sandbox.lost"):
    """The self-healing sweep found the record's runtime resources gone."""

    reason: str = "missing from the runtime"


class SandboxStarted(SandboxEvent, frozen=True, kw_only=True, tag="sandbox.started"):
    """The runtime reports the sandbox running."""

    image_digest: str | None = None
    """The manifest digest of the image it runs (a tag resolved once, when it was made),
    where the runtime knows it."""


class SandboxStopped(SandboxEvent, frozen=True, kw_only=True, tag="sandbox.stopped"):
    """Every process in it was stopped; its workspace is kept."""

    reason: str = "requested"
    """``requested``; ``lost`` (the runtime lost it while it ran); ``retired`` (an idle pool
    sandbox its pool no longer wants, deleted next)."""


class SandboxDeleted(SandboxEvent, frozen=True, kw_only=True, tag="sandbox.deleted"):
    """The sandbox and its workspace are gone."""

    reason: str = "requested"


class SandboxFailed(SandboxEvent, frozen=True, kw_only=True, tag="sandbox.failed"):
    """The runtime could not create or start it."""

    error: str


class SandboxPaused(SandboxEvent, frozen=True, kw_only=True, tag="sandbox.paused"):
    """Every process in it was frozen (memory kept, no CPU time); the session's next call
    resumes it. ``reason``: ``idle`` (the reaper) or ``requested`` (an operator)."""

    reason: str = "requested"


class SandboxResumed(SandboxEvent, frozen=True, kw_only=True, tag="sandbox.resumed"):
    """Its processes run again, as they were. ``reason``: ``call`` (the session's next
    call), ``requested`` (an operator) or ``activity`` (a call came while it was being
    paused)."""

    reason: str = "requested"


class SandboxProxyAssigned(SandboxEvent, frozen=True, kw_only=True, tag="sandbox.proxy_assigned"):
    """The sandbox's traffic now goes to this proxy of the fleet (``reason``: ``new`` for a
    first assignment, ``reassigned`` when its proxy died or was drained)."""

    proxy_id: str
    reason: str = "new"


class SandboxCacheAttached(SandboxEvent, frozen=True, kw_only=True, tag="sandbox.cache_attached"):
    """The organisation's package cache now shows in the sandbox (``/.sbx/cache``):
    shared by that organisation's sandboxes, never another's."""

    session_id: str
    org_id: str


# ---- proxies -------------------------------------------------------------------


class ProxyEvent(Event, frozen=True, kw_only=True):
    kind: ClassVar[str] = subjects.PROXY
    proxy_id: str

    @property
    def aggregate_id(self) -> str:
        return self.proxy_id


class ProxyStarted(ProxyEvent, frozen=True, kw_only=True, tag="proxy.started"):
    """A credential proxy of the fleet runs and accepts sandboxes' connections."""

    backend: str = "local"
    endpoint: str
    """Where it listens (local: ``address:port``)."""


class ProxyDraining(ProxyEvent, frozen=True, kw_only=True, tag="proxy.draining"):
    """Taken out of service: its sandboxes move to other proxies now, open connections
    continue, and it is stopped after the drain period."""

    reason: str = "scale-down"


class ProxyStopped(ProxyEvent, frozen=True, kw_only=True, tag="proxy.stopped"):
    """It no longer runs: ``drained`` (scaled down) or ``died`` (found dead; its
    sandboxes are reassigned)."""

    reason: str


# ---- snapshots -----------------------------------------------------------------


class SnapshotEvent(Event, frozen=True, kw_only=True):
    kind: ClassVar[str] = subjects.SNAPSHOT
    snapshot_id: str

    @property
    def aggregate_id(self) -> str:
        return self.snapshot_id


class SnapshotCreated(SnapshotEvent, frozen=True, kw_only=True, tag="snapshot.created"):
    """A consistent, immutable copy of a session's sandbox files (``/workspace``, its
    copy-on-write root, the shell's directory and exported variables) was made: its
    processes frozen while the files were copied. Sessions can be forked from it and
    restored to it; its layers are content-addressed and shared."""

    session_id: str
    sandbox_id: str
    org_id: str | None = None
    digest: str
    """``sha256:…`` of its content: equal files, equal digest."""
    layers: tuple[str, ...] = ()
    """Its layers' digests, bottom first (a fork's snapshot: its parent's, then its own)."""
    parent: str | None = None
    """The snapshot the sandbox started from (it was forked or restored), or None."""
    size: int = 0
    """Bytes it added on disk (0 when an equal layer was there already)."""
    total_size: int = 0
    """Bytes of all its layers: what a fork of it shows."""
    files: int = 0
    image: str = "default"
    image_digest: str | None = None
    run_as_root: bool = True
    writable_root: bool = True
    frozen_ms: float = 0.0
    """How long the sandbox's processes were frozen while its files were copied."""


class SnapshotDeleted(SnapshotEvent, frozen=True, kw_only=True, tag="snapshot.deleted"):
    """The snapshot is gone: no new fork or restore can use it. Sandboxes started from it
    keep its files (its layers stay until the last of them is deleted). ``reason``:
    ``requested`` or ``retention`` (the session kept more than it may)."""

    session_id: str | None = None
    reason: str = "requested"


class SnapshotWarmSet(SnapshotEvent, frozen=True, kw_only=True, tag="snapshot.warm_set"):
    """How many idle sandboxes started from the snapshot the pool-manager keeps ready, so
    that forks and restores of it are claims, not cold starts (0: none; the idle ones are
    removed). They count against ``max_running``; a deleted snapshot keeps none."""

    session_id: str | None = None
    count: int


# ---- executions (audit) ------------------------------------------------------


class CommandExecuted(Event, frozen=True, kw_only=True, tag="exec.completed"):
    """One tool call that ran something in a sandbox: what, by whom, how it ended.
    Outputs are not recorded. While the event store has lately refused a record, a call
    is recorded once more before it runs (outcome ``started``)."""

    kind: ClassVar[str] = subjects.EXEC
    session_id: str
    sandbox_id: str
    tool: str
    command: str
    """The command text or edit summary, cut at 4 KiB."""
    exit_code: int | None = None
    duration_ms: int = 0
    job_id: str | None = None
    outcome: str = "ok"
    """``ok``, ``timeout``, ``error`` (with the error code in ``error``) or ``started``."""
    error: str | None = None
    path: str | None = None
    """The file an edit touched (edits only)."""
    size: int | None = None
    """Bytes of new text an edit wrote (``create``, ``str_replace``, ``insert``)."""

    @property
    def aggregate_id(self) -> str:
        return self.session_id


# ---- egress (audit) ----------------------------------------------------------


class EgressConnection(msgspec.Struct, frozen=True, kw_only=True):
    """One sandbox connection through the proxy (or, ``connections`` > 1, an aggregate of
    several with the same destination, verdict, rule and reason). Never a header, a path
    or a secret."""

    host: str | None = None
    """Where it went: the CONNECT target or the plain-HTTP request's host (None: the
    connection closed before it said)."""
    port: int | None = None
    verdict: str
    """``tunnelled`` (relayed, not seen), ``intercepted`` (TLS terminated under ``rule``),
    ``forwarded`` (plain HTTP), ``refused`` (nothing went upstream) or ``empty``."""
    rule: str | None = None
    """The configured rule that handled it (intercepted connections)."""
    reason: str | None = None
    """Why something on it was refused (the first refusal): ``private_address``,
    ``metadata_address``, ``unresolvable``, ``host_mismatch``, ``bad_request``,
    ``credential_unavailable``, ``upstream_failure``, ``proxy_itself``..."""
    detail: str | None = None
    """The refusal in words (an address, a name; cut at 200 characters)."""
    started: datetime
    """When it (the first of an aggregate) opened."""
    duration_ms: int = 0
    """How long it stayed open (an aggregate: the sum)."""
    requests: int = 0
    """HTTP requests the proxy saw on it (not for tunnels)."""
    injected: int = 0
    """Requests that got a credential."""
    refused: int = 0
    upstream_errors: int = 0
    bytes_up: int = 0
    """Bytes from the sandbox towards the destination."""
    bytes_down: int = 0
    connections: int = 1
    """How many connections this entry stands for (> 1: an aggregate)."""


class EgressRecorded(Event, frozen=True, kw_only=True, tag="egress.recorded"):
    """Connections a sandbox made through its proxy, collected from the proxy in one batch
    (one event per session and batch). A sandbox that opens many connections between two
    collections has them aggregated (``aggregated``); ``lost`` counts connections the
    proxy could not keep (too many waited for collection)."""

    kind: ClassVar[str] = subjects.EGRESS
    session_id: str | None = None
    """The session the sandbox served (None: a pool sandbox not yet claimed, or an
    address no sandbox was known to hold)."""
    sandbox_id: str | None = None
    proxy_id: str
    peer: str | None = None
    """The sandbox's address as the proxy saw it."""
    connections: list[EgressConnection]
    aggregated: int = 0
    """Connections folded into the aggregates of this event, beyond the first of each."""
    lost: int = 0

    @property
    def aggregate_id(self) -> str:
        return self.session_id or self.sandbox_id or self.proxy_id


# ---- image pulls (audit) -------------------------------------------------------------


class ImageEvent(Event, frozen=True, kw_only=True):
    """A pull of one image reference onto one machine (``meta.instance`` says whose)."""

    kind: ClassVar[str] = subjects.IMAGE
    reference: str
    """The normalised reference (``docker.io/library/python:3.12``)."""

    @property
    def aggregate_id(self) -> str:
        return self.reference


class ImagePullStarted(ImageEvent, frozen=True, kw_only=True, tag="image.pull_started"):
    """An image not on the machine is being fetched from its registry."""

    sandbox_id: str | None = None
    """The sandbox that needs it (None: an operator's ``sbx image pull``)."""


class ImagePulled(ImageEvent, frozen=True, kw_only=True, tag="image.pulled"):
    """The image is on the machine, checked against its digest."""

    digest: str
    size: int
    """Bytes of its layers (compressed)."""
    layers: int
    fetched: int
    """Layers downloaded (the others were in the layer store already)."""
    seconds: float


class ImagePullFailed(ImageEvent, frozen=True, kw_only=True, tag="image.pull_failed"):
    """The pull failed; nothing of it was kept."""

    error: str
    """The error code (``not_found``, ``invalid_input``, ``unavailable``, ...)."""
    reason: str
    """What went wrong, as the registry or the check said it (never a credential)."""


# ---- service instances -------------------------------------------------------------


class InstanceEvent(Event, frozen=True, kw_only=True):
    kind: ClassVar[str] = subjects.INSTANCE
    service: str
    instance: str

    @property
    def aggregate_id(self) -> str:
        return self.instance


class InstanceStarted(InstanceEvent, frozen=True, kw_only=True, tag="instance.started"):
    """A service process started and joined the bus."""

    pid: int
    host: str
    version: str


class InstanceStopped(InstanceEvent, frozen=True, kw_only=True, tag="instance.stopped"):
    """A service process drained and left cleanly (a crash leaves no such event)."""

    reason: str = "signal"


EVENT_TYPES: tuple[type[Event], ...] = (
    SessionCreated,
    SessionStopped,
    SessionDeleted,
    SessionResumed,
    SessionSandboxAssigned,
    SessionSandboxReleased,
    SessionDeadlineSet,
    SandboxRequested,
    SandboxStarted,
    SandboxStopped,
    SandboxDeleted,
    SandboxFailed,
    SandboxClaimed,
    SandboxRefused,
    SandboxLost,
    SandboxProxyAssigned,
    SandboxCacheAttached,
    SandboxPaused,
    SandboxResumed,
    ProxyStarted,
    ProxyDraining,
    ProxyStopped,
    SnapshotCreated,
    SnapshotDeleted,
    SnapshotWarmSet,
    CommandExecuted,
    ImagePullStarted,
    ImagePulled,
    ImagePullFailed,
    InstanceStarted,
    InstanceStopped,
    EgressRecorded,
)

AnyEvent = (
    SessionCreated
    | SessionStopped
    | SessionDeleted
    | SessionResumed
    | SessionSandboxAssigned
    | SessionSandboxReleased
    | SessionDeadlineSet
    | SandboxRequested
    | SandboxStarted
    | SandboxStopped
    | SandboxDeleted
    | SandboxFailed
    | SandboxClaimed
    | SandboxRefused
    | SandboxLost
    | SandboxProxyAssigned
    | SandboxCacheAttached
    | SandboxPaused
    | SandboxResumed
    | ProxyStarted
    | ProxyDraining
    | ProxyStopped
    | SnapshotCreated
    | SnapshotDeleted
    | SnapshotWarmSet
    | CommandExecuted
    | ImagePullStarted
    | ImagePulled
    | ImagePullFailed
    | InstanceStarted
    | InstanceStopped
    | EgressRecorded
)


def tag_of(cls: type[msgspec.Struct]) -> str:
    """The wire tag of an event, command or request type."""
    tag = cls.__struct_config__.tag
    assert isinstance(tag, str)
    return tag


def current_version(cls: type[Event]) -> int:
    default = cls.__struct_defaults__[cls.__struct_fields__.index("v")]
    assert isinstance(default, int)
    return default

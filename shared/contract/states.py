"""Projected state of each aggregate kind: what the KV buckets hold.

States are frozen Structs produced only by the pure ``evolve`` functions in
:mod:`shared.domain.projections`. ``last_seq`` is the stream sequence of the last event
folded in, which is how a projection knows whether it is caught up.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal, get_args

import msgspec

from sbx_api.wire import SessionStatus, SnapshotStatus

SESSION_STATUSES: tuple[SessionStatus, ...] = get_args(SessionStatus)
SNAPSHOT_STATUSES: tuple[SnapshotStatus, ...] = get_args(SnapshotStatus)


class SessionState(msgspec.Struct, frozen=True, kw_only=True):
    session_id: str
    status: SessionStatus
    image: str | None = None
    org_id: str | None = None
    user_id: str | None = None
    created_at: datetime
    updated_at: datetime
    incarnation: int = 1
    """1 for the first life of this id; +1 each time it is created again after deletion."""
    version: int = 1
    """Number of events folded into this state (over all incarnations)."""
    last_seq: int
    """Stream sequence of the last event folded in."""
    last_command_id: str | None = None
    """The command that caused the last event (makes retries idempotent)."""
    sandbox_id: str | None = None
    """The sandbox currently assigned to this session (None until first use)."""
    forked_from: str | None = None
    """The snapshot this incarnation was forked from."""
    metadata: dict[str, str] = {}
    """The creator's labels (E2B ``metadata``)."""
    env: dict[str, str] = {}
    """Environment variables for commands run in the session (E2B ``envVars``)."""
    end_at: datetime | None = None
    """When the reaper deletes the session; ``None``: the lifetimes alone decide."""


SandboxStatus = Literal["requested", "running", "paused", "stopped", "deleted", "failed", "refused", "lost"]
"""``paused``: every process frozen (memory kept, no CPU); it counts as running for
``max_running`` and keeps its proxy, and the session's next call resumes it."""
SANDBOX_STATUSES: tuple[SandboxStatus, ...] = get_args(SandboxStatus)


class SandboxState(msgspec.Struct, frozen=True, kw_only=True):
    sandbox_id: str
    status: SandboxStatus
    session_id: str | None = None
    image: str = "default"
    run_as_root: bool = True
    writable_root: bool = True
    use_kata: bool = False
    backend: str = "local"
    pool: str | None = None
    """Set for warm pool sandboxes; ``session_id`` is None until one is claimed."""
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None = None
    """When it last started running."""
    claimed_at: datetime | None = None
    """When a session claimed it from the warm pool (its lifetime counts from the later of
    this and ``started_at``)."""
    error: str | None = None
    proxy_id: str | None = None
    """The fleet proxy its traffic goes to (proxy egress)."""
    cache_org: str | None = None
    """The organisation whose package cache it shows (None: a cache of its own)."""
    image_digest: str | None = None
    """The manifest digest of its image, where the runtime reports it (``sandbox.started``)."""
    paused_at: datetime | None = None
    """When it was paused (set only while ``paused``)."""
    pause_command_id: str | None = None
    """The command that caused its last pause or resume: the same command again (a
    retried request with its Idempotency-Key) changes nothing."""
    snapshot: str | None = None
    """The snapshot it started from (a fork or a restore), if any."""
    last_seq: int


ProxyStatus = Literal["running", "draining", "stopped"]


class ProxyState(msgspec.Struct, frozen=True, kw_only=True):
    proxy_id: str
    status: ProxyStatus
    backend: str = "local"
    endpoint: str
    started_at: datetime
    updated_at: datetime
    stop_reason: str | None = None
    last_seq: int


class SnapshotState(msgspec.Struct, frozen=True, kw_only=True):
    snapshot_id: str
    status: SnapshotStatus
    session_id: str
    sandbox_id: str
    org_id: str | None = None
    user_id: str | None = None
    digest: str
    layers: tuple[str, ...] = ()
    parent: str | None = None
    size: int = 0
    total_size: int = 0
    files: int = 0
    image: str = "default"
    image_digest: str | None = None
    run_as_root: bool = True
    writable_root: bool = True
    frozen_ms: float = 0.0
    created_at: datetime
    updated_at: datetime
    delete_reason: str | None = None
    warm: int = 0
    """Idle sandboxes started from it kept ready for forks (``snapshot.warm_set``)."""
    last_seq: int


InstanceStatus = Literal["running", "stopped"]


class InstanceState(msgspec.Struct, frozen=True, kw_only=True):
    service: str
    instance: str
    status: InstanceStatus
    pid: int
    host: str
    version: str
    started_at: datetime
    stopped_at: datetime | None = None
    last_seq: int


AnyState = SessionState | InstanceState | SandboxState

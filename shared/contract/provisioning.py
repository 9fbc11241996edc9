"""Requests to the pool-manager, which alone creates, starts, stops and deletes sandboxes
through the runtime. Request/reply on ``<ns>.cmd.pool`` (queue group ``pool-manager``)."""

from __future__ import annotations

import msgspec

from shared.contract import commands, states


class PoolRequest(msgspec.Struct, frozen=True, kw_only=True, tag_field="op"):
    sandbox_id: str
    command_id: str
    correlation_id: str | None = None
    actor: commands.Actor = commands.Actor()


class Provision(PoolRequest, frozen=True, kw_only=True, tag="provision"):
    session_id: str | None = None
    image: str = "default"
    run_as_root: bool = True
    writable_root: bool = True
    use_kata: bool = False
    pool: str | None = None
    """Set when the pool-manager fills a warm pool (no session yet)."""
    org_id: str | None = None
    """The organisation of the session (or of the pool) the sandbox is for: where the
    runtime has package caches, the sandbox shows that organisation's from its start."""
    snapshot: str | None = None
    """Start from this snapshot (a fork or a restore): ``image``, ``run_as_root`` and
    ``writable_root`` are then the snapshot's."""


class Start(PoolRequest, frozen=True, kw_only=True, tag="start"):
    pass


class Stop(PoolRequest, frozen=True, kw_only=True, tag="stop"):
    reason: str = "requested"
    """Recorded on ``sandbox.stopped``: ``requested``, or ``hibernated`` (an idle session's
    sandbox stopped while the session stays active: its next call starts it again)."""


class Delete(PoolRequest, frozen=True, kw_only=True, tag="delete"):
    pass


class Pause(PoolRequest, frozen=True, kw_only=True, tag="pause"):
    """Freeze every process of a running sandbox (a paused one: nothing to do)."""

    reason: str = "requested"


class Resume(PoolRequest, frozen=True, kw_only=True, tag="resume"):
    """Thaw a paused sandbox (a running one: nothing to do). ``Start`` also resumes one."""

    reason: str = "requested"


class Snapshot(PoolRequest, frozen=True, kw_only=True, tag="snapshot"):
    """Snapshot the sandbox's files as ``snapshot_id`` (idempotent) and record
    ``snapshot.created``; then apply the session's retention rule."""

    snapshot_id: str
    session_id: str
    org_id: str | None = None


class DropSnapshot(PoolRequest, frozen=True, kw_only=True, tag="snapshot_delete"):
    """Delete snapshot ``snapshot_id`` (``sandbox_id``: the sandbox it was taken of) and
    record ``snapshot.deleted``; deleted already: nothing to do."""

    snapshot_id: str
    reason: str = "requested"


AnyPoolRequest = Provision | Start | Stop | Delete | Pause | Resume | Snapshot | DropSnapshot
POOL_REQUEST_TYPES = (Provision, Start, Stop, Delete, Pause, Resume, Snapshot, DropSnapshot)


class PoolReply(msgspec.Struct, frozen=True, kw_only=True):
    ok: bool
    error: commands.ErrorInfo | None = None
    sandbox: states.SandboxState | None = None
    snapshot: states.SnapshotState | None = None


_request_decoder = msgspec.json.Decoder(AnyPoolRequest)
_reply_decoder = msgspec.json.Decoder(PoolReply)


def decode_request(data: bytes) -> AnyPoolRequest:
    return _request_decoder.decode(data)


def decode_reply(data: bytes) -> PoolReply:
    return _reply_decoder.decode(data)

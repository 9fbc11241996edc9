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


AnyPoolRequest = Provision | Start | Stop | Delete | Pause | Resume
POOL_REQUEST_TYPES = (Provision, Start, Stop, Delete, Pause, Resume)


class PoolReply(msgspec.Struct, frozen=True, kw_only=True):
    ok: bool
    error: commands.ErrorInfo | None = None
    sandbox: states.SandboxState | None = None


_request_decoder = msgspec.json.Decoder(AnyPoolRequest)
_reply_decoder = msgspec.json.Decoder(PoolReply)


def decode_request(data: bytes) -> AnyPoolRequest:
    return _request_decoder.decode(data)


def decode_reply(data: bytes) -> PoolReply:
    return _reply_decoder.decode(data)

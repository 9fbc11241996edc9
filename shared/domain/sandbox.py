"""A sandbox: its state fold and the pure rules that decide its events, whichever
service records them (the pool-manager requests, starts, stops and deletes; the
scheduler claims; the proxy-scaler assigns a proxy; the executor attaches a cache; the
reaper marks one failed or lost). ``evolve`` raises
:class:`~sbx_api.errors.InvalidTransition` for an event that cannot follow.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import msgspec

from sbx_api import errors
from shared.contract import events, states

# The sandbox status groups, each named once (every service asks these, none spells them).
ROUTED: tuple[states.SandboxStatus, ...] = ("running", "paused")
"""Sandboxes that hold a proxy: a paused one keeps its own (its memory, connections and
route are kept too), so its next call finds its way out at once."""
HOLDING: tuple[states.SandboxStatus, ...] = ("requested", *ROUTED)
"""What counts against ``max_running`` and what the proxy fleet is sized for: a paused
sandbox holds its memory, and a requested one is starting (with its proxy)."""
LIVE: tuple[states.SandboxStatus, ...] = (*HOLDING, "stopped")
"""Statuses of a sandbox that exists in the runtime (or is about to)."""
DEAD: tuple[states.SandboxStatus, ...] = ("deleted", "failed", "refused", "lost")
"""Statuses of a sandbox that is gone for good."""


# Long on purpose: one case per event, so a sandbox's whole lifecycle reads as one table.
def evolve(state: states.SandboxState | None, event: events.Event, seq: int) -> states.SandboxState:  # noqa: C901
    status = state.status if state else None
    match event:
        case events.SandboxRequested() if state is None:
            return states.SandboxState(
                sandbox_id=event.sandbox_id,
                status="requested",
                session_id=event.session_id,
                image=event.image,
                run_as_root=event.run_as_root,
                writable_root=event.writable_root,
                use_kata=event.use_kata,
                backend=event.backend,
                pool=event.pool,
                cache_org=event.cache_org,
                snapshot=event.snapshot,
                created_at=event.meta.time,
                updated_at=event.meta.time,
                last_seq=seq,
            )
        case events.SandboxStarted() if status in ("requested", "stopped"):
            assert state is not None
            return msgspec.structs.replace(  # a new start has a new network link: no proxy yet
                state,
                status="running",
                started_at=event.meta.time,
                updated_at=event.meta.time,
                proxy_id=None,
                image_digest=event.image_digest or state.image_digest,
                last_seq=seq,
            )
        case events.SandboxClaimed() if (
            status in ("requested", "running") and state and state.session_id is None
        ):
            return msgspec.structs.replace(
                state,
                session_id=event.session_id,
                claimed_at=event.meta.time,
                updated_at=event.meta.time,
                last_seq=seq,
            )
        case events.SandboxRefused() if state is None:
            return states.SandboxState(
                sandbox_id=event.sandbox_id,
                status="refused",
                session_id=event.session_id,
                created_at=event.meta.time,
                updated_at=event.meta.time,
                error=event.reason,
                last_seq=seq,
            )
        case events.SandboxLost() if status in LIVE:
            assert state is not None
            return msgspec.structs.replace(
                state, status="lost", error=event.reason, updated_at=event.meta.time, last_seq=seq
            )
        case events.SandboxStopped() if status in ("requested", "running", "paused"):
            assert state is not None
            return msgspec.structs.replace(
                state, status="stopped", paused_at=None, updated_at=event.meta.time, last_seq=seq
            )
        case events.SandboxPaused() if status == "running":
            assert state is not None
            return msgspec.structs.replace(
                state,
                status="paused",
                paused_at=event.meta.time,
                pause_command_id=event.meta.command_id,
                updated_at=event.meta.time,
                last_seq=seq,
            )
        case events.SandboxResumed() if status == "paused":
            assert state is not None
            return msgspec.structs.replace(
                state,
                status="running",
                paused_at=None,
                pause_command_id=event.meta.command_id,
                updated_at=event.meta.time,
                last_seq=seq,
            )
        case events.SandboxDeleted() if state is not None and status not in ("deleted", "refused"):
            return msgspec.structs.replace(state, status="deleted", updated_at=event.meta.time, last_seq=seq)
        case events.SandboxProxyAssigned() if status in LIVE:
            assert state is not None
            return msgspec.structs.replace(
                state, proxy_id=event.proxy_id, updated_at=event.meta.time, last_seq=seq
            )
        case events.SandboxCacheAttached() if status in LIVE:
            assert state is not None
            return msgspec.structs.replace(
                state, cache_org=event.org_id, updated_at=event.meta.time, last_seq=seq
            )
        case events.SandboxFailed() if status in LIVE:
            assert state is not None
            return msgspec.structs.replace(
                state, status="failed", error=event.error, updated_at=event.meta.time, last_seq=seq
            )
    raise errors.InvalidTransition(
        f"{events.tag_of(type(event))} at seq {seq} cannot follow {status or 'nothing'} for a sandbox"
    )


def decide_claim(
    sandbox: states.SandboxState | None,
    sandbox_id: str,
    session_id: str,
    meta: events.Meta,
    *,
    pool_id: str | None = None,
    org: str | None = None,
    snapshot: str | None = None,
) -> list[events.SandboxEvent]:
    """Take a warm sandbox iff it is still running and unclaimed, of the pool it was
    offered for, started from ``snapshot`` (None: from none; a snapshot's pool serves
    only that snapshot's forks, and never a plain session), and shows no other
    organisation's cache (than ``org``, the session's): the CAS makes one claim win."""
    if (
        sandbox is None
        or sandbox.status != "running"
        or sandbox.session_id is not None
        or sandbox.pool is None
        or (pool_id is not None and sandbox.pool != pool_id)
        or sandbox.snapshot != snapshot
        or sandbox.cache_org not in (None, org)
    ):
        return []
    return [events.SandboxClaimed(meta=meta, sandbox_id=sandbox_id, session_id=session_id)]


MetaFor = Callable[[str | None], events.Meta]
"""Builds an event's meta for the sandbox's session (None: not claimed)."""


def _when(
    state: states.SandboxState | None, allowed: tuple[str | None, ...], make: Callable[[], events.Event]
) -> list[events.Event]:
    return [make()] if (state.status if state else None) in allowed else []


def decide_requested(
    state: states.SandboxState | None, meta: events.Meta, **fields: Any
) -> list[events.Event]:
    """The first event of a sandbox: recorded once, before the runtime creates it."""
    return [] if state is not None else [events.SandboxRequested(meta=meta, **fields)]


def decide_refused(state: states.SandboxState | None, meta: events.Meta, **fields: Any) -> list[events.Event]:
    """A sandbox the limits did not admit: recorded instead of a request, never after one."""
    return [] if state is not None else [events.SandboxRefused(meta=meta, **fields)]


def decide_started(
    state: states.SandboxState | None, sandbox_id: str, meta: MetaFor, *, image_digest: str | None = None
) -> list[events.Event]:
    """Running, after a request or a stop."""
    session = state.session_id if state else None
    return _when(
        state,
        ("requested", "stopped"),
        lambda: events.SandboxStarted(meta=meta(session), sandbox_id=sandbox_id, image_digest=image_digest),
    )


def decide_stopped(
    state: states.SandboxState | None, sandbox_id: str, meta: MetaFor, *, reason: str = "requested"
) -> list[events.Event]:
    """Stopped (workspace kept), from paused too; one the runtime lost (``reason="lost"``)
    only while it was running or paused."""
    allowed: tuple[str, ...] = (
        ("running", "paused") if reason == "lost" else ("requested", "running", "paused")
    )
    session = state.session_id if state else None
    return _when(
        state,
        allowed,
        lambda: events.SandboxStopped(meta=meta(session), sandbox_id=sandbox_id, reason=reason),
    )


def _repeated(state: states.SandboxState, meta: events.Meta) -> bool:
    """The command that caused the last pause or resume, again (a retried request)."""
    return meta.command_id is not None and state.pause_command_id == meta.command_id


def decide_paused(
    state: states.SandboxState | None, sandbox_id: str, meta: MetaFor, *, reason: str = "requested"
) -> list[events.Event]:
    """Paused (every process frozen): only a running sandbox, and not again for the
    command that caused its last pause or resume."""
    if state is None or state.status != "running" or _repeated(state, meta(state.session_id)):
        return []
    return [events.SandboxPaused(meta=meta(state.session_id), sandbox_id=sandbox_id, reason=reason)]


def decide_resumed(
    state: states.SandboxState | None, sandbox_id: str, meta: MetaFor, *, reason: str = "requested"
) -> list[events.Event]:
    """Running again: only a paused sandbox."""
    if state is None or state.status != "paused":
        return []
    return [events.SandboxResumed(meta=meta(state.session_id), sandbox_id=sandbox_id, reason=reason)]


def decide_retired(
    state: states.SandboxState | None, sandbox_id: str, meta: events.Meta
) -> list[events.Event]:
    """An idle pool sandbox the pool no longer wants (above ``min_idle``, too old, of a
    pool that is gone) is stopped first, as one CAS: a claim racing it loses (or wins,
    and then it is not retired)."""
    if state is None or state.pool is None or state.session_id is not None or state.status != "running":
        return []
    return [events.SandboxStopped(meta=meta, sandbox_id=sandbox_id, reason="retired")]


def decide_deleted(state: states.SandboxState | None, sandbox_id: str, meta: MetaFor) -> list[events.Event]:
    """Deleted from the runtime: from any status but deleted, refused and lost."""
    session = state.session_id if state else None
    return _when(
        state,
        (*LIVE, "failed"),
        lambda: events.SandboxDeleted(meta=meta(session), sandbox_id=sandbox_id),
    )


def decide_failed(
    state: states.SandboxState | None, sandbox_id: str, meta: MetaFor, error: str, *, stuck: bool = False
) -> list[events.Event]:
    """The runtime could not create or start it; ``stuck``: the reaper found it still
    ``requested`` long after, which only a requested sandbox can be."""
    allowed: tuple[str, ...] = ("requested",) if stuck else LIVE
    session = state.session_id if state else None
    return _when(
        state, allowed, lambda: events.SandboxFailed(meta=meta(session), sandbox_id=sandbox_id, error=error)
    )


def decide_lost(
    state: states.SandboxState | None, sandbox_id: str, meta: events.Meta, reason: str
) -> list[events.Event]:
    """Gone from the runtime while recorded as live (the reaper's reconciliation)."""
    return _when(state, LIVE, lambda: events.SandboxLost(meta=meta, sandbox_id=sandbox_id, reason=reason))


def decide_proxy_assigned(
    state: states.SandboxState | None,
    sandbox_id: str,
    proxy_id: str,
    meta: MetaFor,
    *,
    moving_from: str | None = None,
) -> list[events.Event]:
    """A running sandbox's egress goes through ``proxy_id`` (new, or moved off another).
    ``moving_from``: the proxy the plan saw it on (None: none); if it is on another one
    now, the plan was made from a view that lagged behind, and nothing moves (a sandbox
    just moved off a dead proxy must not be moved again for it)."""
    if state is None or state.status not in ("running", "paused") or state.proxy_id == proxy_id:
        return []
    if state.proxy_id != moving_from:
        return []
    reason = "new" if state.proxy_id is None else "reassigned"
    return [
        events.SandboxProxyAssigned(
            meta=meta(state.session_id), sandbox_id=sandbox_id, proxy_id=proxy_id, reason=reason
        )
    ]


def decide_cache_attached(
    state: states.SandboxState | None, session_id: str, org_id: str, meta: events.Meta
) -> list[events.Event]:
    """The session's organisation's package cache now shows in its sandbox."""
    if state is None or state.session_id != session_id or state.status not in ("running", "stopped"):
        return []
    if state.cache_org == org_id:
        return []
    return [
        events.SandboxCacheAttached(
            meta=meta, sandbox_id=state.sandbox_id, session_id=session_id, org_id=org_id
        )
    ]


def at_stack_stop(state: states.SandboxState | None) -> Literal["stop", "delete"]:
    """What stopping a stack does with a sandbox it runs: a session's is stopped with its
    files kept (the session's next call, after the next start, resumes it); any other (an
    idle pool one, one no live record claims) is deleted."""
    if state is not None and state.session_id is not None and state.status in LIVE:
        return "stop"
    return "delete"

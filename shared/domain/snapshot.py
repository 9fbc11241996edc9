"""A snapshot of a session's sandbox files: its state fold and the pure rules around it
(what may be recorded, which snapshots retention removes, what a fork is given)."""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from sbx_api import errors
from shared.contract import commands, events, states


def evolve(state: states.SnapshotState | None, event: events.Event, seq: int) -> states.SnapshotState:
    status = state.status if state else None
    match event:
        case events.SnapshotCreated() if state is None:
            return states.SnapshotState(
                snapshot_id=event.snapshot_id,
                status="ready",
                session_id=event.session_id,
                sandbox_id=event.sandbox_id,
                org_id=event.org_id,
                user_id=event.meta.user_id,
                digest=event.digest,
                layers=event.layers,
                parent=event.parent,
                size=event.size,
                total_size=event.total_size,
                files=event.files,
                image=event.image,
                image_digest=event.image_digest,
                run_as_root=event.run_as_root,
                writable_root=event.writable_root,
                frozen_ms=event.frozen_ms,
                created_at=event.meta.time,
                updated_at=event.meta.time,
                last_seq=seq,
            )
        case events.SnapshotDeleted() if status == "ready":
            assert state is not None
            return msgspec.structs.replace(
                state, status="deleted", delete_reason=event.reason, updated_at=event.meta.time, last_seq=seq
            )
        case events.SnapshotWarmSet() if status == "ready":
            assert state is not None
            return msgspec.structs.replace(state, warm=event.count, updated_at=event.meta.time, last_seq=seq)
    raise errors.InvalidTransition(
        f"{events.tag_of(type(event))} at seq {seq} cannot follow {status or 'nothing'} for a snapshot"
    )


def decide_created(state: states.SnapshotState | None, event: events.SnapshotCreated) -> list[events.Event]:
    """Recorded once per snapshot id (a retried request finds it recorded)."""
    return [event] if state is None else []


def decide_deleted(state: states.SnapshotState | None, event: events.SnapshotDeleted) -> list[events.Event]:
    return [event] if state is not None and state.status == "ready" else []


WARM_MAX = 100
"""Most idle sandboxes kept warm for one organisation's snapshots, all of them together
(as many as one fork request makes); the same for the snapshots of no organisation."""


def decide_warm(
    state: states.SnapshotState | None,
    command: commands.WarmSnapshot,
    meta: events.Meta,
    others: int = 0,
) -> list[events.Event]:
    """Set how many idle sandboxes started from the snapshot are kept ready: once per
    change (the same count again changes nothing). ``others``: how many its organisation
    keeps warm for its other snapshots. A caller acting for an organisation sets it only on
    that organisation's snapshots (one of no organisation is the operator's to warm)."""
    if not 0 <= command.count <= WARM_MAX:
        raise errors.InvalidInput(f"count must be from 0 to {WARM_MAX}, not {command.count}")
    ready = usable(state, command.snapshot_id, command.actor.org_id)
    if command.actor.org_id is not None and ready.org_id != command.actor.org_id:
        raise errors.Forbidden(
            f"snapshot {command.snapshot_id!r} belongs to no organisation: only an operator keeps it warm"
        )
    if ready.warm == command.count:
        return []
    if command.count > ready.warm and others + command.count > WARM_MAX:
        whose = (
            f"organisation {ready.org_id!r} keeps" if ready.org_id else "snapshots of no organisation keep"
        )
        raise errors.LimitExceeded(
            f"{whose} {others} sandboxes warm for other snapshots: at most {WARM_MAX} in all "
            f"(this one may have {max(0, WARM_MAX - others)})"
        )
    return [
        events.SnapshotWarmSet(
            meta=meta, snapshot_id=ready.snapshot_id, session_id=ready.session_id, count=command.count
        )
    ]


def warm_elsewhere(snapshots: Iterable[states.SnapshotState], snapshot_id: str, org: str | None) -> int:
    """How many sandboxes ``org`` (None: no organisation) keeps warm for its ready
    snapshots other than ``snapshot_id``."""
    return sum(
        s.warm for s in snapshots if s.status == "ready" and s.org_id == org and s.snapshot_id != snapshot_id
    )


def usable(state: states.SnapshotState | None, snapshot_id: str, org: str | None) -> states.SnapshotState:
    """The snapshot a fork or restore by a caller acting for ``org`` may start from (a
    caller without one, the operator, may use any). Raises NotFound otherwise: another
    organisation's snapshot is as unknown as a missing one."""
    if state is None or state.status != "ready" or (org is not None and state.org_id not in (None, org)):
        raise errors.NotFound(f"snapshot {snapshot_id!r} does not exist")
    return state


def of_session(
    snapshots: Iterable[states.SnapshotState], session_id: str, org_id: str | None
) -> list[states.SnapshotState]:
    """A session's snapshots: of its id *and* its organisation. An id deleted and created
    again by another organisation is another tenant's session: its snapshots never count
    against (nor are removed for) the other's."""
    return [s for s in snapshots if s.session_id == session_id and s.org_id == org_id]


def over_retention(snapshots: Iterable[states.SnapshotState], keep: int) -> list[states.SnapshotState]:
    """A session's ready snapshots past the newest ``keep``, oldest first (``keep`` 0: no
    limit)."""
    ready = sorted((s for s in snapshots if s.status == "ready"), key=lambda s: (s.created_at, s.snapshot_id))
    return ready[: max(0, len(ready) - keep)] if keep > 0 else []

"""Pure folds from events to projected state, one per aggregate kind.

``evolve(state, event, seq)`` returns the next state; it never touches I/O and
raises :class:`~shared.errors.InvalidTransition` for an event that cannot follow
``state`` (``decide`` never emits one, so seeing it means a corrupt stream).
Deleted sessions stay as ``status="deleted"`` tombstones, so a late or replayed
event can never resurrect them; creating the id again starts a new incarnation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import msgspec

from shared import errors, events, ids, states, subjects

S = TypeVar("S", states.SessionState, states.InstanceState, states.SandboxState, states.ProxyState)


def evolve_session(
    state: states.SessionState | None, event: events.AnyEvent, seq: int
) -> states.SessionState:
    def refuse(why: str) -> errors.InvalidTransition:
        return errors.InvalidTransition(
            f"{events.tag_of(type(event))} at seq {seq} cannot follow "
            f"{state.status if state else 'nothing'}: {why}"
        )

    def step(current: states.SessionState, **changes: object) -> states.SessionState:
        return msgspec.structs.replace(
            current,
            updated_at=event.meta.time,
            version=current.version + 1,
            last_seq=seq,
            last_command_id=event.meta.command_id,
            **changes,
        )

    match event:
        case events.SessionCreated():
            if state is not None and state.status != "deleted":
                raise refuse("the session already exists")
            return states.SessionState(
                session_id=event.session_id,
                status="active",
                image=event.image,
                org_id=event.org_id,
                user_id=event.user_id,
                created_at=event.meta.time,
                updated_at=event.meta.time,
                incarnation=state.incarnation + 1 if state else 1,
                version=state.version + 1 if state else 1,
                last_seq=seq,
                last_command_id=event.meta.command_id,
            )
        case events.SessionStopped():
            if state is None or state.status != "active":
                raise refuse("only an active session can stop")
            return step(state, status="stopped")
        case events.SessionDeleted():
            if state is None or state.status == "deleted":
                raise refuse("the session does not exist")
            return step(state, status="deleted", sandbox_id=None)
        case events.SessionResumed():
            if state is None or state.status != "stopped":
                raise refuse("only a stopped session can resume")
            return step(state, status="active")
        case events.SessionSandboxAssigned():
            if state is None or state.status != "active" or state.sandbox_id is not None:
                raise refuse("a sandbox is assigned only to an active session without one")
            return step(state, sandbox_id=event.sandbox_id, image=event.image)
        case events.SessionSandboxReleased():
            if state is None or state.sandbox_id != event.sandbox_id:
                raise refuse("only the assigned sandbox can be released")
            return step(state, sandbox_id=None)
        case _:
            raise refuse("not a session event")


def evolve_sandbox(
    state: states.SandboxState | None, event: events.AnyEvent, seq: int
) -> states.SandboxState:
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
        case events.SandboxLost() if status in ("requested", "running", "stopped"):
            assert state is not None
            return msgspec.structs.replace(
                state, status="lost", error=event.reason, updated_at=event.meta.time, last_seq=seq
            )
        case events.SandboxStopped() if status in ("requested", "running"):
            assert state is not None
            return msgspec.structs.replace(state, status="stopped", updated_at=event.meta.time, last_seq=seq)
        case events.SandboxDeleted() if state is not None and status not in ("deleted", "refused"):
            return msgspec.structs.replace(state, status="deleted", updated_at=event.meta.time, last_seq=seq)
        case events.SandboxProxyAssigned() if status in ("requested", "running", "stopped"):
            assert state is not None
            return msgspec.structs.replace(
                state, proxy_id=event.proxy_id, updated_at=event.meta.time, last_seq=seq
            )
        case events.SandboxCacheAttached() if status in ("requested", "running", "stopped"):
            assert state is not None
            return msgspec.structs.replace(
                state, cache_org=event.org_id, updated_at=event.meta.time, last_seq=seq
            )
        case events.SandboxFailed() if status in ("requested", "running", "stopped"):
            assert state is not None
            return msgspec.structs.replace(
                state, status="failed", error=event.error, updated_at=event.meta.time, last_seq=seq
            )
    raise errors.InvalidTransition(
        f"{events.tag_of(type(event))} at seq {seq} cannot follow {status or 'nothing'} for a sandbox"
    )


def evolve_proxy(state: states.ProxyState | None, event: events.AnyEvent, seq: int) -> states.ProxyState:
    status = state.status if state else None
    match event:
        case events.ProxyStarted() if state is None:
            return states.ProxyState(
                proxy_id=event.proxy_id,
                status="running",
                backend=event.backend,
                endpoint=event.endpoint,
                started_at=event.meta.time,
                updated_at=event.meta.time,
                last_seq=seq,
            )
        case events.ProxyDraining() if status == "running":
            assert state is not None
            return msgspec.structs.replace(state, status="draining", updated_at=event.meta.time, last_seq=seq)
        case events.ProxyStopped() if status in ("running", "draining"):
            assert state is not None
            return msgspec.structs.replace(
                state, status="stopped", stop_reason=event.reason, updated_at=event.meta.time, last_seq=seq
            )
    raise errors.InvalidTransition(
        f"{events.tag_of(type(event))} at seq {seq} cannot follow {status or 'nothing'} for a proxy"
    )


def evolve_instance(
    state: states.InstanceState | None, event: events.AnyEvent, seq: int
) -> states.InstanceState:
    match event:
        case events.InstanceStarted():
            # A fixed SBX_INSTANCE_ID may start again (after a clean stop or a crash
            # that left no stop event): the new start replaces the old life.
            return states.InstanceState(
                service=event.service,
                instance=event.instance,
                status="running",
                pid=event.pid,
                host=event.host,
                version=event.version,
                started_at=event.meta.time,
                last_seq=seq,
            )
        case events.InstanceStopped() if state is not None and state.status == "running":
            return msgspec.structs.replace(state, status="stopped", stopped_at=event.meta.time, last_seq=seq)
        case _:
            raise errors.InvalidTransition(
                f"{events.tag_of(type(event))} at seq {seq} cannot follow "
                f"{state.status if state else 'nothing'} for an instance"
            )


@dataclass(frozen=True)
class Projection(Generic[S]):
    """How one aggregate kind is folded and where its state lives."""

    kind: str
    state_type: type[S]
    evolve: Callable[[S | None, events.AnyEvent, int], S]

    def key_of(self, aggregate_id: str) -> str:
        """KV key of an aggregate: the same token as its subject's last token."""
        return ids.token(aggregate_id)

    def key_of_subject(self, subject: str) -> str:
        return subject.rsplit(".", 1)[1]

    def fold(self, stored: Iterable[tuple[int, events.AnyEvent]], state: S | None = None) -> S | None:
        for seq, event in stored:
            state = self.evolve(state, event, seq)
        return state


SESSIONS: Projection[states.SessionState] = Projection(subjects.SESSION, states.SessionState, evolve_session)
INSTANCES: Projection[states.InstanceState] = Projection(
    subjects.INSTANCE, states.InstanceState, evolve_instance
)

SANDBOXES: Projection[states.SandboxState] = Projection(subjects.SANDBOX, states.SandboxState, evolve_sandbox)

PROXIES: Projection[states.ProxyState] = Projection(subjects.PROXY, states.ProxyState, evolve_proxy)

BY_KIND: dict[str, Projection[Any]] = {p.kind: p for p in (SESSIONS, INSTANCES, SANDBOXES, PROXIES)}

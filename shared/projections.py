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

S = TypeVar("S", states.SessionState, states.InstanceState)


def evolve_session(
    state: states.SessionState | None, event: events.AnyEvent, seq: int
) -> states.SessionState:
    def refuse(why: str) -> errors.InvalidTransition:
        return errors.InvalidTransition(
            f"{events.tag_of(type(event))} at seq {seq} cannot follow "
            f"{state.status if state else 'nothing'}: {why}"
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
            return msgspec.structs.replace(
                state,
                status="stopped",
                updated_at=event.meta.time,
                version=state.version + 1,
                last_seq=seq,
                last_command_id=event.meta.command_id,
            )
        case events.SessionDeleted():
            if state is None or state.status == "deleted":
                raise refuse("the session does not exist")
            return msgspec.structs.replace(
                state,
                status="deleted",
                updated_at=event.meta.time,
                version=state.version + 1,
                last_seq=seq,
                last_command_id=event.meta.command_id,
            )
        case _:
            raise refuse("not a session event")


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

BY_KIND: dict[str, Projection[Any]] = {p.kind: p for p in (SESSIONS, INSTANCES)}

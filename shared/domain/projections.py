"""How each aggregate kind is folded and where its state lives: one ``Projection`` per
kind, its fold from the aggregate's module (``evolve(state, event, seq)``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from shared.contract import events, ids, states, subjects
from shared.domain import instance, proxy, sandbox, session, snapshot

S = TypeVar(
    "S",
    states.SessionState,
    states.InstanceState,
    states.SandboxState,
    states.ProxyState,
    states.SnapshotState,
)


@dataclass(frozen=True)
class Projection(Generic[S]):
    """How one aggregate kind is folded and where its state lives."""

    kind: str
    state_type: type[S]
    evolve: Callable[[S | None, events.Event, int], S]

    def key_of(self, aggregate_id: str) -> str:
        """KV key of an aggregate: the same token as its subject's last token."""
        return ids.token(aggregate_id)

    def key_of_subject(self, subject: str) -> str:
        return subject.rsplit(".", 1)[1]

    def fold(self, stored: Iterable[tuple[int, events.Event]], state: S | None = None) -> S | None:
        for seq, event in stored:
            state = self.evolve(state, event, seq)
        return state


SESSIONS: Projection[states.SessionState] = Projection(subjects.SESSION, states.SessionState, session.evolve)
INSTANCES: Projection[states.InstanceState] = Projection(
    subjects.INSTANCE, states.InstanceState, instance.evolve
)

SANDBOXES: Projection[states.SandboxState] = Projection(subjects.SANDBOX, states.SandboxState, sandbox.evolve)

PROXIES: Projection[states.ProxyState] = Projection(subjects.PROXY, states.ProxyState, proxy.evolve)

SNAPSHOTS: Projection[states.SnapshotState] = Projection(
    subjects.SNAPSHOT, states.SnapshotState, snapshot.evolve
)

BY_KIND: dict[str, Projection[Any]] = {
    p.kind: p for p in (SESSIONS, INSTANCES, SANDBOXES, PROXIES, SNAPSHOTS)
}

"""Deciding and appending on one aggregate with optimistic concurrency: the write path.

``transact`` loads the aggregate's state (from KV, fast), asks a pure ``decide`` for
the events, appends them expecting the state's ``last_seq``, and projects them. If
another writer got there first it rebuilds the state from the stream and decides
again; if JetStream recognises the events as already appended (a redelivered
command) it returns the current state and appends nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Generic

from sbx_api import errors
from shared.contract import events
from shared.domain import projections
from shared.infrastructure import eventstore, faults, projector

MAX_ATTEMPTS = 16


class Outcome(Generic[projections.S]):
    __slots__ = ("appended", "before", "revision", "state")

    def __init__(
        self,
        state: projections.S | None,
        appended: list[eventstore.Stored],
        before: projections.S | None = None,
        revision: int | None = None,
    ) -> None:
        self.state: projections.S | None = state
        self.appended = appended
        self.before: projections.S | None = before
        """The state the appended events were decided on (None when nothing was appended)."""
        self.revision = revision
        """The KV revision of ``state`` as this writer wrote it, when known: with ``state``,
        the ``read`` of a next ``transact`` on the aggregate (no read of the bucket)."""

    @property
    def read(self) -> tuple[projections.S | None, int | None] | None:
        """``(state, revision)`` for a next ``transact``, or None when the revision is not known."""
        return (self.state, self.revision) if self.revision is not None else None


async def transact(
    store: projector.ProjectionStore[projections.S],
    aggregate_id: str,
    decide: Callable[[projections.S | None], Sequence[events.Event]],
    *,
    crash_points: frozenset[str] = frozenset(),
    crash_point: str = "",
    read: tuple[projections.S | None, int | None] | None = None,
) -> Outcome[projections.S]:
    topology = store.store.topology
    subject = topology.aggregate_subject(store.projection.kind, aggregate_id)
    # ``read``: the entry (state, KV revision) as the caller just read it; a stale one only
    # costs a failed append and a rebuild, as any concurrent writer does.
    state, revision = (
        read if read is not None else await store.get_entry(store.projection.key_of(aggregate_id))
    )
    revision_known = True  # False once the state is rebuilt from the stream, not read from KV
    for _ in range(MAX_ATTEMPTS):
        new_events = decide(state)
        if not new_events:
            return Outcome(state, [])
        try:
            stored = await store.store.append(
                subject, new_events, expected_last_seq=state.last_seq if state else 0
            )
        except eventstore.AlreadyAppended:
            return Outcome(await store.rebuild(subject), [])
        except errors.ConcurrencyError:
            state = await store.rebuild(subject)
            revision_known = False
            continue
        if crash_point:
            faults.crash_point(crash_points, crash_point)
        before = state
        written = None
        if not revision_known:
            for item in stored:
                state = await store.apply(item)
        else:
            state, written = await store.apply_appended(before, revision, stored)
        return Outcome(state, stored, before, written)
    raise errors.ConcurrencyError(f"{store.projection.kind} {aggregate_id!r} is changing too fast; retry")

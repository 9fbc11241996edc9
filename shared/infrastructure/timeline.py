"""Reading a session's timeline from the event stream (the rules of what belongs to it and
what each entry says: :mod:`shared.domain.timeline`). The gateway's route and ``sbx
timeline`` both read through :class:`TimelineReader`.

:meth:`TimelineReader.members` reads the session's own subject whole (its incarnations
and the sandboxes each had) for one caller; a page then reads only the session's subjects:
its own events, its audit records and the subjects of the sandboxes it had, and shows
what is of an incarnation the caller sees. Following reads that, then every sandbox's
subject from the stream's end as it was, so that a sandbox the session gets later joins.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Set

from sbx_api.wire import Timeline, TimelineEntry, TimelineKind
from shared.contract import events, subjects
from shared.domain import incarnations
from shared.domain import timeline as rules
from shared.infrastructure import eventstore


class TimelineReader:
    def __init__(self, store: eventstore.EventStore, topology: subjects.Topology) -> None:
        self.store = store
        self.topology = topology

    async def members(self, session_id: str, viewer: str | None = None) -> rules.Membership:
        """What the session's own subject says (its incarnations and sandboxes), for a
        caller acting for ``viewer`` (None: the operator)."""
        members = rules.Membership(session_id, viewer)
        async for stored in self.store.read(self.topology.aggregate_subject(subjects.SESSION, session_id)):
            members.learn(stored.seq, stored.event)
        return members

    async def page(
        self, members: rules.Membership, kinds: Set[TimelineKind], *, after: int = 0, limit: int = 100
    ) -> Timeline:
        session_id = members.session_id
        found: list[TimelineEntry] = []
        async for entry in self._entries(
            session_id, kinds, members, after, every_sandbox=False, follow=False
        ):
            found.append(entry)
            if len(found) > limit:
                break
        page = found[:limit]
        return Timeline(
            session_id=session_id,
            entries=page,
            next_after=page[-1].seq if page else after,
            more=len(found) > limit,
        )

    async def follow(
        self, members: rules.Membership, kinds: Set[TimelineKind], *, after: int = 0
    ) -> AsyncGenerator[TimelineEntry, None]:
        """The entries there are after ``after``, then each new one; never ends."""
        session_id = members.session_id
        end = await self.store.last_seq()
        sent = after
        async for entry in self._entries(
            session_id, kinds, members, after, every_sandbox=False, follow=False
        ):
            sent = entry.seq
            yield entry
        live = self._entries(session_id, kinds, members, max(end, sent), every_sandbox=True, follow=True)
        async for entry in live:
            if entry.seq > sent:
                sent = entry.seq
                yield entry

    def _subjects(
        self, session_id: str, kinds: Set[TimelineKind], members: rules.Membership, *, every_sandbox: bool
    ) -> list[str]:
        out = []
        for kind in rules.subject_kinds(frozenset(kinds)):
            if kind == subjects.SNAPSHOT:  # named by snapshot ids: every one, the session's kept
                out.append(self.topology.events_of_kind(subjects.SNAPSHOT))
            elif kind != subjects.SANDBOX:
                out.append(self.topology.aggregate_subject(kind, session_id))
            elif every_sandbox:
                out.append(self.topology.events_of_kind(subjects.SANDBOX))
            else:
                out += [self.topology.aggregate_subject(kind, s) for s in members.sandboxes]
        return out

    async def _entries(
        self,
        session_id: str,
        kinds: Set[TimelineKind],
        members: rules.Membership,
        after: int,
        *,
        every_sandbox: bool,
        follow: bool,
    ) -> AsyncGenerator[TimelineEntry, None]:
        wanted = self._subjects(session_id, kinds, members, every_sandbox=every_sandbox)
        reader = self.store.read(wanted, start_seq=after + 1, follow=follow)
        try:
            async for stored in reader:
                members.learn(stored.seq, stored.event)
                if not members.owns(stored.seq, stored.event):
                    continue
                await self._snapshot_of(members, stored.event)
                if not members.shows(stored.seq, stored.event):
                    continue
                entry = members.entry(stored.seq, stored.event)
                if entry is not None and entry.kind in kinds:
                    yield entry
        finally:
            await reader.aclose()

    async def _snapshot_of(self, members: rules.Membership, event: events.Event) -> None:
        """Learn which incarnation took a snapshot that a later event names (a page that
        starts after its creation has not read it): its subject's first event says."""
        if not isinstance(event, events.SnapshotEvent) or members.lives.knows_snapshot(event.snapshot_id):
            return
        if (first := await self._first_of_snapshot(event.snapshot_id)) is not None:
            members.learn(first.seq, first.event)

    async def place_snapshot(self, lives: incarnations.Incarnations, event: events.Event) -> None:
        """The same for a reader of the whole stream (the console's audit page): an event of
        a snapshot is placed in the incarnation that took it, whatever the page has read."""
        if not isinstance(event, events.SnapshotEvent) or lives.knows_snapshot(event.snapshot_id):
            return
        if (first := await self._first_of_snapshot(event.snapshot_id)) is not None:
            lives.learn(first.seq, first.event)

    async def _first_of_snapshot(self, snapshot_id: str) -> eventstore.Stored | None:
        reader = self.store.read(self.topology.aggregate_subject(subjects.SNAPSHOT, snapshot_id))
        try:
            async for first in reader:
                return first
        finally:
            await reader.aclose()
        return None

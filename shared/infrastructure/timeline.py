"""Reading a session's timeline from the event stream (the rules of what belongs to it and
what each entry says: :mod:`shared.domain.timeline`). The gateway's route and ``sbx
timeline`` both read through :class:`TimelineReader`.

A page reads only the session's subjects: its own events (always: they name its
sandboxes), its audit records and the subjects of the sandboxes it had. Following reads
that, then every sandbox's subject from the stream's end as it was, so that a sandbox the
session gets later joins.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Set

from sbx_client.api import Timeline, TimelineEntry, TimelineKind
from shared.contract import subjects
from shared.domain import timeline as rules
from shared.infrastructure import eventstore


class TimelineReader:
    def __init__(self, store: eventstore.EventStore, topology: subjects.Topology) -> None:
        self.store = store
        self.topology = topology

    async def page(
        self, session_id: str, kinds: Set[TimelineKind], *, after: int = 0, limit: int = 100
    ) -> Timeline:
        members = await self._members(session_id)
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
        self, session_id: str, kinds: Set[TimelineKind], *, after: int = 0
    ) -> AsyncGenerator[TimelineEntry, None]:
        """The entries there are after ``after``, then each new one; never ends."""
        members = await self._members(session_id)
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

    async def _members(self, session_id: str) -> rules.Membership:
        members = rules.Membership(session_id)
        async for stored in self.store.read(self.topology.aggregate_subject(subjects.SESSION, session_id)):
            members.learn(stored.seq, stored.event)
        return members

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
                entry = rules.entry_of(stored.seq, stored.event)
                if entry is not None and entry.kind in kinds:
                    yield entry
        finally:
            await reader.aclose()

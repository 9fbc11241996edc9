"""Which life of a session id an event belongs to, and who may see it (pure).

A session id can be deleted and created again, by another organisation too: each
``session.created`` on the id's subject starts an *incarnation*, its ``session.deleted``
ends it. Everything recorded about the id (its sandboxes' events, its commands, edits,
egress and snapshots) belongs to one incarnation, and an incarnation's history is shown
only to the organisation that created it; the operator (no organisation) sees every
incarnation, each entry with its number. A re-created id thus starts with an empty history
for its new owner, and the old owner keeps its own.

An event is placed, most exact rule first:

1. by its sandbox, if that sandbox was the session's in one incarnation (assigned, requested
   or claimed for it while that incarnation lived); by its snapshot, likewise;
2. a ``session.*`` event: by its position on the id's subject;
3. else by its position in the stream: the incarnation alive at that point; between two
   (after a deletion, before the next creation, where a first call's sandbox is requested)
   the next one, else the previous one; in each case only an incarnation of the
   organisation that caused the event (``meta.org_id``) or of none, when it names one.

An event none of these places is the operator's to see only.
"""

from __future__ import annotations

import msgspec

from shared.contract import events


class Incarnation(msgspec.Struct, frozen=True, kw_only=True):
    number: int
    """1 for the id's first life, +1 each time it is created again (as ``SessionState``'s)."""
    org_id: str | None
    """The organisation that created it (None: no organisation; only the operator sees it)."""
    created: int
    """Stream sequence of its ``session.created``."""
    deleted: int | None = None
    """Stream sequence of its ``session.deleted`` (None: it lives)."""


def named_sandbox(event: events.Event, session_id: str) -> str | None:
    """The sandbox an event gives the session (assigned to it, requested, claimed or
    refused for it), if any."""
    if isinstance(event, events.SessionSandboxAssigned) and event.session_id == session_id:
        return event.sandbox_id
    if isinstance(event, events.SandboxEvent) and getattr(event, "session_id", None) == session_id:
        return event.sandbox_id
    return None


def shown(incarnation: Incarnation | None, viewer: str | None) -> bool:
    """Whether a caller sees what belongs to ``incarnation``: the operator (``viewer``
    None) everything, even what no incarnation holds; an organisation only the
    incarnations it created (not those of no organisation, nor another's)."""
    return viewer is None or (incarnation is not None and incarnation.org_id == viewer)


class Incarnations:
    """The incarnations of one session id and what each had, learnt from the events in
    stream order (:meth:`learn` every event read; the id's own subject first, whole, so
    that later lives are known before their sandboxes' earlier events are placed)."""

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        self.lives: list[Incarnation] = []
        self._sandboxes: dict[str, int] = {}
        self._snapshots: dict[str, int] = {}
        self._last = 0
        """The last sequence of the id's own subject learnt (a re-read changes nothing)."""

    def learn(self, seq: int, event: events.Event) -> None:
        if isinstance(event, events.SessionEvent) and event.session_id == self.session_id:
            if seq <= self._last:
                return
            self._last = seq
            if isinstance(event, events.SessionCreated):
                self.lives.append(Incarnation(number=len(self.lives) + 1, org_id=event.org_id, created=seq))
            elif isinstance(event, events.SessionDeleted) and self.lives:
                self.lives[-1] = msgspec.structs.replace(self.lives[-1], deleted=seq)
        sandbox = named_sandbox(event, self.session_id)
        if sandbox is not None and sandbox not in self._sandboxes:
            if (life := self._placed(seq, event)) is not None:
                self._sandboxes[sandbox] = life.number
        if isinstance(event, events.SnapshotCreated) and event.session_id == self.session_id:
            if event.snapshot_id not in self._snapshots and (life := self.of(seq, event)) is not None:
                self._snapshots[event.snapshot_id] = life.number

    def knows_snapshot(self, snapshot_id: str) -> bool:
        return snapshot_id in self._snapshots

    def of(self, seq: int, event: events.Event) -> Incarnation | None:
        """The incarnation the event (at stream sequence ``seq``) belongs to, if any."""
        sandbox = getattr(event, "sandbox_id", None)
        if isinstance(sandbox, str) and sandbox in self._sandboxes:
            return self.lives[self._sandboxes[sandbox] - 1]
        if isinstance(event, events.SnapshotEvent) and event.snapshot_id in self._snapshots:
            return self.lives[self._snapshots[event.snapshot_id] - 1]
        return self._placed(seq, event)

    def shows(self, seq: int, event: events.Event, viewer: str | None) -> bool:
        """The rule: whether a caller acting for ``viewer`` (None: the operator) sees this
        event of the id."""
        return shown(self.of(seq, event), viewer)

    def seen_by(self, viewer: str | None) -> bool:
        """Whether the caller sees any incarnation (else, to it, the id never existed)."""
        return any(shown(life, viewer) for life in self.lives)

    def _placed(self, seq: int, event: events.Event) -> Incarnation | None:
        before = [life for life in self.lives if life.created <= seq]
        if isinstance(event, events.SessionEvent):
            return before[-1] if before else None
        last = before[-1] if before else None
        if last is not None and (last.deleted is None or seq <= last.deleted):
            return last if _caused_by(event, last) else None  # alive then
        after = self.lives[len(before)] if len(before) < len(self.lives) else None
        return next((c for c in (after, last) if c is not None and _caused_by(event, c)), None)


def _caused_by(event: events.Event, life: Incarnation) -> bool:
    """Whether the event may be the incarnation's by who caused it: an organisation's
    action is only ever in that organisation's sessions (or in those of none)."""
    org = event.meta.org_id
    return org is None or life.org_id is None or org == life.org_id

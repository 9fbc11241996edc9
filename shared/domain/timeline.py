"""A session's timeline (pure): which events belong to it and what each says, as
:class:`~sbx_api.wire.TimelineEntry`.

A session's timeline is its own events (``session.*``), the audit records of what ran in
it (``exec.completed``: commands, edits, transfers) and of what its sandboxes sent
through their proxy (``egress.recorded``), the events of the sandboxes it had, from
the moment each was its own (a warm pool sandbox's life before its claim belongs to the
pool), and its snapshots' (``snapshot.created``/``deleted``). Of those, a caller sees only
the incarnations its organisation created (:mod:`shared.domain.incarnations`); each entry
says which incarnation it is of.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from sbx_api import errors
from sbx_api.wire import TIMELINE_KINDS, EgressConnection, TimelineEntry, TimelineKind
from shared.contract import events, subjects
from shared.domain import egress, incarnations

EDIT_OPERATIONS = ("create", "str_replace", "insert")


def kinds(given: Iterable[str]) -> frozenset[TimelineKind]:
    """The kinds asked for (none: all); an unknown kind is an error."""
    chosen: set[TimelineKind] = set()
    for kind in given:
        if kind not in TIMELINE_KINDS:
            raise errors.InvalidInput(f"kind must be one of: {', '.join(TIMELINE_KINDS)}; not {kind[:40]!r}")
        chosen.add(kind)
    return frozenset(chosen or TIMELINE_KINDS)


def subject_kinds(wanted: frozenset[TimelineKind]) -> tuple[str, ...]:
    """The aggregate kinds whose subjects hold entries of the wanted kinds."""
    out: list[str] = [subjects.SESSION]  # always read: they name the session's sandboxes
    if wanted & {"command", "edit"}:
        out.append(subjects.EXEC)
    if "egress" in wanted:
        out.append(subjects.EGRESS)
    if "lifecycle" in wanted:
        out += [subjects.SANDBOX, subjects.SNAPSHOT]
    return tuple(out)


class Membership:
    """Which sandboxes are the session's, learnt from its events as they are read, and
    which of its events the caller sees (``viewer``: the organisation it acts for; None:
    the operator, who sees every incarnation)."""

    def __init__(self, session_id: str, viewer: str | None = None) -> None:
        self.session_id = session_id
        self.viewer = viewer
        self.sandboxes: dict[str, int] = {}
        """Sandbox id -> the sequence from which its events are the session's."""
        self.lives = incarnations.Incarnations(session_id)

    def learn(self, seq: int, event: events.Event) -> bool:
        """Note a sandbox the event gives the session; True if it is a new one."""
        self.lives.learn(seq, event)
        sandbox_id = incarnations.named_sandbox(event, self.session_id)
        if sandbox_id is None or sandbox_id in self.sandboxes:
            return False
        self.sandboxes[sandbox_id] = seq
        return True

    def owns(self, seq: int, event: events.Event) -> bool:
        """Whether the event is the session id's (of any incarnation)."""
        if isinstance(event, events.SandboxEvent):
            since = self.sandboxes.get(event.sandbox_id)
            return (since is not None and seq >= since) or event.meta.session_id == self.session_id
        if isinstance(event, events.SessionEvent | events.CommandExecuted | events.EgressRecorded):
            return event.session_id == self.session_id
        if isinstance(event, events.SnapshotEvent):  # the session's snapshots: taken, kept warm, deleted
            return getattr(event, "session_id", None) == self.session_id
        return False

    def shows(self, seq: int, event: events.Event) -> bool:
        """Whether the event is the session's and of an incarnation the caller sees."""
        return self.owns(seq, event) and self.lives.shows(seq, event, self.viewer)

    def entry(self, seq: int, event: events.Event) -> TimelineEntry | None:
        """The entry of one of the session's events, with its incarnation."""
        entry = entry_of(seq, event)
        life = self.lives.of(seq, event)
        if entry is None or life is None:
            return entry
        return msgspec.structs.replace(entry, incarnation=life.number)


def entry_of(seq: int, event: events.Event) -> TimelineEntry | None:
    """The entry one of a session's events makes (None: it makes none)."""
    meta = event.meta
    base = TimelineEntry(
        seq=seq,
        time=meta.time,
        kind="lifecycle",
        type=events.tag_of(type(event)),
        summary="",
        org_id=meta.org_id,
        user_id=meta.user_id,
        request_id=meta.correlation_id,
    )
    if isinstance(event, events.CommandExecuted):
        edit = event.tool == "edit"
        operation = event.command.split(" ", 1)[0] if edit else None
        shown = f"{event.command[:200]}" + (
            f" -> exit {event.exit_code}" if event.exit_code is not None else f" -> {event.outcome}"
        )
        return msgspec.structs.replace(
            base,
            kind="edit" if edit else "command",
            summary=f"{event.tool}: {shown}",
            sandbox_id=event.sandbox_id or None,
            tool=event.tool,
            command=event.command,
            exit_code=event.exit_code,
            duration_ms=event.duration_ms,
            outcome=event.outcome,
            error=event.error,
            path=event.path,
            operation=operation if operation in EDIT_OPERATIONS else None,
            size=event.size,
        )
    if isinstance(event, events.EgressRecorded):
        return msgspec.structs.replace(
            base,
            kind="egress",
            summary=egress.summary(event),
            sandbox_id=event.sandbox_id,
            connections=[
                msgspec.convert(msgspec.to_builtins(c), EgressConnection) for c in event.connections
            ],
            lost=event.lost or None,
        )
    if isinstance(event, events.SessionEvent | events.SandboxEvent | events.SnapshotEvent):
        return msgspec.structs.replace(
            base,
            summary=_lifecycle_summary(event),
            sandbox_id=getattr(event, "sandbox_id", None),
        )
    return None


def _lifecycle_summary(event: events.Event) -> str:
    tag = events.tag_of(type(event))
    details = [
        f"{name}={value}"
        for name in (
            "snapshot_id",
            "sandbox_id",
            "image",
            "snapshot",
            "forked_from",
            "reason",
            "error",
            "exit_code",
            "count",
        )
        if (value := getattr(event, name, None)) not in (None, "")
    ]
    return tag + (f" ({', '.join(details)})" if details else "")

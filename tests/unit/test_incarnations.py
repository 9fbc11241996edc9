"""Which incarnation of a session id an event belongs to, and who sees it
(shared/domain/incarnations.py): a deleted session's history never goes to the id's next
owner, and the next owner's never to the old one."""

from __future__ import annotations

from datetime import UTC, datetime

from shared.contract import events
from shared.domain import incarnations, timeline

NOW = datetime(2026, 12, 3, tzinfo=UTC)


def meta(org: str | None = None, session_id: str | None = "x") -> events.Meta:
    return events.Meta(
        event_id="e" * 32, time=NOW, service="test", instance="t1", org_id=org, session_id=session_id
    )


def created(org: str | None) -> events.SessionCreated:
    return events.SessionCreated(meta=meta(org), session_id="x", org_id=org)


def assigned(sandbox: str, org: str | None) -> events.SessionSandboxAssigned:
    return events.SessionSandboxAssigned(meta=meta(org), session_id="x", sandbox_id=sandbox, image="default")


def ran(sandbox: str, org: str | None, command: str = "true") -> events.CommandExecuted:
    return events.CommandExecuted(
        meta=meta(org), session_id="x", sandbox_id=sandbox, tool="shell", command=command
    )


def deleted(org: str | None) -> events.SessionDeleted:
    return events.SessionDeleted(meta=meta(org), session_id="x")


# acme's life of "x" (seq 1-9), then globex's (from 20): what the id's subject holds.
SUBJECT = [
    (1, created("acme")),
    (2, assigned("sb-a", "acme")),
    (9, deleted("acme")),
    (20, created("globex")),
    (21, assigned("sb-g", "globex")),
]


def lives() -> incarnations.Incarnations:
    known = incarnations.Incarnations("x")
    for seq, event in SUBJECT:
        known.learn(seq, event)
    return known


def test_each_creation_starts_an_incarnation_of_its_organisation():
    known = lives()
    assert [(life.number, life.org_id, life.created, life.deleted) for life in known.lives] == [
        (1, "acme", 1, 9),
        (2, "globex", 20, None),
    ]
    for seq, event in SUBJECT:  # the subject read again (a page, then the stream): nothing changes
        known.learn(seq, event)
    assert len(known.lives) == 2 and known.lives[0].deleted == 9


def test_an_organisation_sees_only_the_incarnations_it_created():
    known = lives()
    mine, theirs = ran("sb-a", "acme", "cat secret"), ran("sb-g", "globex", "make")
    assert known.shows(5, mine, "acme") and not known.shows(5, mine, "globex")
    assert known.shows(25, theirs, "globex") and not known.shows(25, theirs, "acme")
    assert known.shows(5, mine, None) and known.shows(25, theirs, None)  # the operator: both
    for seq, event in SUBJECT:
        assert known.shows(seq, event, None)
        assert known.shows(seq, event, "acme") == (seq < 20)
        assert known.shows(seq, event, "globex") == (seq >= 20)
    assert known.seen_by("acme") and known.seen_by("globex") and known.seen_by(None)
    assert not known.seen_by("initech")


def test_a_late_record_of_the_old_life_stays_with_it():
    """acme's command ended after its session was deleted and globex took the id: its
    record lands in globex's life by position, but it names acme's sandbox."""
    known = lives()
    late = ran("sb-a", "acme", "cat secret")
    assert known.of(30, late).number == 1
    assert not known.shows(30, late, "globex") and known.shows(30, late, "acme")
    egress = events.EgressRecorded(
        meta=meta(), session_id="x", sandbox_id="sb-a", proxy_id="p1", connections=[]
    )
    assert not known.shows(31, egress, "globex")
    stopped = events.SandboxDeleted(meta=meta(), sandbox_id="sb-a")
    assert known.of(32, stopped).number == 1


def test_a_first_call_before_the_creation_is_the_next_life():
    """A session's first call asks for its sandbox before the session is recorded: between
    two lives, an event is the next one's when its organisation made it."""
    known = incarnations.Incarnations("x")
    requested = events.SandboxRequested(meta=meta("globex"), sandbox_id="sb-g", session_id="x")
    refused = events.SandboxRefused(meta=meta("globex"), sandbox_id="sb-r", session_id="x", reason="limit")
    for seq, event in SUBJECT[:3]:
        known.learn(seq, event)
    known.learn(15, requested)  # live: globex's life is not known yet
    assert known.of(15, requested) is None  # not acme's: another organisation made it
    for seq, event in SUBJECT[3:]:
        known.learn(seq, event)
    assert known.of(15, requested).number == 2  # assigned in globex's life
    assert known.of(16, refused).number == 2 and not known.shows(16, refused, "acme")
    # Read in stream order with the subject read first (as a page does): the same answers.
    again = lives()
    again.learn(15, requested)
    again.learn(16, refused)
    assert again.of(15, requested).number == 2 and again.of(16, refused).number == 2


def test_what_another_organisation_caused_is_never_placed_in_a_life_by_position():
    known = lives()
    stray = events.CommandExecuted(meta=meta("acme"), session_id="x", sandbox_id="", tool="run", command="id")
    assert known.of(25, stray) is None  # during globex's life, made by acme: nobody's
    assert known.shows(25, stray, None) and not known.shows(25, stray, "globex")
    assert not known.shows(25, stray, "acme")
    by_service = events.CommandExecuted(
        meta=meta(None), session_id="x", sandbox_id="", tool="run", command="id"
    )
    assert known.of(25, by_service).number == 2 and known.of(5, by_service).number == 1
    assert known.of(12, by_service).number == 2  # after acme's deletion: the next life first


def test_an_id_of_no_organisation_is_the_operators_alone():
    known = incarnations.Incarnations("x")
    known.learn(1, created(None))
    assert known.seen_by(None) and not known.seen_by("acme")
    assert not known.shows(2, ran("sb", "acme"), "acme")  # an organisation acting in it sees nothing of it


def test_snapshots_are_of_the_life_whose_sandbox_they_copied():
    known = lives()
    taken = events.SnapshotCreated(
        meta=meta(), snapshot_id="snap-a", session_id="x", sandbox_id="sb-a", org_id="acme", digest="sha256:0"
    )
    known.learn(5, taken)
    gone = events.SnapshotDeleted(meta=meta(), snapshot_id="snap-a", session_id="x")
    assert known.knows_snapshot("snap-a") and known.of(40, gone).number == 1
    assert not known.shows(40, gone, "globex") and known.shows(40, gone, "acme")


def test_the_timeline_shows_a_viewer_its_incarnations_numbered():
    members = timeline.Membership("x", "globex")
    for seq, event in SUBJECT:
        members.learn(seq, event)
    assert not members.shows(5, ran("sb-a", "acme", "cat secret"))
    assert members.shows(25, ran("sb-g", "globex"))
    entry = members.entry(25, ran("sb-g", "globex"))
    assert entry is not None and entry.incarnation == 2
    operator = timeline.Membership("x")
    for seq, event in SUBJECT:
        operator.learn(seq, event)
    assert operator.shows(5, ran("sb-a", "acme")) and operator.entry(5, ran("sb-a", "acme")).incarnation == 1
    other = events.CommandExecuted(
        meta=meta("acme"), session_id="y", sandbox_id="sb-y", tool="run", command="id"
    )
    assert not operator.shows(5, other)  # another session's: not on this timeline at all

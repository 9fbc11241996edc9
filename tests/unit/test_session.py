"""Pure session decisions (scheduler.logic.decide/validate) and the folds in shared.domain.projections."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sbx_api import errors
from shared.contract import commands, events, states
from shared.domain import instance as instance_rules
from shared.domain import projections, session
from tests import factories

T0 = datetime(2025, 6, 1, 12, 0, 0, tzinfo=UTC)
SID = "task-42"
ACTOR = commands.Actor(via="rest", org_id="acme", user_id="alice")


def meta(n: int = 0, command_id: str | None = "cmd-0") -> events.Meta:
    return factories.meta(n, command_id=command_id, session_id=SID)


def create(cid: str = "cmd-c", image: str | None = "python:3.12", sid: str = SID) -> commands.CreateSession:
    return commands.CreateSession(command_id=cid, actor=ACTOR, session_id=sid, image=image)


def stop(cid: str = "cmd-s", sid: str = SID) -> commands.StopSession:
    return commands.StopSession(command_id=cid, session_id=sid)


def delete(cid: str = "cmd-d", sid: str = SID) -> commands.DeleteSession:
    return commands.DeleteSession(command_id=cid, session_id=sid)


def state(status: str, **kw: Any) -> states.SessionState:
    fields: dict[str, Any] = dict(last_seq=3, version=3, last_command_id="cmd-earlier")
    return factories.session_state(SID, status, **(fields | kw))


# ---- decide -------------------------------------------------------------------------------


def test_create_on_nothing() -> None:
    m = meta(1, "cmd-c")
    assert session.decide(None, create(), m) == [
        events.SessionCreated(meta=m, session_id=SID, image="python:3.12", org_id="acme", user_id="alice")
    ]


def test_create_on_deleted_starts_a_new_incarnation() -> None:
    old = state("deleted", incarnation=2, version=6, last_seq=10)
    m = meta(20, "cmd-c")
    [event] = session.decide(old, create(image=None), m)
    assert isinstance(event, events.SessionCreated) and event.image is None
    new = session.evolve(old, event, 11)
    assert (new.status, new.incarnation, new.version, new.last_seq) == ("active", 3, 7, 11)
    assert new.created_at == new.updated_at == m.time
    assert new.image is None and new.last_command_id == "cmd-c"


@pytest.mark.parametrize("status", ["active", "stopped"])
def test_create_on_existing_is_a_conflict(status: str) -> None:
    with pytest.raises(errors.Conflict, match=status):
        session.decide(state(status), create(), meta())


def test_stop_active() -> None:
    m = meta(2, "cmd-s")
    assert session.decide(state("active"), stop(), m) == [events.SessionStopped(meta=m, session_id=SID)]


def test_stop_stopped_is_a_no_op() -> None:
    assert session.decide(state("stopped"), stop(), meta()) == []


@pytest.mark.parametrize("current", [None, state("deleted")], ids=["missing", "deleted"])
@pytest.mark.parametrize("command", [stop(), delete()], ids=["stop", "delete"])
def test_stop_or_delete_missing_is_not_found(current: states.SessionState | None, command: Any) -> None:
    with pytest.raises(errors.NotFound):
        session.decide(current, command, meta())


@pytest.mark.parametrize("status", ["active", "stopped"])
def test_delete_existing(status: str) -> None:
    m = meta(4, "cmd-d")
    assert session.decide(state(status), delete(), m) == [events.SessionDeleted(meta=m, session_id=SID)]


@pytest.mark.parametrize(
    ("status", "command"),
    [
        ("active", create("dup")),  # would otherwise be a Conflict
        ("stopped", stop("dup")),
        ("active", stop("dup")),  # would otherwise stop
        ("deleted", delete("dup")),  # would otherwise be NotFound
        ("deleted", stop("dup")),
        ("stopped", delete("dup")),
    ],
)
def test_duplicate_command_decides_nothing(status: str, command: Any) -> None:
    assert session.decide(state(status, last_command_id="dup"), command, meta(9, "dup")) == []


# ---- validate -----------------------------------------------------------------------------


@pytest.mark.parametrize("command", [create(), create(image=None), stop(), delete()])
def test_validate_accepts_well_formed(command: Any) -> None:
    session.validate(command)


@pytest.mark.parametrize(
    "command",
    [
        create(sid=""),
        create(sid="a.b"),
        create(sid="a>b"),
        create(sid="*"),
        stop(sid="../etc"),
        delete(sid="x" * 129),
        commands.CreateSession(command_id="c", session_id=SID, actor=commands.Actor(org_id="ac\nme")),
        commands.StopSession(command_id="c", session_id=SID, actor=commands.Actor(user_id="bo\x00b")),
        commands.DeleteSession(command_id="c", session_id=SID, actor=commands.Actor(org_id="o" * 257)),
        create(image="a b"),
        create(image="$(reboot)"),
        create(image=""),
        create(image="i" * 257),
    ],
)
def test_validate_rejects_malformed(command: Any) -> None:
    with pytest.raises(errors.InvalidInput):
        session.validate(command)


# ---- evolve -------------------------------------------------------------------------------


def created(n: int = 1) -> events.SessionCreated:
    return events.SessionCreated(meta=meta(n, f"c{n}"), session_id=SID, org_id="acme")


def stopped(n: int = 2) -> events.SessionStopped:
    return events.SessionStopped(meta=meta(n, f"c{n}"), session_id=SID)


def deleted(n: int = 3) -> events.SessionDeleted:
    return events.SessionDeleted(meta=meta(n, f"c{n}"), session_id=SID)


def started() -> events.InstanceStarted:
    return events.InstanceStarted(
        meta=meta(0, None), service="executor", instance="executor-1", pid=10, host="h", version="1.0"
    )


def test_session_lifecycle_fold() -> None:
    s = projections.SESSIONS.fold([(5, created(1)), (8, stopped(2)), (13, deleted(3))])
    assert s is not None
    assert (s.status, s.version, s.last_seq, s.incarnation, s.org_id) == ("deleted", 3, 13, 1, "acme")
    assert s.created_at == T0 + timedelta(seconds=1) and s.updated_at == T0 + timedelta(seconds=3)
    assert s.last_command_id == "c3"


@pytest.mark.parametrize(
    ("before", "event"),
    [
        (None, stopped()),
        (None, deleted()),
        (state("active"), created()),
        (state("stopped"), created()),
        (state("stopped"), stopped()),
        (state("deleted"), stopped()),
        (state("deleted"), deleted()),
        (None, started()),
        (state("active"), started()),
    ],
)
def test_evolve_session_refuses_impossible_events(before: states.SessionState | None, event: Any) -> None:
    with pytest.raises(errors.InvalidTransition):
        session.evolve(before, event, 99)


def test_evolve_instance_started_then_stopped() -> None:
    s = instance_rules.evolve(None, started(), 1)
    assert (s.status, s.pid, s.host, s.version, s.started_at, s.stopped_at, s.last_seq) == (
        "running",
        10,
        "h",
        "1.0",
        T0,
        None,
        1,
    )
    stop_event = events.InstanceStopped(meta=meta(7, None), service="executor", instance="executor-1")
    s2 = instance_rules.evolve(s, stop_event, 2)
    assert s2 == msgspec.structs.replace(
        s, status="stopped", stopped_at=T0 + timedelta(seconds=7), last_seq=2
    )
    with pytest.raises(errors.InvalidTransition):
        instance_rules.evolve(s2, stop_event, 3)
    # A reused SBX_INSTANCE_ID starts again, after a clean stop or after a crash.
    for before in (s, s2):
        again = instance_rules.evolve(before, started(), 3)
        assert (again.status, again.stopped_at, again.last_seq) == ("running", None, 3)
    with pytest.raises(errors.InvalidTransition):
        instance_rules.evolve(None, stop_event, 1)
    with pytest.raises(errors.InvalidTransition):
        instance_rules.evolve(s, created(), 3)


# ---- property: decide then evolve never disagree ------------------------------------------


def ensure(cid: str) -> commands.EnsureSession:
    return commands.EnsureSession(command_id=cid, actor=ACTOR, session_id=SID, image="python:3.12")


def provision(cid: str) -> commands.ProvisionSandbox:
    return commands.ProvisionSandbox(
        command_id=cid, actor=ACTOR, session_id=SID, image="node:22", use_kata=True
    )


def clear(cid: str) -> commands.ClearSession:
    return commands.ClearSession(command_id=cid, actor=ACTOR, session_id=SID)


def pause(cid: str = "cmd-p", sid: str = SID) -> commands.PauseSession:
    return commands.PauseSession(command_id=cid, session_id=sid)


def resume(cid: str = "cmd-r", sid: str = SID) -> commands.ResumeSession:
    return commands.ResumeSession(command_id=cid, session_id=sid)


def hibernate(cid: str = "cmd-h", sid: str = SID) -> commands.HibernateSession:
    return commands.HibernateSession(command_id=cid, session_id=sid)


def snapshot(cid: str = "cmd-s", sid: str = SID) -> commands.SnapshotSession:
    return commands.SnapshotSession(command_id=cid, session_id=sid, snapshot_id="snap-1")


def fork(cid: str = "cmd-f", sid: str = SID) -> commands.ForkSession:
    return commands.ForkSession(command_id=cid, session_id=sid, snapshot_id="snap-1")


def restore(cid: str = "cmd-rs", sid: str = SID) -> commands.RestoreSession:
    return commands.RestoreSession(command_id=cid, session_id=sid, snapshot_id="snap-1")


def unsnap(cid: str = "cmd-u", sid: str = SID) -> commands.DeleteSnapshot:
    return commands.DeleteSnapshot(command_id=cid, session_id=sid, snapshot_id="snap-1")


def warm(cid: str = "cmd-w", sid: str = SID) -> commands.WarmSnapshot:
    return commands.WarmSnapshot(command_id=cid, session_id=sid, snapshot_id="snap-1", count=2)


def deadline(cid: str = "cmd-d", sid: str = SID) -> commands.SetDeadline:
    return commands.SetDeadline(
        command_id=cid, session_id=sid, end_at=datetime(2026, 12, 5, 3, 0, tzinfo=UTC)
    )


KINDS: dict[str, Any] = {
    "create": create,
    "stop": stop,
    "delete": delete,
    "ensure": ensure,
    "provision": provision,
    "clear": clear,
    "pause": pause,
    "resume": resume,
    "hibernate": hibernate,
    "snapshot": snapshot,
    "fork": fork,
    "restore": restore,
    "unsnap": unsnap,
    "warm": warm,
    "deadline": deadline,
}
#: Status a command leaves the session in whenever it appends an event.
STATUS_AFTER = {
    commands.CreateSession: "active",
    commands.EnsureSession: "active",
    commands.ProvisionSandbox: "active",
    commands.StopSession: "stopped",
    commands.DeleteSession: "deleted",
    commands.ClearSession: "deleted",
    commands.PauseSession: "never",  # the sandbox's transition: no session event
    commands.ResumeSession: "never",
    commands.HibernateSession: "never",
    commands.SnapshotSession: "never",  # a snapshot's events, or a sandbox swap (the scheduler's)
    commands.ForkSession: "never",  # created with its sandbox: decide_fork
    commands.RestoreSession: "never",
    commands.DeleteSnapshot: "never",
    commands.WarmSnapshot: "never",  # a snapshot's event: the session is untouched
    commands.SetDeadline: "same",  # only its deadline moves
}
SANDBOXES = ["sb-1", "sb-2"]
step = st.one_of(
    st.just(("dup", "")),
    st.tuples(st.sampled_from(sorted(KINDS)), st.sampled_from(["a", "b", "c", "d"])),
    st.tuples(st.sampled_from(["assign", "release"]), st.sampled_from(SANDBOXES)),
)


def test_status_table_covers_every_command() -> None:
    assert set(STATUS_AFTER) == set(commands.COMMAND_TYPES)
    assert {type(make("x")) for make in KINDS.values()} == set(commands.COMMAND_TYPES)


@settings(max_examples=400, deadline=None)
@given(st.lists(step, max_size=40))
def test_decide_then_evolve_property(steps: list[tuple[str, str]]) -> None:
    current: states.SessionState | None = None
    seq = folded = 0
    previous: Any = None
    for n, (kind, arg) in enumerate(steps):
        before = current
        if kind in ("assign", "release"):
            # The scheduler assigns/releases within the command that needed it, under its id.
            m = meta(n, previous.command_id if previous is not None else "system")
            if kind == "assign":
                produced: list[events.SessionEvent] = session.decide_assign(current, arg, "img:1", m)
                should = current is not None and current.status == "active" and current.sandbox_id is None
            else:
                produced = session.decide_release(current, arg, m)
                should = current is not None and current.sandbox_id == arg
            assert len(produced) == int(should)
            for event in produced:
                seq += 1
                current = session.evolve(current, event, seq)
                folded += 1
            if produced:
                assert before is not None and current is not None
                assert current.status == before.status and current.incarnation == before.incarnation
                assert current.sandbox_id == (arg if kind == "assign" else None)
                if kind == "assign":
                    assert current.image == "img:1"
            else:
                assert current == before
        else:
            is_dup = kind == "dup" and previous is not None
            command = previous if is_dup else KINDS["create" if kind == "dup" else kind](arg)
            try:
                produced = session.decide(current, command, meta(n, command.command_id))
            except errors.Conflict:  # exists already; or stopped, for a snapshot or a restore
                assert isinstance(
                    command,
                    commands.CreateSession
                    | commands.ForkSession
                    | commands.SnapshotSession
                    | commands.RestoreSession,
                )
                produced = []
            except errors.NotFound:
                assert isinstance(
                    command,
                    commands.StopSession
                    | commands.DeleteSession
                    | commands.PauseSession
                    | commands.ResumeSession
                    | commands.HibernateSession
                    | commands.SnapshotSession
                    | commands.RestoreSession
                    | commands.SetDeadline,
                )
                produced = []
            if is_dup:  # a retry never transitions again, even after an assign/release
                assert produced == []
            assert len(produced) <= 1
            for event in produced:
                seq += 1 + n % 3  # sequences increase, not necessarily by one
                current = session.evolve(current, event, seq)
                folded += 1
                if isinstance(event, events.SessionCreated):  # incarnation only ever goes up, by one
                    assert current.incarnation == (before.incarnation + 1 if before else 1)
                    assert current.sandbox_id is None
                else:
                    assert before is not None and current.incarnation == before.incarnation
                assert current.last_command_id == command.command_id
                after = STATUS_AFTER[type(command)]
                assert current.status == (before.status if after == "same" and before else after)
            previous = command
        if current is not None:
            assert current.version == folded
            assert current.last_seq == seq
            assert current.status in ("active", "stopped", "deleted")
            assert current.session_id == SID
            if current.status == "deleted":
                assert current.sandbox_id is None
        else:
            assert folded == 0


# ---- organisations ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("command", "outcome"),
    [
        (stop(), errors.NotFound),
        (delete(), errors.NotFound),
        (commands.ClearSession(command_id="c", session_id=SID, actor=ACTOR), []),
        (commands.EnsureSession(command_id="c", session_id=SID, actor=ACTOR), errors.Conflict),
        (commands.ProvisionSandbox(command_id="c", session_id=SID, actor=ACTOR), errors.Conflict),
        (create(), errors.Conflict),
    ],
)
def test_a_caller_for_one_organisation_never_reaches_anothers_session(command: Any, outcome: Any) -> None:
    other = state("active", org_id="globex")
    if isinstance(command, commands.StopSession | commands.DeleteSession):
        command = msgspec.structs.replace(command, actor=ACTOR)
    if isinstance(outcome, list):
        assert session.decide(other, command, meta(4)) == outcome
    else:
        with pytest.raises(outcome):
            session.decide(other, command, meta(4))


def test_the_operator_and_the_sessions_own_organisation_reach_it() -> None:
    mine = state("stopped", org_id="acme")
    resumed = session.decide(
        mine, commands.EnsureSession(command_id="c", session_id=SID, actor=ACTOR), meta(4)
    )
    assert [type(e) for e in resumed] == [events.SessionResumed]
    operator = commands.StopSession(command_id="c", session_id=SID)
    assert session.decide(state("active", org_id="globex"), operator, meta(4))


# ---- a new session's first request: created and given its sandbox in one append -----------


def ensure(cid: str = "cmd-e") -> commands.EnsureSession:
    return commands.EnsureSession(command_id=cid, actor=ACTOR, session_id=SID)


def test_first_request_creates_and_assigns_in_one_decision() -> None:
    decided = session.decide_new_with_sandbox(None, ensure(), "sb-1", "default", "acme", meta())
    assert [type(e) for e in decided] == [events.SessionCreated, events.SessionSandboxAssigned]
    folded = projections.SESSIONS.fold((n + 1, e) for n, e in enumerate(decided))
    assert folded is not None and folded.status == "active" and folded.sandbox_id == "sb-1"
    assert folded.org_id == "acme"


def test_first_request_on_a_deleted_session_starts_a_new_incarnation_with_the_sandbox() -> None:
    decided = session.decide_new_with_sandbox(state("deleted"), ensure(), "sb-1", "default", "acme", meta())
    assert [type(e) for e in decided] == [events.SessionCreated, events.SessionSandboxAssigned]


def test_first_request_that_lost_a_race_assigns_nothing() -> None:
    """Another request created the session and gave it a sandbox meanwhile: the caller
    keeps theirs and discards its own."""
    taken = state("active", sandbox_id="sb-other")
    assert session.decide_new_with_sandbox(taken, ensure(), "sb-1", "default", "acme", meta()) == []
    resumed = session.decide_new_with_sandbox(
        state("stopped", sandbox_id="sb-other"), ensure(), "sb-1", "default", "acme", meta()
    )
    assert [type(e) for e in resumed] == [events.SessionResumed]


def test_first_request_on_a_session_made_without_a_sandbox_just_assigns() -> None:
    mine = state("active", org_id="acme")
    decided = session.decide_new_with_sandbox(mine, ensure(), "sb-1", "default", "acme", meta())
    assert [type(e) for e in decided] == [events.SessionSandboxAssigned]


def test_a_sandbox_obtained_for_an_organisation_never_goes_to_a_session_of_none() -> None:
    """Another request made the session first, for no organisation: the sandbox obtained
    for acme (which may show acme's cache) is not given to it; the caller discards it
    and serves the session as it is (another organisation's session is refused below)."""
    made = state("active", org_id=None)
    assert session.decide_new_with_sandbox(made, ensure(), "sb-1", "default", "acme", meta()) == []
    for_none = session.decide_new_with_sandbox(state("active"), ensure(), "sb-1", "default", None, meta())
    assert [type(e) for e in for_none] == [events.SessionSandboxAssigned]


def test_first_request_never_takes_another_organisations_session() -> None:
    theirs = state("active", org_id="globex")
    with pytest.raises(errors.Conflict):
        session.decide_new_with_sandbox(theirs, ensure(), "sb-1", "default", "acme", meta())


def test_create_sandbox_replaces_whatever_sandbox_the_session_got_meanwhile() -> None:
    """A first-call create_sandbox races the sandbox claimed at connect: its own sandbox
    wins (the claimed one is released in the same append), never the other way round."""
    m = meta()
    claimed = state("active", sandbox_id="sb-claimed")
    install = session.decide_install(claimed, "sb-asked", "default", m)
    assert [type(e).__name__ for e in install] == ["SessionSandboxReleased", "SessionSandboxAssigned"]
    assert session.released(install) == ["sb-claimed"] and install[1].sandbox_id == "sb-asked"
    empty = session.decide_install(state("active"), "sb-asked", "default", m)
    assert [type(e).__name__ for e in empty] == ["SessionSandboxAssigned"] and session.released(empty) == []
    assert session.decide_install(state("active", sandbox_id="sb-asked"), "sb-asked", "default", m) == []
    assert session.decide_install(state("stopped", sandbox_id="sb-x"), "sb-asked", "default", m) == []
    assert session.decide_install(None, "sb-asked", "default", m) == []

"""Sessions with sandboxes: the new session events and commands (scheduler.logic) and the
sandbox fold (shared.domain.sandbox_rules.evolve)."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta
from typing import Any

import msgspec
import pytest

from sbx_api import errors
from shared.contract import commands, events, ids, states
from shared.domain import projections
from shared.domain import sandbox as sandbox_rules
from shared.domain import session as session_rules
from tests import factories

T0 = datetime(2025, 6, 1, 12, 0, 0, tzinfo=UTC)
SID = "task-42"
SB = "sb-0123456789abcdef0123"
SB2 = "sb-fedcba9876543210fedc"
ACTOR = commands.Actor(via="mcp", org_id="acme", user_id="alice")


def meta(n: int = 0, command_id: str | None = "cmd-0") -> events.Meta:
    return factories.meta(n, command_id=command_id, session_id=SID)


def session(status: str, **kw: Any) -> states.SessionState:
    fields: dict[str, Any] = dict(image="python:3.12", last_seq=3, version=3, last_command_id="cmd-earlier")
    return factories.session_state(SID, status, **(fields | kw))


def ensure(cid: str = "cmd-e", image: str | None = "python:3.12", actor: commands.Actor = ACTOR) -> Any:
    return commands.EnsureSession(command_id=cid, actor=actor, session_id=SID, image=image)


def provision(cid: str = "cmd-p", image: str | None = "node:22", **kw: Any) -> commands.ProvisionSandbox:
    return commands.ProvisionSandbox(command_id=cid, actor=ACTOR, session_id=SID, image=image, **kw)


def clear(cid: str = "cmd-x") -> commands.ClearSession:
    return commands.ClearSession(command_id=cid, actor=ACTOR, session_id=SID)


# ---- evolve_session: resumed, sandbox assigned/released ---------------------------------


def resumed(n: int = 5) -> events.SessionResumed:
    return events.SessionResumed(meta=meta(n, f"c{n}"), session_id=SID)


def assigned(sandbox_id: str = SB, image: str = "node:22", n: int = 6) -> events.SessionSandboxAssigned:
    return events.SessionSandboxAssigned(
        meta=meta(n, f"c{n}"), session_id=SID, sandbox_id=sandbox_id, image=image
    )


def released(sandbox_id: str = SB, n: int = 7) -> events.SessionSandboxReleased:
    return events.SessionSandboxReleased(meta=meta(n, f"c{n}"), session_id=SID, sandbox_id=sandbox_id)


def test_resume_a_stopped_session_keeps_its_sandbox() -> None:
    before = session("stopped", sandbox_id=SB)
    after = session_rules.evolve(before, resumed(5), 40)
    assert after == msgspec.structs.replace(
        before,
        status="active",
        updated_at=T0 + timedelta(seconds=5),
        version=4,
        last_seq=40,
        last_command_id="c5",
    )


@pytest.mark.parametrize(
    "before",
    [None, session("active"), session("active", sandbox_id=SB), session("deleted")],
    ids=["missing", "active", "active-with-sandbox", "deleted"],
)
def test_resume_only_from_stopped(before: states.SessionState | None) -> None:
    with pytest.raises(errors.InvalidTransition, match="session.resumed at seq 9"):
        session_rules.evolve(before, resumed(), 9)


def test_assign_sets_sandbox_and_image() -> None:
    before = session("active", image=None)
    after = session_rules.evolve(before, assigned(SB, "node:22", 6), 11)
    assert (after.status, after.sandbox_id, after.image) == ("active", SB, "node:22")
    assert (after.version, after.last_seq, after.last_command_id) == (4, 11, "c6")
    assert after.updated_at == T0 + timedelta(seconds=6) and after.created_at == T0
    assert after.incarnation == before.incarnation


@pytest.mark.parametrize(
    "before",
    [
        None,
        session("stopped"),
        session("deleted"),
        session("active", sandbox_id=SB),
        session("active", sandbox_id=SB2),
        session("stopped", sandbox_id=SB),
    ],
    ids=["missing", "stopped", "deleted", "already-same", "already-other", "stopped-with-sandbox"],
)
def test_assign_only_to_active_without_sandbox(before: states.SessionState | None) -> None:
    with pytest.raises(errors.InvalidTransition, match="session.sandbox_assigned"):
        session_rules.evolve(before, assigned(), 9)


@pytest.mark.parametrize("status", ["active", "stopped"])
def test_release_clears_the_assigned_sandbox(status: str) -> None:
    before = session(status, sandbox_id=SB)
    after = session_rules.evolve(before, released(SB, 7), 12)
    assert after == msgspec.structs.replace(
        before,
        sandbox_id=None,
        updated_at=T0 + timedelta(seconds=7),
        version=4,
        last_seq=12,
        last_command_id="c7",
    )


@pytest.mark.parametrize(
    "before",
    [None, session("active"), session("active", sandbox_id=SB2), session("deleted"), session("stopped")],
    ids=["missing", "no-sandbox", "other-sandbox", "deleted", "stopped-no-sandbox"],
)
def test_release_only_the_assigned_sandbox(before: states.SessionState | None) -> None:
    with pytest.raises(errors.InvalidTransition, match="session.sandbox_released"):
        session_rules.evolve(before, released(SB), 9)


@pytest.mark.parametrize("status", ["active", "stopped"])
def test_delete_clears_the_sandbox(status: str) -> None:
    before = session(status, sandbox_id=SB)
    after = session_rules.evolve(before, events.SessionDeleted(meta=meta(8), session_id=SID), 13)
    assert (after.status, after.sandbox_id, after.last_seq) == ("deleted", None, 13)


def test_stop_keeps_the_sandbox() -> None:
    before = session("active", sandbox_id=SB)
    after = session_rules.evolve(before, events.SessionStopped(meta=meta(8), session_id=SID), 13)
    assert (after.status, after.sandbox_id) == ("stopped", SB)


def test_recreated_session_starts_without_sandbox() -> None:
    created = events.SessionCreated(meta=meta(1, "c1"), session_id=SID, image="python:3.12")
    fold = projections.SESSIONS.fold(
        [
            (1, created),
            (2, assigned(SB, "python:3.12", 2)),
            (3, events.SessionDeleted(meta=meta(3, "c3"), session_id=SID)),
            (4, events.SessionCreated(meta=meta(4, "c4"), session_id=SID, image="node:22")),
        ]
    )
    assert fold is not None
    assert (fold.status, fold.sandbox_id, fold.image, fold.incarnation, fold.version) == (
        "active",
        None,
        "node:22",
        2,
        4,
    )


def test_full_session_story_fold() -> None:
    created = events.SessionCreated(meta=meta(1, "c1"), session_id=SID, image=None, org_id="acme")
    fold = projections.SESSIONS.fold(
        [
            (10, created),
            (11, assigned(SB, "default", 2)),
            (12, events.SessionStopped(meta=meta(3, "c3"), session_id=SID)),
            (13, resumed(4)),
            (14, released(SB, 5)),
            (15, assigned(SB2, "node:22", 6)),
        ]
    )
    assert fold is not None
    assert (fold.status, fold.sandbox_id, fold.image, fold.version, fold.last_seq) == (
        "active",
        SB2,
        "node:22",
        6,
        15,
    )
    assert fold.org_id == "acme" and fold.last_command_id == "c6"


@pytest.mark.parametrize(
    "event",
    [
        events.SandboxStarted(meta=meta(), sandbox_id=SB),
        events.CommandExecuted(meta=meta(), session_id=SID, sandbox_id=SB, tool="shell", command="ls"),
    ],
    ids=["sandbox-event", "exec-event"],
)
def test_evolve_session_refuses_foreign_events(event: Any) -> None:
    with pytest.raises(errors.InvalidTransition, match="not a session event"):
        session_rules.evolve(session("active", sandbox_id=SB), event, 9)


# ---- evolve_sandbox -------------------------------------------------------------------


def requested(n: int = 1, **kw: Any) -> events.SandboxRequested:
    fields: dict[str, Any] = dict(session_id=SID, image="python:3.12", use_kata=True, backend="kata")
    fields.update(kw)
    return events.SandboxRequested(meta=meta(n), sandbox_id=SB, **fields)


SID2 = "task-43"
POOL = "default@0a1b2c3d"

SANDBOX_EVENTS: dict[str, Any] = {
    "requested": lambda n: requested(n),
    "started": lambda n: events.SandboxStarted(meta=meta(n), sandbox_id=SB),
    "stopped": lambda n: events.SandboxStopped(meta=meta(n), sandbox_id=SB),
    "deleted": lambda n: events.SandboxDeleted(meta=meta(n), sandbox_id=SB),
    "failed": lambda n: events.SandboxFailed(meta=meta(n), sandbox_id=SB, error="oom"),
    "claimed": lambda n: events.SandboxClaimed(meta=meta(n), sandbox_id=SB, session_id=SID2),
    "refused": lambda n: events.SandboxRefused(
        meta=meta(n), sandbox_id=SB, session_id=SID, reason="max_running (3) reached", running=3, limit=3
    ),
    "lost": lambda n: events.SandboxLost(meta=meta(n), sandbox_id=SB, reason="gone from the runtime"),
    "proxy_assigned": lambda n: events.SandboxProxyAssigned(meta=meta(n), sandbox_id=SB, proxy_id="px-1"),
    "cache_attached": lambda n: events.SandboxCacheAttached(
        meta=meta(n), sandbox_id=SB, session_id=SID, org_id="acme"
    ),
    "paused": lambda n: events.SandboxPaused(meta=meta(n), sandbox_id=SB, reason="idle"),
    "resumed": lambda n: events.SandboxResumed(meta=meta(n), sandbox_id=SB, reason="call"),
}

#: state before (None: nothing yet) -> event -> status after. Everything absent is impossible.
#: (``claimed`` is tried on an unclaimed pool sandbox; a claimed one can never be claimed again.)
SANDBOX_TRANSITIONS: dict[str | None, dict[str, str]] = {
    None: {"requested": "requested", "refused": "refused"},
    "requested": {
        "started": "running",
        "stopped": "stopped",
        "deleted": "deleted",
        "failed": "failed",
        "claimed": "requested",
        "lost": "lost",
        "proxy_assigned": "requested",
        "cache_attached": "requested",
    },
    "running": {
        "stopped": "stopped",
        "deleted": "deleted",
        "failed": "failed",
        "claimed": "running",
        "lost": "lost",
        "proxy_assigned": "running",
        "cache_attached": "running",
        "paused": "paused",
    },
    "paused": {
        "resumed": "running",
        "stopped": "stopped",
        "deleted": "deleted",
        "failed": "failed",
        "lost": "lost",
        "proxy_assigned": "paused",
        "cache_attached": "paused",
    },
    "stopped": {
        "started": "running",
        "deleted": "deleted",
        "failed": "failed",
        "lost": "lost",
        "proxy_assigned": "stopped",
        "cache_attached": "stopped",
    },
    "failed": {"deleted": "deleted"},
    "deleted": {},
    "refused": {},
    "lost": {"deleted": "deleted"},
}

#: fields besides status, updated_at and last_seq that an event sets (at meta(8)).
SANDBOX_CHANGES: dict[str, dict[str, Any]] = {
    "failed": {"error": "oom"},
    "lost": {"error": "gone from the runtime"},
    "started": {"started_at": T0 + timedelta(seconds=8)},
    "claimed": {"session_id": SID2, "claimed_at": T0 + timedelta(seconds=8)},
    "proxy_assigned": {"proxy_id": "px-1"},
    "cache_attached": {"cache_org": "acme"},
    "paused": {"paused_at": T0 + timedelta(seconds=8), "pause_command_id": "cmd-0"},
    "resumed": {"paused_at": None, "pause_command_id": "cmd-0"},
}


def sandbox(status: str, **kw: Any) -> states.SandboxState:
    fields: dict[str, Any] = dict(
        session_id=SID, image="python:3.12", use_kata=True, backend="kata", last_seq=4
    )
    return factories.sandbox_state(SB, status, **(fields | kw))


def test_sandbox_transition_table_covers_every_status() -> None:
    assert set(SANDBOX_TRANSITIONS) - {None} == set(states.SandboxStatus.__args__)  # type: ignore[attr-defined]
    assert set(SANDBOX_EVENTS) == {
        events.tag_of(c).split(".")[1] for c in events.EVENT_TYPES if c.kind == "sandbox"
    }


def test_requested_records_the_options() -> None:
    event = requested(1, run_as_root=False, writable_root=False)
    assert sandbox_rules.evolve(None, event, 7) == states.SandboxState(
        sandbox_id=SB,
        status="requested",
        session_id=SID,
        image="python:3.12",
        run_as_root=False,
        writable_root=False,
        use_kata=True,
        backend="kata",
        created_at=event.meta.time,
        updated_at=event.meta.time,
        error=None,
        last_seq=7,
    )


def test_sandbox_lifecycle_requested_started_stopped_started_deleted() -> None:
    story = ["requested", "started", "stopped", "started", "deleted"]
    current: states.SandboxState | None = None
    seen = []
    for n, name in enumerate(story, start=1):
        current = projections.SANDBOXES.evolve(current, SANDBOX_EVENTS[name](n), n * 10)
        seen.append(current.status)
        assert current.last_seq == n * 10
        assert current.updated_at == T0 + timedelta(seconds=n)
        assert current.created_at == T0 + timedelta(seconds=1)
        assert (current.image, current.use_kata, current.backend, current.session_id) == (
            "python:3.12",
            True,
            "kata",
            SID,
        )
    assert seen == ["requested", "running", "stopped", "running", "deleted"]


@pytest.mark.parametrize("status", ["requested", "running", "stopped"])
def test_failed_records_the_error(status: str) -> None:
    after = sandbox_rules.evolve(
        sandbox(status), events.SandboxFailed(meta=meta(9), sandbox_id=SB, error="image pull failed"), 50
    )
    assert after == sandbox(
        "failed", error="image pull failed", updated_at=T0 + timedelta(seconds=9), last_seq=50
    )


_BEFORE = list(SANDBOX_TRANSITIONS)
_ALL = list(itertools.product(_BEFORE, SANDBOX_EVENTS))
_POSSIBLE = [(b, e) for b, e in _ALL if e in SANDBOX_TRANSITIONS[b]]
_IMPOSSIBLE = [(b, e) for b, e in _ALL if e not in SANDBOX_TRANSITIONS[b]]


def table_state(before: str | None, event: str) -> states.SandboxState | None:
    """The state a table row starts from: claims are tried on an unclaimed warm sandbox."""
    if before is None:
        return None
    if event == "claimed":
        return sandbox(before, session_id=None, pool=POOL)
    return sandbox(before)


@pytest.mark.parametrize(("before", "event"), _POSSIBLE, ids=[f"{b}-{e}" for b, e in _POSSIBLE])
def test_every_possible_sandbox_transition(before: str | None, event: str) -> None:
    state = table_state(before, event)
    after = sandbox_rules.evolve(state, SANDBOX_EVENTS[event](8), 99)
    assert after.status == SANDBOX_TRANSITIONS[before][event]
    assert after.last_seq == 99 and after.updated_at == T0 + timedelta(seconds=8)
    if state is not None:  # only status, time, seq and the event's own fields change
        assert after == msgspec.structs.replace(
            state,
            status=after.status,
            updated_at=after.updated_at,
            last_seq=99,
            **SANDBOX_CHANGES.get(event, {}),
        )


@pytest.mark.parametrize(("before", "event"), _IMPOSSIBLE, ids=[f"{b}-{e}" for b, e in _IMPOSSIBLE])
def test_every_impossible_sandbox_transition_raises(before: str | None, event: str) -> None:
    state = table_state(before, event)
    with pytest.raises(
        errors.InvalidTransition, match=f"sandbox.{event} at seq 99 cannot follow {before or 'nothing'}"
    ):
        sandbox_rules.evolve(state, SANDBOX_EVENTS[event](8), 99)


@pytest.mark.parametrize("before", [b for b in _BEFORE if b is not None], ids=str)
@pytest.mark.parametrize("pool", [POOL, None], ids=["pool", "no-pool"])
def test_claimed_sandbox_is_never_claimed_again(before: str, pool: str | None) -> None:
    with pytest.raises(errors.InvalidTransition, match="sandbox.claimed"):
        sandbox_rules.evolve(sandbox(before, session_id=SID, pool=pool), SANDBOX_EVENTS["claimed"](8), 99)


def test_refused_creates_a_refused_record_with_the_reason() -> None:
    event = SANDBOX_EVENTS["refused"](3)
    assert sandbox_rules.evolve(None, event, 21) == states.SandboxState(
        sandbox_id=SB,
        status="refused",
        session_id=SID,
        created_at=T0 + timedelta(seconds=3),
        updated_at=T0 + timedelta(seconds=3),
        error="max_running (3) reached",
        last_seq=21,
    )


def test_requested_for_a_pool_has_no_session_until_claimed() -> None:
    story = [
        (1, events.SandboxRequested(meta=meta(1), sandbox_id=SB, image="default", pool=POOL)),
        (2, events.SandboxStarted(meta=meta(2), sandbox_id=SB)),
        (3, events.SandboxClaimed(meta=meta(3), sandbox_id=SB, session_id=SID2)),
    ]
    folded = [projections.SANDBOXES.fold(story[:n]) for n in (1, 2, 3)]
    assert [(s.status, s.pool, s.session_id) for s in folded if s] == [
        ("requested", POOL, None),
        ("running", POOL, None),
        ("running", POOL, SID2),
    ]
    final = folded[-1]
    assert final is not None
    assert final.started_at == T0 + timedelta(seconds=2) and final.updated_at == T0 + timedelta(seconds=3)
    assert final.created_at == T0 + timedelta(seconds=1)


def test_restart_moves_started_at_and_stop_keeps_it() -> None:
    current = projections.SANDBOXES.fold(
        [(1, requested(1)), (2, SANDBOX_EVENTS["started"](2)), (3, SANDBOX_EVENTS["stopped"](30))]
    )
    assert current is not None and current.started_at == T0 + timedelta(seconds=2)
    current = sandbox_rules.evolve(current, SANDBOX_EVENTS["started"](90), 4)
    assert (current.status, current.started_at) == ("running", T0 + timedelta(seconds=90))


def test_lost_keeps_session_and_pool_and_records_the_reason() -> None:
    before = sandbox("running", pool=POOL, started_at=T0)
    after = sandbox_rules.evolve(before, SANDBOX_EVENTS["lost"](5), 8)
    assert (after.status, after.error, after.session_id, after.pool, after.started_at) == (
        "lost",
        "gone from the runtime",
        SID,
        POOL,
        T0,
    )


@pytest.mark.parametrize("before", _BEFORE, ids=str)
@pytest.mark.parametrize(
    "event",
    [
        events.SessionCreated(meta=meta(), session_id=SID),
        events.CommandExecuted(meta=meta(), session_id=SID, sandbox_id=SB, tool="shell", command="ls"),
    ],
    ids=["session-event", "exec-event"],
)
def test_evolve_sandbox_refuses_foreign_events(before: str | None, event: Any) -> None:
    with pytest.raises(errors.InvalidTransition):
        sandbox_rules.evolve(sandbox(before) if before else None, event, 1)


def test_sandbox_projection_is_registered() -> None:
    assert projections.BY_KIND["sandbox"] is projections.SANDBOXES
    assert projections.SANDBOXES.state_type is states.SandboxState
    assert projections.SANDBOXES.key_of(SB) == ids.token(SB) != projections.SANDBOXES.key_of(SB2)


# ---- decide: ensure, provision, clear ---------------------------------------------------


@pytest.mark.parametrize("current", [None, session("deleted", incarnation=3)], ids=["missing", "deleted"])
@pytest.mark.parametrize("command", [ensure(), provision()], ids=["ensure", "provision"])
def test_ensure_or_provision_creates_a_missing_session(
    current: states.SessionState | None, command: Any
) -> None:
    m = meta(1, command.command_id)
    assert session_rules.decide(current, command, m) == [
        events.SessionCreated(meta=m, session_id=SID, image=command.image, org_id="acme", user_id="alice")
    ]


def test_ensure_without_image_or_attribution() -> None:
    m = meta(1, "cmd-e")
    command = ensure(image=None, actor=commands.Actor(via="mcp"))
    assert session_rules.decide(None, command, m) == [
        events.SessionCreated(meta=m, session_id=SID, image=None, org_id=None, user_id=None)
    ]


@pytest.mark.parametrize("command", [ensure(), provision()], ids=["ensure", "provision"])
def test_ensure_or_provision_resumes_a_stopped_session(command: Any) -> None:
    m = meta(2, command.command_id)
    assert session_rules.decide(session("stopped", sandbox_id=SB), command, m) == [
        events.SessionResumed(meta=m, session_id=SID)
    ]


@pytest.mark.parametrize("sandbox_id", [None, SB], ids=["no-sandbox", "with-sandbox"])
@pytest.mark.parametrize("command", [ensure(), provision()], ids=["ensure", "provision"])
def test_ensure_or_provision_on_active_decides_nothing(sandbox_id: str | None, command: Any) -> None:
    assert session_rules.decide(session("active", sandbox_id=sandbox_id), command, meta()) == []


def test_clear_missing_session_is_fine() -> None:
    assert session_rules.decide(None, clear(), meta()) == []
    assert session_rules.decide(session("deleted"), clear(), meta()) == []


@pytest.mark.parametrize("status", ["active", "stopped"])
def test_clear_existing_deletes_it(status: str) -> None:
    m = meta(3, "cmd-x")
    assert session_rules.decide(session(status, sandbox_id=SB), clear(), m) == [
        events.SessionDeleted(meta=m, session_id=SID, reason="cleared")
    ]


@pytest.mark.parametrize(
    ("status", "command"),
    [
        ("deleted", ensure("dup")),
        ("stopped", ensure("dup")),
        ("stopped", provision("dup")),
        ("active", clear("dup")),
    ],
)
def test_duplicate_new_command_decides_nothing(status: str, command: Any) -> None:
    assert session_rules.decide(session(status, last_command_id="dup"), command, meta(9, "dup")) == []


@pytest.mark.parametrize(
    "command", [ensure(), ensure(image=None), provision(), provision(image=None, use_kata=True), clear()]
)
def test_validate_accepts_new_commands(command: Any) -> None:
    session_rules.validate(command)


@pytest.mark.parametrize(
    "command",
    [
        commands.EnsureSession(command_id="c", session_id="a.b"),
        commands.EnsureSession(command_id="c", session_id=SID, image="$(reboot)"),
        commands.ProvisionSandbox(command_id="c", session_id=SID, image=""),
        commands.ProvisionSandbox(command_id="c", session_id="*"),
        commands.ClearSession(command_id="c", session_id="../etc"),
        commands.ClearSession(command_id="c", session_id=SID, actor=commands.Actor(user_id="bo\nb")),
    ],
)
def test_validate_rejects_malformed_new_commands(command: Any) -> None:
    with pytest.raises(errors.InvalidInput):
        session_rules.validate(command)


# ---- decide_assign / decide_release -----------------------------------------------------


def test_assign_to_active_session_without_sandbox() -> None:
    m = meta(4, "cmd-e")
    assert session_rules.decide_assign(session("active"), SB, "node:22", m) == [
        events.SessionSandboxAssigned(meta=m, session_id=SID, sandbox_id=SB, image="node:22")
    ]


@pytest.mark.parametrize(
    "current",
    [
        None,
        session("stopped"),
        session("deleted"),
        session("active", sandbox_id=SB),
        session("active", sandbox_id=SB2),
    ],
    ids=["missing", "stopped", "deleted", "same-sandbox", "other-sandbox"],
)
def test_assign_otherwise_decides_nothing(current: states.SessionState | None) -> None:
    assert session_rules.decide_assign(current, SB, "node:22", meta()) == []


@pytest.mark.parametrize("status", ["active", "stopped"])
def test_release_the_assigned_sandbox(status: str) -> None:
    m = meta(5, "cmd-p")
    assert session_rules.decide_release(session(status, sandbox_id=SB), SB, m) == [
        events.SessionSandboxReleased(meta=m, session_id=SID, sandbox_id=SB)
    ]


@pytest.mark.parametrize(
    "current",
    [None, session("active"), session("active", sandbox_id=SB2), session("deleted")],
    ids=["missing", "no-sandbox", "other-sandbox", "deleted"],
)
def test_release_otherwise_decides_nothing(current: states.SessionState | None) -> None:
    assert session_rules.decide_release(current, SB, meta()) == []


def test_decided_assign_and_release_always_fold() -> None:
    current = session("active")
    [a] = session_rules.decide_assign(current, SB, "node:22", meta(1, "e"))
    current = session_rules.evolve(current, a, 10)
    assert session_rules.decide_assign(current, SB2, "node:22", meta(2, "e")) == []
    [r] = session_rules.decide_release(current, SB, meta(3, "p"))
    current = session_rules.evolve(current, r, 11)
    assert current.sandbox_id is None and current.image == "node:22"


# ---- sandbox_options --------------------------------------------------------------------


def test_options_of_provision_come_from_the_command() -> None:
    command = provision(image="ghcr.io/acme/agent:2", use_kata=True, run_as_root=False, writable_root=False)
    assert session_rules.sandbox_options(command, session("active", image="python:3.12")) == {
        "image": "ghcr.io/acme/agent:2",
        "use_kata": True,
        "run_as_root": False,
        "writable_root": False,
    }


def test_options_of_provision_without_image_use_the_default_not_the_session_image() -> None:
    assert session_rules.sandbox_options(provision(image=None), session("active", image="python:3.12")) == {
        "image": "default",
        "use_kata": False,
        "run_as_root": True,
        "writable_root": True,
    }


@pytest.mark.parametrize(
    ("image", "want"), [("python:3.12", "python:3.12"), (None, "default")], ids=["session-image", "no-image"]
)
@pytest.mark.parametrize("command", [ensure(image="ignored:1"), clear()], ids=["ensure", "clear"])
def test_options_of_other_commands_come_from_the_session(image: str | None, want: str, command: Any) -> None:
    assert session_rules.sandbox_options(command, session("active", image=image)) == {"image": want}


# ---- decide_claim -----------------------------------------------------------------------


def test_claim_a_running_unclaimed_pool_sandbox() -> None:
    m = meta(6, "cmd-e")
    assert sandbox_rules.decide_claim(sandbox("running", session_id=None, pool=POOL), SB, SID2, m) == [
        events.SandboxClaimed(meta=m, sandbox_id=SB, session_id=SID2)
    ]


@pytest.mark.parametrize(
    "current",
    [
        None,
        sandbox("requested", session_id=None, pool=POOL),
        sandbox("stopped", session_id=None, pool=POOL),
        sandbox("failed", session_id=None, pool=POOL),
        sandbox("deleted", session_id=None, pool=POOL),
        sandbox("lost", session_id=None, pool=POOL),
        sandbox("running", session_id=SID, pool=POOL),
        sandbox("running", session_id=SID2, pool=POOL),
        sandbox("running", session_id=None, pool=None),
    ],
    ids=[
        "missing",
        "requested",
        "stopped",
        "failed",
        "deleted",
        "lost",
        "claimed-by-other",
        "claimed-by-same",
        "not-a-pool-sandbox",
    ],
)
def test_claim_otherwise_decides_nothing(current: states.SandboxState | None) -> None:
    assert sandbox_rules.decide_claim(current, SB, SID2, meta()) == []


def test_a_claim_takes_only_a_sandbox_of_the_pool_it_was_offered_for_and_never_another_organisations() -> (
    None
):
    """(An offer on the wrong subject, published by anyone on NATS, must not hand over
    another pool's sandbox, nor one that shows another organisation's cache.)"""
    plain = sandbox("running", session_id=None, pool=POOL)
    assert sandbox_rules.decide_claim(plain, SB, SID2, meta(), pool_id=POOL)
    assert sandbox_rules.decide_claim(plain, SB, SID2, meta(), pool_id="other@00000000") == []
    acme = msgspec.structs.replace(plain, cache_org="acme")
    assert sandbox_rules.decide_claim(acme, SB, SID2, meta(), pool_id=POOL, org="acme")
    assert sandbox_rules.decide_claim(acme, SB, SID2, meta(), pool_id=POOL, org="globex") == []
    assert sandbox_rules.decide_claim(acme, SB, SID2, meta(), pool_id=POOL, org=None) == []
    # A snapshot's pool's sandbox serves only that snapshot's forks, and a plain claim none.
    forked = msgspec.structs.replace(plain, snapshot="snap-1")
    assert sandbox_rules.decide_claim(forked, SB, SID2, meta(), pool_id=POOL, snapshot="snap-1")
    assert sandbox_rules.decide_claim(forked, SB, SID2, meta(), pool_id=POOL) == []
    assert sandbox_rules.decide_claim(forked, SB, SID2, meta(), pool_id=POOL, snapshot="snap-2") == []
    assert sandbox_rules.decide_claim(plain, SB, SID2, meta(), pool_id=POOL, snapshot="snap-1") == []


def test_decided_claim_folds_and_a_second_claim_loses() -> None:
    current = sandbox("running", session_id=None, pool=POOL)
    [claim] = sandbox_rules.decide_claim(current, SB, SID2, meta(1, "a"))
    current = sandbox_rules.evolve(current, claim, 10)
    assert current.session_id == SID2
    assert sandbox_rules.decide_claim(current, SB, SID, meta(2, "b")) == []


# ---- decide: stop/delete reasons ----------------------------------------------------------


@pytest.mark.parametrize("reason", ["idle", "lifetime", "requested"])
def test_stop_records_the_command_reason(reason: str) -> None:
    m = meta(2, "cmd-s")
    command = commands.StopSession(command_id="cmd-s", session_id=SID, reason=reason)
    assert session_rules.decide(session("active", sandbox_id=SB), command, m) == [
        events.SessionStopped(meta=m, session_id=SID, reason=reason)
    ]


@pytest.mark.parametrize("reason", ["retention", "max_stopped", "requested"])
@pytest.mark.parametrize("status", ["active", "stopped"])
def test_delete_records_the_command_reason(status: str, reason: str) -> None:
    m = meta(2, "cmd-d")
    command = commands.DeleteSession(command_id="cmd-d", session_id=SID, reason=reason)
    assert session_rules.decide(session(status, sandbox_id=SB), command, m) == [
        events.SessionDeleted(meta=m, session_id=SID, reason=reason)
    ]


def test_stop_and_delete_default_reason_is_requested() -> None:
    assert commands.StopSession(command_id="c", session_id=SID).reason == "requested"
    assert commands.DeleteSession(command_id="c", session_id=SID).reason == "requested"
    [stopped] = session_rules.decide(
        session("active"), commands.StopSession(command_id="c", session_id=SID), meta()
    )
    assert isinstance(stopped, events.SessionStopped) and stopped.reason == "requested"


def test_stop_with_reason_of_stopped_session_decides_nothing() -> None:
    command = commands.StopSession(command_id="cmd-s", session_id=SID, reason="idle")
    assert session_rules.decide(session("stopped"), command, meta(2, "cmd-s")) == []


@pytest.mark.parametrize(
    ("record", "action"),
    [
        (None, "delete"),  # no record claims it: an orphan
        (sandbox("running", pool="default", session_id=None), "delete"),  # an idle pool sandbox
        (sandbox("running", session_id=SID), "stop"),
        (sandbox("requested", session_id=SID), "stop"),
        (sandbox("stopped", session_id=SID), "stop"),
        (sandbox("failed", session_id=SID), "delete"),
        (sandbox("deleted", session_id=SID), "delete"),  # the runtime still had it: remove
    ],
)
def test_a_stack_stop_keeps_only_sessions_sandboxes(record: states.SandboxState | None, action: str) -> None:
    assert sandbox_rules.at_stack_stop(record) == action


# ---- pause and resume ----------------------------------------------------------------------


def test_a_pause_is_decided_only_for_a_running_sandbox_and_once_per_command() -> None:
    def m(command_id: str) -> Any:
        return lambda session: meta(3, command_id)

    running = sandbox("running")
    [paused_event] = sandbox_rules.decide_paused(running, SB, m("op-1"), reason="idle")
    assert isinstance(paused_event, events.SandboxPaused) and paused_event.reason == "idle"
    paused = sandbox_rules.evolve(running, paused_event, 5)
    assert (paused.status, paused.paused_at, paused.pause_command_id) == (
        "paused",
        T0 + timedelta(seconds=3),
        "op-1",
    )
    assert sandbox_rules.decide_paused(paused, SB, m("op-2")) == []  # paused already
    for status in ("requested", "stopped", "deleted", "failed", "lost"):
        assert sandbox_rules.decide_paused(sandbox(status), SB, m("op-1")) == []
    assert sandbox_rules.decide_paused(None, SB, m("op-1")) == []
    [resumed_event] = sandbox_rules.decide_resumed(paused, SB, m("call-1"), reason="call")
    resumed = sandbox_rules.evolve(paused, resumed_event, 6)
    assert (resumed.status, resumed.paused_at) == ("running", None)
    assert sandbox_rules.decide_resumed(resumed, SB, m("call-2")) == []  # running already
    # The request that paused it, retried while its pause is the last: nothing again.
    again = msgspec.structs.replace(resumed, pause_command_id="op-1")
    assert sandbox_rules.decide_paused(again, SB, m("op-1")) == []
    assert len(sandbox_rules.decide_paused(resumed, SB, m("op-1"))) == 1  # after another's resume: anew


def test_a_paused_sandbox_stops_deletes_and_counts_as_live() -> None:
    paused = sandbox("paused", paused_at=T0)
    assert "paused" in sandbox_rules.LIVE
    [stopped] = sandbox_rules.decide_stopped(paused, SB, lambda s: meta(4))
    assert sandbox_rules.evolve(paused, stopped, 9).paused_at is None
    assert len(sandbox_rules.decide_stopped(paused, SB, lambda s: meta(4), reason="lost")) == 1
    assert len(sandbox_rules.decide_deleted(paused, SB, lambda s: meta(4))) == 1
    assert sandbox_rules.at_stack_stop(paused) == "stop"
    assert len(sandbox_rules.decide_proxy_assigned(paused, SB, "px-9", lambda s: meta(4))) == 1


def test_a_proxy_move_planned_from_a_lagging_view_moves_nothing() -> None:
    """The scaler plans from its followed copy of the sandboxes; the decision reads the
    aggregate. A sandbox it already moved off a dead proxy (the copy still shows the dead
    one) is not moved a second time."""

    def m(session_id: str | None) -> events.Meta:
        return meta(4)

    on_b = sandbox("running", proxy_id="px-b")
    assert sandbox_rules.decide_proxy_assigned(on_b, SB, "px-c", m, moving_from="px-dead") == []
    [moved] = sandbox_rules.decide_proxy_assigned(on_b, SB, "px-c", m, moving_from="px-b")
    assert (moved.proxy_id, moved.reason) == ("px-c", "reassigned")
    [first] = sandbox_rules.decide_proxy_assigned(sandbox("running"), SB, "px-b", m)
    assert first.reason == "new"

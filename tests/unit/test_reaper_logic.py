"""The reaper's pure rules (services.reaper.logic) with fake time: every ``now`` is a fixed datetime,
nothing sleeps and nothing reads a clock."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.reaper import logic
from shared.contract import states
from shared.infrastructure.settings import lifecycle

T0 = datetime(2025, 6, 1, 12, 0, 0, tzinfo=UTC)
US = timedelta(microseconds=1)
LIFETIME = 3600.0
IDLE = 600.0
RETENTION = 86400.0
RULES = lifecycle.LifecycleSettings(
    max_lifetime=LIFETIME, idle_timeout=IDLE, stopped_retention=RETENTION, max_stopped=3
)
POOL = "default@0a1b2c3d"


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def session(
    sid: str = "s1",
    status: str = "active",
    *,
    created: float = 0,
    updated: float | None = None,
    sandbox_id: str | None = "__auto__",
) -> states.SessionState:
    return states.SessionState(
        session_id=sid,
        status=status,  # type: ignore[arg-type]
        created_at=at(created),
        updated_at=at(created if updated is None else updated),
        last_seq=1,
        sandbox_id=f"sb-{sid}" if sandbox_id == "__auto__" else sandbox_id,
    )


def sandbox(
    sandbox_id: str = "sb-s1",
    status: str = "running",
    *,
    created: float = 0,
    started: float | None = 0,
    pool: str | None = None,
    updated: float | None = None,
    claimed: float | None = None,
) -> states.SandboxState:
    return states.SandboxState(
        sandbox_id=sandbox_id,
        status=status,  # type: ignore[arg-type]
        session_id=None,
        pool=pool,
        created_at=at(created),
        updated_at=at(created if updated is None else updated),
        started_at=None if started is None else at(started),
        claimed_at=None if claimed is None else at(claimed),
        last_seq=1,
    )


def reaps(
    sessions: list[states.SessionState],
    sandboxes: list[states.SandboxState] | None = None,
    activity: dict[str, datetime] | None = None,
    *,
    now: datetime,
    rules: lifecycle.LifecycleSettings = RULES,
) -> list[logic.Reap]:
    if sandboxes is None:  # every session's sandbox, running since it was created
        sandboxes = [
            sandbox(s.sandbox_id, created=(s.created_at - T0).total_seconds(), started=None)
            for s in sessions
            if s.sandbox_id
        ]
    by_id = {b.sandbox_id: b for b in sandboxes}
    return logic.decide_reaps(sessions, by_id, activity or {}, now, rules)


# ---- session_start ----------------------------------------------------------------------


def test_start_of_a_warm_sandbox_is_its_claim() -> None:
    """A sandbox that sat in the pool for hours does not bring those hours into the session."""
    warm = sandbox(created=-5 * 3600, started=-5 * 3600 + 2, pool=POOL, claimed=0)
    assert logic.session_start(session(created=0), warm) == T0


def test_start_of_a_sandbox_started_after_the_session_is_its_start() -> None:
    assert logic.session_start(session(created=0), sandbox(created=1, started=7)) == at(7)


def test_start_falls_back_to_sandbox_creation_when_never_started() -> None:
    assert logic.session_start(session(created=0), sandbox(created=5, started=None)) == at(5)
    assert logic.session_start(session(created=9), sandbox(created=5, started=None)) == at(5)


def test_restart_moves_the_start() -> None:
    restarted = sandbox(created=0, started=7200)
    assert logic.session_start(session(created=0, updated=7100), restarted) == at(7200)


def test_pool_time_does_not_count_for_a_session_that_claims_later() -> None:
    # created at T0 without a sandbox; at T0+3h the first tool call claims a sandbox warm since T0+1h
    claimed_late = session(created=0, updated=3 * 3600)
    warm = sandbox(created=3600 - 5, started=3600, pool=POOL, updated=3 * 3600, claimed=3 * 3600)
    now = at(3 * 3600 + 60)
    assert now - logic.session_start(claimed_late, warm) < timedelta(seconds=LIFETIME)
    assert reaps([claimed_late], [warm], now=now) == []


# ---- lifetime ---------------------------------------------------------------------------


def _busy(sid: str, now: datetime) -> dict[str, datetime]:
    return {sid: now - timedelta(seconds=1)}  # a tool call a second ago: never idle


def test_lifetime_fires_exactly_at_max_lifetime_after_start() -> None:
    s, b = session(created=0), sandbox(started=0)
    before, exactly = at(LIFETIME) - US, at(LIFETIME)
    assert reaps([s], [b], _busy("s1", before), now=before) == []
    assert reaps([s], [b], _busy("s1", exactly), now=exactly) == [logic.Reap("s1", "stop", "lifetime")]
    assert reaps([s], [b], _busy("s1", exactly), now=at(10 * LIFETIME)) == [
        logic.Reap("s1", "stop", "lifetime")
    ]


def test_lifetime_of_a_warm_sandbox_counts_from_its_claim() -> None:
    s = session(created=990)
    b = sandbox(created=-7200, started=-7200, pool=POOL, claimed=1000)
    assert reaps([s], [b], _busy("s1", at(1000 + LIFETIME) - US), now=at(1000 + LIFETIME) - US) == []
    now = at(1000 + LIFETIME)
    assert reaps([s], [b], _busy("s1", now), now=now) == [logic.Reap("s1", "stop", "lifetime")]


def test_lifetime_counts_from_a_later_sandbox_start() -> None:
    s, b = session(created=0), sandbox(created=0, started=500)
    assert reaps([s], [b], _busy("s1", at(500 + LIFETIME) - US), now=at(500 + LIFETIME) - US) == []
    now = at(500 + LIFETIME)
    assert reaps([s], [b], _busy("s1", now), now=now) == [logic.Reap("s1", "stop", "lifetime")]


def test_lifetime_wins_over_idle_and_reaps_once() -> None:
    assert reaps([session(created=0)], [sandbox(started=0)], now=at(2 * LIFETIME)) == [
        logic.Reap("s1", "stop", "lifetime")
    ]


# ---- idle -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("started", "updated", "activity", "quiet_since"),
    [
        (0, 0, None, 0),
        (100, 0, None, 100),
        (0, 200, None, 200),
        (0, 200, 300, 300),
        (400, 200, 300, 400),
        (0, 250, 100, 250),
    ],
    ids=["start", "late-start", "updated", "activity", "start-latest", "updated-over-old-activity"],
)
def test_idle_fires_at_idle_timeout_after_the_latest_sign_of_life(
    started: float, updated: float, activity: float | None, quiet_since: float
) -> None:
    s, b = session(created=0, updated=updated), sandbox(started=started)
    seen = {"s1": at(activity)} if activity is not None else {}
    due = at(quiet_since + IDLE)
    assert reaps([s], [b], seen, now=due - US) == []
    assert reaps([s], [b], seen, now=due) == [logic.Reap("s1", "stop", "idle")]


def test_activity_resets_idle() -> None:
    s, b = session(created=0), sandbox(started=0)
    assert reaps([s], [b], now=at(IDLE)) == [logic.Reap("s1", "stop", "idle")]
    seen = {"s1": at(IDLE - 1)}
    assert reaps([s], [b], seen, now=at(IDLE)) == []
    assert reaps([s], [b], seen, now=at(2 * IDLE - 1) - US) == []
    assert reaps([s], [b], seen, now=at(2 * IDLE - 1)) == [logic.Reap("s1", "stop", "idle")]


def test_activity_of_another_session_does_not_count() -> None:
    s, b = session(created=0), sandbox(started=0)
    assert reaps([s], [b], {"s2": at(IDLE)}, now=at(IDLE)) == [logic.Reap("s1", "stop", "idle")]


# ---- skipped sessions -------------------------------------------------------------------


@pytest.mark.parametrize("status", ["requested", "deleted", "failed", "refused", "lost"])
def test_active_session_whose_sandbox_is_not_running_is_skipped(status: str) -> None:
    assert reaps([session(created=0)], [sandbox(status=status, started=0)], now=at(10 * LIFETIME)) == []


def test_an_active_session_whose_sandbox_is_stopped_is_stopped_when_idle_never_for_its_lifetime() -> None:
    """A hibernated session (its sandbox stopped, files kept; the session active)."""
    hibernated = sandbox(status="stopped", started=0)
    assert reaps([session(created=0)], [hibernated], {"s1": at(LIFETIME)}, now=at(LIFETIME + IDLE) - US) == []
    assert reaps([session(created=0)], [hibernated], {"s1": at(LIFETIME)}, now=at(LIFETIME + IDLE)) == [
        logic.Reap("s1", "stop", "idle")
    ]


def test_active_session_without_sandbox_or_record_is_skipped() -> None:
    now = at(10 * LIFETIME)
    assert reaps([session(created=0, sandbox_id=None)], [], now=now) == []
    assert reaps([session(created=0)], [], now=now) == []  # record missing from the map


def test_deleted_sessions_are_ignored() -> None:
    gone = [session(f"d{i}", "deleted", created=0, updated=i) for i in range(10)]
    assert reaps(gone, now=at(100 * RETENTION), rules=lifecycle.LifecycleSettings(max_stopped=0)) == []


# ---- stopped: retention and max_stopped ---------------------------------------------------


def test_stopped_session_is_purged_at_stopped_retention() -> None:
    s = session("s1", "stopped", created=0, updated=50)
    assert reaps([s], now=at(50 + RETENTION) - US) == []
    assert reaps([s], now=at(50 + RETENTION)) == [logic.Reap("s1", "delete", "retention")]


def test_stopped_session_without_sandbox_is_purged_too() -> None:
    s = session("s1", "stopped", created=0, updated=0, sandbox_id=None)
    assert reaps([s], [], now=at(RETENTION)) == [logic.Reap("s1", "delete", "retention")]


def test_stopped_retention_counts_from_the_stop_not_the_creation() -> None:
    s = session("s1", "stopped", created=0, updated=RETENTION)
    assert reaps([s], now=at(2 * RETENTION) - US) == []


def test_max_stopped_purges_the_oldest_extras_only() -> None:
    stopped = [session(f"s{i}", "stopped", created=0, updated=100 * i) for i in (4, 1, 5, 2, 3)]
    assert reaps(stopped, now=at(1000)) == [
        logic.Reap("s1", "delete", "max_stopped"),
        logic.Reap("s2", "delete", "max_stopped"),
    ]


def test_max_stopped_ties_are_broken_by_session_id() -> None:
    stopped = [session(sid, "stopped", created=0, updated=10) for sid in ("c", "a", "e", "b", "d")]
    assert reaps(stopped, now=at(1000)) == [
        logic.Reap("a", "delete", "max_stopped"),
        logic.Reap("b", "delete", "max_stopped"),
    ]


def test_max_stopped_at_the_limit_purges_nothing() -> None:
    stopped = [session(f"s{i}", "stopped", created=0, updated=i) for i in range(3)]
    assert reaps(stopped, now=at(1000)) == []


def test_max_stopped_zero_purges_every_stopped_session() -> None:
    stopped = [session(f"s{i}", "stopped", created=0, updated=i) for i in range(3)]
    rules = lifecycle.LifecycleSettings(max_stopped=0)
    assert [r.session_id for r in reaps(stopped, now=at(10), rules=rules)] == ["s0", "s1", "s2"]


def test_sessions_purged_for_retention_do_not_count_towards_max_stopped() -> None:
    expired = [session(f"old{i}", "stopped", created=0, updated=i) for i in range(3)]
    recent = [session(f"new{i}", "stopped", created=0, updated=RETENTION + i) for i in range(3)]
    found = reaps(expired + recent, now=at(RETENTION + 10))
    assert found == [logic.Reap(f"old{i}", "delete", "retention") for i in range(3)]


def test_active_sessions_do_not_count_towards_max_stopped() -> None:
    active = [session(f"a{i}", created=0) for i in range(5)]
    stopped = [session(f"s{i}", "stopped", created=0, updated=i) for i in range(3)]
    busy = {s.session_id: at(19) for s in active}
    assert reaps(active + stopped, activity=busy, now=at(20)) == []


def test_mixed_population_each_rule_once() -> None:
    sessions = [
        session("life", created=0),
        session("idle", created=LIFETIME - 1),
        session("busy", created=LIFETIME - 1),
        session("kept", "stopped", created=0, updated=LIFETIME),
        session("expired", "stopped", created=0, updated=0),
        session("gone", "deleted", created=0, updated=0),
    ]
    now = at(LIFETIME + IDLE)
    rules = lifecycle.LifecycleSettings(
        max_lifetime=LIFETIME, idle_timeout=IDLE, stopped_retention=LIFETIME, max_stopped=5
    )
    found = reaps(sessions, activity={"busy": now, "life": now}, now=now, rules=rules)
    assert found == [
        logic.Reap("life", "stop", "lifetime"),
        logic.Reap("idle", "stop", "idle"),
        logic.Reap("expired", "delete", "retention"),
    ]


# ---- needs_activity -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("started", "updated", "quiet_since"),
    [(0, 0, 0), (300, 0, 300), (0, 450, 450)],
    ids=["start", "late-start", "updated"],
)
def test_needs_activity_edges(started: float, updated: float, quiet_since: float) -> None:
    s, b = session(created=0, updated=updated), sandbox(started=started)
    assert not logic.needs_activity(s, b, at(quiet_since + IDLE) - US, RULES)
    assert logic.needs_activity(s, b, at(quiet_since + IDLE), RULES)


def test_needs_activity_ignores_warm_pool_time() -> None:
    s, b = session(created=1000), sandbox(created=-9000, started=-9000, pool=POOL)
    assert not logic.needs_activity(s, b, at(1000 + IDLE) - US, RULES)
    assert logic.needs_activity(s, b, at(1000 + IDLE), RULES)


def test_without_needed_activity_idle_never_fires() -> None:
    """The reaper may skip the activity lookup when needs_activity is False: idle cannot fire then."""
    for now in (at(IDLE - 1), at(IDLE) - US):
        s, b = session(created=0), sandbox(started=0)
        assert not logic.needs_activity(s, b, now, RULES)
        assert reaps([s], [b], now=now) == []


# ---- reconcile --------------------------------------------------------------------------

GRACE = 30.0


def seen(sandbox_id: str, created: float, status: str = "running") -> logic.RuntimeView:
    return logic.RuntimeView(sandbox_id=sandbox_id, status=status, created_at=at(created))


def record(sandbox_id: str, status: str, updated: float = 0) -> states.SandboxState:
    return sandbox(sandbox_id, status, created=0, started=0, updated=updated)


def reconcile(
    records: list[states.SandboxState], runtime: list[logic.RuntimeView], now: float
) -> list[logic.Finding]:
    return logic.reconcile(
        {r.sandbox_id: r for r in records}, {v.sandbox_id: v for v in runtime}, at(now), GRACE
    )


def test_runtime_sandbox_without_record_is_an_orphan_only_after_grace() -> None:
    assert reconcile([], [seen("sb-x", 100)], 100 + GRACE - 0.001) == []
    assert reconcile([], [seen("sb-x", 100)], 100 + GRACE) == [
        logic.Finding("sb-x", "delete_orphan", "no record")
    ]


@pytest.mark.parametrize("status", ["deleted", "failed", "refused", "lost"])
def test_runtime_sandbox_with_dead_record_is_an_orphan(status: str) -> None:
    assert reconcile([record("sb-x", status)], [seen("sb-x", 100)], 100 + GRACE - 0.001) == []
    assert reconcile([record("sb-x", status)], [seen("sb-x", 100)], 100 + GRACE) == [
        logic.Finding("sb-x", "delete_orphan", f"record is {status}")
    ]


@pytest.mark.parametrize("status", ["requested", "running", "stopped"])
def test_live_record_without_runtime_is_lost_only_after_grace(status: str) -> None:
    assert reconcile([record("sb-x", status, updated=100)], [], 100 + GRACE - 0.001) == []
    assert reconcile([record("sb-x", status, updated=100)], [], 100 + GRACE) == [
        logic.Finding("sb-x", "mark_lost", f"record is {status}, runtime has nothing")
    ]


@pytest.mark.parametrize("status", ["deleted", "failed", "refused", "lost"])
def test_dead_record_without_runtime_is_fine(status: str) -> None:
    assert reconcile([record("sb-x", status)], [], 10**6) == []


def test_requested_record_with_runtime_is_stuck_only_after_several_graces() -> None:
    stuck_at = 100 + GRACE * logic.STUCK_GRACES
    assert logic.STUCK_GRACES > 1
    rows = [record("sb-x", "requested", updated=100)], [seen("sb-x", 100)]
    assert reconcile(*rows, 100 + GRACE) == []
    assert reconcile(*rows, stuck_at - 0.001) == []
    assert reconcile(*rows, stuck_at) == [logic.Finding("sb-x", "fail_stuck", "provisioning never finished")]


@pytest.mark.parametrize("status", ["running", "stopped"])
def test_live_record_with_runtime_is_fine(status: str) -> None:
    assert reconcile([record("sb-x", status)], [seen("sb-x", 0, status)], 10**6) == []


def test_findings_are_sorted_orphans_first() -> None:
    records = [record("sb-b", "running"), record("sb-a", "stopped"), record("sb-c", "deleted")]
    runtime = [seen("sb-z", 0), seen("sb-c", 0), seen("sb-y", 0)]
    assert [(f.sandbox_id, f.action) for f in reconcile(records, runtime, 10 * GRACE)] == [
        ("sb-c", "delete_orphan"),
        ("sb-y", "delete_orphan"),
        ("sb-z", "delete_orphan"),
        ("sb-a", "mark_lost"),
        ("sb-b", "mark_lost"),
    ]


def test_zero_grace_acts_immediately() -> None:
    found = logic.reconcile({"sb-a": record("sb-a", "running", 5)}, {"sb-b": seen("sb-b", 5)}, at(5), 0)
    assert [(f.sandbox_id, f.action) for f in found] == [("sb-b", "delete_orphan"), ("sb-a", "mark_lost")]


# ---- properties ---------------------------------------------------------------------------

_SECONDS = st.integers(0, 20_000)


@st.composite
def _population(draw: st.DrawFn) -> Any:
    rules = lifecycle.LifecycleSettings(
        max_lifetime=draw(st.integers(1, 5000)),
        idle_timeout=draw(st.integers(1, 5000)),
        stopped_retention=draw(st.integers(1, 20_000)),
        max_stopped=draw(st.integers(0, 4)),
    )
    sessions, sandboxes, activity = [], {}, {}
    for i in range(draw(st.integers(0, 12))):
        sid = f"s{i}"
        created = draw(_SECONDS)
        status = draw(st.sampled_from(["active", "active", "stopped", "deleted"]))
        has_sandbox = status == "active" or draw(st.booleans())
        sandbox_id = f"sb-{sid}" if has_sandbox else None
        sessions.append(
            session(sid, status, created=created, updated=created + draw(_SECONDS), sandbox_id=sandbox_id)
        )
        if sandbox_id is not None and draw(st.integers(0, 9)):  # sometimes the record is missing
            sb_created = draw(st.integers(-20_000, 20_000))
            started = draw(st.none() | st.integers(sb_created, sb_created + 20_000))
            sb_status = draw(st.sampled_from(["running", "running", "requested", "stopped", "lost"]))
            sandboxes[sandbox_id] = sandbox(sandbox_id, sb_status, created=sb_created, started=started)
        if draw(st.booleans()):
            activity[sid] = at(draw(st.integers(-1000, 40_000)))
    now = at(draw(st.integers(0, 60_000)))
    return sessions, sandboxes, activity, now, rules


@given(_population())
def test_decide_reaps_is_safe(population: Any) -> None:
    sessions, sandboxes, activity, now, rules = population
    found = logic.decide_reaps(sessions, sandboxes, activity, now, rules)
    assert len({r.session_id for r in found}) == len(found), "two reaps for one session"
    by_id = {s.session_id: s for s in sessions}
    for reap in found:
        s = by_id[reap.session_id]
        assert s.status != "deleted"
        if s.status == "active":
            assert reap.action == "stop" and reap.reason in ("lifetime", "idle")
            assert s.sandbox_id is not None
            sb = sandboxes[s.sandbox_id]
            assert sb.status in ("running", "stopped")  # (stopped, the session active: hibernated)
            assert sb.status == "running" or reap.reason == "idle"
            start = logic.session_start(s, sb)
            assert now - start >= timedelta(seconds=min(rules.idle_timeout, rules.max_lifetime))
            if reap.reason == "lifetime":
                assert now - start >= timedelta(seconds=rules.max_lifetime)
            else:
                assert logic.needs_activity(s, sb, now, rules)
                if s.session_id in activity:
                    assert now - activity[s.session_id] >= timedelta(seconds=rules.idle_timeout)
        else:
            assert s.status == "stopped" and reap.action == "delete"
            assert reap.reason in ("retention", "max_stopped")
    stopped = [s for s in sessions if s.status == "stopped"]
    expired = [s for s in stopped if now - s.updated_at >= timedelta(seconds=rules.stopped_retention)]
    assert len([r for r in found if r.reason == "retention"]) == len(expired)
    assert len([r for r in found if r.reason == "max_stopped"]) == max(
        0, len(stopped) - len(expired) - rules.max_stopped
    )


@given(_population())
def test_decide_reaps_reaps_every_running_session_past_its_lifetime(population: Any) -> None:
    sessions, sandboxes, activity, now, rules = population
    stopped_ids = {r.session_id for r in logic.decide_reaps(sessions, sandboxes, activity, now, rules)}
    for s in sessions:
        sb = sandboxes.get(s.sandbox_id or "")
        if s.status == "active" and sb is not None and sb.status == "running":
            if now - logic.session_start(s, sb) >= timedelta(seconds=rules.max_lifetime):
                assert s.session_id in stopped_ids


def _owned(sandbox_id: str, session_id: str, status: str = "running") -> states.SandboxState:
    return msgspec.structs.replace(sandbox(sandbox_id, status, created=0), session_id=session_id)


@pytest.mark.parametrize(
    ("owner", "unowned"),
    [
        (None, True),  # the session is gone from the projection
        ("deleted", True),
        ("other-sandbox", True),  # re-provisioned: it points elsewhere now
        ("active", False),
        ("stopped", False),
    ],
)
def test_reconcile_deletes_sandboxes_their_session_let_go_of(owner: str | None, unowned: bool) -> None:
    record = _owned("sb-x", "s1")
    sessions = {}
    if owner == "other-sandbox":
        sessions["s1"] = session("s1", "active", sandbox_id="sb-y")
    elif owner is not None:
        sessions["s1"] = session("s1", owner, sandbox_id="sb-x")
    runtime = {"sb-x": logic.RuntimeView("sb-x", "running", T0)}
    early = logic.reconcile({"sb-x": record}, runtime, T0 + timedelta(seconds=GRACE - 1), GRACE, sessions)
    assert early == []
    late = logic.reconcile({"sb-x": record}, runtime, T0 + timedelta(seconds=GRACE), GRACE, sessions)
    assert [f.action for f in late] == (["delete_unowned"] if unowned else [])


def test_pool_sandboxes_without_a_session_are_never_unowned() -> None:
    warm = sandbox("sb-w", "running", created=0, pool=POOL)
    runtime = {"sb-w": logic.RuntimeView("sb-w", "running", T0)}
    assert logic.reconcile({"sb-w": warm}, runtime, T0 + timedelta(days=1), GRACE, {}) == []


# ---- pause before stop ------------------------------------------------------------------------

PAUSE = 300.0
PAUSING = lifecycle.LifecycleSettings(
    max_lifetime=LIFETIME, idle_timeout=IDLE, pause_timeout=PAUSE, stopped_retention=RETENTION, max_stopped=3
)


def pause_reaps(
    sessions: list[states.SessionState],
    sandboxes: list[states.SandboxState],
    activity: dict[str, datetime] | None = None,
    *,
    now: datetime,
    rules: lifecycle.LifecycleSettings = PAUSING,
    pausable: bool = True,
) -> list[logic.Reap]:
    return logic.decide_reaps(
        sessions, {s.sandbox_id: s for s in sandboxes}, activity or {}, now, rules, pausable=pausable
    )


def test_an_idle_running_sandbox_is_paused_first_then_stopped_at_the_idle_timeout() -> None:
    s, running = session(), sandbox()
    assert pause_reaps([s], [running], now=at(PAUSE) - US) == []
    [reap] = pause_reaps([s], [running], now=at(PAUSE))
    assert (reap.action, reap.reason, reap.quiet_since) == ("pause", "idle", T0)
    paused = msgspec.structs.replace(running, status="paused", paused_at=at(PAUSE))
    assert pause_reaps([s], [paused], now=at(IDLE) - US) == []  # paused: nothing more until the stop
    assert pause_reaps([s], [paused], now=at(IDLE)) == [logic.Reap("s1", "stop", "idle")]


def test_the_idle_clock_of_a_pause_counts_from_the_last_call() -> None:
    s, running = session(), sandbox()
    called = {"s1": at(100)}
    assert pause_reaps([s], [running], called, now=at(100 + PAUSE) - US) == []
    [reap] = pause_reaps([s], [running], called, now=at(100 + PAUSE))
    assert reap.action == "pause" and reap.quiet_since == at(100)
    paused = msgspec.structs.replace(running, status="paused")
    assert pause_reaps([s], [paused], called, now=at(100 + IDLE)) == [logic.Reap("s1", "stop", "idle")]


def test_paused_time_counts_towards_the_lifetime() -> None:
    paused = sandbox(status="paused")
    called = {"s1": at(LIFETIME - 1)}  # (a paused sandbox has had no call since; this is the rule)
    assert pause_reaps([session()], [paused], called, now=at(LIFETIME)) == [
        logic.Reap("s1", "stop", "lifetime")
    ]


@pytest.mark.parametrize(
    ("pause", "pausable"), [(0.0, True), (PAUSE, False), (IDLE, True), (IDLE + 1, True)], ids=str
)
def test_without_pausing_idle_sandboxes_are_stopped_as_before(pause: float, pausable: bool) -> None:
    rules = lifecycle.LifecycleSettings(
        max_lifetime=LIFETIME, idle_timeout=IDLE, pause_timeout=pause, stopped_retention=RETENTION
    )
    s, running = session(), sandbox()
    assert pause_reaps([s], [running], now=at(IDLE) - US, rules=rules, pausable=pausable) == []
    assert pause_reaps([s], [running], now=at(IDLE), rules=rules, pausable=pausable) == [
        logic.Reap("s1", "stop", "idle")
    ]
    assert logic.first_idle_step(rules, pausable) == IDLE


def test_activity_is_looked_up_from_the_pause_timeout_on() -> None:
    s, running = session(), sandbox()
    assert not logic.needs_activity(s, running, at(PAUSE) - US, PAUSING, pausable=True)
    assert logic.needs_activity(s, running, at(PAUSE), PAUSING, pausable=True)
    assert not logic.needs_activity(s, running, at(PAUSE), PAUSING, pausable=False)


# ---- hibernate: stopped, the session left active, before the session is stopped ----------

HIBERNATE = 450.0
LONG = lifecycle.LifecycleSettings(
    max_lifetime=LIFETIME, idle_timeout=IDLE, pause_timeout=PAUSE, hibernate_timeout=HIBERNATE
)


def test_an_idle_sandbox_is_paused_then_hibernated_then_its_session_stopped() -> None:
    s = session()
    running, paused = sandbox(), sandbox(status="paused")
    hibernated = sandbox(status="stopped")
    assert [r.action for r in pause_reaps([s], [running], now=at(PAUSE), rules=LONG)] == ["pause"]
    assert pause_reaps([s], [paused], now=at(HIBERNATE) - US, rules=LONG) == []
    [reap] = pause_reaps([s], [paused], now=at(HIBERNATE), rules=LONG)
    assert (reap.action, reap.reason, reap.quiet_since) == ("hibernate", "idle", T0)
    # A running one (a job kept it from the pause) is hibernated too; nothing runs in it then.
    assert [r.action for r in pause_reaps([s], [running], now=at(HIBERNATE), rules=LONG)] == ["hibernate"]
    assert pause_reaps([s], [hibernated], now=at(IDLE) - US, rules=LONG) == []
    assert pause_reaps([s], [hibernated], now=at(IDLE), rules=LONG) == [logic.Reap("s1", "stop", "idle")]
    assert logic.first_idle_step(LONG, pausable=False) == HIBERNATE


@pytest.mark.parametrize("hibernate", [0.0, IDLE, IDLE + 1])
def test_without_hibernation_idle_sandboxes_are_stopped_as_before(hibernate: float) -> None:
    rules = lifecycle.LifecycleSettings(max_lifetime=LIFETIME, idle_timeout=IDLE, hibernate_timeout=hibernate)
    assert not logic.hibernates(rules)
    assert pause_reaps([session()], [sandbox()], now=at(IDLE), rules=rules, pausable=False) == [
        logic.Reap("s1", "stop", "idle")
    ]


def test_orphan_snapshots_are_old_ones_no_ready_record_names() -> None:
    from shared.contract import states

    def record(snapshot_id: str, status: str) -> states.SnapshotState:
        return states.SnapshotState(
            snapshot_id=snapshot_id, status=status, session_id="s", sandbox_id="b", digest="sha256:x",
            created_at=T0, updated_at=T0, last_seq=1,
        )  # fmt: skip

    recorded = {"kept": record("kept", "ready"), "dropped": record("dropped", "deleted")}
    held = {"kept": T0, "dropped": T0, "stray": T0, "young": T0 + timedelta(minutes=9)}
    now = T0 + logic.ORPHAN_SNAPSHOT_AGE
    assert logic.orphan_snapshots(recorded, held, now) == ["dropped", "stray"]
    assert logic.orphan_snapshots(recorded, held, T0 + timedelta(minutes=5)) == []


def test_a_deadline_deletes_the_session_and_replaces_the_idle_rules() -> None:
    # E2B's timeout: the session lives until its deadline however idle, then is deleted.
    start = datetime(2026, 12, 5, 2, 0, tzinfo=UTC)
    rules = lifecycle.LifecycleSettings(idle_timeout=600, max_lifetime=3600, pause_timeout=300)
    session = states.SessionState(
        session_id="e2b-1", status="active", created_at=start, updated_at=start, last_seq=3,
        sandbox_id="sb-1", end_at=start + timedelta(minutes=30),
    )  # fmt: skip
    sandbox = states.SandboxState(
        sandbox_id="sb-1", status="running", session_id="e2b-1", created_at=start, updated_at=start,
        started_at=start, last_seq=1,
    )  # fmt: skip
    idle_long = start + timedelta(minutes=29)
    assert logic.decide_reaps([session], {"sb-1": sandbox}, {}, idle_long, rules, pausable=True) == []
    due = start + timedelta(minutes=30)
    assert logic.decide_reaps([session], {"sb-1": sandbox}, {}, due, rules, pausable=True) == [
        logic.Reap("e2b-1", "delete", "deadline")
    ]
    later = msgspec.structs.replace(session, end_at=start + timedelta(hours=2))
    past_lifetime = start + timedelta(hours=1)
    assert logic.decide_reaps([later], {"sb-1": sandbox}, {}, past_lifetime, rules) == [
        logic.Reap("e2b-1", "stop", "lifetime")
    ]

"""Pure policies: supervisor restart back-off, health liveness and replay's state diff."""

from __future__ import annotations

import asyncio
import os
import sys
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sbx import supervisor
from shared.contract import states
from shared.infrastructure import health, replay

NOW = datetime(2025, 6, 1, 12, 0, 0, tzinfo=UTC)


# ---- restart back-off ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("failures", "delay"),
    [
        (-3, 0.0),
        (0, 0.0),
        (1, 0.25),
        (2, 0.5),
        (3, 1.0),
        (4, 2.0),
        (5, 4.0),
        (7, 16.0),
        (8, 30.0),
        (9, 30.0),
        (1000, 30.0),
        (1026, 30.0),
        (10**6, 30.0),
    ],  # a child crash-looping for hours still gets 30s
)
def test_restart_delay(failures: int, delay: float) -> None:
    assert supervisor.restart_delay(failures) == delay


@given(st.integers(min_value=1, max_value=5000))
def test_restart_delay_doubles_until_capped(n: int) -> None:
    now, after = supervisor.restart_delay(n), supervisor.restart_delay(n + 1)
    assert 0.25 <= now <= after <= supervisor.MAX_DELAY_SECONDS == 30.0
    assert after == min(2 * now, 30.0)


# ---- liveness -----------------------------------------------------------------------------


def report(status: str = "ok", age: timedelta = timedelta(0), interval: float = 2.0) -> health.HealthReport:
    return health.HealthReport(
        service="scheduler",
        instance="scheduler-1",
        pid=1,
        host="h",
        version="1",
        status=status,
        started_at=NOW - timedelta(hours=1),
        reported_at=NOW - age,
        interval=interval,
    )


@pytest.mark.parametrize(
    ("age", "expected"),
    [
        (timedelta(0), "ok"),
        (timedelta(seconds=5.999), "ok"),
        (timedelta(seconds=6), "ok"),  # exactly three intervals still counts
        (timedelta(seconds=6, microseconds=1), "stale"),
        (timedelta(minutes=5), "stale"),
        (-timedelta(seconds=1), "ok"),  # a clock slightly ahead is not stale
    ],
)
def test_liveness_by_age(age: timedelta, expected: str) -> None:
    assert health.liveness(report(age=age), NOW) == expected


@pytest.mark.parametrize("status", ["starting", "ok", "draining"])
def test_liveness_passes_status_through_while_fresh(status: str) -> None:
    assert health.liveness(report(status, timedelta(seconds=1)), NOW) == status
    assert health.liveness(report(status, timedelta(seconds=7)), NOW) == "stale"


def test_liveness_scales_with_interval() -> None:
    assert health.liveness(report(age=timedelta(seconds=25), interval=10.0), NOW) == "ok"
    assert health.liveness(report(age=timedelta(seconds=31), interval=10.0), NOW) == "stale"
    assert health.liveness(report(age=timedelta(seconds=0.4), interval=0.1), NOW) == "stale"


# ---- replay diff --------------------------------------------------------------------------


def session(status: str = "active", last_seq: int = 3, **kw: object) -> states.SessionState:
    return states.SessionState(
        session_id="s1", status=status, created_at=NOW, updated_at=NOW, last_seq=last_seq, **kw
    )


def test_diff_equal_maps() -> None:
    assert replay.diff("session", {}, {}) == []
    assert (
        replay.diff(
            "session",
            {"k1": session(), "k2": session("stopped")},
            {"k2": session("stopped"), "k1": session()},
        )
        == []
    )


def test_diff_missing_key() -> None:
    [d] = replay.diff("session", {"k1": session(), "k2": session()}, {"k1": session()})
    assert (d.kind, d.key, d.actual) == ("session", "k2", None)
    assert d.expected is not None and d.expected["last_seq"] == 3 and d.expected["status"] == "active"
    assert "k2" in d.describe() and "missing" in d.describe() and "3" in d.describe()


def test_diff_extra_key() -> None:
    [d] = replay.diff("instance", {}, {"ghost": session()})
    assert (d.kind, d.key, d.expected) == ("instance", "ghost", None)
    assert d.actual is not None and d.actual["session_id"] == "s1"
    assert "ghost" in d.describe() and "not in the stream" in d.describe()


def test_diff_changed_fields() -> None:
    want, have = session("stopped", last_seq=9, version=2), session("active", last_seq=3, version=2)
    [d] = replay.diff("session", {"k": want}, {"k": have})
    assert d.key == "k"
    assert d.expected == {**d.actual, "status": "stopped", "last_seq": 9}
    assert d.actual["status"] == "active" and d.actual["created_at"] == "2025-06-01T12:00:00Z"
    text = d.describe()
    assert "status" in text and "last_seq" in text
    assert "'stopped'" in text and "'active'" in text
    assert "version" not in text and "created_at" not in text
    assert text.index("last_seq") < text.index("status")  # fields are listed in a stable order


def test_diff_is_sorted_by_key() -> None:
    out = replay.diff("session", {"b": session(), "c": session()}, {"a": session(), "c": session("stopped")})
    assert [d.key for d in out] == ["a", "b", "c"]


async def test_a_child_that_refuses_its_configuration_is_not_restarted(tmp_path) -> None:
    """Exit 2 (a service's configuration error) is not retried: the supervisor says so
    once and tells `sbx up`, which stops the stack; any other exit is restarted."""
    sup = supervisor.Supervisor(stop_timeout=5)
    env = supervisor.child_env({"PATH": os.environ.get("PATH", "")})
    refusing = await sup.start(
        supervisor.Child("refusing", [sys.executable, "-c", "raise SystemExit(2)"], env)
    )
    crashing = await sup.start(
        supervisor.Child(
            "crashing", [sys.executable, "-c", "import time; time.sleep(0.2); raise SystemExit(1)"], env
        )
    )
    try:
        async with asyncio.timeout(10):
            await sup.refused.wait()
        assert sup.refused_by == "refusing" and refusing.restarts == 0
        async with asyncio.timeout(10):
            while crashing.restarts == 0:
                await asyncio.sleep(0.05)
    finally:
        await sup.stop_all()

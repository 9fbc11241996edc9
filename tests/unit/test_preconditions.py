"""The reaper's commands carry the session's last_seq: a session used since the reaper's
snapshot is left alone (no stale stop or purge)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from services.reaper import logic as reaper_logic
from shared.contract import commands, events, states
from shared.domain import session as session_rules
from shared.infrastructure.settings import lifecycle

T0 = datetime(2025, 6, 1, tzinfo=UTC)
META = events.Meta(event_id="e" * 32, time=T0, service="scheduler", instance="s1")


def session(status: str = "active", last_seq: int = 7) -> states.SessionState:
    return states.SessionState(
        session_id="s1",
        status=status,
        created_at=T0,
        updated_at=T0,
        last_seq=last_seq,  # type: ignore[arg-type]
    )


def test_stop_with_a_matching_precondition_stops() -> None:
    stop = commands.StopSession(command_id="c1", session_id="s1", reason="idle", if_last_seq=7)
    [event] = session_rules.decide(session(), stop, META)
    assert isinstance(event, events.SessionStopped) and event.reason == "idle"


def test_stop_and_delete_with_a_stale_precondition_do_nothing() -> None:
    assert (
        session_rules.decide(
            session(), commands.StopSession(command_id="c1", session_id="s1", if_last_seq=6), META
        )
        == []
    )
    stopped = session("stopped", last_seq=9)
    purge = commands.DeleteSession(command_id="c2", session_id="s1", reason="retention", if_last_seq=8)
    assert session_rules.decide(stopped, purge, META) == []
    assert session_rules.decide(None, purge, META) == []


def test_reaps_carry_the_last_seq_they_were_decided_on() -> None:
    stopped = states.SessionState(
        session_id="old", status="stopped", created_at=T0, updated_at=T0, last_seq=41
    )
    [reap] = reaper_logic.decide_reaps(
        [stopped], {}, {}, T0 + timedelta(days=2), lifecycle.LifecycleSettings()
    )
    assert (reap.reason, reap.last_seq) == ("retention", 41)

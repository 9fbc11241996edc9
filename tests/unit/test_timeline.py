"""Which events make a session's timeline and what each entry says (shared/domain/timeline.py)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from sbx_api import errors
from shared.contract import events
from shared.domain import timeline

NOW = datetime(2026, 12, 3, tzinfo=UTC)


def meta(session_id: str | None = None, **more) -> events.Meta:
    return events.Meta(
        event_id="e" * 32, time=NOW, service="test", instance="t1", session_id=session_id, **more
    )


def test_a_pool_sandbox_is_the_sessions_from_its_claim_on():
    members = timeline.Membership("s1")
    requested = events.SandboxRequested(meta=meta(), sandbox_id="sb1", pool="default")
    started = events.SandboxStarted(meta=meta(), sandbox_id="sb1")
    claimed = events.SandboxClaimed(meta=meta("s1"), sandbox_id="sb1", session_id="s1")
    stopped = events.SandboxStopped(meta=meta(), sandbox_id="sb1", reason="idle")
    for seq, event in ((1, requested), (2, started)):
        assert not members.learn(seq, event) and not members.owns(seq, event)
    assert members.learn(3, claimed) and members.owns(3, claimed)
    assert not members.learn(4, claimed)  # known already
    assert members.owns(9, stopped)  # whoever stops it, later on: the session's
    other = events.SandboxClaimed(meta=meta("s2"), sandbox_id="sb2", session_id="s2")
    assert not members.learn(5, other) and not members.owns(5, other)


def test_a_sandbox_assigned_to_the_session_is_its_own():
    members = timeline.Membership("s1")
    assigned = events.SessionSandboxAssigned(
        meta=meta("s1"), session_id="s1", sandbox_id="sb7", image="default"
    )
    assert members.learn(10, assigned) and members.sandboxes == {"sb7": 10}
    assert not members.owns(8, events.SandboxStarted(meta=meta(), sandbox_id="sb7"))  # before: not yet
    assert members.owns(11, events.SandboxStarted(meta=meta(), sandbox_id="sb7"))


def test_commands_and_edits_become_entries_with_their_fields():
    ran = events.CommandExecuted(
        meta=meta("s1", user_id="ann", correlation_id="req-1"),
        session_id="s1", sandbox_id="sb1", tool="shell", command="make test", exit_code=2, duration_ms=40,
    )  # fmt: skip
    entry = timeline.entry_of(5, ran)
    assert entry is not None and entry.kind == "command" and entry.summary == "shell: make test -> exit 2"
    assert (entry.user_id, entry.request_id, entry.exit_code, entry.path) == ("ann", "req-1", 2, None)
    edit = events.CommandExecuted(
        meta=meta("s1"), session_id="s1", sandbox_id="sb1", tool="edit", command="create /workspace/a.py",
        path="/workspace/a.py", size=12,
    )  # fmt: skip
    entry = timeline.entry_of(6, edit)
    assert entry is not None and (entry.kind, entry.operation, entry.path, entry.size) == (
        "edit", "create", "/workspace/a.py", 12,
    )  # fmt: skip


def test_lifecycle_entries_say_what_changed():
    entry = timeline.entry_of(1, events.SandboxStopped(meta=meta(), sandbox_id="sb1", reason="idle"))
    assert entry is not None and entry.kind == "lifecycle"
    assert entry.summary == "sandbox.stopped (sandbox_id=sb1, reason=idle)" and entry.sandbox_id == "sb1"
    assert timeline.entry_of(1, events.ProxyStopped(meta=meta(), proxy_id="p1", reason="x")) is None


def test_kinds_are_checked():
    assert timeline.kinds([]) == frozenset(("lifecycle", "command", "edit", "egress"))
    assert timeline.kinds(["edit"]) == {"edit"}
    with pytest.raises(errors.InvalidInput, match="kind must be one of"):
        timeline.kinds(["secrets"])
    assert timeline.subject_kinds(frozenset({"edit"})) == ("session", "exec")

"""States and event metadata for tests: every required field filled, each test naming only
what it is about (``session_state(status="stopped", sandbox_id="sb-1")``). One place, so a
new required field is added here once, not in every test module."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from shared.contract import events, states

T0 = datetime(2025, 6, 1, 12, 0, 0, tzinfo=UTC)
"""The tests' epoch: factories date everything from it unless told otherwise."""


def at(seconds: float) -> datetime:
    """``seconds`` after :data:`T0`."""
    return T0 + timedelta(seconds=seconds)


def meta(n: int = 0, **fields: Any) -> events.Meta:
    """The metadata of the ``n``-th event: its own id, ``n`` seconds after T0, appended by
    the scheduler unless ``fields`` say otherwise."""
    values: dict[str, Any] = dict(
        event_id=f"{n:032x}",
        time=at(n),
        service="scheduler",
        instance="scheduler-1",
        command_id="cmd-0",
        session_id="task-42",
    )
    values.update(fields)
    return events.Meta(**values)


def session_state(session_id: str = "task-42", status: str = "active", **fields: Any) -> states.SessionState:
    values: dict[str, Any] = dict(
        session_id=session_id, status=status, created_at=T0, updated_at=T0, last_seq=1
    )
    values.update(fields)
    return states.SessionState(**values)


def sandbox_state(sandbox_id: str = "sb-1", status: str = "running", **fields: Any) -> states.SandboxState:
    values: dict[str, Any] = dict(
        sandbox_id=sandbox_id, status=status, created_at=T0, updated_at=T0, last_seq=1
    )
    values.update(fields)
    return states.SandboxState(**values)


def snapshot_state(snapshot_id: str = "snap-1", status: str = "ready", **fields: Any) -> states.SnapshotState:
    values: dict[str, Any] = dict(
        snapshot_id=snapshot_id,
        status=status,
        session_id="task-42",
        sandbox_id="sb-1",
        digest="sha256:" + "0" * 64,
        created_at=T0,
        updated_at=T0,
        last_seq=1,
    )
    values.update(fields)
    return states.SnapshotState(**values)

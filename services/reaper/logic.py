"""Pure reaper rules: lifetimes and the self-healing reconcile, as functions of state and time.

Nothing here reads a clock or does I/O; ``now`` is an argument, so the rules are tested
with fake time (``tests/unit/test_reaper_logic.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Literal

from shared.contract import states
from shared.domain import sandbox as sandbox_rules
from shared.infrastructure.settings import lifecycle


@dataclass(frozen=True)
class Reap:
    session_id: str
    action: Literal["pause", "hibernate", "stop", "delete"]
    reason: Literal["lifetime", "idle", "retention", "max_stopped", "deadline"]
    last_seq: int | None = field(default=None, compare=False)
    """The session's ``last_seq`` the decision was made on (sent as a precondition)."""
    quiet_since: datetime | None = field(default=None, compare=False)
    """A pause's or hibernation's: the session's last call as seen (a later one undoes the
    pause, or leaves the sandbox running)."""


def session_start(session: states.SessionState, sandbox: states.SandboxState) -> datetime:
    """Lifetimes count from when this session got its sandbox running: the later of the
    sandbox's last start and its claim from the pool (pool time does not count)."""
    del session  # the session's own times say nothing about when it got this sandbox
    times = [t for t in (sandbox.started_at, sandbox.claimed_at) if t is not None]
    return max(times) if times else sandbox.created_at


def pauses(rules: lifecycle.LifecycleSettings, pausable: bool) -> bool:
    """Whether idle sandboxes are paused before they are stopped: where the runtime can
    pause, with a pause timeout shorter than the idle (stop) timeout."""
    return pausable and 0 < rules.pause_timeout < rules.idle_timeout


def hibernates(rules: lifecycle.LifecycleSettings) -> bool:
    """Whether idle sandboxes are hibernated (stopped, the session left active) before the
    session is stopped: with a hibernate timeout shorter than the idle (stop) timeout."""
    return 0 < rules.hibernate_timeout < rules.idle_timeout


def first_idle_step(rules: lifecycle.LifecycleSettings, pausable: bool) -> float:
    """Seconds without a call after which the idle rules first act (pause, hibernate, stop)."""
    steps = [rules.idle_timeout]
    if pauses(rules, pausable):
        steps.append(rules.pause_timeout)
    if hibernates(rules):
        steps.append(rules.hibernate_timeout)
    return min(steps)


def needs_activity(session: states.SessionState, sandbox: states.SandboxState, now: datetime,
                   rules: lifecycle.LifecycleSettings, pausable: bool = False) -> bool:  # fmt: skip
    """Whether an idle rule could fire without looking up the last tool call."""
    quiet_since = max(session_start(session, sandbox), session.updated_at)
    return now - quiet_since >= timedelta(seconds=first_idle_step(rules, pausable))


def decide_reaps(
    sessions: Iterable[states.SessionState],
    sandboxes: Mapping[str, states.SandboxState],
    last_activity: Mapping[str, datetime],
    now: datetime,
    rules: lifecycle.LifecycleSettings,
    *,
    pausable: bool = False,
) -> list[Reap]:
    """What the lifetimes say now. A session's sandbox is paused after ``pause_timeout``
    without a call (where ``pauses``), stopped after ``idle_timeout`` without one, paused
    or not, and stopped at ``max_lifetime`` (paused time counts: a paused sandbox holds its
    memory). A session with a deadline (``end_at``, E2B's timeout) is deleted at it and
    never paused, hibernated or stopped for idleness before. Stopped sessions are purged
    after ``stopped_retention`` and beyond ``max_stopped``, oldest first."""
    reaps: list[Reap] = []
    kept_stopped: list[states.SessionState] = []
    for session in sessions:
        if session.status == "active" and session.sandbox_id:
            sandbox = sandboxes.get(session.sandbox_id)
            if sandbox is not None and sandbox.status in ("running", "paused", "stopped"):
                reap = _lifetime_rule(session, sandbox, last_activity.get(session.session_id), now, rules,
                                      pausable)  # fmt: skip
                if reap is not None:
                    reaps.append(reap)
        elif session.status == "stopped":
            if now - session.updated_at >= timedelta(seconds=rules.stopped_retention):
                reaps.append(Reap(session.session_id, "delete", "retention", session.last_seq))
            else:
                kept_stopped.append(session)
    extra = len(kept_stopped) - rules.max_stopped
    if extra > 0:
        oldest = sorted(kept_stopped, key=lambda s: (s.updated_at, s.session_id))[:extra]
        reaps.extend(Reap(s.session_id, "delete", "max_stopped", s.last_seq) for s in oldest)
    return reaps


def _lifetime_rule(
    session: states.SessionState,
    sandbox: states.SandboxState,
    last_call: datetime | None,
    now: datetime,
    rules: lifecycle.LifecycleSettings,
    pausable: bool,
) -> Reap | None:
    start = session_start(session, sandbox)
    if session.end_at is not None and now >= session.end_at:
        return Reap(session.session_id, "delete", "deadline", session.last_seq)
    if sandbox.status != "stopped" and now - start >= timedelta(seconds=rules.max_lifetime):
        return Reap(session.session_id, "stop", "lifetime", session.last_seq)
    if session.end_at is not None:  # a deadline replaces the idle rules (E2B's timeout)
        return None
    quiet_since = max(t for t in (start, session.updated_at, last_call) if t is not None)
    quiet = now - quiet_since
    if quiet >= timedelta(seconds=rules.idle_timeout):
        return Reap(session.session_id, "stop", "idle", session.last_seq)
    if sandbox.status == "stopped":  # hibernated: the session is stopped at the idle timeout
        return None
    if hibernates(rules) and quiet >= timedelta(seconds=rules.hibernate_timeout):
        return Reap(session.session_id, "hibernate", "idle", session.last_seq, quiet_since)
    if (
        sandbox.status == "running"
        and pauses(rules, pausable)
        and quiet >= timedelta(seconds=rules.pause_timeout)
    ):
        return Reap(session.session_id, "pause", "idle", session.last_seq, quiet_since)
    return None


@dataclass(frozen=True)
class RuntimeView:
    """What the runtime reports about one of its sandboxes."""

    sandbox_id: str
    status: str
    created_at: datetime


@dataclass(frozen=True)
class Finding:
    sandbox_id: str
    action: Literal["delete_orphan", "mark_lost", "fail_stuck", "delete_unowned"]
    detail: str


ORPHAN_SNAPSHOT_AGE = timedelta(minutes=10)
"""A snapshot the runtime holds and no event names is removed once this old: its
pool-manager died between the copy and ``snapshot.created``, and a retry of the request
(same id) within this time records it instead."""


def orphan_snapshots(
    recorded: Mapping[str, states.SnapshotState], held: Mapping[str, datetime], now: datetime
) -> list[str]:
    """The snapshots the runtime holds (id -> when made) that no ready record names, made
    at least ``ORPHAN_SNAPSHOT_AGE`` ago."""
    return sorted(
        snapshot_id
        for snapshot_id, made in held.items()
        if now - made >= ORPHAN_SNAPSHOT_AGE
        and (snapshot_id not in recorded or recorded[snapshot_id].status != "ready")
    )


#: A record still "requested" this many grace periods after it was made is stuck
#: (its provisioner died between asking the runtime and recording the outcome).
STUCK_GRACES = 5


def reconcile(
    records: Mapping[str, states.SandboxState],
    runtime: Mapping[str, RuntimeView],
    now: datetime,
    grace: float,
    sessions: Mapping[str, states.SessionState] | None = None,
) -> list[Finding]:
    """Compare the runtime with the records. Runtime sandboxes without a live record are
    orphans (deleted); live records without runtime resources are lost (recorded). Both
    wait ``grace`` seconds, so nothing in the middle of being provisioned is touched."""
    settle = timedelta(seconds=grace)
    findings: list[Finding] = []
    for sandbox_id, seen in sorted(runtime.items()):
        record = records.get(sandbox_id)
        if (record is None or record.status in sandbox_rules.DEAD) and now - seen.created_at >= settle:
            why = "no record" if record is None else f"record is {record.status}"
            findings.append(Finding(sandbox_id, "delete_orphan", why))
    for sandbox_id, record in sorted(records.items()):
        if (
            record.status in sandbox_rules.LIVE
            and sandbox_id not in runtime
            and now - record.updated_at >= settle
        ):
            findings.append(
                Finding(sandbox_id, "mark_lost", f"record is {record.status}, runtime has nothing")
            )
        elif (
            record.status == "requested"
            and sandbox_id in runtime
            and now - record.updated_at >= settle * STUCK_GRACES
        ):
            findings.append(Finding(sandbox_id, "fail_stuck", "provisioning never finished"))
        elif (
            sessions is not None
            and record.status in sandbox_rules.LIVE
            and record.session_id
            and now - record.updated_at >= settle
        ):
            # A session's sandbox that the session no longer points to (a scheduler died,
            # or the pool-manager was unreachable, between the session's event and the
            # sandbox's deletion): nobody will ever use or delete it.
            owner = sessions.get(record.session_id)
            if owner is None or owner.status == "deleted" or owner.sandbox_id != sandbox_id:
                findings.append(Finding(sandbox_id, "delete_unowned", "its session no longer uses it"))
    return findings

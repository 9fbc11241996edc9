"""Pure snapshot rules (shared.domain.snapshot) and the session rules of forks and restores."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from sbx_api import errors
from shared.contract import commands, events, states
from shared.domain import pools, projections, session
from shared.domain import snapshot as rules

T0 = datetime(2026, 12, 4, 2, 0, tzinfo=UTC)


def meta(n: int = 0, command_id: str = "cmd-0", org: str | None = "acme") -> events.Meta:
    return events.Meta(
        event_id=f"{n:032x}",
        time=T0 + timedelta(seconds=n),
        service="pool-manager",
        instance="pool-manager-1",
        command_id=command_id,
        org_id=org,
        user_id="ann",
        session_id="task-42",
    )


def created(snapshot_id: str = "snap-1", n: int = 0, session_id: str = "task-42") -> events.SnapshotCreated:
    return events.SnapshotCreated(
        meta=meta(n),
        snapshot_id=snapshot_id,
        session_id=session_id,
        sandbox_id="sb-1",
        org_id="acme",
        digest="sha256:" + "ab" * 32,
        layers=("cd" * 32,),
        size=10,
        total_size=10,
        image="python:3.12",
        run_as_root=False,
    )


def state(snapshot_id: str = "snap-1", n: int = 0, session_id: str = "task-42") -> states.SnapshotState:
    folded = projections.SNAPSHOTS.fold([(n + 1, created(snapshot_id, n, session_id))])
    assert folded is not None
    return folded


def test_a_snapshot_is_created_once_and_deleted_once() -> None:
    first = state()
    assert (
        first.status == "ready" and first.user_id == "ann" and first.org_id == "acme" and first.last_seq == 1
    )
    assert first.created_at == T0 and first.layers == ("cd" * 32,) and first.run_as_root is False
    assert rules.decide_created(None, created()) == [created()]
    assert rules.decide_created(first, created()) == []  # recorded already: a retry adds nothing
    gone = events.SnapshotDeleted(
        meta=meta(1), snapshot_id="snap-1", session_id="task-42", reason="retention"
    )
    assert rules.decide_deleted(first, gone) == [gone]
    deleted = projections.SNAPSHOTS.fold([(2, gone)], first)
    assert deleted is not None and deleted.status == "deleted" and deleted.delete_reason == "retention"
    assert rules.decide_deleted(deleted, gone) == [] and rules.decide_deleted(None, gone) == []
    with pytest.raises(errors.InvalidTransition):
        projections.SNAPSHOTS.fold([(3, gone)], deleted)
    with pytest.raises(errors.InvalidTransition):
        projections.SNAPSHOTS.fold([(3, created())], first)


def test_only_a_ready_snapshot_of_ones_own_organisation_is_usable() -> None:
    ready = state()
    assert rules.usable(ready, "snap-1", "acme") is ready
    assert rules.usable(ready, "snap-1", None) is ready  # the operator
    for bad, org in ((ready, "globex"), (None, "acme")):
        with pytest.raises(errors.NotFound, match="snapshot 'snap-1' does not exist"):
            rules.usable(bad, "snap-1", org)
    gone = projections.SNAPSHOTS.fold(
        [(2, events.SnapshotDeleted(meta=meta(1), snapshot_id="snap-1"))], ready
    )
    with pytest.raises(errors.NotFound):
        rules.usable(gone, "snap-1", "acme")


def test_retention_removes_a_sessions_oldest_ready_snapshots_past_the_limit() -> None:
    mine = [state(f"snap-{n}", n) for n in range(5)]
    assert [s.snapshot_id for s in rules.over_retention(mine, 3)] == ["snap-0", "snap-1"]
    assert rules.over_retention(mine, 5) == [] and rules.over_retention(mine, 0) == []  # 0: no limit
    gone = projections.SNAPSHOTS.fold(
        [(9, events.SnapshotDeleted(meta=meta(9), snapshot_id="snap-0"))], mine[0]
    )
    assert gone is not None
    assert [s.snapshot_id for s in rules.over_retention([gone, *mine[1:]], 3)] == ["snap-1"]


def test_a_sessions_snapshots_are_those_of_its_id_and_its_organisation() -> None:
    """An id deleted and created again by another organisation: the new owner's snapshots
    never make retention remove the old owner's (nor count them)."""
    acme = [state(f"snap-{n}", n) for n in range(3)]
    globex = msgspec_replace(state("snap-g", 5), org_id="globex")
    other = state("snap-o", 6, session_id="task-43")
    every = [*acme, globex, other]
    assert rules.of_session(every, "task-42", "globex") == [globex]
    assert rules.of_session(every, "task-42", "acme") == acme
    assert rules.over_retention(rules.of_session(every, "task-42", "globex"), 1) == []


def test_a_fork_is_created_with_its_sandbox_in_one_append_and_never_over_an_existing_session() -> None:
    snap = state()
    fork = commands.ForkSession(
        command_id="cmd-f",
        session_id="task-42-try",
        snapshot_id="snap-1",
        actor=commands.Actor(user_id="bob"),
    )
    made = session.decide_fork(None, fork, snap, "sb-9", meta(2))
    assert [type(e) for e in made] == [events.SessionCreated, events.SessionSandboxAssigned]
    assert made[0].forked_from == "snap-1" and made[0].org_id == "acme" and made[0].image == "python:3.12"
    after = projections.SESSIONS.fold([(1 + n, e) for n, e in enumerate(made)])
    assert after is not None and after.sandbox_id == "sb-9" and after.forked_from == "snap-1"
    assert after.status == "active" and after.user_id == "bob"
    assert session.decide_fork(after, fork, snap, "sb-10", meta(3)) == []  # the same command again
    other = commands.ForkSession(command_id="cmd-g", session_id="task-42-try", snapshot_id="snap-1")
    assert session.decide_fork(after, other, snap, "sb-10", meta(3)) == []  # taken meanwhile: nothing
    with pytest.raises(errors.Conflict, match="already exists"):  # (what the scheduler says first)
        session.decide(after, other, meta(3))


def test_snapshots_and_restores_need_an_active_session_of_the_callers_organisation() -> None:
    acme = commands.Actor(org_id="acme")
    live = projections.SESSIONS.fold(
        [(1, events.SessionCreated(meta=meta(), session_id="task-42", org_id="acme"))]
    )
    take = commands.SnapshotSession(command_id="c1", session_id="task-42", snapshot_id="s", actor=acme)
    assert session.decide(live, take, meta()) == []
    foreign = commands.SnapshotSession(
        command_id="c2", session_id="task-42", snapshot_id="s", actor=commands.Actor(org_id="globex")
    )
    with pytest.raises(errors.NotFound):
        session.decide(live, foreign, meta())
    stopped = projections.SESSIONS.fold(
        [(2, events.SessionStopped(meta=meta(1, "c0"), session_id="task-42"))], live
    )
    restore = commands.RestoreSession(command_id="c3", session_id="task-42", snapshot_id="s", actor=acme)
    with pytest.raises(errors.Conflict, match="stopped"):
        session.decide(stopped, restore, meta())
    with pytest.raises(errors.NotFound):
        session.decide(None, restore, meta())
    with pytest.raises(errors.InvalidInput):
        session.validate(commands.SnapshotSession(command_id="c4", session_id="task-42", snapshot_id="../x"))


def test_a_sandbox_from_a_snapshot_is_never_a_warm_pools() -> None:
    spec = pools.PoolSpec(image="python:3.12", run_as_root=False, writable_root=True, min_idle=1)
    options = session.snapshot_options(state())
    assert options == {
        "image": "python:3.12",
        "run_as_root": False,
        "writable_root": True,
        "snapshot": "snap-1",
    }
    assert not spec.serves(options)
    assert spec.serves({k: v for k, v in options.items() if k != "snapshot"})


def warm_command(count: int, org: str | None = "acme", cid: str = "cmd-w") -> commands.WarmSnapshot:
    return commands.WarmSnapshot(
        command_id=cid,
        session_id="task-42",
        snapshot_id="snap-1",
        count=count,
        actor=commands.Actor(via="rest", org_id=org),
    )


def test_keeping_a_snapshot_warm_is_recorded_per_change_and_only_for_a_usable_one() -> None:
    ready = state()
    (event,) = rules.decide_warm(ready, warm_command(3), meta(1))
    assert isinstance(event, events.SnapshotWarmSet) and (event.count, event.session_id) == (3, "task-42")
    kept = rules.evolve(ready, event, 2)
    assert kept.warm == 3 and kept.status == "ready" and kept.last_seq == 2
    assert rules.decide_warm(kept, warm_command(3), meta(2)) == []  # the same count: nothing
    assert rules.decide_warm(kept, warm_command(0), meta(2))[0].count == 0
    for bad in (-1, rules.WARM_MAX + 1):
        with pytest.raises(errors.InvalidInput, match="count"):
            rules.decide_warm(kept, warm_command(bad), meta(2))
    with pytest.raises(errors.NotFound):
        rules.decide_warm(kept, warm_command(1, org="globex"), meta(2))  # another organisation's
    assert rules.decide_warm(kept, warm_command(4, org=None), meta(2))  # the operator may
    nobodys = msgspec_replace(kept, org_id=None)
    with pytest.raises(errors.Forbidden, match="only an operator"):
        rules.decide_warm(nobodys, warm_command(1), meta(2))  # forkable by a tenant, not theirs to warm
    assert rules.decide_warm(nobodys, warm_command(1, org=None), meta(2))
    # An organisation keeps at most WARM_MAX warm in all; lowering is always allowed.
    with pytest.raises(errors.LimitExceeded, match="keeps 98 sandboxes warm for other snapshots"):
        rules.decide_warm(kept, warm_command(5), meta(2), others=98)
    assert rules.decide_warm(kept, warm_command(5), meta(2), others=95)
    assert rules.decide_warm(kept, warm_command(1), meta(2), others=100)[0].count == 1
    mine = [
        kept,
        msgspec_replace(kept, snapshot_id="snap-2", warm=7),
        msgspec_replace(kept, snapshot_id="x", warm=9, org_id="globex"),
    ]
    assert rules.warm_elsewhere(mine, "snap-1", "acme") == 7
    assert (
        rules.warm_elsewhere(
            [*mine, msgspec_replace(kept, snapshot_id="g", warm=5, status="deleted")], "snap-2", "acme"
        )
        == 3
    )
    with pytest.raises(errors.NotFound):
        rules.decide_warm(None, warm_command(1), meta(2))
    gone = rules.evolve(kept, events.SnapshotDeleted(meta=meta(3), snapshot_id="snap-1"), 3)
    with pytest.raises(errors.NotFound):
        rules.decide_warm(gone, warm_command(1), meta(4))
    with pytest.raises(errors.InvalidTransition):
        rules.evolve(gone, event, 4)  # a deleted snapshot is kept warm no more


def test_a_snapshot_kept_warm_has_a_pool_of_its_own_that_serves_only_its_forks() -> None:
    kept = msgspec_replace(state(), warm=4)
    spec = pools.PoolSpec.of_snapshot(kept)
    assert (spec.snapshot, spec.min_idle, spec.org, spec.image) == ("snap-1", 4, "acme", "python:3.12")
    assert spec.name == "snapshot:snap-1"  # (configured pools' names have no colon)
    options = session.snapshot_options(kept)
    assert spec.serves(options)
    assert not spec.serves({**options, "snapshot": "snap-2"})
    assert not spec.serves({k: v for k, v in options.items() if k != "snapshot"})  # an ordinary session
    assert spec.pool_id == pools.PoolSpec.of_snapshot(msgspec_replace(kept, warm=9)).pool_id  # count aside
    other = pools.PoolSpec.of_snapshot(msgspec_replace(kept, snapshot_id="snap-2"))
    assert other.pool_id != spec.pool_id
    plain = pools.PoolSpec(image="python:3.12", run_as_root=False, org="acme")
    assert plain.pool_id != spec.pool_id
    assert pools.serving([plain, spec], options, "acme") == spec
    assert pools.serving([spec], options, "globex") is None
    listed = [
        kept,
        msgspec_replace(kept, snapshot_id="snap-0", warm=0),
        msgspec_replace(kept, status="deleted"),
    ]
    assert pools.warm_snapshots(listed) == [spec]


def msgspec_replace(s: states.SnapshotState, **changes: object) -> states.SnapshotState:
    import msgspec

    return msgspec.structs.replace(s, **changes)

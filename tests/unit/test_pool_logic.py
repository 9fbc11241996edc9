"""Warm pool specs (shared.domain.pools) and the pool-manager's pure refill plan
(services.pool_manager.logic)."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.pool_manager import logic
from shared.contract import states
from shared.domain import pools
from shared.infrastructure.settings import lifecycle as lifecycle_settings

T0 = datetime(2025, 6, 1, 12, 0, 0, tzinfo=UTC)
DEFAULT = pools.PoolSpec()
PY = pools.PoolSpec(name="py", image="python:3.12", min_idle=3)
OLD = pools.PoolSpec(image="old:1")
STATUSES: tuple[str, ...] = states.SandboxStatus.__args__  # type: ignore[attr-defined]

_counter = iter(range(10**9))


def sbx(status: str = "running", *, pool: str | None = None, session_id: str | None = None, **kw: Any) -> Any:
    return states.SandboxState(
        sandbox_id=kw.pop("sandbox_id", f"sb-{next(_counter):020d}"),
        status=status,  # type: ignore[arg-type]
        session_id=session_id,
        pool=pool,
        created_at=T0,
        updated_at=T0,
        last_seq=1,
        **kw,
    )


def warm(spec: pools.PoolSpec, status: str = "running", **kw: Any) -> states.SandboxState:
    return sbx(status, pool=spec.pool_id, **kw)


# ---- PoolSpec ---------------------------------------------------------------------------


def test_pool_id_is_stable_for_equal_specs() -> None:
    assert pools.PoolSpec().pool_id == pools.PoolSpec().pool_id == DEFAULT.pool_id
    assert pools.PoolSpec(image="python:3.12").pool_id == pools.PoolSpec(image="python:3.12").pool_id


def test_pool_id_is_name_at_short_hash() -> None:
    name, _, digest = DEFAULT.pool_id.partition("@")
    assert name == "default" and len(digest) == 8 and int(digest, 16) >= 0
    assert PY.pool_id.startswith("py@")


@pytest.mark.parametrize(
    "change",
    [{"image": "python:3.12"}, {"run_as_root": False}, {"writable_root": False}, {"name": "other"}],
    ids=["image", "run_as_root", "writable_root", "name"],
)
def test_pool_id_changes_with_the_spec(change: dict[str, Any]) -> None:
    assert dataclasses.replace(DEFAULT, **change).pool_id != DEFAULT.pool_id


@pytest.mark.parametrize("min_idle", [0, 1, 7, 100])
def test_pool_id_ignores_min_idle(min_idle: int) -> None:
    assert dataclasses.replace(DEFAULT, min_idle=min_idle).pool_id == DEFAULT.pool_id


def test_pool_ids_do_not_collide_across_flag_combinations() -> None:
    specs = [
        pools.PoolSpec(image=image, run_as_root=root, writable_root=writable)
        for image in ("default", "python:3.12", "node:22")
        for root in (True, False)
        for writable in (True, False)
    ]
    assert len({s.pool_id for s in specs}) == len(specs)


@pytest.mark.parametrize(
    ("options", "served"),
    [
        ({}, True),
        ({"image": "default"}, True),
        ({"image": "default", "run_as_root": True, "writable_root": True, "use_kata": False}, True),
        ({"image": "python:3.12"}, False),
        ({"image": "default", "use_kata": True}, False),
        ({"image": "default", "run_as_root": False}, False),
        ({"image": "default", "writable_root": False}, False),
    ],
)
def test_default_pool_serves_only_matching_options(options: dict[str, object], served: bool) -> None:
    assert DEFAULT.serves(options) is served


def test_pool_with_options_serves_exactly_those() -> None:
    spec = pools.PoolSpec(image="python:3.12", run_as_root=False, writable_root=False)
    assert spec.serves({"image": "python:3.12", "run_as_root": False, "writable_root": False})
    assert not spec.serves({"image": "python:3.12"})  # defaults are root and writable
    assert not spec.serves(
        {"image": "python:3.12", "run_as_root": False, "writable_root": False, "use_kata": True}
    )


SHARED = pools.PoolSpec(min_idle=2)
ACME = pools.PoolSpec(name="acme", min_idle=1, org="acme")


def test_an_organisations_pool_serves_it_first_and_nobody_else() -> None:
    specs = [SHARED, ACME]
    assert pools.serving(specs, {}, "acme") == ACME
    assert pools.serving(specs, {}, "globex") == SHARED  # sandboxes take a cache on first call
    assert pools.serving(specs, {}, None) == SHARED
    assert pools.serving([ACME], {}, None) is None
    assert pools.serving([ACME], {}, "globex") is None


def test_where_caches_are_chosen_at_creation_an_organisation_never_takes_a_shared_sandbox() -> None:
    """(Kubernetes with caches: a shared pool's pod can never show the organisation's
    cache, so the session starts cold with it unless its organisation has a pool.)"""
    specs = [SHARED, ACME]
    assert pools.serving(specs, {}, "acme", caches_at_create=True) == ACME
    assert pools.serving(specs, {}, "globex", caches_at_create=True) is None
    assert pools.serving(specs, {}, None, caches_at_create=True) == SHARED
    assert pools.serving(specs, {"writable_root": False}, "acme", caches_at_create=True) is None


def test_a_pools_organisation_is_part_of_its_id_and_no_organisation_keeps_old_ids() -> None:
    assert ACME.pool_id != dataclasses.replace(ACME, org="globex").pool_id
    assert ACME.pool_id != dataclasses.replace(ACME, org=None).pool_id
    assert (
        SHARED.pool_id
        == "default@" + __import__("hashlib").blake2b(b'["default", true, true]', digest_size=4).hexdigest()
    )


def test_configured_default_pool() -> None:
    lifecycle = lifecycle_settings.LifecycleSettings(pool_min_idle=4, pool_image="python:3.12")
    assert pools.configured(lifecycle) == [pools.PoolSpec(name="default", image="python:3.12", min_idle=4)]
    assert pools.configured(lifecycle_settings.LifecycleSettings()) == [pools.PoolSpec(min_idle=2)]


def test_configured_no_pool_when_min_idle_is_zero() -> None:
    assert (
        pools.configured(lifecycle_settings.LifecycleSettings(pool_min_idle=0, pool_image="python:3.12"))
        == []
    )


def test_pool_manager_logic_reexports_the_shared_spec() -> None:
    assert logic.PoolSpec is pools.PoolSpec


# ---- idle -------------------------------------------------------------------------------


@pytest.mark.parametrize("status", STATUSES)
def test_idle_is_a_live_unclaimed_pool_sandbox(status: str) -> None:
    assert logic.idle(warm(DEFAULT, status)) is (status in ("requested", "running"))
    assert not logic.idle(warm(DEFAULT, status, session_id="s1"))
    assert not logic.idle(sbx(status))
    assert not logic.idle(sbx(status, session_id="s1"))


# ---- plan -------------------------------------------------------------------------------


def test_empty_pool_is_filled_to_min_idle() -> None:
    assert logic.plan([], [DEFAULT], 100) == logic.Plan(
        create={DEFAULT.pool_id: 2}, remove=[], running=0, idle={DEFAULT.pool_id: 0}
    )


@pytest.mark.parametrize(("have", "want"), [(0, 3), (1, 2), (2, 1), (3, 0)])
def test_refill_tops_up_to_min_idle(have: int, want: int) -> None:
    current = [warm(PY) for _ in range(have)]
    plan = logic.plan(current, [PY], 100)
    assert plan.create == ({PY.pool_id: want} if want else {})
    assert plan.idle == {PY.pool_id: have} and plan.running == have and plan.remove == []


def test_a_pool_above_min_idle_gives_back_its_oldest() -> None:
    """min_idle lowered (or a crash mid-refill came back with a smaller pool): the surplus
    goes, oldest first, and nothing new is made."""
    current = [warm(PY) for _ in range(5)]
    for i, sandbox in enumerate(current):
        current[i] = msgspec.structs.replace(sandbox, created_at=T0 + timedelta(seconds=10 - i))
    plan = logic.plan(current, [PY], 100)
    assert plan.create == {} and plan.idle == {PY.pool_id: 5}
    assert plan.remove == sorted(s.sandbox_id for s in current[3:])  # the two oldest


def test_only_running_idle_sandboxes_are_given_back() -> None:
    current = [warm(PY, "requested") for _ in range(4)] + [warm(PY)]
    plan = logic.plan(current, [PY], 100)
    assert plan.remove == [current[-1].sandbox_id] and plan.create == {}


def test_idle_sandboxes_past_the_maximum_age_are_recycled() -> None:
    old, young = warm(PY), warm(PY)
    old = msgspec.structs.replace(old, created_at=T0)
    young = msgspec.structs.replace(young, created_at=T0 + timedelta(minutes=50))
    now = T0 + timedelta(hours=1)
    plan = logic.plan([old, young], [PY], 100, now=now, max_age=3600)
    assert plan.remove == [old.sandbox_id]
    assert plan.create == {PY.pool_id: 2}, "the refill replaces it (and the missing one)"
    assert logic.plan([old, young], [PY], 100).remove == [], "no maximum age: kept"


def test_requested_pool_sandboxes_count_as_idle_and_running() -> None:
    plan = logic.plan([warm(PY, "requested"), warm(PY, "running")], [PY], 100)
    assert (plan.create, plan.idle, plan.running) == ({PY.pool_id: 1}, {PY.pool_id: 2}, 2)


@pytest.mark.parametrize("status", ["stopped", "deleted", "failed", "refused", "lost"])
def test_dead_or_stopped_sandboxes_are_neither_idle_nor_running(status: str) -> None:
    plan = logic.plan([warm(PY, status), sbx(status, session_id="s1")], [PY], 100)
    assert (plan.create, plan.idle, plan.running, plan.remove) == ({PY.pool_id: 3}, {PY.pool_id: 0}, 0, [])


def test_claimed_pool_sandboxes_are_running_but_not_idle() -> None:
    current = [warm(PY, session_id="s1"), warm(PY, session_id="s2"), warm(PY)]
    plan = logic.plan(current, [PY], 100)
    assert (plan.create, plan.idle, plan.running) == ({PY.pool_id: 2}, {PY.pool_id: 1}, 3)


def test_non_pool_sandboxes_count_only_towards_running() -> None:
    current = [sbx("running", session_id="s1"), sbx("requested", session_id="s2"), sbx("running")]
    plan = logic.plan(current, [PY], 100)
    assert (plan.create, plan.idle, plan.running, plan.remove) == ({PY.pool_id: 3}, {PY.pool_id: 0}, 3, [])


def test_idle_sandboxes_of_another_pool_do_not_fill_this_one() -> None:
    plan = logic.plan([warm(DEFAULT), warm(DEFAULT)], [DEFAULT, PY], 100)
    assert plan.idle == {DEFAULT.pool_id: 2, PY.pool_id: 0}
    assert plan.create == {PY.pool_id: 3}


@pytest.mark.parametrize(("max_running", "want"), [(5, 3), (4, 2), (3, 1), (2, 0), (1, 0)])
def test_refill_never_goes_past_max_running(max_running: int, want: int) -> None:
    current = [sbx("running", session_id="s1"), sbx("requested", session_id="s2")]
    plan = logic.plan(current, [PY], max_running)
    assert plan.create == ({PY.pool_id: want} if want else {})
    assert plan.running + sum(plan.create.values()) <= max(max_running, plan.running)


def test_nothing_is_created_when_already_over_the_limit() -> None:
    current = [sbx("running", session_id=f"s{i}") for i in range(7)]
    plan = logic.plan(current, [PY], 5)
    assert (plan.create, plan.running) == ({}, 7)


def test_pools_share_the_budget_in_order() -> None:
    a = pools.PoolSpec(name="a", image="a:1", min_idle=3)
    b = pools.PoolSpec(name="b", image="b:1", min_idle=3)
    assert logic.plan([], [a, b], 4).create == {a.pool_id: 3, b.pool_id: 1}
    assert logic.plan([], [b, a], 4).create == {b.pool_id: 3, a.pool_id: 1}
    assert logic.plan([], [a, b], 3).create == {a.pool_id: 3}
    assert logic.plan([warm(a)], [a, b], 4).create == {a.pool_id: 2, b.pool_id: 1}
    assert logic.plan([], [a, b], 100).create == {a.pool_id: 3, b.pool_id: 3}


def test_pool_with_zero_min_idle_creates_nothing() -> None:
    spec = dataclasses.replace(PY, min_idle=0)
    assert logic.plan([], [spec], 100) == logic.Plan(create={}, remove=[], running=0, idle={spec.pool_id: 0})


def test_spec_change_removes_idle_sandboxes_of_the_old_pool() -> None:
    stale = [warm(OLD, sandbox_id="sb-b"), warm(OLD, "requested", sandbox_id="sb-a")]
    plan = logic.plan(stale, [PY], 100)
    assert plan.remove == ["sb-a", "sb-b"]  # sorted
    assert plan.idle == {PY.pool_id: 0} and plan.create == {PY.pool_id: 3} and plan.running == 2


def test_spec_change_never_removes_claimed_or_non_pool_sandboxes() -> None:
    keep = [
        warm(OLD, session_id="s1"),
        warm(OLD, "requested", session_id="s2"),
        sbx("running", session_id="s3"),
        sbx("running"),  # unowned, not from a pool: not the pool-manager's to remove
        warm(OLD, "stopped"),
        warm(OLD, "failed"),
    ]
    plan = logic.plan(keep, [PY], 100)
    assert plan.remove == []
    assert plan.running == 4


def test_no_configured_pool_removes_every_idle_pool_sandbox() -> None:
    plan = logic.plan([warm(DEFAULT, sandbox_id="sb-1"), warm(DEFAULT, session_id="s1")], [], 100)
    assert plan == logic.Plan(create={}, remove=["sb-1"], running=2, idle={})


def test_plan_accepts_iterators() -> None:
    plan = logic.plan(iter([warm(PY)]), iter([PY]), 100)
    assert plan.create == {PY.pool_id: 2} and plan.idle == {PY.pool_id: 1}


def test_rollover_at_capacity_does_not_plan_past_max_running() -> None:
    current = [warm(OLD), warm(OLD), sbx("running", session_id="s1")]
    plan = logic.plan(current, [PY], 3)
    assert len(plan.remove) == 2
    assert plan.running + sum(plan.create.values()) <= max(3, plan.running)
    # The next round, with the old ones gone, fills the new pool.
    assert logic.plan([sbx("running", session_id="s1")], [PY], 3).create == {PY.pool_id: 2}


# ---- over_limit -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("live", "limit", "full"), [(0, 1, False), (2, 3, False), (3, 3, True), (4, 3, True)]
)
def test_over_limit_counts_requested_and_running(live: int, limit: int, full: bool) -> None:
    current = [sbx("requested" if i % 2 else "running", session_id=f"s{i}") for i in range(live)]
    current += [sbx(status) for status in ("stopped", "deleted", "failed", "refused", "lost")]
    assert logic.over_limit(current, limit) == (full, live)


def test_over_limit_counts_paused_sandboxes_they_hold_their_memory() -> None:
    paused = [sbx("paused", session_id="s1"), sbx("running", session_id="s2")]
    assert logic.over_limit(paused, 2) == (True, 2)
    assert logic.plan([*paused, warm(DEFAULT)], [DEFAULT], 4).create == {DEFAULT.pool_id: 1}
    assert not logic.idle(warm(DEFAULT, "paused"))  # never an idle pool sandbox, never retired


def test_over_limit_counts_idle_pool_sandboxes() -> None:
    assert logic.over_limit([warm(DEFAULT), warm(DEFAULT)], 2) == (True, 2)
    assert logic.over_limit(iter([]), 1) == (False, 0)


# ---- properties -------------------------------------------------------------------------

_SPECS = [
    pools.PoolSpec(name="default", image="default"),
    pools.PoolSpec(name="py", image="python:3.12", run_as_root=False),
    pools.PoolSpec(name="node", image="node:22", writable_root=False),
]
_STALE = [pools.PoolSpec(name="default", image="old:1").pool_id, "gone@deadbeef"]


@st.composite
def _world(draw: st.DrawFn, *, stale: bool) -> tuple[list[states.SandboxState], list[pools.PoolSpec], int]:
    chosen = draw(st.lists(st.sampled_from(range(len(_SPECS))), unique=True, max_size=3))
    specs = [dataclasses.replace(_SPECS[i], min_idle=draw(st.integers(0, 6))) for i in chosen]
    pool_ids = [s.pool_id for s in specs] + (_STALE if stale else [])
    rows = draw(
        st.lists(
            st.tuples(
                st.sampled_from(STATUSES),
                st.none() | st.sampled_from(pool_ids or [None]),
                st.none() | st.sampled_from(["s1", "s2", "s3"]),
            ),
            max_size=25,
        )
    )
    sandboxes = [
        sbx(status, pool=pool, session_id=session, sandbox_id=f"sb-{i:020d}")
        for i, (status, pool, session) in enumerate(rows)
    ]
    return sandboxes, specs, draw(st.integers(1, 20))


def _check_plan(sandboxes: list[states.SandboxState], specs: list[pools.PoolSpec], max_running: int) -> Any:
    plan = logic.plan(sandboxes, specs, max_running)
    by_id = {s.sandbox_id: s for s in sandboxes}
    # A paused sandbox holds its memory: it counts against max_running (never as idle).
    live = [s for s in sandboxes if s.status in ("requested", "running", "paused")]
    current = {p.pool_id for p in specs}
    assert plan.running == len(live)
    assert plan.idle == {
        p.pool_id: sum(
            1 for s in live if s.pool == p.pool_id and s.session_id is None and s.status != "paused"
        )
        for p in specs
    }
    for sandbox_id in plan.remove:  # only idle ones: of pools that are gone, or a pool's surplus
        removed = by_id[sandbox_id]
        assert removed.session_id is None and removed.pool is not None
        assert removed.status in ("requested", "running")
        if removed.pool in current:
            assert removed.status == "running", "one still being made is left to finish"
    assert len(set(plan.remove)) == len(plan.remove) and plan.remove == sorted(plan.remove)
    for pool in specs:
        gone = sum(1 for sandbox_id in plan.remove if by_id[sandbox_id].pool == pool.pool_id)
        kept = plan.idle[pool.pool_id] - gone
        assert kept == max(min(pool.min_idle, plan.idle[pool.pool_id]), kept), "never below min_idle"
        making = sum(
            1 for s in live if s.pool == pool.pool_id and s.session_id is None and s.status == "requested"
        )
        assert gone == 0 or kept <= max(pool.min_idle, making), "a surplus goes, down to min_idle"
        want = plan.create.get(pool.pool_id, 0)
        assert 0 <= want <= max(0, pool.min_idle - kept)
    assert set(plan.create) <= current and all(n > 0 for n in plan.create.values())
    return plan


def _pools_of(sandboxes: list[states.SandboxState], ids: list[str]) -> list[str | None]:
    by_id = {s.sandbox_id: s for s in sandboxes}
    return [by_id[i].pool for i in ids]


@given(_world(stale=False))
def test_plan_never_goes_past_max_running(world: Any) -> None:
    sandboxes, specs, max_running = world
    plan = _check_plan(sandboxes, specs, max_running)
    assert all(by_id_pool in {p.pool_id for p in specs} for by_id_pool in _pools_of(sandboxes, plan.remove))
    assert plan.running + sum(plan.create.values()) <= max(max_running, plan.running)


@given(_world(stale=True))
def test_plan_never_removes_claimed_sandboxes(world: Any) -> None:
    sandboxes, specs, max_running = world
    plan = _check_plan(sandboxes, specs, max_running)
    claimed = {s.sandbox_id for s in sandboxes if s.session_id is not None}
    assert not claimed & set(plan.remove)
    # Removals free no room in the same round, so even a rollover never plans past the limit.
    assert plan.running + sum(plan.create.values()) <= max(max_running, plan.running)


def test_a_change_leaves_room_when_an_idle_sandbox_is_claimed_or_a_live_one_goes() -> None:
    """What wakes the refill (services.pool_manager.logic.leaves_room): an idle pool
    sandbox claimed or gone, or any live sandbox gone (room under max_running); not a
    new sandbox, not a claimed one changing, not a dead one changing."""
    import msgspec

    idle_one = sbx("running", pool="p1")
    claimed = msgspec.structs.replace(idle_one, session_id="s1")
    stopped = msgspec.structs.replace(claimed, status="stopped")
    assert logic.leaves_room(idle_one, claimed)
    assert logic.leaves_room(idle_one, None)
    assert logic.leaves_room(claimed, stopped)
    assert logic.leaves_room(claimed, None)
    assert not logic.leaves_room(None, idle_one)
    assert not logic.leaves_room(idle_one, idle_one)
    assert not logic.leaves_room(claimed, claimed)
    assert not logic.leaves_room(stopped, None)


def test_a_session_may_wait_for_the_pools_unclaimed_requested_and_running_sandboxes():
    pid = DEFAULT.pool_id
    sandboxes = [
        sbx("requested", pool=pid),  # being started
        sbx("running", pool=pid),  # being warmed up, or offered
        sbx("running", pool=pid, session_id="taken"),  # claimed: not for a waiting session
        sbx("stopped", pool=pid),
        sbx("running", pool="another"),
        sbx("running"),  # a session's own cold start
    ]
    assert pools.preparing(sandboxes, pid) == 2


def test_a_pool_serves_its_image_under_any_spelling_of_the_reference() -> None:
    spec = pools.PoolSpec("py", "python:3.12", min_idle=1)
    for asked in ("python:3.12", "docker.io/library/python:3.12", "index.docker.io/library/python:3.12"):
        assert spec.serves({"image": asked}), asked
    for other in ("python:3.13", "python", "ghcr.io/library/python:3.12", "default", "Bad Ref"):
        assert not spec.serves({"image": other}), other


def test_a_snapshot_kept_warm_is_one_more_pool_and_goes_when_it_is_no_longer_kept() -> None:
    """Its idle sandboxes are filled like any pool's, within max_running; once the snapshot
    is no longer among the pools (count 0, or deleted), they are removed."""
    snap = pools.PoolSpec(name="snap-1", image="python:3.12", min_idle=3, snapshot="snap-1")
    plan = logic.plan([warm(DEFAULT), warm(DEFAULT)], [DEFAULT, snap], 4)
    assert plan.create == {snap.pool_id: 2}  # the room max_running leaves
    current = [warm(snap), warm(snap), warm(DEFAULT)]
    assert logic.plan(current, [DEFAULT], 100).remove == sorted(s.sandbox_id for s in current[:2])


def test_a_snapshots_pool_is_refilled_once_its_forks_stop_coming() -> None:
    """A burst of forks claims a snapshot's pool empty; refilling it at once would take the
    CPU from the forks' first commands, so it waits SNAPSHOT_QUIET after the last claim,
    but never longer than SNAPSHOT_HOLD_MAX from the burst's first. Configured pools
    wait only CLAIM_QUIET (they serve a steady stream of new sessions)."""
    snap = pools.PoolSpec(name="snapshot:snap-1", min_idle=3, snapshot="snap-1")
    burst = logic.Claims(100.0, 100.0)
    claimed = {snap.pool_id: burst, DEFAULT.pool_id: burst}
    assert logic.held([DEFAULT, snap], claimed, 100.5) == {snap.pool_id}
    assert logic.held([DEFAULT, snap], claimed, 100.1) == {snap.pool_id, DEFAULT.pool_id}
    assert logic.held([DEFAULT, snap], claimed, 100.0 + logic.SNAPSHOT_QUIET) == frozenset()
    assert logic.held([DEFAULT, snap], {}, 0.0) == frozenset()  # never claimed: filled at once
    steady = burst
    for t in range(101, 120):  # a fork every second: one burst, held at most SNAPSHOT_HOLD_MAX
        steady = steady.after(float(t))
    assert steady.first == 100.0 and steady.last == 119.0
    assert logic.held([snap], {snap.pool_id: steady}, 119.5) == frozenset()
    assert burst.after(100.0 + logic.SNAPSHOT_QUIET).first == 100.0 + logic.SNAPSHOT_QUIET  # a new burst
    plan = logic.plan([warm(snap)], [DEFAULT, snap], 100, hold={snap.pool_id})
    assert plan.create == {DEFAULT.pool_id: 2} and plan.idle[snap.pool_id] == 1
    surplus = [warm(snap) for _ in range(5)]
    assert len(logic.plan(surplus, [snap], 100, hold={snap.pool_id}).remove) == 2  # still gives back


def test_a_snapshots_pool_that_failed_is_left_alone_for_a_while_and_only_it() -> None:
    snap = pools.PoolSpec(name="snapshot:snap-1", min_idle=3, snapshot="snap-1")
    failed = {snap.pool_id: 50.0, DEFAULT.pool_id: 50.0}
    assert logic.held([DEFAULT, snap], {}, 60.0, failed) == {snap.pool_id}
    assert logic.held([DEFAULT, snap], {}, 50.0 + logic.SNAPSHOT_RETRY, failed) == frozenset()


def test_a_configured_pool_waits_while_a_burst_claims_it_and_catches_up_after() -> None:
    """Refilling during a burst takes the CPU from the sessions being served: a configured
    pool is held while its claims come within CLAIM_QUIET of each other, at most
    CLAIM_HOLD_MAX from the burst's first claim, then refilled in full."""
    burst = logic.Claims(100.0, 100.0)
    for i in range(1, 50):  # 50 claims within a quarter of a second
        burst = burst.after(100.0 + i * 0.005, logic.CLAIM_QUIET)
    assert burst.first == 100.0
    assert logic.held([DEFAULT], {DEFAULT.pool_id: burst}, burst.last + 0.1) == {DEFAULT.pool_id}
    burst_end = burst.last + logic.CLAIM_QUIET + 0.01
    assert logic.held([DEFAULT], {DEFAULT.pool_id: burst}, burst_end) == frozenset()
    steady = logic.Claims(100.0, 100.0)
    for i in range(1, 200):  # 40 a second for 5 s: one burst, held at most CLAIM_HOLD_MAX
        steady = steady.after(100.0 + i / 40, logic.CLAIM_QUIET)
    assert logic.held([DEFAULT], {DEFAULT.pool_id: steady}, steady.last) == frozenset()
    sized = dataclasses.replace(DEFAULT, min_idle=50)
    assert logic.plan([], [sized], 100, hold={DEFAULT.pool_id}).create == {}
    assert logic.plan([], [sized], 100).create == {DEFAULT.pool_id: 50}  # caught up after


def test_only_pools_short_of_offers_are_offered_again():
    """Every REOFFER_EVERY the refill compares each pool's idle sandboxes with the offers
    waiting for them: equal or more (a duplicate past the dedupe window) costs nothing;
    fewer means one was lost, and that pool's idle sandboxes are offered again."""
    idle = {"p1": 3, "p2": 2, "p3": 1}
    waiting = {"p1": 3, "p2": 1, "p3": 2}
    assert logic.short_of_offers(idle, waiting) == {"p2"}
    assert logic.short_of_offers({"p4": 1}, {}) == {"p4"}
    assert logic.short_of_offers({}, waiting) == set()

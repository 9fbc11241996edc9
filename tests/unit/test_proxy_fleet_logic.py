"""The proxy-scaler's pure decisions (services.proxy_scaler.logic) and the proxy fold."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sbx_api import errors
from services.proxy_scaler import logic
from shared.contract import events, states
from shared.domain import proxy as proxy_rules
from shared.domain import sandbox as sandbox_rules
from tests import factories

T0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


def sandbox(n: int, status: str = "running", proxy: str | None = None) -> states.SandboxState:
    return factories.sandbox_state(f"sb-{n:03d}", status, proxy_id=proxy, created_at=T0, updated_at=T0)


def proxy(pid: str, status: str = "running", since: datetime = T0) -> states.ProxyState:
    return states.ProxyState(
        proxy_id=pid,
        status=status,
        endpoint="10.213.255.254:3129",
        started_at=T0,
        updated_at=since,
        last_seq=1,
    )


def run(sandboxes, proxies, alive=None, per=100, now=T0, grace=30.0) -> logic.Plan:
    alive = {p.proxy_id for p in proxies} if alive is None else alive
    return logic.plan(sandboxes, proxies, alive, per_proxy=per, drain_grace=grace, now=now)


def test_none_wanted_without_sandboxes_and_the_first_starts_with_the_first_request():
    assert run([], []) == logic.Plan()
    assert run([sandbox(1, "requested")], []).start == 1
    assert run([sandbox(1, "stopped")], []).start == 0


@pytest.mark.parametrize(
    "count, per, expected", [(1, 100, 1), (100, 100, 1), (101, 100, 2), (250, 100, 3), (5, 2, 3)]
)
def test_about_one_proxy_per_n_sandboxes(count, per, expected):
    assert logic.wanted(count, per) == expected
    assert run([sandbox(i) for i in range(count)], [], per=per).start == expected


def test_sandboxes_go_to_the_least_loaded_serving_proxy():
    plan = run(
        [sandbox(1, proxy="a"), sandbox(2, proxy="a"), sandbox(3), sandbox(4)],
        [proxy("a"), proxy("b")],
        per=2,
    )
    assert plan.assign == {"sb-003": "b", "sb-004": "b"}
    assert plan.start == 0 and plan.drain == ()


def test_a_dead_proxy_is_reported_and_its_sandboxes_move():
    plan = run([sandbox(1, proxy="a"), sandbox(2, proxy="b")], [proxy("a"), proxy("b")], alive={"b"}, per=2)
    assert plan.died == ("a",)
    assert plan.assign == {"sb-001": "b"}, "on the survivor, which has room"
    full = run([sandbox(1, proxy="a"), sandbox(2, proxy="b")], [proxy("a"), proxy("b")], alive={"b"}, per=1)
    assert full.start == 1 and full.assign == {}, "the survivor is full: wait a round for the replacement"


def test_a_full_fleet_starts_another_and_new_sandboxes_wait_for_it():
    plan = run([sandbox(1, proxy="a"), sandbox(2, proxy="a"), sandbox(3)], [proxy("a")], per=2)
    assert plan.start == 1 and plan.assign == {}
    later = run([sandbox(1, proxy="a"), sandbox(2, proxy="a"), sandbox(3)], [proxy("a"), proxy("b")], per=2)
    assert later.assign == {"sb-003": "b"}


def test_scale_down_drains_the_least_loaded_then_stops_it_after_the_grace():
    sandboxes = [sandbox(1, proxy="a"), sandbox(2, proxy="a"), sandbox(3, proxy="b")]
    plan = run(sandboxes, [proxy("a"), proxy("b")], per=100)
    assert plan.drain == ("b",) and plan.assign == {"sb-003": "a"}
    draining = proxy("b", "draining", since=T0)
    assert run(sandboxes, [proxy("a"), draining], now=T0 + timedelta(seconds=10)).stop == ()
    assert run(sandboxes, [proxy("a"), draining], now=T0 + timedelta(seconds=31)).stop == ("b",)


def test_back_to_zero_when_no_sandbox_runs():
    plan = run([sandbox(1, "deleted", proxy="a")], [proxy("a")])
    assert plan.drain == ("a",) and plan.assign == {}


def test_one_is_kept_warm_when_asked():
    kept = logic.plan([], [proxy("a")], {"a"}, per_proxy=100, drain_grace=30, now=T0, keep_one=True)
    assert kept.drain == () and kept.start == 0
    started = logic.plan([], [], set(), per_proxy=100, drain_grace=30, now=T0, keep_one=True)
    assert started.start == 1


@given(
    st.lists(st.sampled_from(["requested", "running", "stopped", "deleted"]), max_size=40),
    st.integers(min_value=0, max_value=5),
    st.integers(min_value=1, max_value=10),
)
def test_every_running_sandbox_ends_up_on_a_serving_proxy(statuses, live_count, per):
    sandboxes = [sandbox(i, status) for i, status in enumerate(statuses)]
    proxies = [proxy(f"p{i}") for i in range(live_count)]
    plan = run(sandboxes, proxies, per=per)
    serving = {p.proxy_id for p in proxies} - set(plan.drain)
    running = {s.sandbox_id for s in sandboxes if s.status == "running"}
    assert set(plan.assign.values()) <= serving
    if serving and not plan.start:
        assert set(plan.assign) == running, "nothing new is coming: everyone is placed"
    if serving:
        placed = len(plan.assign)
        assert placed >= min(len(running), len(serving) * per), "proxies with room are used"
    wanted = logic.wanted(sum(s in ("requested", "running") for s in statuses), per)
    assert live_count - len(plan.drain) + plan.start == wanted


def test_the_proxy_fold():
    def meta(n):
        return events.Meta(event_id=f"{n:032x}", time=T0 + timedelta(seconds=n), service="s", instance="i")

    started = proxy_rules.evolve(
        None, events.ProxyStarted(meta=meta(1), proxy_id="a", endpoint="10.213.255.254:3129"), 1
    )
    assert (started.status, started.endpoint) == ("running", "10.213.255.254:3129")
    draining = proxy_rules.evolve(started, events.ProxyDraining(meta=meta(2), proxy_id="a"), 2)
    assert draining.status == "draining" and draining.updated_at == T0 + timedelta(seconds=2)
    stopped = proxy_rules.evolve(
        draining, events.ProxyStopped(meta=meta(3), proxy_id="a", reason="drained"), 3
    )
    assert (stopped.status, stopped.stop_reason) == ("stopped", "drained")
    with pytest.raises(errors.InvalidTransition):
        proxy_rules.evolve(stopped, events.ProxyDraining(meta=meta(4), proxy_id="a"), 4)
    with pytest.raises(errors.InvalidTransition):
        proxy_rules.evolve(started, events.ProxyStarted(meta=meta(5), proxy_id="a", endpoint="x"), 5)


def test_when_proxies_cannot_start_full_ones_take_more():
    sandboxes = [sandbox(1, proxy="a"), sandbox(2, proxy="a"), sandbox(3)]
    plan = logic.plan(sandboxes, [proxy("a")], {"a"}, per_proxy=2, drain_grace=30, now=T0, can_start=False)
    assert plan.assign == {"sb-003": "a"}


def test_a_new_start_clears_the_proxy_assignment():
    """A resumed sandbox has a new link: it needs an assignment (and a route) again."""
    meta = events.Meta(event_id=f"{1:032x}", time=T0, service="s", instance="i")
    stopped = sandbox(1, "stopped", proxy="a")
    resumed = sandbox_rules.evolve(stopped, events.SandboxStarted(meta=meta, sandbox_id="sb-001"), 9)
    assert resumed.status == "running" and resumed.proxy_id is None


# ---- a fleet behind one address (Kubernetes: a Deployment and its Service) ------------


def test_replicas_follow_the_sandboxes_and_go_to_zero():
    assert logic.replica_plan([], [], {}, per_proxy=2).replicas == 0
    assert logic.replica_plan([], [], {}, per_proxy=2, keep_one=True).replicas == 1
    requested = [sandbox(0, "requested")]
    assert logic.replica_plan(requested, [], {}, per_proxy=2).replicas == 1, (
        "the first starts with the request"
    )
    three = [sandbox(n) for n in range(3)] + [sandbox(9, "stopped")]
    assert logic.replica_plan(three, [], {}, per_proxy=2).replicas == 2


def test_serving_pods_are_recorded_once_and_gone_ones_stopped_with_the_right_reason():
    serving = {"px-a": "10.0.0.1:3128", "px-b": "10.0.0.2:3128"}
    plan = logic.replica_plan([sandbox(0)], [proxy("px-a")], serving, per_proxy=1)
    assert plan.started == {"px-b": "10.0.0.2:3128"} and plan.stopped == {}
    # Two recorded, one wanted, one gone: it was scaled away.
    plan = logic.replica_plan([sandbox(0)], [proxy("px-a"), proxy("px-b")], {"px-a": "x"}, per_proxy=1)
    assert plan.stopped == {"px-b": "drained"}
    # As many recorded as wanted and one gone: it died (the Deployment replaces it).
    plan = logic.replica_plan(
        [sandbox(0), sandbox(1)], [proxy("px-a"), proxy("px-b")], {"px-a": "x"}, per_proxy=1
    )
    assert plan.stopped == {"px-b": "died"} and plan.replicas == 2
    # Stopped records are history, never stopped again.
    assert logic.replica_plan([], [proxy("px-z", "stopped")], {}, per_proxy=1).stopped == {}


def test_a_round_is_wanted_at_once_only_for_what_a_sandbox_waits_for():
    """logic.wants_round: a sandbox that starts running where sandboxes are routed waits
    for its route; one requested when the serving proxies have no room left waits for a
    proxy to start. Anything else (a proxy assigned, a sandbox leaving, a request with
    room) waits for the periodic round."""
    requested, started = sandbox(1, "requested"), sandbox(1)
    assigned = sandbox(1, proxy="px-1")
    assert logic.wants_round(requested, started, room=5, routed=True)
    assert logic.wants_round(None, started, room=5, routed=True)  # resumed (stopped ones are not followed)
    assert not logic.wants_round(requested, started, room=5, routed=False)  # Kubernetes: nothing to route
    assert logic.wants_round(None, requested, room=-1, routed=True)
    assert not logic.wants_round(None, requested, room=0, routed=True)
    assert not logic.wants_round(started, assigned, room=-3, routed=True)
    assert not logic.wants_round(started, None, room=-3, routed=True)
    assert not logic.wants_round(requested, requested, room=-3, routed=True)


def test_the_plan_says_how_much_room_is_left_for_requests():
    """Plan.room: what the serving (not draining) proxies can still take after the plan's
    assignments, less the sandboxes still being requested; the scaler counts requests
    down from it and wakes when one finds none."""
    px = [proxy("px-1")]
    assert run([], px, per=2).room == 0  # no sandbox: keep_one is off, the proxy is drained
    two = [sandbox(1, proxy="px-1"), sandbox(2, "requested")]
    assert run(two, px, per=3).room == 1
    assert run(two, px, per=2).room == 0  # the request takes px-1's last place
    three = [*two, sandbox(3, "requested")]
    assert run(three, px, per=2).room == -1  # one waits for the proxy this plan starts
    assert run([sandbox(1)], px, per=2).room == 1  # the unassigned one is assigned first


def test_a_replica_plan_says_how_much_room_the_serving_proxies_have():
    """ReplicaPlan.room: serving proxies times per_proxy, less requested and running
    sandboxes (negative: requests wait for the Deployment to grow)."""
    active = [sandbox(1), sandbox(2, "requested"), sandbox(3, "requested")]
    assert logic.replica_plan(active, [], {"px-1": "10.0.0.1:3128"}, per_proxy=2).room == -1
    assert logic.replica_plan(active, [], {"px-1": "a", "px-2": "b"}, per_proxy=2).room == 1
    assert logic.replica_plan([], [], {}, per_proxy=2).room == 0


def test_a_paused_sandbox_keeps_its_proxy_and_counts_for_the_fleet():
    """Paused, it holds its memory and its connections: its proxy stays (its next call
    finds its way out at once), it counts for sizing, and one whose proxy died is moved."""
    paused = [sandbox(1, "paused", proxy="a"), sandbox(2, "paused", proxy="a")]
    plan = run(paused, [proxy("a")], per=1)
    assert plan.drain == () and plan.start == 1 and plan.assign == {}
    moved = run([sandbox(1, "paused", proxy="dead")], [proxy("dead"), proxy("b")], alive={"b"})
    assert moved.died == ("dead",) and moved.assign == {"sb-001": "b"}
    assert logic.replica_plan(paused, [], {"p": "10.0.0.1:3129"}, per_proxy=1).replicas == 2

"""The warm pool with real sandboxes: refill, race-free claims by two schedulers, the
max_running limit, and a spec change rolling the pool over without touching claimed ones."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from sbx_api import errors
from services.pool_manager import app as pool_app
from services.scheduler import app as scheduler_app
from shared.contract import commands, events, ids, subjects
from shared.domain import pools, projections
from shared.infrastructure import eventstore, projector
from shared.infrastructure.settings import lifecycle as lifecycle_settings
from shared.infrastructure.settings import runtime as runtime_settings
from tests import support

pytestmark = [pytest.mark.needs_root("the local runtime needs root"), pytest.mark.slow]
RUNTIME = runtime_settings.RuntimeSettings(memory_bytes=256 * 1024**2)
LIFECYCLE = lifecycle_settings.LifecycleSettings(pool_min_idle=2, max_running=6)


async def sandboxes(nc, topology):
    js = nc.jetstream()
    store = await projector.ProjectionStore.open(
        js, projections.SANDBOXES, eventstore.EventStore(js, topology)
    )
    return list((await store.all()).values())


async def idle(nc, topology, pool_id):
    return [
        s
        for s in await sandboxes(nc, topology)
        if s.pool == pool_id and s.session_id is None and s.status == "running"
    ]


@pytest.fixture
async def env(nats_server, namespace, tmp_path):
    state = tmp_path / "state"
    started = []

    async def start(name, setup, **overrides):
        r = await support.start_in_process(
            nats_server.url, namespace, name, setup, state_dir=state, **overrides
        )
        started.append(r)
        return r

    nc, topology = await support.connect(nats_server.url, namespace)
    yield start, nc, topology, state
    await nc.close()
    for r in reversed(started):
        if not r.task.done():
            await r.stop()
    from shared.runtime.local import runtime as local

    rt = local.LocalRuntime(state)
    for info in await rt.list():
        await rt.delete(info.sandbox_id)
    rt.caches.detach_all()  # organisations' pools mount caches


async def ensure(nc, topology, session):
    return await support.send(
        nc, topology, commands.EnsureSession(command_id=ids.new_id(), session_id=session), timeout=60
    )


async def test_claims_take_warm_sandboxes_and_the_pool_refills(env):
    start, nc, topology, _ = env
    pool_id = pools.configured(LIFECYCLE)[0].pool_id
    await start("pool-manager", pool_app.make_setup(RUNTIME, LIFECYCLE))
    await start("scheduler", scheduler_app.make_setup(LIFECYCLE))
    await start("scheduler", scheduler_app.make_setup(LIFECYCLE))
    await support.eventually(lambda: _count(idle(nc, topology, pool_id), 2), timeout=30)
    await support.eventually(lambda: _offered(nc, topology, pool_id, 2), timeout=30)
    warm_ids = {s.sandbox_id for s in await idle(nc, topology, pool_id)}

    replies = await asyncio.gather(*(ensure(nc, topology, f"racer-{n}") for n in range(4)))
    assert all(r.ok for r in replies), [r.error for r in replies]
    assigned = [r.session.sandbox_id for r in replies]
    assert len(set(assigned)) == 4, "no sandbox is given to two sessions"
    assert warm_ids <= set(assigned), "both warm sandboxes were claimed"
    claims = [
        s
        for s in await support.stream_events(nc, topology, subjects.SANDBOX)
        if s.event.__struct_config__.tag == "sandbox.claimed"
    ]
    assert sorted(c.event.sandbox_id for c in claims) == sorted(warm_ids)
    await support.eventually(lambda: _count(idle(nc, topology, pool_id), 2), timeout=30)


async def test_max_running_refuses_clearly_and_records_it(env):
    start, nc, topology, _ = env
    lifecycle = replace(LIFECYCLE, pool_min_idle=1, max_running=2)
    await start("pool-manager", pool_app.make_setup(RUNTIME, lifecycle))
    await start("scheduler", scheduler_app.make_setup(lifecycle))
    pool_id = pools.configured(lifecycle)[0].pool_id
    await support.eventually(lambda: _count(idle(nc, topology, pool_id), 1), timeout=30)
    first = await ensure(nc, topology, "one")  # claims the warm one; the pool refills to 2 running
    assert first.ok
    await support.eventually(lambda: _count(idle(nc, topology, pool_id), 1), timeout=30)
    await support.eventually(lambda: _offered(nc, topology, pool_id, 1), timeout=30)
    full = await ensure(nc, topology, "two")  # claims the refill: now 2 running, limit reached
    assert full.ok
    refused = await ensure(nc, topology, "three")
    assert not refused.ok and refused.error.code == "limit_exceeded"
    assert "limit" in refused.error.message
    assert errors.BY_CODE[refused.error.code].retriable
    tags = [
        s.event.__struct_config__.tag for s in await support.stream_events(nc, topology, subjects.SANDBOX)
    ]
    assert "sandbox.refused" in tags


async def test_at_max_running_a_session_takes_the_room_of_an_idle_pool_sandbox(env):
    """Sessions before the pool: at the limit, a session whose options no pool serves (so
    it starts cold) makes room by retiring an idle pool sandbox; it is refused only once
    the sessions' own sandboxes fill the limit."""
    start, nc, topology, _ = env
    lifecycle = replace(LIFECYCLE, pool_min_idle=2, max_running=3)
    await start("pool-manager", pool_app.make_setup(RUNTIME, lifecycle))
    await start("scheduler", scheduler_app.make_setup(lifecycle))
    pool_id = pools.configured(lifecycle)[0].pool_id
    await support.eventually(lambda: _count(idle(nc, topology, pool_id), 2), timeout=30)

    async def cold(session: str) -> commands.CommandReply:
        command = commands.ProvisionSandbox(command_id=ids.new_id(), session_id=session, writable_root=False)
        return await support.send(nc, topology, command, timeout=60)

    assert (await cold("own-1")).ok  # 3 running: 2 idle and its own
    assert (await cold("own-2")).ok, "an idle pool sandbox made room"
    assert (await cold("own-3")).ok, "and the other one"
    refused = await cold("own-4")
    assert not refused.ok and refused.error.code == "limit_exceeded"
    assert await idle(nc, topology, pool_id) == []
    live = [s for s in await sandboxes(nc, topology) if s.status in ("requested", "running")]
    assert sorted(s.session_id or "" for s in live) == ["own-1", "own-2", "own-3"]


async def test_at_max_running_a_session_waits_for_a_pool_sandbox_being_prepared(env):
    """Sessions before the pool: at the limit with the pool's next sandbox still starting,
    a new session waits for it and claims it instead of being refused."""
    start, nc, topology, _ = env
    lifecycle = replace(LIFECYCLE, pool_min_idle=1, max_running=2)
    slow = frozenset({"pool.slow_pool_start"})  # each pool sandbox starts 3 s after its request
    await start("pool-manager", pool_app.make_setup(RUNTIME, lifecycle), faults=slow)
    await start("scheduler", scheduler_app.make_setup(lifecycle))
    pool_id = pools.configured(lifecycle)[0].pool_id
    await support.eventually(lambda: _count(idle(nc, topology, pool_id), 1), timeout=30)
    await support.eventually(lambda: _offered(nc, topology, pool_id, 1), timeout=30)
    assert (await ensure(nc, topology, "first")).ok  # claims it; the refill requests the next one

    async def next_one_preparing():
        return [s for s in await sandboxes(nc, topology) if s.pool == pool_id and s.status == "requested"]

    (preparing,) = await support.eventually(next_one_preparing, timeout=30)
    second = await ensure(nc, topology, "second")  # 2 running: its own cold start is refused
    assert second.ok, second.error
    assert second.session.sandbox_id == preparing.sandbox_id, "it waited for the pool's"
    tags = [
        s.event.__struct_config__.tag for s in await support.stream_events(nc, topology, subjects.SANDBOX)
    ]
    assert "sandbox.refused" in tags  # its own start was refused first, and recorded so


async def test_two_pool_managers_admitting_at_once_never_exceed_max_running(env):
    """Cold starts spread over two pool-manager instances (the work queue hands requests
    to either): the shared admission lease keeps the total at the limit, not above."""
    start, nc, topology, state = env
    lifecycle = replace(LIFECYCLE, pool_min_idle=0, max_running=3)
    await start("pool-manager", pool_app.make_setup(RUNTIME, lifecycle))
    await start("pool-manager", pool_app.make_setup(RUNTIME, lifecycle))
    await start("scheduler", scheduler_app.make_setup(lifecycle))
    # 16 requests: NATS hands each to either instance at random, so both take some
    # (all to one: 1 in 32768; with 8 it was 1 in 128, and CI met it).
    replies = await asyncio.gather(*(ensure(nc, topology, f"cold-{n}") for n in range(16)))
    admitted = [r for r in replies if r.ok]
    refused = [r for r in replies if not r.ok]
    assert len(admitted) == 3, [r.error for r in refused]
    assert {r.error.code for r in refused} == {"limit_exceeded"}
    from shared.runtime.local import runtime as local

    running = [i for i in await local.LocalRuntime(state).list() if i.status == "running"]
    assert len(running) == 3
    handled_by = {
        s.event.meta.instance
        for s in await support.stream_events(nc, topology, subjects.SANDBOX)
        if s.event.__struct_config__.tag in ("sandbox.requested", "sandbox.refused")
    }
    assert len(handled_by) == 2, "both instances took requests (else the race was not tried)"


async def test_a_spec_change_rolls_the_pool_over_without_touching_claimed_sandboxes(env, tmp_path):
    start, nc, topology, state = env
    first = await start("pool-manager", pool_app.make_setup(RUNTIME, LIFECYCLE))
    await start("scheduler", scheduler_app.make_setup(LIFECYCLE))
    old_pool = pools.configured(LIFECYCLE)[0].pool_id
    await support.eventually(lambda: _count(idle(nc, topology, old_pool), 2), timeout=30)
    claimed = (await ensure(nc, topology, "keeper")).session.sandbox_id
    await first.stop()

    from shared.runtime.local import runtime as local
    from tests.integration.test_local_images import minimal_rootfs

    local.LocalRuntime(state).images.add_rootfs("tiny", minimal_rootfs(tmp_path / "rootfs"))
    changed = replace(LIFECYCLE, pool_image="tiny")
    new_pool = pools.configured(changed)[0].pool_id
    assert new_pool != old_pool
    await start("pool-manager", pool_app.make_setup(RUNTIME, changed))
    await support.eventually(lambda: _count(idle(nc, topology, new_pool), 2), timeout=30)
    await support.eventually(lambda: _count(idle(nc, topology, old_pool), 0), timeout=30)
    kept = {s.sandbox_id: s for s in await sandboxes(nc, topology)}[claimed]
    assert kept.status == "running" and kept.session_id == "keeper"


async def test_a_pool_above_min_idle_shrinks_and_old_idle_sandboxes_are_recycled(env):
    """Lowering SBX_POOL_MIN_IDLE (or coming back from a crash with a bigger pool) gives
    back the surplus, oldest first, each recorded stopped (``retired``) then deleted and
    gone from the runtime; with SBX_POOL_MAX_AGE an idle sandbox is replaced by a fresh
    one once it is that old."""
    start, nc, topology, state = env
    big = replace(LIFECYCLE, pool_min_idle=3)
    first = await start("pool-manager", pool_app.make_setup(RUNTIME, big))
    pool_id = pools.configured(big)[0].pool_id
    await support.eventually(lambda: _count(idle(nc, topology, pool_id), 3), timeout=30)
    before = sorted(await idle(nc, topology, pool_id), key=lambda s: s.created_at)
    await first.stop()

    small = replace(LIFECYCLE, pool_min_idle=1)
    second = await start("pool-manager", pool_app.make_setup(RUNTIME, small))
    await support.eventually(lambda: _count(idle(nc, topology, pool_id), 1), timeout=30)

    async def statuses() -> list[str]:
        records = {s.sandbox_id: s for s in await sandboxes(nc, topology)}
        return [records[s.sandbox_id].status for s in before]

    async def retired() -> bool:  # stopped (retired) first, deleted once the runtime is done
        return await statuses() == ["deleted", "deleted", "running"]

    await support.eventually(retired, timeout=30)
    from shared.runtime.local import runtime as local

    assert [i.sandbox_id for i in await local.LocalRuntime(state).list()] == [before[-1].sandbox_id]
    store = eventstore.EventStore(nc.jetstream(), topology)
    subject = topology.aggregate_subject(subjects.SANDBOX, before[0].sandbox_id)
    kinds = [type(stored.event).__name__ for stored in [s async for s in store.read(subject)]]
    assert kinds[-2:] == ["SandboxStopped", "SandboxDeleted"]
    stopped = [s.event async for s in store.read(subject) if isinstance(s.event, events.SandboxStopped)]
    assert [e.reason for e in stopped] == ["retired"]
    await second.stop()

    recycling = replace(LIFECYCLE, pool_min_idle=1, pool_max_age=2.0)
    await start("pool-manager", pool_app.make_setup(RUNTIME, recycling))
    kept = before[-1].sandbox_id

    async def replaced() -> bool:
        now = await idle(nc, topology, pool_id)
        return len(now) == 1 and now[0].sandbox_id != kept

    await support.eventually(replaced, timeout=30)


async def _count(coro, n):
    return len(await coro) == n


async def _offered(nc, topology, pool_id, n):
    """``n`` offers wait in the pool's queue: a running pool sandbox is offered a moment
    after its record says so, and a claim before that starts a sandbox cold."""
    info = await nc.jetstream().consumer_info(topology.pool_stream, topology.claims_consumer(pool_id))
    return info.num_pending == n


async def test_a_second_pool_serves_sessions_that_ask_for_its_options(env):
    start, nc, topology, _ = env
    lifecycle = replace(LIFECYCLE, pool_min_idle=1, extra_pools=(("ro", "default", True, False, 1, None),))
    specs = pools.configured(lifecycle)
    ro = next(p for p in specs if p.name == "ro")
    await start("pool-manager", pool_app.make_setup(RUNTIME, lifecycle))
    await start("scheduler", scheduler_app.make_setup(lifecycle))
    await support.eventually(lambda: _count(idle(nc, topology, ro.pool_id), 1), timeout=30)
    warm_ro = (await idle(nc, topology, ro.pool_id))[0].sandbox_id

    async def offered() -> bool:  # (idle in the record a moment before it is offered)
        try:
            last = await nc.jetstream().get_last_msg(topology.pool_stream, topology.pool_offers(ro.pool_id))
        except Exception:
            return False
        return last.data == warm_ro.encode()

    await support.eventually(offered, timeout=30)
    reply = await support.send(
        nc,
        topology,
        commands.ProvisionSandbox(command_id=ids.new_id(), session_id="reader", writable_root=False),
        timeout=60,
    )
    assert reply.ok, reply.error
    assert reply.session.sandbox_id == warm_ro


async def test_pool_sandboxes_are_offered_with_an_executor_shell_server_running(env):
    """The pool-manager asks an executor to start each pool sandbox's shell server before
    offering it, so a session's first `shell` needs no process started from the host.
    The executor refuses to do this for a claimed sandbox, an unknown one, or garbage."""
    from services.executor import app as executor_app
    from shared.contract import codec, execution
    from shared.runtime.local import runtime as local

    start, nc, topology, state = env
    pool_id = pools.configured(LIFECYCLE)[0].pool_id
    await start("executor", executor_app.make_setup(RUNTIME))
    await start("pool-manager", pool_app.make_setup(RUNTIME, LIFECYCLE))
    await start("scheduler", scheduler_app.make_setup(LIFECYCLE))
    await support.eventually(lambda: _count(idle(nc, topology, pool_id), 2), timeout=30)
    rt = local.LocalRuntime(state)

    async def helpers(sandbox_id):
        _, out, _ = await rt.run(sandbox_id, ["/bin/sh", "-c", "pgrep -fc 'sbx-shell-serve[r]' || true"])
        return int(out.strip())

    for sandbox in await idle(nc, topology, pool_id):
        # (A relay forks when it starts the session's bash: a copy may show for a moment.)
        async def one_relay(sandbox_id: str = sandbox.sandbox_id) -> bool:
            return await helpers(sandbox_id) == 1

        assert await support.eventually(one_relay, timeout=5), "offered without its shell server"

    async def prepare(body: bytes):
        return execution.decode_reply((await nc.request(topology.exec_prepare, body, timeout=30)).data)

    reply = await ensure(nc, topology, "first")
    assert reply.ok, reply.error
    claimed = reply.session.sandbox_id
    refused = await prepare(codec.encode(execution.Prepare(sandbox_id=claimed)))
    assert not refused.ok and refused.error.code == "conflict"
    unknown = await prepare(codec.encode(execution.Prepare(sandbox_id="sb-nothing")))
    assert not unknown.ok and unknown.error.code == "not_found"
    for garbage in (b"{", b'{"sandbox_id": "a b"}', b'{"sandbox_id": 7}'):
        bad = await prepare(garbage)
        assert not bad.ok and bad.error.code == "invalid_input", garbage

    shell = execution.Shell(session_id="first", sandbox_id=claimed, command="echo $((6 * 7))")
    answer = execution.decode_reply(
        (await nc.request(topology.exec_requests, codec.encode(shell), timeout=30)).data
    )
    assert answer.ok and answer.output == "42\n" and answer.exit_code == 0
    assert await helpers(claimed) == 1, "the call used the prepared server, not a second one"


async def test_first_requests_racing_on_one_new_session_give_it_one_sandbox(env):
    """A new session's first request is created with its sandbox in one append; when
    several first requests race (two schedulers), one sandbox is assigned, every reply
    names it, and the sandboxes the losers obtained are deleted, not leaked."""
    start, nc, topology, _ = env
    pool_id = pools.configured(LIFECYCLE)[0].pool_id
    await start("pool-manager", pool_app.make_setup(RUNTIME, LIFECYCLE))
    await start("scheduler", scheduler_app.make_setup(LIFECYCLE))
    await start("scheduler", scheduler_app.make_setup(LIFECYCLE))
    await support.eventually(lambda: _count(idle(nc, topology, pool_id), 2), timeout=30)

    replies = await asyncio.gather(*(ensure(nc, topology, "contested") for _ in range(4)))
    assert all(r.ok for r in replies), [r.error for r in replies]
    assert len({r.session.sandbox_id for r in replies}) == 1
    winner = replies[0].session.sandbox_id

    history = [s for s in await support.stream_events(nc, topology, subjects.SESSION)]
    tags = [s.event.__struct_config__.tag for s in history]
    assert tags == ["session.created", "session.sandbox_assigned"]
    assert history[1].prev_seq == history[0].seq, "created and assigned in one append"

    async def only_the_winner_is_held():
        held = [
            s.sandbox_id
            for s in await sandboxes(nc, topology)
            if s.session_id == "contested" and s.status not in ("deleted", "failed", "lost")
        ]
        return held == [winner]

    await support.eventually(only_the_winner_is_held, timeout=30)


async def test_an_organisations_pool_serves_only_its_sessions_with_its_cache_from_the_start(env):
    """SBX_POOLS with "org": its sandboxes show the organisation's package cache before
    they are claimed (recorded on sandbox.requested), its sessions claim from it, and no
    other session ever does (another organisation's, or one without)."""
    from shared.runtime.local import runtime as local

    start, nc, topology, state = env
    lifecycle = replace(LIFECYCLE, pool_min_idle=1, extra_pools=(("acme", "default", True, True, 1, "acme"),))
    shared_pool, acme_pool = (p.pool_id for p in pools.configured(lifecycle))
    await start("pool-manager", pool_app.make_setup(RUNTIME, lifecycle))
    await start("scheduler", scheduler_app.make_setup(lifecycle))
    await support.eventually(lambda: _count(idle(nc, topology, acme_pool), 1), timeout=30)
    await support.eventually(lambda: _count(idle(nc, topology, shared_pool), 1), timeout=30)
    [waiting] = await idle(nc, topology, acme_pool)
    assert waiting.cache_org == "acme"
    rt = local.LocalRuntime(state)
    result, _, _ = await rt.run(waiting.sandbox_id, ["sh", "-c", "echo from-pool > /.sbx/cache/seen"])
    assert result.exit_code == 0

    async def ensure_as(session, org):
        actor = commands.Actor(via="mcp", org_id=org)
        command = commands.EnsureSession(command_id=ids.new_id(), session_id=session, actor=actor)
        reply = await support.send(nc, topology, command, timeout=60)
        assert reply.ok, reply.error
        return next(s for s in await sandboxes(nc, topology) if s.sandbox_id == reply.session.sandbox_id)

    other = await ensure_as("globex-1", "globex")
    assert other.pool == shared_pool and other.sandbox_id != waiting.sandbox_id
    plain = await ensure_as("plain-1", None)
    assert plain.pool != acme_pool
    mine = await ensure_as("acme-1", "acme")
    assert mine.sandbox_id == waiting.sandbox_id and mine.cache_org == "acme"
    _, out, _ = await rt.run(other.sandbox_id, ["sh", "-c", "cat /.sbx/cache/seen 2>/dev/null || echo none"])
    assert out == b"none\n"


async def test_a_snapshot_kept_warm_is_a_pool_within_max_running_and_leaves_nothing_when_dropped(env):
    """``snapshot.warm``: the pool-manager starts that many idle sandboxes from the snapshot
    (counted against ``max_running``); forks racing through two schedulers claim them and
    the rest start cold; once the snapshot is no longer kept warm, its claims consumer and
    any offer left are removed from JetStream (configured pools' consumers stay)."""
    start, nc, topology, _ = env
    lifecycle = replace(LIFECYCLE, pool_min_idle=1, max_running=5)
    await start("pool-manager", pool_app.make_setup(RUNTIME, lifecycle))
    await start("scheduler", scheduler_app.make_setup(lifecycle))
    await start("scheduler", scheduler_app.make_setup(lifecycle))
    assert (await ensure(nc, topology, "origin")).ok
    snap = commands.SnapshotSession(command_id=ids.new_id(), session_id="origin", snapshot_id="snap-w")
    taken = await support.send(nc, topology, snap, timeout=60)
    assert taken.ok, taken.error

    async def warm(count: int) -> commands.CommandReply:
        command = commands.WarmSnapshot(
            command_id=ids.new_id(), session_id="origin", snapshot_id="snap-w", count=count
        )
        return await support.send(nc, topology, command)

    too_many = await warm(101)
    assert not too_many.ok and too_many.error.code == "invalid_input"
    kept = await warm(2)
    assert kept.ok and kept.snapshot.warm == 2 and kept.appended == 1
    assert (await warm(2)).appended == 0  # the same count again: nothing recorded
    pool_id = pools.PoolSpec.of_snapshot(kept.snapshot).pool_id
    await support.eventually(lambda: _count(idle(nc, topology, pool_id), 2), timeout=30)
    pooled = {s.sandbox_id for s in await idle(nc, topology, pool_id)}
    assert all(s.snapshot == "snap-w" for s in await idle(nc, topology, pool_id))
    js = nc.jetstream()

    async def both_offered() -> bool:  # (idle in the record a moment before it is offered)
        subject = topology.pool_offers(pool_id)
        info = await js.stream_info(topology.pool_stream, subjects_filter=subject)
        return (info.state.subjects or {}).get(subject, 0) >= 2

    await support.eventually(both_offered, timeout=30)
    forks = await asyncio.gather(
        *(
            support.send(
                nc,
                topology,
                commands.ForkSession(command_id=ids.new_id(), session_id=f"fork-{n}", snapshot_id="snap-w"),
                timeout=60,
            )
            for n in range(3)
        )
    )
    assert all(f.ok for f in forks), [f.error for f in forks]
    given = {f.session.sandbox_id for f in forks}
    assert len(given) == 3 and pooled <= given, "both warm ones were claimed, one fork started cold"
    live = [s for s in await sandboxes(nc, topology) if s.status in ("requested", "running")]
    assert len(live) <= lifecycle.max_running

    assert (await warm(0)).snapshot.warm == 0

    async def dropped() -> bool:
        consumers = [c.config.metadata or {} for c in await js.consumers_info(topology.pool_stream)]
        return not any(m.get("sbx.snapshot") == "snap-w" for m in consumers)

    await support.eventually(dropped, timeout=40)
    left = await js.stream_info(topology.pool_stream, subjects_filter=topology.pool_offers(pool_id))
    assert not left.state.subjects, left.state.subjects
    configured = pools.configured(lifecycle)[0].pool_id
    await js.consumer_info(topology.pool_stream, topology.claims_consumer(configured))  # still there

    # Kept warm again: the schedulers, which made its consumer before, make it again.
    for n in range(3):
        done = commands.DeleteSession(command_id=ids.new_id(), session_id=f"fork-{n}")
        assert (await support.send(nc, topology, done, timeout=30)).ok
    assert (await warm(1)).snapshot.warm == 1
    await support.eventually(lambda: _count(idle(nc, topology, pool_id), 1), timeout=30)
    (again,) = [s.sandbox_id for s in await idle(nc, topology, pool_id)]

    async def queued() -> bool:  # offered, with no consumer yet: the offer waits in the stream
        subject = topology.pool_offers(pool_id)
        info = await js.stream_info(topology.pool_stream, subjects_filter=subject)
        return (info.state.subjects or {}).get(subject) == 1

    await support.eventually(queued, timeout=30)
    forked = await support.send(
        nc,
        topology,
        commands.ForkSession(command_id=ids.new_id(), session_id="fork-again", snapshot_id="snap-w"),
        timeout=60,
    )
    assert forked.ok and forked.session.sandbox_id == again


async def test_a_burst_is_served_and_the_pool_grows_to_absorb_the_next(env):
    """A burst of new sessions at once is served in full (warm claims, then cold starts);
    the pool then keeps its floor plus that burst (SBX_POOL_AUTOSIZE), so the next burst
    of the same size is claimed warm, every session of it."""
    start, nc, topology, _ = env
    lifecycle = replace(LIFECYCLE, pool_min_idle=2, max_running=40, pool_max_idle=20)
    pool_id = pools.configured(lifecycle)[0].pool_id
    await start("pool-manager", pool_app.make_setup(RUNTIME, lifecycle))
    await start("scheduler", scheduler_app.make_setup(lifecycle))
    await support.eventually(lambda: _offered(nc, topology, pool_id, 2), timeout=30)

    first = await asyncio.gather(*(ensure(nc, topology, f"burst1-{n}") for n in range(8)))
    assert all(r.ok for r in first), [r.error for r in first]
    assert len({r.session.sandbox_id for r in first}) == 8
    # Demand 8 (2 claims, 6 cold starts it could have served) on a floor of 2.
    await support.eventually(lambda: _offered(nc, topology, pool_id, 10), timeout=60)

    second = await asyncio.gather(*(ensure(nc, topology, f"burst2-{n}") for n in range(8)))
    assert all(r.ok for r in second), [r.error for r in second]
    claimed = {
        s.event.sandbox_id
        for s in await support.stream_events(nc, topology, subjects.SANDBOX)
        if isinstance(s.event, events.SandboxClaimed)
    }
    assert {r.session.sandbox_id for r in second} <= claimed, "the second burst was served warm"


async def test_without_autosize_the_pool_stays_at_its_floor(env):
    start, nc, topology, _ = env
    lifecycle = replace(LIFECYCLE, pool_min_idle=2, max_running=20, pool_autosize=False)
    pool_id = pools.configured(lifecycle)[0].pool_id
    await start("pool-manager", pool_app.make_setup(RUNTIME, lifecycle))
    await start("scheduler", scheduler_app.make_setup(lifecycle))
    await support.eventually(lambda: _offered(nc, topology, pool_id, 2), timeout=30)
    replies = await asyncio.gather(*(ensure(nc, topology, f"s-{n}") for n in range(5)))
    assert all(r.ok for r in replies), [r.error for r in replies]
    await support.eventually(lambda: _offered(nc, topology, pool_id, 2), timeout=30)
    await asyncio.sleep(3)  # a refill round or two later: still at its floor
    assert len(await idle(nc, topology, pool_id)) == 2

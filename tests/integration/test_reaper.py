"""The reaper with real sandboxes and real NATS, driven with fake time (``pass_once(now=…)``):
lifetimes, idle, retention, orphans, lost sandboxes, and a pool-manager SIGKILLed
mid-provision."""

from __future__ import annotations

import contextlib
from datetime import UTC, datetime, timedelta

import pytest

from services.executor import app as executor_app
from services.pool_manager import app as pool_app
from services.reaper import handlers as reaper_handlers
from services.scheduler import app as scheduler_app
from shared.contract import codec, commands, execution, ids, subjects
from shared.domain import projections
from shared.infrastructure import eventstore, projector
from shared.infrastructure.settings import lifecycle
from shared.infrastructure.settings import runtime as runtime_settings
from shared.runtime import api
from shared.runtime.local import runtime as local
from tests import support

pytestmark = [pytest.mark.needs_root("the local runtime needs root"), pytest.mark.slow]
RUNTIME = runtime_settings.RuntimeSettings(memory_bytes=256 * 1024**2)
RULES = lifecycle.LifecycleSettings(
    pool_min_idle=0,
    max_lifetime=3600,
    idle_timeout=600,
    pause_timeout=0,  # idle sandboxes stopped without a pause first (test_pause.py pauses them)
    stopped_retention=86400,
    max_stopped=10,
)


class Harness:
    def __init__(self, nc, topology, state, reaper) -> None:
        self.nc, self.topology, self.state, self.reaper = nc, topology, state, reaper
        self.runtime = local.LocalRuntime(state)

    async def ensure(self, sid: str):
        reply = await support.send(
            self.nc,
            self.topology,
            commands.EnsureSession(command_id=ids.new_id(), session_id=sid),
            timeout=60,
        )
        assert reply.ok, reply.error
        return reply.session

    async def shell(self, sid: str, command: str):
        sandbox = (await self.ensure(sid)).sandbox_id
        request = execution.Shell(session_id=sid, sandbox_id=sandbox, command=command)
        msg = await self.nc.request(self.topology.exec_requests, codec.encode(request), timeout=60)
        return execution.decode_reply(msg.data)

    async def session(self, sid: str):
        js = self.nc.jetstream()
        store = await projector.ProjectionStore.open(
            js, projections.SESSIONS, eventstore.EventStore(js, self.topology)
        )
        return await store.get(sid)

    async def tags(self, kind: str) -> list[str]:
        return [
            s.event.__struct_config__.tag for s in await support.stream_events(self.nc, self.topology, kind)
        ]


@pytest.fixture
async def harness(nats_server, namespace, tmp_path):
    state = tmp_path / "state"
    running = [
        await support.start_in_process(
            nats_server.url, namespace, "scheduler", scheduler_app.make_setup(RULES), state_dir=state
        ),
        await support.start_in_process(
            nats_server.url, namespace, "pool-manager", pool_app.make_setup(RUNTIME, RULES), state_dir=state
        ),
        await support.start_in_process(
            nats_server.url, namespace, "executor", executor_app.make_setup(RUNTIME), state_dir=state
        ),
    ]
    nc, topology = await support.connect(nats_server.url, namespace)
    ctx_holder = running[0]  # the reaper is driven directly, with fake time
    from shared.infrastructure import service

    js = nc.jetstream()
    store = eventstore.EventStore(js, topology)
    ctx = service.Context(
        support.service_settings(nats_server.url, namespace, "reaper", state_dir=state),
        nc, js, topology, store, started_at=datetime.now(UTC),
    )  # fmt: skip
    reaper = reaper_handlers.Reaper(
        ctx,
        local.LocalRuntime(state),
        await projector.ProjectionStore.open(js, projections.SESSIONS, store),
        await projector.ProjectionStore.open(js, projections.SANDBOXES, store),
        RULES,
        snapshots=await projector.ProjectionStore.open(js, projections.SNAPSHOTS, store),
    )
    yield Harness(nc, topology, state, reaper)
    del ctx_holder
    await nc.close()
    for r in reversed(running):
        await r.stop()
    rt = local.LocalRuntime(state)
    for info in await rt.list():
        await rt.delete(info.sandbox_id)


def later(**delta) -> datetime:
    return datetime.now(UTC) + timedelta(**delta)


async def test_idle_and_lifetime_stop_sessions_and_retention_purges_them(harness):
    await harness.shell("idle", "echo hi")
    await harness.shell("busy", "echo hi")
    assert not (await harness.reaper.pass_once(later(minutes=5))).reaps  # nothing is due yet
    report = await harness.reaper.pass_once(later(minutes=11))
    assert report.reaps == {"idle": 2}
    assert (await harness.session("idle")).status == "stopped"
    stopped = [s for s in await support.stream_events(harness.nc, harness.topology, subjects.SESSION)
               if s.event.__struct_config__.tag == "session.stopped"]  # fmt: skip
    assert {s.event.reason for s in stopped} == {"idle"}
    # A stopped session comes back with its workspace when used again...
    back = (await harness.shell("busy", "echo back")).output  # in a new shell, which says so
    assert back.startswith("[a new shell: the sandbox was restarted") and back.endswith("]\nback\n")
    # ...and one left stopped is purged after the retention period.
    report = await harness.reaper.pass_once(later(hours=25))
    assert report.reaps["retention"] == 1 and report.reaps["lifetime"] == 1
    assert (await harness.session("idle")).status == "deleted"


async def test_activity_keeps_a_session_alive(harness):
    await harness.shell("active", "echo 1")
    first = await harness.reaper.pass_once(later(minutes=9))
    assert not first.reaps
    await harness.shell("active", "echo 2")  # a tool call resets the idle clock
    assert (await harness.reaper.pass_once(later(minutes=9))).reaps == {}


async def test_the_sweep_deletes_orphans_and_records_lost_sandboxes(harness):
    orphan = api.SandboxSpec(sandbox_id="sb-orphan-0001")
    await harness.runtime.create(orphan)
    await harness.runtime.start(orphan.sandbox_id)
    session = await harness.ensure("victim")
    await harness.runtime.delete(session.sandbox_id)  # vanished behind the control plane's back

    assert not (await harness.reaper.pass_once(datetime.now(UTC))).findings  # within the grace period
    report = await harness.reaper.pass_once(later(minutes=2))
    assert report.findings == {"delete_orphan": 1, "mark_lost": 1}
    assert await harness.runtime.get(orphan.sandbox_id) is None
    assert "sandbox.lost" in await harness.tags(subjects.SANDBOX)
    replacement = await harness.ensure("victim")
    assert replacement.sandbox_id != session.sandbox_id
    assert (await harness.runtime.get(replacement.sandbox_id)).status == "running"


async def test_pool_manager_killed_mid_provision_leaks_nothing(
    nats_server, namespace, tmp_path, log_dir, harness
):
    """A pool-manager process SIGKILLed after starting a sandbox but before recording it:
    the sweep fails the stuck record and deletes the sandbox; the session gets a new one."""
    env = support.service_env(nats_server.url, namespace, SBX_STATE_DIR=str(harness.state))
    # Stop the in-process pool-manager so the doomed one gets the request.
    doomed = support.spawn_service(
        "pool_manager",
        {**env, "SBX_FAULTS": "pool.after_runtime_start", "SBX_POOL_MIN_IDLE": "0"},
        log_dir / "p.log",
    )
    try:
        await support.wait_for_health(nats_server.url, namespace, "pool-manager")
        for n in range(30):  # the queue group spreads requests; the doomed one dies on its first
            with contextlib.suppress(Exception):  # the request it took never gets an answer
                await support.send(
                    harness.nc, harness.topology,
                    commands.EnsureSession(command_id=ids.new_id(), session_id=f"crash-{n}"), timeout=5,
                )  # fmt: skip
            if doomed.poll() is not None:
                break
        assert doomed.wait(30) == -9
    finally:
        if doomed.poll() is None:
            doomed.kill()
    records = await harness.reaper.sandboxes.all()
    stuck = [r for r in records.values() if r.status == "requested"]
    assert stuck
    for record in stuck:
        assert await harness.runtime.get(record.sandbox_id) is not None, "the runtime still holds it"
    report = await harness.reaper.pass_once(later(minutes=10))
    assert report.findings["fail_stuck"] == len(stuck)
    for record in stuck:
        assert await harness.runtime.get(record.sandbox_id) is None
    assert (await harness.shell(f"crash-{n}", "echo alive")).output == "alive\n"


async def test_a_sandbox_its_session_let_go_of_is_deleted(harness):
    """The scheduler died between `session.deleted` and asking the pool-manager to delete
    the sandbox: the sweep finds the running sandbox nobody points to and deletes it."""
    from shared.contract import events
    from shared.infrastructure import eventstore

    session = await harness.ensure("abandoned")
    store = eventstore.EventStore(harness.nc.jetstream(), harness.topology)
    subject = harness.topology.aggregate_subject(subjects.SESSION, "abandoned")
    meta = events.Meta(event_id=ids.new_id(), time=datetime.now(UTC), service="scheduler", instance="dead")
    history = await store.load(subject)
    await store.append(subject, [events.SessionDeleted(meta=meta, session_id="abandoned")],
                       expected_last_seq=history[-1].seq)  # fmt: skip
    await support.eventually(lambda: _deleted(harness, "abandoned"), timeout=10)
    assert not (await harness.reaper.pass_once(datetime.now(UTC))).findings  # grace first
    report = await harness.reaper.pass_once(later(minutes=2))
    assert report.findings["delete_unowned"] == 1
    assert await harness.runtime.get(session.sandbox_id) is None


async def _deleted(harness, sid):
    state = await harness.session(sid)
    return state is not None and state.status == "deleted"


async def test_a_long_call_in_flight_and_polls_count_as_activity(harness):
    import asyncio

    await harness.shell("longrun", "true")
    sandbox = (await harness.ensure("longrun")).sandbox_id
    request = execution.Shell(session_id="longrun", sandbox_id=sandbox, command="sleep 3", timeout=1800)
    in_flight = asyncio.create_task(
        harness.nc.request(harness.topology.exec_requests, codec.encode(request), timeout=60)
    )
    await asyncio.sleep(0.5)
    # Eleven minutes later the call may still be running (its timeout is 30 min): not idle.
    assert (await harness.reaper.pass_once(later(minutes=11))).reaps == {}
    await in_flight
    # A poll is a tool call too: it resets the idle clock.
    job = execution.ShellAsync(session_id="longrun", sandbox_id=sandbox, command="sleep 1")
    started = execution.decode_reply(
        (await harness.nc.request(harness.topology.exec_requests, codec.encode(job), timeout=30)).data
    )
    poll = execution.ShellPoll(session_id="longrun", sandbox_id=sandbox, job_id=started.job_id)
    await harness.nc.request(harness.topology.exec_requests, codec.encode(poll), timeout=30)
    assert (await harness.reaper.pass_once(later(minutes=9))).reaps == {}
    assert (await harness.reaper.pass_once(later(minutes=11))).reaps == {"idle": 1}


async def test_a_snapshot_no_event_names_is_removed_once_old_and_a_recorded_one_never(harness):
    """A pool-manager killed between its copy and ``snapshot.created`` leaves a snapshot in
    the runtime that no event names: the sweep removes it after ``ORPHAN_SNAPSHOT_AGE``
    (a retry of the request records it before that); a recorded snapshot stays."""
    from shared.contract import commands, ids
    from shared.infrastructure import rpc

    await harness.shell("snappy", "echo kept > /workspace/k")
    reply = await rpc.SessionClient(harness.nc, harness.topology).call(
        commands.SnapshotSession(command_id=ids.new_id(), session_id="snappy", snapshot_id="recorded")
    )
    assert reply.snapshot is not None
    rt = local.LocalRuntime(harness.state)
    sandbox_id = reply.snapshot.sandbox_id
    await rt.snapshot(sandbox_id, "unrecorded")  # the copy, with no event (a crash after it)
    assert not (await harness.reaper.pass_once(later(minutes=5))).findings  # a retry may still come
    report = await harness.reaper.pass_once(later(minutes=11))
    assert report.findings == {"delete_orphan_snapshot": 1}
    assert [s.snapshot_id for s in await rt.list_snapshots()] == ["recorded"]

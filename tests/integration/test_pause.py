"""Pause and resume with real sandboxes, real services (scheduler, pool-manager, executor in
process) and real NATS; the reaper driven with fake time (``pass_once(now=…)``): an idle
session's sandbox is paused, its next call resumes it with its shell state, an async job
in progress keeps it running, a paused one idle for the stop timeout is stopped, and every
transition is an event the projections fold as replay does."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta

import pytest

from sbx_api import errors
from shared.contract import codec, commands, execution, ids, states, subjects
from shared.domain import projections
from shared.infrastructure import eventstore, projector, replay
from shared.infrastructure.settings import lifecycle
from tests import support
from tests.integration.test_reaper import Harness, harness, later  # noqa: F401 (the fixture)

pytestmark = [pytest.mark.needs_root("the local runtime needs root"), pytest.mark.slow]
PAUSING = lifecycle.LifecycleSettings(
    pool_min_idle=0, max_lifetime=3600, idle_timeout=600, pause_timeout=300, stopped_retention=86400
)


@pytest.fixture
def pausing(harness):  # noqa: F811
    harness.reaper.rules = PAUSING
    return harness


async def sandbox_of(h: Harness, sid: str) -> states.SandboxState:
    js = h.nc.jetstream()
    store = await projector.ProjectionStore.open(
        js, projections.SANDBOXES, eventstore.EventStore(js, h.topology)
    )
    session = await h.session(sid)
    found = await store.get(session.sandbox_id)
    assert found is not None
    return found


async def sandbox_events(h: Harness) -> list[tuple[str, str]]:
    return [
        (s.event.__struct_config__.tag, getattr(s.event, "reason", ""))
        for s in await support.stream_events(h.nc, h.topology, subjects.SANDBOX)
        if s.event.__struct_config__.tag in ("sandbox.paused", "sandbox.resumed", "sandbox.stopped")
    ]


async def command(h: Harness, made: commands.SessionCommand) -> commands.CommandReply:
    return await support.send(h.nc, h.topology, made, timeout=60)


async def test_an_idle_sandbox_is_paused_and_its_next_call_resumes_it_with_its_shell(pausing):
    h = pausing
    assert (await h.shell("napper", "export KEPT=yes; cd /tmp; counter=41")).exit_code == 0
    assert (await h.reaper.pass_once(later(minutes=4))).reaps == {}  # not idle long enough
    report = await h.reaper.pass_once(later(minutes=5))
    assert report.reaps == {"pause": 1}
    sandbox = await sandbox_of(h, "napper")
    assert sandbox.status == "paused" and sandbox.paused_at is not None
    assert (await h.runtime.get(sandbox.sandbox_id)).status == "paused"
    assert (await h.session("napper")).status == "active"  # the session itself goes on
    assert (await h.reaper.pass_once(later(minutes=6))).reaps == {}  # paused: nothing more yet
    # The next call resumes it: same shell, same variables and directory.
    reply = await h.shell("napper", 'echo "$KEPT $PWD $((counter+1))"')
    assert reply.ok and reply.output.strip() == "yes /tmp 42", reply
    assert (await sandbox_of(h, "napper")).status == "running"
    assert await sandbox_events(h) == [("sandbox.paused", "idle"), ("sandbox.resumed", "call")]
    assert not (await replay.verify(h.nc.jetstream(), h.topology)).differences


async def test_an_async_job_in_progress_keeps_the_sandbox_running(pausing):
    h = pausing
    sandbox_id = (await h.ensure("worker")).sandbox_id
    job = execution.ShellAsync(session_id="worker", sandbox_id=sandbox_id, command="sleep 600")
    msg = await h.nc.request(h.topology.exec_requests, codec.encode(job), timeout=60)
    assert execution.decode_reply(msg.data).status == "running"
    assert (await h.reaper.pass_once(later(minutes=5))).reaps == {}
    assert (await sandbox_of(h, "worker")).status == "running"
    # ...unless configured to pause anyway.
    h.reaper.rules = dataclasses.replace(PAUSING, pause_running_jobs=True)
    assert (await h.reaper.pass_once(later(minutes=5))).reaps == {"pause": 1}
    assert (await sandbox_of(h, "worker")).status == "paused"


async def test_a_paused_sandbox_idle_for_the_stop_timeout_is_stopped(pausing):
    h = pausing
    await h.shell("sleeper", "echo kept > /workspace/file")
    assert (await h.reaper.pass_once(later(minutes=5))).reaps == {"pause": 1}
    assert (await h.reaper.pass_once(later(minutes=11))).reaps == {"idle": 1}
    assert (await h.session("sleeper")).status == "stopped"
    sandbox = await sandbox_of(h, "sleeper")
    assert sandbox.status == "stopped" and sandbox.paused_at is None
    assert (await h.runtime.get(sandbox.sandbox_id)).status == "stopped"
    reply = await h.shell("sleeper", "cat /workspace/file")
    assert reply.output.endswith("kept\n"), reply  # files kept, as after any stop
    assert await sandbox_events(h) == [
        ("sandbox.paused", "idle"),
        ("sandbox.stopped", "requested"),
    ]
    assert not (await replay.verify(h.nc.jetstream(), h.topology)).differences


async def test_pause_and_resume_commands_check_their_input_and_are_idempotent(pausing):
    h = pausing

    def pause(sid: str, command_id: str | None = None, **kw) -> commands.PauseSession:
        return commands.PauseSession(command_id=command_id or ids.new_id(), session_id=sid, **kw)

    reply = await command(h, pause("nobody"))
    assert not reply.ok and reply.error.code == errors.NotFound.code
    await command(h, commands.CreateSession(command_id=ids.new_id(), session_id="unused"))
    reply = await command(h, pause("unused"))
    assert not reply.ok and reply.error.code == errors.Conflict.code and "has none yet" in reply.error.message
    await h.shell("op", "true")
    first = await command(h, pause("op", "pause:key-1"))
    assert first.ok and first.appended == 1 and first.sandbox.status == "paused"
    again = await command(h, pause("op", "pause:key-1"))
    assert again.ok and again.appended == 0 and again.sandbox.status == "paused"
    other = await command(h, pause("op"))
    assert other.ok and other.appended == 0
    resumed = await command(h, commands.ResumeSession(command_id="resume:key-2", session_id="op"))
    assert resumed.ok and resumed.appended == 1 and resumed.sandbox.status == "running"
    same = await command(h, commands.ResumeSession(command_id="resume:key-2", session_id="op"))
    assert same.ok and same.appended == 0
    await command(h, commands.StopSession(command_id=ids.new_id(), session_id="op"))
    reply = await command(h, pause("op"))
    assert not reply.ok and reply.error.code == errors.Conflict.code and "stopped" in reply.error.message
    # A pause whose sender saw an older session (the reaper's precondition) does nothing.
    await h.shell("moved", "true")
    stale = await command(h, pause("moved", if_last_seq=1))
    assert stale.ok and stale.appended == 0 and (await sandbox_of(h, "moved")).status == "running"


async def test_a_call_while_the_sandbox_is_being_paused_resumes_it_at_once(pausing):
    """The idle clock moved past what the pause's sender saw: paused, then resumed
    (``activity``), both recorded."""
    h = pausing
    await h.shell("racer", "true")
    long_ago = datetime.now(UTC) - timedelta(hours=1)
    reply = await command(
        h, commands.PauseSession(command_id=ids.new_id(), session_id="racer", quiet_since=long_ago)
    )
    assert reply.ok and reply.sandbox.status == "running"
    assert await sandbox_events(h) == [("sandbox.paused", "requested"), ("sandbox.resumed", "activity")]


async def test_the_executor_refuses_a_paused_sandbox_and_the_scheduler_resumes_it(pausing):
    """A call sent straight to the executor (a gateway's stale placement) is refused as
    not running, never left hanging in the frozen shell; the session's EnsureSession
    resumes it."""
    h = pausing
    sandbox_id = (await h.ensure("stale")).sandbox_id
    assert (await h.shell("stale", "echo warm")).ok  # its shell helper is up, and will be frozen
    assert (await command(h, commands.PauseSession(command_id=ids.new_id(), session_id="stale"))).ok
    request = execution.Shell(session_id="stale", sandbox_id=sandbox_id, command="echo hi")
    reply = execution.decode_reply(
        (await h.nc.request(h.topology.exec_requests, codec.encode(request), timeout=60)).data
    )
    assert not reply.ok and reply.error.code == errors.NotRunning.code and "paused" in reply.error.message
    assert (await h.ensure("stale")).sandbox_id == sandbox_id  # resumes it
    assert (await h.shell("stale", "echo hi")).output.startswith("hi")


async def test_a_sandbox_frozen_but_never_recorded_paused_is_thawed_by_the_next_call(pausing):
    """A pool-manager that died between freezing a sandbox and recording it leaves it
    frozen, recorded running: the session's next call thaws it (nothing hangs)."""
    h = pausing
    sandbox_id = (await h.ensure("halfway")).sandbox_id
    await h.runtime.pause(sandbox_id)  # frozen behind the records' back
    assert (await sandbox_of(h, "halfway")).status == "running"
    reply = await h.shell("halfway", "echo thawed")
    assert reply.ok and reply.output.startswith("thawed"), reply
    assert (await h.runtime.get(sandbox_id)).status == "running"
    assert not (await replay.verify(h.nc.jetstream(), h.topology)).differences


HIBERNATING = lifecycle.LifecycleSettings(
    pool_min_idle=0,
    max_lifetime=3600,
    idle_timeout=600,
    pause_timeout=300,
    hibernate_timeout=450,
    stopped_retention=86400,
)


async def test_an_idle_sandbox_is_paused_then_hibernated_and_its_next_call_starts_it(pausing):
    """Hibernated: stopped with its files kept, the session left active; the next call
    starts it again with its files, directory and exports; idle long enough, the session
    is stopped as before."""
    h = pausing
    h.reaper.rules = HIBERNATING
    await h.shell("bear", "echo kept > /workspace/file; cd /tmp; export KEPT=yes")
    assert (await h.reaper.pass_once(later(minutes=5))).reaps == {"pause": 1}
    assert (await h.reaper.pass_once(later(minutes=8))).reaps == {"hibernate": 1}
    sandbox = await sandbox_of(h, "bear")
    assert sandbox.status == "stopped" and (await h.session("bear")).status == "active"
    assert (await h.runtime.get(sandbox.sandbox_id)).status == "stopped"  # no process left, files kept
    reply = await h.shell("bear", 'cat /workspace/file; echo "$KEPT $PWD"')
    assert reply.ok and reply.output.endswith("kept\nyes /tmp\n"), reply
    assert (await sandbox_of(h, "bear")).status == "running"
    assert await sandbox_events(h) == [("sandbox.paused", "idle"), ("sandbox.stopped", "hibernated")]
    # Idle again: hibernated straight from running (no pause first at 8 minutes), then stopped.
    assert (await h.reaper.pass_once(later(minutes=8))).reaps == {"hibernate": 1}
    assert (await h.reaper.pass_once(later(minutes=11))).reaps == {"idle": 1}
    assert (await h.session("bear")).status == "stopped"
    assert not (await replay.verify(h.nc.jetstream(), h.topology)).differences

"""A scheduler killed with SIGKILL between appending an event and writing its projection:
the event survives, the projection is caught up after a restart, replay --verify passes,
and a retry of the same command does not transition twice. Real processes, real NATS."""

from __future__ import annotations

import subprocess
import sys

import pytest

from shared.contract import codec, commands, ids, subjects
from shared.domain import projections
from shared.infrastructure import eventstore, projector, replay
from tests import support

pytestmark = pytest.mark.slow


async def test_kill_between_append_and_projection_is_caught_up(nats_server, namespace, bus, log_dir):
    nc, topology = bus
    js = nc.jetstream()
    env = support.service_env(nats_server.url, namespace)
    doomed = support.spawn_service(
        "scheduler", {**env, "SBX_FAULTS": "scheduler.after_append"}, log_dir / "s1.log"
    )
    try:
        await support.wait_for_health(nats_server.url, namespace, "scheduler")
        command = commands.CreateSession(command_id=ids.new_id(), session_id="crashy")
        with pytest.raises(Exception):  # no reply: the process died mid-command
            await nc.request(topology.session_commands, codec.encode(command), timeout=3)
        assert doomed.wait(10) == -9, "the scheduler should have been SIGKILLed at the crash point"
    finally:
        if doomed.poll() is None:
            doomed.kill()

    # The event is in the stream; the projection was never written.
    history = [s for s in await support.stream_events(nc, topology, subjects.SESSION)]
    assert [type(s.event).__name__ for s in history] == ["SessionCreated"]
    sessions = await projector.ProjectionStore.open(
        js, projections.SESSIONS, eventstore.EventStore(js, topology)
    )
    assert await sessions.get("crashy") is None
    assert [d.key for d in (await replay.verify(js, topology)).differences] == [
        sessions.projection.key_of("crashy")
    ]

    # A fresh instance catches the projection up by itself.
    healthy = support.spawn_service("scheduler", env, log_dir / "s2.log")
    try:
        state = await support.eventually(lambda: sessions.get("crashy"), timeout=20)
        assert state.status == "active" and state.last_seq == history[0].seq

        # The caller's retry of the same command is recognised: no second transition.
        reply = codec.decode_reply(
            (await nc.request(topology.session_commands, codec.encode(command), timeout=5)).data
        )
        assert reply.ok and reply.appended == 0 and reply.session.session_id == "crashy"
        assert len(await support.stream_events(nc, topology, subjects.SESSION)) == 1

        # The operator's check, through the real CLI.
        cli = subprocess.run(
            [sys.executable, "-m", "sbx.cli", "replay", "--verify"],
            env={**env, "NATS_URL": nats_server.url, "SBX_NAMESPACE": namespace},
            capture_output=True,
            text=True,
            timeout=60,
            cwd=support.ROOT,
        )
        assert cli.returncode == 0, cli.stdout + cli.stderr
        assert "projections match" in cli.stdout
    finally:
        healthy.terminate()
        assert healthy.wait(15) == 0


async def test_verify_exits_nonzero_and_names_the_difference(nats_server, namespace, bus, log_dir):
    nc, topology = bus
    js = nc.jetstream()
    store = eventstore.EventStore(js, topology)
    await store.append(
        topology.aggregate_subject(subjects.SESSION, "lagging"),
        [support_created("lagging")],
        expected_last_seq=0,
    )
    env = {**support.service_env(nats_server.url, namespace)}
    cli = subprocess.run(
        [sys.executable, "-m", "sbx.cli", "replay", "--verify"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=support.ROOT,
    )
    assert cli.returncode == 1
    key = projections.SESSIONS.key_of("lagging")
    assert f"session {key}: missing from KV" in cli.stdout
    fixed = subprocess.run(
        [sys.executable, "-m", "sbx.cli", "replay", "--rebuild"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=support.ROOT,
    )
    assert fixed.returncode == 0 and "rewrote 1 entries" in fixed.stdout
    again = subprocess.run(
        [sys.executable, "-m", "sbx.cli", "replay", "--verify", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=support.ROOT,
    )
    assert again.returncode == 0 and '"differences": []' in again.stdout


def support_created(sid: str):
    from datetime import UTC, datetime

    from shared.contract import events

    meta = events.Meta(
        event_id=ids.new_id(), time=datetime.now(UTC), service="test", instance="t", command_id=ids.new_id()
    )
    return events.SessionCreated(meta=meta, session_id=sid)

"""The scheduler deciding session commands over real NATS: idempotency under duplicate
delivery, two instances racing on one session, and projections that stay exact."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from services.scheduler import app as scheduler_app
from shared.contract import commands, ids, subjects
from shared.domain import projections
from shared.infrastructure import replay
from tests import support


@pytest.fixture
async def schedulers(nats_server, namespace):
    """Two scheduler instances in one queue group."""
    running = [
        await support.start_in_process(nats_server.url, namespace, "scheduler", scheduler_app.setup)
        for _ in range(2)
    ]
    yield running
    for r in running:
        assert await r.stop() == 0


def create(sid: str, command_id: str | None = None, **kw) -> commands.CreateSession:
    return commands.CreateSession(command_id=command_id or ids.new_id(), session_id=sid, **kw)


async def test_duplicate_delivery_makes_one_transition(bus, schedulers):
    nc, topology = bus
    command = create("dup", actor=commands.Actor(org_id="acme", user_id="ann"))
    replies = await asyncio.gather(*(support.send(nc, topology, command) for _ in range(6)))
    assert all(r.ok for r in replies), replies
    assert sum(r.appended for r in replies) == 1
    assert {r.session.session_id for r in replies} == {"dup"}
    # ...and again later, one at a time, after other commands happened elsewhere.
    await support.send(nc, topology, create("other"))
    late = await support.send(nc, topology, command)
    assert late.ok and late.appended == 0
    created = [
        s for s in await support.stream_events(nc, topology, subjects.SESSION) if s.event.session_id == "dup"
    ]
    assert len(created) == 1
    meta = created[0].event.meta
    assert (meta.command_id, meta.org_id, meta.user_id, meta.service) == (
        command.command_id,
        "acme",
        "ann",
        "scheduler",
    )


async def test_two_instances_racing_on_one_session_lose_nothing(bus, schedulers):
    """Sixty create/stop/delete commands on one id, in ten waves of six at once, spread over
    two scheduler instances. Every command that appended is in the stream exactly once, the
    stream folds without an invalid transition, and the KV equals the fold."""
    nc, topology = bus
    kinds = itertools.cycle([commands.CreateSession, commands.StopSession, commands.DeleteSession])
    batch = [next(kinds)(command_id=ids.new_id(), session_id="hot") for _ in range(60)]
    replies = []
    for wave in range(0, len(batch), 6):  # one wave can all read the same state: several see changes
        replies += await asyncio.gather(*(support.send(nc, topology, c) for c in batch[wave : wave + 6]))
    failures = {r.error.code for r in replies if not r.ok}
    assert failures <= {"conflict", "not_found"}, failures
    appended_by = {c.command_id for c, r in zip(batch, replies, strict=True) if r.ok and r.appended}
    history = [s for s in await support.stream_events(nc, topology, subjects.SESSION)]
    assert sorted(s.event.meta.command_id for s in history) == sorted(appended_by)
    assert len(appended_by) >= 3
    folded = projections.SESSIONS.fold((s.seq, s.event) for s in history)
    assert folded is not None and folded.version == len(history)
    report = await replay.verify(nc.jetstream(), topology)
    assert not report.differences, [d.describe() for d in report.differences]

    # Both instances take part: forty independent creates are spread over the queue group.
    await asyncio.gather(*(support.send(nc, topology, create(f"spread-{n}")) for n in range(40)))
    spread = [
        s for s in await support.stream_events(nc, topology, subjects.SESSION) if s.event.session_id != "hot"
    ]
    assert len({s.event.meta.instance for s in spread}) == 2


async def test_every_reply_reflects_its_own_transition(bus, schedulers):
    nc, topology = bus
    first = await support.send(nc, topology, create("life", image="python:3.12"))
    assert first.ok and first.session.status == "active" and first.session.image == "python:3.12"
    again = await support.send(nc, topology, create("life"))
    assert not again.ok and again.error.code == "conflict"
    stop = await support.send(nc, topology, commands.StopSession(command_id=ids.new_id(), session_id="life"))
    assert stop.session.status == "stopped" and stop.appended == 1
    stop2 = await support.send(nc, topology, commands.StopSession(command_id=ids.new_id(), session_id="life"))
    assert stop2.ok and stop2.appended == 0
    gone = await support.send(
        nc, topology, commands.DeleteSession(command_id=ids.new_id(), session_id="life")
    )
    assert gone.session.status == "deleted"
    reborn = await support.send(nc, topology, create("life"))
    assert reborn.session.incarnation == 2 and reborn.session.version == 4 and reborn.session.image is None
    missing = await support.send(
        nc, topology, commands.DeleteSession(command_id=ids.new_id(), session_id="nope")
    )
    assert missing.error.code == "not_found"


async def test_malformed_commands_get_errors_and_append_nothing(bus, schedulers):
    nc, topology = bus
    before = await support.stream_events(nc, topology, subjects.SESSION)
    raw = await nc.request(topology.session_commands, b"not json", timeout=5)
    from shared.contract import codec

    assert codec.decode_reply(raw.data).error.code == "invalid_input"
    for bad in ["a.b", "*", ">", "a b", "x" * 129, "", "a\x00", "../etc"]:
        reply = await support.send(nc, topology, create(bad))
        assert not reply.ok and reply.error.code == "invalid_input", bad
    reply = await support.send(nc, topology, create("fine", image="bad image"))
    assert reply.error.code == "invalid_input"
    assert await support.stream_events(nc, topology, subjects.SESSION) == before


async def test_a_late_redelivered_delete_does_not_delete_the_new_incarnation(bus, schedulers):
    """Within JetStream's duplicate window the Msg-Id (scoped to the session) recognises
    the old delete; it changes nothing and answers with the current state."""
    nc, topology = bus
    await support.send(nc, topology, create("again"))
    delete = commands.DeleteSession(command_id=ids.new_id(), session_id="again")
    assert (await support.send(nc, topology, delete)).appended == 1
    await support.send(nc, topology, create("again"))
    late = await support.send(nc, topology, delete)
    assert late.ok and late.appended == 0
    assert late.session.status == "active" and late.session.incarnation == 2
    assert len(await support.stream_events(nc, topology, subjects.SESSION)) == 3

"""Event store and projections against a real nats-server: optimistic concurrency,
de-duplication, gap repair and catch-up."""

from __future__ import annotations

import asyncio
import itertools
from datetime import UTC, datetime

import msgspec
import pytest

from sbx_api import errors
from shared.contract import codec, events, ids, subjects
from shared.domain import projections
from shared.infrastructure import eventstore, projector, replay
from tests import support


def meta(command_id: str | None = None) -> events.Meta:
    return events.Meta(
        event_id=ids.new_id(), time=datetime.now(UTC), service="test", instance="t1", command_id=command_id
    )


def created(sid: str) -> events.SessionCreated:
    return events.SessionCreated(meta=meta(ids.new_id()), session_id=sid)


async def test_append_expects_the_aggregates_last_sequence(bus):
    nc, topology = bus
    store = eventstore.EventStore(nc.jetstream(), topology)
    subject = topology.aggregate_subject(subjects.SESSION, "s1")
    [first] = await store.append(subject, [created("s1")], expected_last_seq=0)
    assert first.prev_seq == 0
    with pytest.raises(errors.ConcurrencyError):
        await store.append(subject, [created("s1")], expected_last_seq=0)
    with pytest.raises(errors.ConcurrencyError):
        await store.append(subject, [created("s1")], expected_last_seq=first.seq + 5)
    # Another aggregate's sequence does not interfere.
    other = topology.aggregate_subject(subjects.SESSION, "s2")
    await store.append(other, [created("s2")], expected_last_seq=0)
    [second] = await store.append(
        subject, [events.SessionStopped(meta=meta(), session_id="s1")], expected_last_seq=first.seq
    )
    loaded = await store.load(subject)
    assert [s.seq for s in loaded] == [first.seq, second.seq]
    assert loaded[1].prev_seq == first.seq
    assert isinstance(loaded[1].event, events.SessionStopped)


async def test_concurrent_writers_lose_no_update(bus):
    """Eight writers race read-decide-append on one aggregate: every append lands exactly
    once and the chain of prev_seq links is unbroken."""
    nc, topology = bus
    store = eventstore.EventStore(nc.jetstream(), topology)
    subject = topology.aggregate_subject(subjects.SESSION, "hot")
    conflicts = 0

    async def writer(n: int) -> None:
        nonlocal conflicts
        for i in range(10):
            while True:
                history = await store.load(subject)
                last = history[-1].seq if history else 0
                try:
                    await store.append(
                        subject,
                        [events.SessionStopped(meta=meta(f"w{n}-{i}"), session_id="hot")],
                        expected_last_seq=last,
                    )
                    break
                except errors.ConcurrencyError:
                    conflicts += 1

    await asyncio.gather(*(writer(n) for n in range(8)))
    history = await store.load(subject)
    assert len(history) == 80
    assert sorted(s.event.meta.command_id for s in history) == sorted(
        f"w{n}-{i}" for n in range(8) for i in range(10)
    )
    assert history[0].prev_seq == 0
    assert all(b.prev_seq == a.seq for a, b in itertools.pairwise(history))
    assert conflicts > 0, "the writers never actually raced; the test proves nothing"


async def test_resent_publish_is_deduplicated_by_msg_id(bus):
    nc, topology = bus
    js = nc.jetstream()
    subject = topology.aggregate_subject(subjects.SESSION, "dup")
    headers = {subjects.MSG_ID: "cmd-1:0"}
    a = await js.publish(subject, b"{}", headers=headers, stream=topology.events_stream)
    b = await js.publish(subject, b"{}", headers=headers, stream=topology.events_stream)
    assert b.duplicate and b.seq == a.seq


async def test_projection_repairs_a_gap_from_the_stream(bus):
    """Two events were appended but never projected; applying the third rebuilds the
    whole aggregate from its subject."""
    nc, topology = bus
    js = nc.jetstream()
    store = eventstore.EventStore(js, topology)
    sessions = await projector.ProjectionStore.open(js, projections.SESSIONS, store)
    subject = topology.aggregate_subject(subjects.SESSION, "gap")
    a = (await store.append(subject, [created("gap")], expected_last_seq=0))[0]
    b = (
        await store.append(
            subject, [events.SessionStopped(meta=meta(), session_id="gap")], expected_last_seq=a.seq
        )
    )[0]
    c = (
        await store.append(
            subject, [events.SessionDeleted(meta=meta(), session_id="gap")], expected_last_seq=b.seq
        )
    )[0]
    assert await sessions.get("gap") is None
    state = await sessions.apply(c)
    assert state.status == "deleted" and state.version == 3 and state.last_seq == c.seq
    # Applying older events afterwards changes nothing (idempotent, order-safe).
    assert await sessions.apply(a) == state
    assert await sessions.get("gap") == state
    assert not (await replay.verify(js, topology)).differences


async def test_catch_up_consumer_projects_unprojected_events(bus):
    nc, topology = bus
    js = nc.jetstream()
    store = eventstore.EventStore(js, topology)
    sessions = await projector.ProjectionStore.open(js, projections.SESSIONS, store)
    for n in range(20):
        await store.append(
            topology.aggregate_subject(subjects.SESSION, f"c{n}"), [created(f"c{n}")], expected_last_seq=0
        )
    report = await replay.verify(js, topology)
    assert len(report.differences) == 20 and all(d.actual is None for d in report.differences)
    task = asyncio.create_task(projector.catch_up(js, sessions))
    try:

        async def caught_up():
            return not (await replay.verify(js, topology)).differences

        await support.eventually(caught_up)
    finally:
        task.cancel()
    assert len(await sessions.all()) == 20


async def test_verify_reports_a_tampered_projection(bus):
    nc, topology = bus
    js = nc.jetstream()
    store = eventstore.EventStore(js, topology)
    sessions = await projector.ProjectionStore.open(js, projections.SESSIONS, store)
    [stored] = await store.append(
        topology.aggregate_subject(subjects.SESSION, "x"), [created("x")], expected_last_seq=0
    )
    await sessions.apply(stored)
    assert not (await replay.verify(js, topology)).differences
    state = await sessions.get("x")
    await sessions.kv.put(
        sessions.projection.key_of("ghost"), codec.encode(msgspec.structs.replace(state, session_id="ghost"))
    )
    await sessions.kv.put(
        sessions.projection.key_of("x"), codec.encode(msgspec.structs.replace(state, image="tampered"))
    )
    report = await replay.verify(js, topology)
    described = sorted(d.describe() for d in report.differences)
    assert len(described) == 2
    assert any("image" in d and "tampered" in d for d in described)
    assert any("not in the stream" in d for d in described)
    rebuilt = await replay.rebuild(js, topology)
    assert len(rebuilt.differences) == 2
    assert not (await replay.verify(js, topology)).differences


async def test_a_followed_projection_lists_what_a_snapshot_lists_even_while_others_write(bus, nats_server):
    """``follow()`` answers ``all()`` from memory, as fresh as a snapshot: every write that
    finished before the call is in the answer, whoever wrote it (here another connection),
    deleted keys are gone, and a value that does not decode is an error, not skipped."""
    nc, topology = bus
    js = nc.jetstream()
    store = eventstore.EventStore(js, topology)
    followed = await projector.ProjectionStore.open(js, projections.SESSIONS, store)
    for n in range(5):
        [stored] = await store.append(
            topology.aggregate_subject(subjects.SESSION, f"f{n}"), [created(f"f{n}")], expected_last_seq=0
        )
        await followed.apply(stored)
    await followed.follow()
    other_nc, _ = await support.connect(nats_server.url, topology.namespace)
    try:
        writer = await projector.ProjectionStore.open(
            other_nc.jetstream(), projections.SESSIONS, eventstore.EventStore(other_nc.jetstream(), topology)
        )
        for n in range(5, 40):  # each write is seen by the very next listing
            state = msgspec.structs.replace(await followed.get("f0"), session_id=f"f{n}")
            await writer.kv.put(writer.projection.key_of(f"f{n}"), codec.encode(state))
            listed = await followed.all()
            assert len(listed) == n + 1 and listed[writer.projection.key_of(f"f{n}")].session_id == f"f{n}"
        await writer.kv.delete(writer.projection.key_of("f3"))
        await writer.kv.purge(writer.projection.key_of("f4"))
        listed = await followed.all()
        assert listed == await _snapshot_of(followed)
        assert len(listed) == 38 and writer.projection.key_of("f3") not in listed
        await writer.kv.put(writer.projection.key_of("f7"), b"{not json")
        with pytest.raises(errors.CorruptEvent, match="does not decode"):
            await followed.all()
        await writer.kv.put(writer.projection.key_of("f7"), codec.encode(await followed.get("f0")))
        assert len(await followed.all()) == 38
    finally:
        await other_nc.close()
        await followed.unfollow()


async def test_a_followed_projection_that_fell_behind_answers_from_a_snapshot(bus, monkeypatch):
    """If the mirror cannot reach the stream's tail in time (its consumer is being
    recreated after a reconnect, say), ``all()`` takes a snapshot rather than answer
    stale."""
    from shared.infrastructure import kvmirror

    nc, topology = bus
    js = nc.jetstream()
    store = eventstore.EventStore(js, topology)
    followed = await projector.ProjectionStore.open(js, projections.SESSIONS, store)
    [stored] = await store.append(
        topology.aggregate_subject(subjects.SESSION, "b0"), [created("b0")], expected_last_seq=0
    )
    await followed.apply(stored)
    await followed.follow()
    try:
        assert len(await followed.all()) == 1
        mirror = followed._mirror
        monkeypatch.setattr(kvmirror, "CATCH_UP", 0.2)
        await mirror._sub.unsubscribe()  # deaf from now on: it can only fall behind
        state = await followed.get("b0")
        await followed.kv.put(followed.projection.key_of("b1"), codec.encode(state))
        listed = await followed.all()
        assert set(listed) == {followed.projection.key_of("b0"), followed.projection.key_of("b1")}
        assert mirror.fallbacks == 1
        monkeypatch.setattr(kvmirror, "CATCH_UP", 60.0)  # behind: the next answer does not wait
        started = asyncio.get_running_loop().time()
        assert len(await followed.all()) == 2 and mirror.fallbacks == 2
        assert asyncio.get_running_loop().time() - started < 30
    finally:
        mirror._sub = None
        await followed.unfollow()


async def _snapshot_of(store: projector.ProjectionStore) -> dict:
    from shared.infrastructure import bus as shared_bus

    raw = await shared_bus.snapshot(store.store_js, store.kv_bucket)
    return {k: codec.decode_state(v, store.projection.state_type) for k, v in raw.items()}


async def test_a_followed_projection_can_keep_only_the_entries_its_owner_looks_at(bus):
    """Deleted records stay in KV for good; a service that follows with ``keep`` lists only
    what it accepts, and an entry that stops (or starts) being accepted leaves (or joins)."""
    nc, topology = bus
    js = nc.jetstream()
    store = eventstore.EventStore(js, topology)
    sessions = await projector.ProjectionStore.open(js, projections.SESSIONS, store)
    seqs = {}
    for sid in ("k1", "k2"):
        [stored] = await store.append(
            topology.aggregate_subject(subjects.SESSION, sid), [created(sid)], expected_last_seq=0
        )
        seqs[sid] = (await sessions.apply(stored)).last_seq
    changes: list[tuple[str | None, str | None]] = []

    def on_change(old, new) -> None:
        changes.append((old and old.status, new and new.status))

    await sessions.follow(keep=lambda s: s.status != "deleted", on_change=on_change)
    try:
        assert {s.session_id for s in (await sessions.all()).values()} == {"k1", "k2"}
        assert changes == [(None, "active"), (None, "active")]  # what it found on starting
        subject = topology.aggregate_subject(subjects.SESSION, "k2")
        [gone] = await store.append(
            subject, [events.SessionDeleted(meta=meta(), session_id="k2")], expected_last_seq=seqs["k2"]
        )
        await sessions.apply(gone)
        assert {s.session_id for s in (await sessions.all()).values()} == {"k1"}
        [back] = await store.append(subject, [created("k2")], expected_last_seq=gone.seq)
        await sessions.apply(back)
        assert {s.session_id for s in (await sessions.all()).values()} == {"k1", "k2"}
        # Heard once each write was in the bucket: k2 left (deleted: not kept), came back.
        assert changes[2:] == [("active", None), (None, "active")]
    finally:
        await sessions.unfollow()


async def test_a_writer_chains_its_appends_on_the_revision_it_wrote(bus):
    """``transact`` says which KV revision it wrote; a next ``transact`` given that read
    appends on it without reading the entry, and a stale one (another writer came in
    between) only costs a failed append: nothing is lost or appended twice."""
    from shared.infrastructure import aggregates

    nc, topology = bus
    js = nc.jetstream()
    store = eventstore.EventStore(js, topology)
    sessions = await projector.ProjectionStore.open(js, projections.SESSIONS, store)
    first = await aggregates.transact(sessions, "ch", lambda s: [created("ch")], read=(None, None))
    assert first.read is not None
    assert first.revision == (await sessions.kv.get(sessions.projection.key_of("ch"))).revision
    stop = [events.SessionStopped(meta=meta(), session_id="ch")]
    second = await aggregates.transact(
        sessions, "ch", lambda s: stop if s.status == "active" else [], read=first.read
    )
    assert second.state.status == "stopped" and len(second.appended) == 1
    # ``first.read`` is stale now: deciding on it again appends nothing new.
    again = await aggregates.transact(
        sessions, "ch", lambda s: stop if s.status == "active" else [], read=first.read
    )
    assert again.appended == [] and again.state.status == "stopped"
    history = await store.load(topology.aggregate_subject(subjects.SESSION, "ch"))
    assert [type(s.event).__name__ for s in history] == ["SessionCreated", "SessionStopped"]
    assert (await sessions.get("ch")).last_seq == history[-1].seq


async def test_a_followed_projection_says_what_it_last_heard_without_reading(bus):
    nc, topology = bus
    js = nc.jetstream()
    store = eventstore.EventStore(js, topology)
    sessions = await projector.ProjectionStore.open(js, projections.SESSIONS, store)
    assert sessions.heard("h1") is None  # not followed: nothing heard
    heard = asyncio.Event()
    await sessions.follow(on_change=lambda old, new: heard.set())
    try:
        [stored] = await store.append(
            topology.aggregate_subject(subjects.SESSION, "h1"), [created("h1")], expected_last_seq=0
        )
        await sessions.apply(stored)
        await asyncio.wait_for(heard.wait(), 10)
        assert sessions.heard("h1").last_seq == stored.seq
        assert sessions.heard("nobody") is None
    finally:
        await sessions.unfollow()


async def test_a_followed_projection_applies_what_it_heard_of_without_reading(bus):
    """The catch-up consumer's ``apply`` of an event the writer already projected: a
    followed store that heard of the entry at or past it reads nothing (the real ``get``
    is counted) and answers the entry."""
    nc, topology = bus
    js = nc.jetstream()
    store = eventstore.EventStore(js, topology)
    sessions = await projector.ProjectionStore.open(js, projections.SESSIONS, store)
    heard = asyncio.Event()
    await sessions.follow(on_change=lambda old, new: heard.set())
    try:
        [stored] = await store.append(
            topology.aggregate_subject(subjects.SESSION, "cu"), [created("cu")], expected_last_seq=0
        )
        await sessions.apply(stored)
        await asyncio.wait_for(heard.wait(), 10)
        reads = 0
        real_get = sessions.kv.get

        async def counted(key):
            nonlocal reads
            reads += 1
            return await real_get(key)

        sessions.kv.get = counted
        again = await sessions.apply(stored)
        assert reads == 0 and again.last_seq == stored.seq
    finally:
        await sessions.unfollow()

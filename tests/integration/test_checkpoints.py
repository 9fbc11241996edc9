"""Projection checkpoints against a real nats-server: a verify or a rebuild folds only the
events since the latest checkpoint, a stream whose head was trimmed is rebuilt right from a
checkpoint that covers it and refused loudly without one, and a checkpoint cut short while
being written leaves the previous one in charge."""

from __future__ import annotations

import os
from datetime import UTC, datetime

import msgspec
import pytest

from shared.contract import codec, events, ids, subjects
from shared.domain import checkpoints, projections
from shared.infrastructure import checkpoints as stored_checkpoints
from shared.infrastructure import eventstore, projector, replay


def meta() -> events.Meta:
    return events.Meta(event_id=ids.new_id(), time=datetime.now(UTC), service="test", instance="t")


async def created(store, target, session_id: str) -> eventstore.Stored:
    subject = store.topology.aggregate_subject(subjects.SESSION, session_id)
    [stored] = await store.append(
        subject, [events.SessionCreated(meta=meta(), session_id=session_id)], expected_last_seq=0
    )
    await target.apply(stored)
    return stored


async def stopped(store, target, session_id: str, after: int) -> eventstore.Stored:
    subject = store.topology.aggregate_subject(subjects.SESSION, session_id)
    [stored] = await store.append(
        subject, [events.SessionStopped(meta=meta(), session_id=session_id)], expected_last_seq=after
    )
    await target.apply(stored)
    return stored


@pytest.fixture
async def stack(bus):
    nc, topology = bus
    js = nc.jetstream()
    store = eventstore.EventStore(js, topology)
    target = await projector.ProjectionStore.open(js, projections.SESSIONS, store)
    return js, topology, store, target


async def test_verify_and_rebuild_fold_only_what_came_since_the_checkpoint(stack):
    js, topology, store, target = stack
    first = {f"old-{n}": await created(store, target, f"old-{n}") for n in range(20)}
    taken = await replay.take_checkpoint(js, topology)
    assert taken.from_seq == 0 and taken.events == 20
    for n in range(5):
        await stopped(store, target, f"old-{n}", first[f"old-{n}"].seq)
    await created(store, target, "new-0")
    report = await replay.verify(js, topology)
    assert report.from_seq == 20 and report.events == 6 and report.differences == []
    assert report.aggregates[subjects.SESSION] == 21
    full = await replay.verify(js, topology, full=True)
    assert full.from_seq == 0 and full.events == 26 and full.differences == []
    again = await replay.take_checkpoint(js, topology)  # folds the 6 onto the first
    assert again.from_seq == 20 and again.events == 6
    latest = await stored_checkpoints.latest(js, topology)
    assert latest is not None and latest.seq == 26 and latest.events == 26 and len(latest.session) == 21


async def test_a_trimmed_head_is_rebuilt_from_the_checkpoint_that_covers_it(stack):
    js, topology, store, target = stack
    seqs = {f"s{n}": (await created(store, target, f"s{n}")).seq for n in range(10)}
    for n in range(3):
        await stopped(store, target, f"s{n}", seqs[f"s{n}"])
    await replay.take_checkpoint(js, topology)
    await js.purge_stream(topology.events_stream, seq=14)  # the head (1..13) is gone
    await created(store, target, "late")
    assert (await replay.verify(js, topology)).differences == []
    for key in list((await target.all()).keys()):  # lose the KV; rebuild from checkpoint + tail
        await target.kv.purge(key)
    rebuilt = await replay.rebuild(js, topology)
    assert rebuilt.from_seq == 13 and rebuilt.events == 1 and len(rebuilt.differences) == 11
    assert (await replay.verify(js, topology)).differences == []
    states = await target.all()
    assert len(states) == 11 and [s.status for s in states.values()].count("stopped") == 3
    with pytest.raises(checkpoints.HistoryGone, match="nothing was rewritten"):
        await replay.rebuild(js, topology, full=True)  # from the first event: loud, not wrong
    assert len(await target.all()) == 11


async def test_a_trimmed_history_without_a_checkpoint_fails_loudly_and_rewrites_nothing(stack):
    js, topology, store, target = stack
    seqs = {f"s{n}": (await created(store, target, f"s{n}")).seq for n in range(4)}
    await js.purge_stream(topology.events_stream, seq=2)  # s0's only event is gone
    before = await target.all()
    # a rebuild would drop s0 from KV (the stream no longer knows it): it refuses instead
    with pytest.raises(checkpoints.HistoryGone, match="nothing was rewritten"):
        await replay.rebuild(js, topology)
    assert await target.all() == before
    await stopped(store, target, "s1", seqs["s1"])
    await js.delete_msg(topology.events_stream, seqs["s1"])  # s1's first event goes, its next stays
    with pytest.raises(checkpoints.HistoryGone, match="follows sequence 2"):
        await replay.verify(js, topology)
    with pytest.raises(checkpoints.HistoryGone):
        await replay.rebuild(js, topology)
    assert set(before) <= set(await target.all())  # s0 is still there


async def test_a_checkpoint_cut_short_while_written_leaves_the_previous_one(stack):
    js, topology, store, target = stack
    for n in range(5):
        await created(store, target, f"c{n}")
    await replay.take_checkpoint(js, topology)
    await created(store, target, "c5")
    # what a writer that died mid-put leaves: chunks of a newer checkpoint, no metadata
    bucket = topology.checkpoints_bucket
    for _ in range(3):
        await js.publish(f"$O.{bucket}.C.{ids.new_id()}", os.urandom(1024), stream=f"OBJ_{bucket}")
    latest = await stored_checkpoints.latest(js, topology)
    assert latest is not None and latest.seq == 5
    report = await replay.verify(js, topology)
    assert report.from_seq == 5 and report.events == 1 and report.differences == []
    taken = await replay.take_checkpoint(js, topology)
    assert taken.from_seq == 5
    latest = await stored_checkpoints.latest(js, topology)
    assert latest is not None and latest.seq == 6 and len(latest.session) == 6


async def test_only_the_newest_checkpoints_are_kept(stack):
    js, topology, store, target = stack
    for n in range(4):
        await created(store, target, f"k{n}")
        await replay.take_checkpoint(js, topology)
    kept = await (await js.object_store(topology.checkpoints_bucket)).list(ignore_deletes=True)
    assert sorted(stored_checkpoints.seq_of(i.name) for i in kept) == [3, 4]


async def test_a_verify_after_a_verified_checkpoint_reads_only_what_changed_and_still_catches_it(stack):
    js, topology, store, target = stack
    first = {f"v{n}": await created(store, target, f"v{n}") for n in range(30)}
    taken = await replay.take_checkpoint(js, topology)
    assert taken.differences == []
    latest = await stored_checkpoints.latest(js, topology)
    assert latest is not None and latest.verified_kv  # every entry matched: verified
    await stopped(store, target, "v0", first["v0"].seq)
    report = await replay.verify(js, topology)
    assert report.differences == [] and report.compared == 1 and report.events == 1
    # an entry nobody touched since is overwritten in KV: it was written, so it is read
    state = await target.get("v5")
    assert state is not None
    key = projections.SESSIONS.key_of("v5")
    _, revision = await target.get_entry(key)
    await target.kv.update(key, codec.encode(msgspec.structs.replace(state, status="stopped")), last=revision)
    # and an event appended but never projected (its KV entry stays behind)
    subject = topology.aggregate_subject(subjects.SESSION, "v9")
    await store.append(
        subject, [events.SessionStopped(meta=meta(), session_id="v9")], expected_last_seq=first["v9"].seq
    )
    report = await replay.verify(js, topology)
    assert sorted(d.key for d in report.differences) == sorted(
        projections.SESSIONS.key_of(s) for s in ("v5", "v9")
    )
    assert report.compared == 3
    assert sorted(d.key for d in (await replay.verify(js, topology, full=True)).differences) == sorted(
        d.key for d in report.differences
    )
    # a checkpoint taken over differences is not verified: the next verify reads everything
    assert (await replay.take_checkpoint(js, topology)).differences
    latest = await stored_checkpoints.latest(js, topology)
    assert latest is not None and not latest.verified_kv
    assert (await replay.verify(js, topology)).compared == 30

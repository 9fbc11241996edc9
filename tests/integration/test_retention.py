"""Bounded audit against a real nats-server: the event stream gets its definition on an
existing stack, audit records expire by their own TTL and are trimmed oldest first near the
byte budget while every aggregate's events stay (``sbx replay --verify`` still holds), one
session's allowance is shared by every executor, and ``sbx events export`` resumes with
neither duplicates nor gaps."""

from __future__ import annotations

import asyncio
import json
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest
from nats.js import api

from sbx_api import errors
from shared.contract import events, ids, subjects
from shared.domain import audit, projections
from shared.infrastructure import auditrate, bus, eventstore, projector, replay, retention
from shared.infrastructure.settings import audit as audit_settings
from tests import support
from tests.integration.test_cli import environment

SBX = str(Path(sys.executable).with_name("sbx"))


def meta() -> events.Meta:
    return events.Meta(event_id=ids.new_id(), time=datetime.now(UTC), service="test", instance="t")


def command(session: str, text: str) -> events.CommandExecuted:
    return events.CommandExecuted(
        meta=meta(), session_id=session, sandbox_id="sb", tool="shell", command=text
    )


async def sessions(store: eventstore.EventStore, js, count: int) -> list[int]:
    """``count`` sessions created and projected; their events' sequences."""
    target = await projector.ProjectionStore.open(js, projections.SESSIONS, store)
    seqs = []
    for _ in range(count):
        sid = f"kept-{ids.new_id()[:12]}"
        subject = store.topology.aggregate_subject(subjects.SESSION, sid)
        [stored] = await store.append(
            subject, [events.SessionCreated(meta=meta(), session_id=sid)], expected_last_seq=0
        )
        await target.apply(stored)
        seqs.append(stored.seq)
    return seqs


async def kinds_left(store: eventstore.EventStore) -> dict[str, list[int]]:
    left: dict[str, list[int]] = {}
    async for stored in store.read():
        left.setdefault(store.topology.kind_of(stored.subject), []).append(stored.seq)
    return left


async def test_an_existing_stream_gets_the_definition_idempotently(nats_server, namespace):
    """A stack made before the limits: its stream (no TTLs, discard old) is brought up to
    date on the next start, its events and its number of copies kept."""
    nc, topology = await support.connect(nats_server.url, namespace)
    js = nc.jetstream()
    try:
        await js.delete_stream(topology.events_stream)
        old = api.StreamConfig(
            name=topology.events_stream,
            subjects=[topology.events_all],
            storage=api.StorageType.FILE,
            discard=api.DiscardPolicy.OLD,
        )
        await js.add_stream(old)
        await js.publish(topology.aggregate_subject(subjects.EXEC, "s"), b"{}", stream=topology.events_stream)
        for _ in range(2):  # twice: a second start changes nothing
            await bus.ensure_topology(js, topology)
            info = await js.stream_info(topology.events_stream)
            assert info.config.allow_msg_ttl and info.config.discard == api.DiscardPolicy.NEW
            assert not info.config.max_age and info.config.max_bytes in (None, -1)  # the server drops nothing
            assert info.config.num_replicas == 1 and info.state.messages == 1
    finally:
        await nc.close()


async def test_audit_records_expire_and_the_aggregates_and_replay_stay(bus):
    nc, topology = bus
    js = nc.jetstream()
    short = eventstore.EventStore(js, topology, audit_ttl=1)
    kept = await sessions(short, js, 3)
    for n in range(5):
        await short.record(topology.aggregate_subject(subjects.EXEC, "s"), command("s", f"echo {n}"))
    # (the stream's own subjects say which kind a record is: an aggregate's event never gets a TTL)
    await support.eventually(lambda: _no_audit(short), timeout=30)
    assert (await kinds_left(short)) == {subjects.SESSION: kept}
    report = await replay.verify(js, topology)
    assert report.differences == [] and report.aggregates[subjects.SESSION] == 3


async def _no_audit(store: eventstore.EventStore) -> bool:
    return subjects.EXEC not in await kinds_left(store)


async def test_near_the_byte_budget_the_oldest_audit_records_go_and_no_state(bus):
    nc, topology = bus
    js = nc.jetstream()
    store = eventstore.EventStore(js, topology)
    kept = await sessions(store, js, 5)
    subject = topology.aggregate_subject(subjects.EXEC, "noisy")
    for n in range(200):
        await store.record(subject, command("noisy", f"{n:04d} " + "x" * 2000))
        if n % 20 == 0:  # state written all along, between the records
            kept += await sessions(store, js, 1)
    used, _ = await retention.usage(js, topology)
    limit = int(used / 0.95)  # 95 % full: past the 90 % mark
    trimmed = await retention.trim_audit(js, topology, limit)
    assert trimmed.below and trimmed.bytes_after <= limit * audit.TRIM_AT
    left = await kinds_left(store)
    assert left[subjects.SESSION] == kept  # every aggregate event stays
    assert left[subjects.EXEC] and min(left[subjects.EXEC]) >= trimmed.below  # the oldest went
    assert (await retention.trim_audit(js, topology, limit)).below == 0  # below the mark: nothing
    assert (await replay.verify(js, topology)).differences == []


async def test_one_sessions_allowance_is_shared_by_every_executor(bus):
    """Two executors (two charges of the same bucket) cannot give a session twice its
    allowance; another session has its own."""
    nc, topology = bus
    js = nc.jetstream()
    limits = audit_settings.AuditRateSettings(bytes_per_window=10_000, window=100)  # 100 bytes a second
    kv = await js.key_value(topology.audit_rate_bucket)
    first, second = auditrate.AuditRate(kv, limits), auditrate.AuditRate(kv, limits)
    results = await asyncio.gather(
        *(rate.charge("busy", 1000, now=100.0) for rate in [first, second] * 8), return_exceptions=True
    )
    refused = [r for r in results if isinstance(r, errors.LimitExceeded)]
    assert results.count(None) == 10 and len(refused) == 6
    assert "retry in 10 s" in refused[0].message and refused[0].code == "limit_exceeded"
    await second.charge("quiet", 1000, now=100.0)  # another session: untouched
    await first.charge("busy", 1000, now=110.0)  # refilled: 1000 bytes in 10 s


# ---- export --------------------------------------------------------------------------


async def export(env: dict[str, str], *args: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        SBX,
        "events",
        "export",
        *args,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    return proc.returncode, out.decode()


async def test_export_resumes_without_duplicates_or_gaps(nats_server, namespace, bus, tmp_path):
    nc, topology = bus
    store = eventstore.EventStore(nc.jetstream(), topology)
    env = environment(nats_server.url, namespace)
    archive, cursor = tmp_path / "audit.jsonl", tmp_path / "audit.cursor"

    async def write(count: int) -> list[int]:
        seqs = []
        for n in range(count):
            seqs.append(
                await store.record(topology.aggregate_subject(subjects.EXEC, "a"), command("a", f"#{n}"))
            )
            await sessions(store, nc.jetstream(), 1)
        return seqs

    written = await write(3)
    await sessions(store, nc.jetstream(), 2)  # not audit: not exported by default
    await export(env, "--output", str(archive), "--cursor", str(cursor))
    assert json.loads(cursor.read_text())["seq"] == written[-1]
    written += await write(4)
    await export(env, "--output", str(archive), "--cursor", str(cursor))
    await export(env, "--output", str(archive), "--cursor", str(cursor))  # nothing new: nothing added
    lines = [json.loads(line) for line in archive.read_text().splitlines()]
    assert [line["seq"] for line in lines] == written
    assert all(line["event"]["type"] == "exec.completed" for line in lines)

    # A crash mid-line: the cut line is removed and written again, whole, once.
    with open(archive, "a") as handle:
        handle.write('{"seq": 99999, "subj')
    cursor.unlink()
    written += await write(2)
    await export(env, "--output", str(archive))  # the file alone says where to go on
    assert [json.loads(line)["seq"] for line in archive.read_text().splitlines()] == written

    # To a pipe, the cursor file says where to go on.
    _, piped = await export(env, "--since-seq", str(written[3]), "--cursor", str(cursor))
    assert [json.loads(line)["seq"] for line in piped.splitlines()] == written[3:]
    written += await write(1)
    _, piped = await export(env, "--cursor", str(cursor))
    assert [json.loads(line)["seq"] for line in piped.splitlines()] == written[-1:]


@pytest.mark.parametrize("bad", ["--kind", "--cursor"])
async def test_export_refuses_a_bad_kind_or_cursor_clearly(nats_server, namespace, bus, tmp_path, bad):
    env = environment(nats_server.url, namespace)
    cursor = tmp_path / "c"
    cursor.write_text("not json")
    value = "commands" if bad == "--kind" else str(cursor)
    proc = await asyncio.create_subprocess_exec(
        SBX,
        "events",
        "export",
        bad,
        value,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 2 and out == b""
    assert err.decode().startswith("sbx: error: ") and "Traceback" not in err.decode()

"""Replay and catch-up against history: 10k, 100k and 1M events, with checkpoints.

For each size, on a fresh private nats-server: appends N events (sessions going through
create/stop/delete/create/stop, five events each, real codec and expected-sequence headers),
takes a first checkpoint (one full fold, once), appends ``--tail`` more events, then times
side by side:

* a checkpoint taken on top of the first (folds only the tail),
* ``replay --verify`` from the checkpoint (fold the tail + read every KV entry + compare),
* ``replay --rebuild`` from the checkpoint into empty buckets,
* a new projector instance joining the shared durable consumer, to its first event applied,
* ``replay --verify --full`` (every event) for comparison, up to ``--full-max`` events.

Prints seconds and events/s; asserts nothing about time.

    .venv/bin/python bench/replay.py [--events 10000,100000,1000000] [--tail 5000] [--full-max 100000]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nats.js import api

from bench import common
from shared.contract import codec, events, ids, subjects
from shared.domain import projections
from shared.infrastructure import bus, eventstore, projector, replay
from shared.infrastructure.settings import bus as bus_settings

CYCLE = (
    events.SessionCreated,
    events.SessionStopped,
    events.SessionDeleted,
    events.SessionCreated,
    events.SessionStopped,
)


async def append_all(js, topology: subjects.Topology, n_events: int, first: int = 0) -> float:
    """Publish asynchronously, five events per session, expected-sequence chained (sessions
    numbered from ``first``)."""
    sessions = n_events // len(CYCLE)
    start = time.perf_counter()
    last: dict[int, int] = {}
    for kind in CYCLE:
        pending = []
        for s in range(sessions):
            meta = events.Meta(
                event_id=ids.new_id(),
                time=datetime.now(UTC),
                service="bench",
                instance="b",
                command_id=ids.new_id(),
            )
            event = kind(meta=meta, session_id=f"s{first + s}")
            headers = {
                subjects.EXPECTED_LAST_SUBJECT_SEQUENCE: str(last.get(s, 0)),
                subjects.MSG_ID: f"{meta.command_id}:0",
            }
            pending.append(
                js.publish(
                    topology.aggregate_subject(subjects.SESSION, f"s{first + s}"),
                    codec.encode(event),
                    headers=headers,
                    stream=topology.events_stream,
                )
            )
            if len(pending) >= 2000:
                acks = await asyncio.gather(*pending)
                base = s - len(acks) + 1
                for offset, ack in enumerate(acks):
                    last[base + offset] = ack.seq
                pending = []
        if pending:
            acks = await asyncio.gather(*pending)
            base = sessions - len(acks)
            for offset, ack in enumerate(acks):
                last[base + offset] = ack.seq
        pass
    return time.perf_counter() - start


async def join_projector(js, topology: subjects.Topology) -> float:
    """A new projector instance joins the (existing) durable consumer: seconds until it has
    applied one new event. Before it, the durable is put at the tail, as on a running stack
    whose projector has kept up."""
    store = eventstore.EventStore(js, topology)
    durable = topology.projector_consumer(subjects.SESSION)
    tail = await store.last_seq()
    await js.add_consumer(
        topology.events_stream,
        api.ConsumerConfig(
            durable_name=durable,
            ack_policy=api.AckPolicy.EXPLICIT,
            ack_wait=projector.ACK_WAIT_SECONDS,
            max_ack_pending=10_000,
            deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=tail + 1,
            filter_subject=topology.events_of_kind(subjects.SESSION),
        ),
    )
    target = await projector.ProjectionStore.open(js, projections.SESSIONS, store)
    started = time.perf_counter()
    task = asyncio.create_task(projector.catch_up(js, target))
    await append_all(js, topology, len(CYCLE), first=10**9)
    end = await store.last_seq()
    while (state := await target.get("s1000000000")) is None or state.last_seq < end:
        await asyncio.sleep(0.005)
    elapsed = time.perf_counter() - started
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return elapsed


def line(label: str, report: replay.Report) -> str:
    return (
        f"  {label:34} {report.seconds:7.2f} s  {report.events:9,} events folded"
        f"  {report.compared:9,} entries compared"
    )


async def one_size(n_events: int, tail: int, full_max: int) -> None:
    with common.nats_server() as url:
        topology = subjects.Topology("bench")
        nc = await bus.connect(bus_settings.BusSettings(nats_url=url, namespace="bench"), "bench")
        js = nc.jetstream()
        await bus.ensure_topology(js, topology)
        append_s = await append_all(js, topology, n_events)
        first = await replay.take_checkpoint(js, topology)  # (KV still empty: not verified)
        await append_all(js, topology, tail, first=n_events)
        filled = await replay.rebuild(js, topology)
        total = (await js.stream_info(topology.events_stream)).state.messages
        print(f"\n{total:,} events ({n_events // len(CYCLE) + tail // len(CYCLE):,} sessions)")
        print(
            f"  append (publish, pipelined)        {append_s:7.2f} s  {n_events / append_s:10,.0f} events/s"
        )
        print(line("first checkpoint (full fold, once)", first))
        print(line("fill KV (rebuild from it)", filled) + f"  ({len(filled.differences):,} written)")
        print(line("checkpoint on top (tail + compare)", await replay.take_checkpoint(js, topology)))
        await append_all(js, topology, tail, first=n_events + tail)
        print(f"  (then {tail:,} more events, not projected)")
        rebuilt = await replay.rebuild(js, topology)
        print(line("rebuild from the checkpoint", rebuilt) + f"  ({len(rebuilt.differences):,} written)")
        verified = await replay.verify(js, topology)
        assert not verified.differences, verified.differences[:3]
        print(line("verify from the checkpoint", verified))
        joined = await join_projector(js, topology)
        print(f"  {'new projector instance joins':34} {joined:7.2f} s  to a new session's 5 events applied")
        if n_events <= full_max:
            full = await replay.verify(js, topology, full=True)
            assert not full.differences, full.differences[:3]
            print(line("verify --full (every event)", full))
        await nc.close()


async def main(sizes: list[int], tail: int, full_max: int) -> None:
    for n_events in sizes:
        await one_size(n_events, tail, full_max)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", default="10000,100000,1000000")
    parser.add_argument("--tail", type=int, default=5000)
    parser.add_argument("--full-max", type=int, default=100_000)
    args = parser.parse_args()
    asyncio.run(main([int(n) for n in args.events.split(",")], args.tail, args.full_max))

"""Replay speed: fold 100k events from the stream into the KV projections.

Appends N events (sessions going through create/stop/delete/create/stop, five events
each, with real expected-sequence headers) to a private nats-server, then times:

* ``replay --rebuild`` into empty buckets (fold + one KV write per aggregate),
* ``replay --verify`` (fold + read every KV entry + compare).

Prints events/s for each; asserts nothing about time.

    .venv/bin/python bench/replay.py [--events 100000]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common
from shared.contract import codec, events, ids, subjects
from shared.infrastructure import bus, replay, settings

CYCLE = (
    events.SessionCreated,
    events.SessionStopped,
    events.SessionDeleted,
    events.SessionCreated,
    events.SessionStopped,
)


async def append_all(js, topology: subjects.Topology, n_events: int) -> float:
    """Publish asynchronously, five events per session, expected-sequence chained."""
    sessions = n_events // len(CYCLE)
    start = time.perf_counter()
    last: dict[int, int] = {}
    for step, kind in enumerate(CYCLE):
        pending = []
        for s in range(sessions):
            meta = events.Meta(
                event_id=ids.new_id(),
                time=datetime.now(UTC),
                service="bench",
                instance="b",
                command_id=ids.new_id(),
            )
            event = kind(meta=meta, session_id=f"s{s}")
            headers = {
                subjects.EXPECTED_LAST_SUBJECT_SEQUENCE: str(last.get(s, 0)),
                subjects.MSG_ID: f"{meta.command_id}:0",
            }
            pending.append(
                js.publish(
                    topology.aggregate_subject(subjects.SESSION, f"s{s}"),
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
        print(f"  appended step {step + 1}/{len(CYCLE)}", file=sys.stderr)
    return time.perf_counter() - start


async def main(n_events: int) -> None:
    with common.nats_server() as url:
        topology = subjects.Topology("bench")
        nc = await bus.connect(settings.BusSettings(nats_url=url, namespace="bench"), "bench")
        js = nc.jetstream()
        await bus.ensure_topology(js, topology)
        append_s = await append_all(js, topology, n_events)
        total = (await js.stream_info(topology.events_stream)).state.messages
        rebuilt = await replay.rebuild(js, topology)
        verified = await replay.verify(js, topology)
        assert not verified.differences, verified.differences[:3]
        print(f"\nreplay benchmark: {total} events over {rebuilt.aggregates.get('session', 0)} sessions\n")
        print(f"append (publish, pipelined)        {append_s:7.2f} s  {total / append_s:10,.0f} events/s")
        print(
            f"rebuild into empty KV              {rebuilt.seconds:7.2f} s  "
            f"{rebuilt.events / rebuilt.seconds:10,.0f} events/s"
            f"  ({len(rebuilt.differences)} entries written)"
        )
        print(
            f"verify (fold + read KV + compare)  {verified.seconds:7.2f} s  "
            f"{verified.events / verified.seconds:10,.0f} events/s"
        )
        await nc.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=100_000)
    asyncio.run(main(parser.parse_args().events))

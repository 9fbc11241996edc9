"""Timeline queries: a session with N audit records among other sessions' traffic.

Appends, to a private nats-server, one session's life (created, a sandbox assigned) and N
``exec.completed`` records (commands and edits), interleaved with as many records of other
sessions and their sandboxes' events, then times through :class:`TimelineReader` (what the
route and ``sbx timeline`` use):

* the first page (100 entries) and a full page (1000),
* walking the whole timeline page by page (N + 2 entries),
* a filtered page (edits only).

Prints the figures; asserts only that the walk saw every entry.

    .venv/bin/python bench/timeline.py [--records 10000] [--noise 10000]
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
from shared.infrastructure import bus, eventstore, timeline
from shared.infrastructure.settings import bus as bus_settings

SESSION = "bench-timeline"


def meta(session_id: str | None) -> events.Meta:
    return events.Meta(
        event_id=ids.new_id(), time=datetime.now(UTC), service="bench", instance="b", session_id=session_id
    )


def record(session_id: str, i: int) -> events.CommandExecuted:
    edit = i % 5 == 0
    return events.CommandExecuted(
        meta=meta(session_id),
        session_id=session_id,
        sandbox_id=f"sb-{session_id}",
        tool="edit" if edit else "shell",
        command=f"create /workspace/f{i}.py" if edit else f"pytest -q tests/test_{i}.py",
        exit_code=None if edit else 0,
        duration_ms=i % 900,
        path=f"/workspace/f{i}.py" if edit else None,
        size=120 if edit else None,
    )


async def append(js, topology: subjects.Topology, records: int, noise: int) -> None:
    first = [
        (subjects.SESSION, SESSION, events.SessionCreated(meta=meta(SESSION), session_id=SESSION)),
        (
            subjects.SESSION,
            SESSION,
            events.SessionSandboxAssigned(
                meta=meta(SESSION), session_id=SESSION, sandbox_id=f"sb-{SESSION}", image="default"
            ),
        ),
    ]
    for kind, key, event in first:
        await js.publish(
            topology.aggregate_subject(kind, key), codec.encode(event), stream=topology.events_stream
        )
    pending = []
    for i in range(max(records, noise)):
        if i < records:
            pending.append((subjects.EXEC, SESSION, record(SESSION, i)))
        if i < noise:
            other = f"other-{i % 200}"
            pending.append((subjects.EXEC, other, record(other, i)))
            pending.append(
                (
                    subjects.SANDBOX,
                    f"sb-{other}",
                    events.SandboxStarted(meta=meta(other), sandbox_id=f"sb-{other}"),
                )
            )
        if len(pending) >= 2000:
            await asyncio.gather(*(publish(js, topology, *p) for p in pending))
            pending = []
    await asyncio.gather(*(publish(js, topology, *p) for p in pending))


async def publish(js, topology: subjects.Topology, kind: str, key: str, event: events.Event) -> None:
    await js.publish(
        topology.aggregate_subject(kind, key), codec.encode(event), stream=topology.events_stream
    )


async def timed(label: str, call, runs: int = 5) -> None:
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        result = await call()
        samples.append(time.perf_counter() - start)
    samples.sort()
    print(f"{label:40} median {samples[len(samples) // 2] * 1000:8.1f} ms  (min {samples[0] * 1000:.1f}, "
          f"max {samples[-1] * 1000:.1f}; {result} entries)")  # fmt: skip


async def main(records: int, noise: int) -> None:
    with common.nats_server() as url:
        topology = subjects.Topology("bench")
        nc = await bus.connect(bus_settings.BusSettings(nats_url=url, namespace="bench"), "bench")
        js = nc.jetstream()
        await bus.ensure_topology(js, topology)
        await append(js, topology, records, noise)
        total = (await js.stream_info(topology.events_stream)).state.messages
        reader = timeline.TimelineReader(eventstore.EventStore(js, topology), topology)
        every = frozenset(("lifecycle", "command", "edit"))
        print(f"\ntimeline benchmark: {records} records of one session among {total} events\n")

        async def page(limit: int, kinds=every) -> int:  # as the route: the session's subject, then a page
            return len((await reader.page(await reader.members(SESSION), kinds, limit=limit)).entries)

        async def walk() -> int:
            seen, after = 0, 0
            while True:
                got = await reader.page(await reader.members(SESSION), every, after=after, limit=1000)
                seen += len(got.entries)
                after = got.next_after
                if not got.more:
                    return seen

        await timed("first page (100)", lambda: page(100))
        await timed("one page of 1000", lambda: page(1000))
        await timed("edits only, 1000", lambda: page(1000, frozenset(("edit",))))
        await timed("whole timeline, pages of 1000", walk, runs=3)
        assert await walk() == records + 2
        await nc.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=10_000)
    parser.add_argument("--noise", type=int, default=10_000)
    args = parser.parse_args()
    asyncio.run(main(args.records, args.noise))

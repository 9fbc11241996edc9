"""Reaper pass time over many recorded sessions (the rules and the self-healing sweep).

Records N sessions (half stopped, half deleted) and N sandboxes (stopped or deleted) as
real events on a private nats-server, folds them into KV, then times full reaper passes
against an empty local runtime: reading both projections, applying the rules, comparing
with the runtime. Nothing is due, so the pass measures the read-and-decide cost. Timed
twice in the same run: reading both buckets whole every pass (a snapshot), and as the
reaper service does, from followed copies that keep only what a pass looks at
(``Reaper.follow``: deleted sessions and dead sandboxes left out).

    .venv/bin/python bench/sweep.py [--sessions 10000]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common
from services.reaper import handlers as reaper_handlers
from shared.contract import codec, events, ids, subjects
from shared.domain import projections
from shared.infrastructure import bus, eventstore, projector, replay, service
from shared.infrastructure.settings import bus as bus_settings
from shared.infrastructure.settings import lifecycle
from shared.infrastructure.settings import service as service_settings
from shared.runtime.local import runtime as local


def meta() -> events.Meta:
    return events.Meta(event_id=ids.new_id(), time=datetime.now(UTC), service="bench", instance="b")


async def publish_history(js, topology: subjects.Topology, n: int) -> None:
    pending = []
    for i in range(n):
        sid, sb = f"s{i}", f"sb-{i}"
        session_events: list[events.Event] = [
            events.SessionCreated(meta=meta(), session_id=sid),
            events.SessionStopped(meta=meta(), session_id=sid),
        ]
        sandbox_events: list[events.Event] = [
            events.SandboxRequested(meta=meta(), sandbox_id=sb, session_id=sid),
            events.SandboxStarted(meta=meta(), sandbox_id=sb),
            events.SandboxStopped(meta=meta(), sandbox_id=sb),
        ]
        if i % 2:
            session_events.append(events.SessionDeleted(meta=meta(), session_id=sid))
            sandbox_events.append(events.SandboxDeleted(meta=meta(), sandbox_id=sb))
        for kind, aggregate, evs in (
            (subjects.SESSION, sid, session_events),
            (subjects.SANDBOX, sb, sandbox_events),
        ):
            for e in evs:
                pending.append(js.publish(topology.aggregate_subject(kind, aggregate), codec.encode(e),
                                          stream=topology.events_stream))  # fmt: skip
        if len(pending) > 4000:
            await asyncio.gather(*pending)
            pending = []
    await asyncio.gather(*pending)


async def main(n: int) -> None:
    with common.nats_server() as url, tempfile.TemporaryDirectory() as tmp:
        topology = subjects.Topology("bench")
        nc = await bus.connect(bus_settings.BusSettings(nats_url=url, namespace="bench"), "bench")
        js = nc.jetstream()
        await bus.ensure_topology(js, topology)
        start = time.perf_counter()
        await publish_history(js, topology, n)
        await replay.rebuild(js, topology)
        prepared = time.perf_counter() - start
        store = eventstore.EventStore(js, topology)
        base = service_settings.ServiceSettings(service="reaper", instance="bench")
        ctx = service.Context(
            base, None, nc, js, topology, store,  # type: ignore[arg-type]
            started_at=datetime.now(UTC),
        )  # fmt: skip
        reaper = reaper_handlers.Reaper(
            ctx,
            local.LocalRuntime(Path(tmp)),
            await projector.ProjectionStore.open(js, projections.SESSIONS, store),
            await projector.ProjectionStore.open(js, projections.SANDBOXES, store),
            lifecycle.LifecycleSettings(max_stopped=10 * n),
        )
        print(f"\nreaper sweep: {n} sessions and {n} sandboxes recorded (prepared in {prepared:.1f} s)")
        p50 = {}
        for how in ("snapshot", "followed"):
            if how == "followed":
                t0 = time.perf_counter()
                await reaper.follow()
                await reaper.sessions.all()  # the copies have caught up with the buckets
                await reaper.sandboxes.all()
                print(f"following both buckets: caught up in {(time.perf_counter() - t0) * 1000:.0f} ms")
            samples = []
            for _ in range(5):
                t0 = time.perf_counter()
                report = await reaper.pass_once(datetime.now(UTC))  # within the sweep's grace: nothing due
                samples.append(time.perf_counter() - t0)
                assert not report.reaps and not report.findings, report
            p = common.percentiles(samples)
            p50[how] = p["p50"]
            print(
                f"one full pass, {how} (read both projections, rules, reconcile): "
                f"p50 {p['p50']:.0f} ms, max {max(samples) * 1000:.0f} ms"
            )
        print(f"followed / snapshot: {p50['followed'] / p50['snapshot']:.2f}x")
        await reaper.unfollow()
        await nc.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=10_000)
    asyncio.run(main(parser.parse_args().sessions))

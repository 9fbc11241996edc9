"""The product on a real 3-node JetStream cluster (three nats-server processes on
loopback): streams and buckets get the copies asked for and keep them, and killing the
events stream's leader loses no acknowledged event."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from datetime import UTC, datetime

import pytest

from shared.contract import events, ids, subjects
from shared.infrastructure import bus, eventstore, service
from shared.infrastructure.settings import bus as bus_settings
from shared.infrastructure.settings import service as service_settings
from tests import support

pytestmark = pytest.mark.slow


@pytest.fixture
async def cluster(tmp_path):
    nodes = support.NatsCluster(tmp_path / "cluster")
    nodes.start()
    nc = await bus.connect(bus_settings.BusSettings(nats_url=nodes.url), "test")
    try:
        await nodes.ready(nc)
        yield nodes, nc
    finally:
        await nc.close()
        nodes.stop()


async def _rejoined(js, topology, node: str) -> bool:
    """The node is back in the events stream's group and caught up (or leads it)."""
    info = await js.stream_info(topology.events_stream)
    replicas = info.cluster.replicas or []
    return any(r.name == node and r.current for r in replicas) or info.cluster.leader == node


async def _replicas(js, topology) -> dict[str, int]:
    return {name: (await js.stream_info(name)).config.num_replicas for name in bus.stream_names(topology)}


async def test_streams_and_buckets_keep_the_copies_they_were_made_with(cluster, namespace):
    """SBX_NATS_REPLICAS applies at creation; a service starting with another setting (the
    default 1) never lowers it, and ``sbx replicas`` (bus.set_replicas) changes it."""
    _, nc = cluster
    js = nc.jetstream()
    topology = subjects.Topology(namespace)
    await bus.ensure_topology(js, topology, replicas=3)
    assert set((await _replicas(js, topology)).values()) == {3}
    await bus.ensure_topology(js, topology)  # a service with the default setting starts
    assert set((await _replicas(js, topology)).values()) == {3}, "never lowered"
    # The operator's command: `sbx replicas 1` against the cluster.
    env = {**os.environ, "NATS_URL": cluster[0].url, "SBX_NAMESPACE": namespace}
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "sbx.cli", "replicas", "1", "--json"],
        env=env, cwd=support.ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    said = json.loads(done.stdout)
    assert said["replicas"] == 1 and set(said["before"].values()) == {3}
    assert set((await _replicas(js, topology)).values()) == {1}
    await bus.ensure_topology(js, topology, replicas=3)
    assert set((await _replicas(js, topology)).values()) == {1}, "never raised by a starting service"
    await bus.set_replicas(js, topology, 3)
    assert set((await _replicas(js, topology)).values()) == {3}


async def test_killing_the_event_streams_leader_loses_no_acknowledged_event(cluster, namespace):
    """Appends go on while the events stream's leader node is SIGKILLed: a few fail while
    a new leader is elected (retried, as a caller would), every acknowledged one is read
    back in order with no gap or duplicate, and the node rejoins."""
    nodes, nc = cluster
    js = nc.jetstream()
    topology = subjects.Topology(namespace)
    await bus.ensure_topology(js, topology, replicas=3)
    store = eventstore.EventStore(js, topology)
    subject = topology.aggregate_subject(subjects.INSTANCE, "writer")
    acknowledged: list[str] = []
    failures = 0
    outage = 0.0

    async def append(n: int) -> None:
        nonlocal failures, outage
        meta = events.Meta(event_id=ids.new_id(), time=datetime.now(UTC), service="test", instance="t")
        event = events.InstanceStarted(
            meta=meta, service="test", instance=f"i{n}", pid=n, host="h", version="0"
        )
        failed_at = None
        while True:
            try:  # a retry of a publish that had landed is de-duplicated by its event id
                await store.record(subject, event)
                break
            except Exception:
                failures += 1
                failed_at = failed_at or time.monotonic()
                await asyncio.sleep(0.1)
        if failed_at is not None:
            outage = max(outage, time.monotonic() - failed_at)
        acknowledged.append(f"i{n}")

    for n in range(20):
        await append(n)
    leader = (await js.stream_info(topology.events_stream)).cluster.leader
    killed = int(leader[1:])
    nodes.kill(killed)
    for n in range(20, 60):
        await append(n)
    stored = [s.event async for s in store.read(subject)]
    assert [e.instance for e in stored] == acknowledged, "every acknowledged event, once, in order"
    nodes.start(killed)
    await support.eventually(lambda: _rejoined(js, topology, nodes.name(killed)), timeout=30)
    print(f"events-stream leader killed: {failures} failed attempts, calls worked again after {outage:.2f} s")


SIX = ("gateway", "scheduler", "pool_manager", "executor", "reaper", "proxy_scaler")


def _assert_none_exited(procs: dict[str, subprocess.Popen[bytes]], logs) -> None:
    exited = {m: p.returncode for m, p in procs.items() if p.poll() is not None}
    tails = "\n".join(f"--- {m}:\n" + (logs / f"{m}.log").read_text()[-3000:] for m in exited)
    assert exited == {}, f"services exited: {exited}\n{tails}"


def _stop_all(procs: dict[str, subprocess.Popen[bytes]]) -> None:
    for proc in procs.values():
        if proc.poll() is None:
            proc.terminate()
    for proc in procs.values():
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.mark.timeout(180)
async def test_services_starting_during_an_election_wait_it_out(cluster, namespace, tmp_path):
    """The six services are started in this process, and each one's set-up waits until all
    six have come that far; then the node leading the most streams and buckets is
    SIGKILLed, so every set-up (opening and following buckets, creating consumers, taking
    leases) meets the elections. Each waits them out and reports ok instead of exiting."""
    import importlib

    nodes, nc = cluster
    js = nc.jetstream()
    topology = subjects.Topology(namespace)
    await bus.ensure_topology(js, topology, replicas=3)
    leaders = [(await js.stream_info(name)).cluster.leader for name in bus.stream_names(topology)]
    busiest = max(set(leaders), key=leaders.count)
    killed = int(busiest[1:])
    env = support.service_env(
        nodes.url, namespace, SBX_NATS_REPLICAS="3", SBX_POOL_MIN_IDLE="0", SBX_SANDBOX_EGRESS="none",
        SBX_STATE_DIR=str(tmp_path / "state"), SANDBOX_API_KEY="k" * 32,
        SBX_GATEWAY_PORT=str(support.free_port()), SBX_INSTANCE_ID="",
    )  # fmt: skip
    arrived, all_there = 0, asyncio.Event()

    def in_an_election(setup: service.Setup) -> service.Setup:
        async def wrapped(ctx: service.Context) -> service.Workload:
            nonlocal arrived
            arrived += 1
            if arrived == len(SIX):
                nodes.kill(killed)
                all_there.set()
            await all_there.wait()
            return await setup(ctx)

        return wrapped

    running: dict[str, tuple[service_settings.ServiceSettings, asyncio.Event, asyncio.Task[int]]] = {}
    try:
        for module in SIX:
            service_settings, setup = importlib.import_module(f"services.{module}.app").build(env)
            service_settings = replace(service_settings, health_interval=0.2, drain_timeout=2.0)
            stop = asyncio.Event()
            task = asyncio.create_task(service.run(service_settings, in_an_election(setup), stop=stop))
            running[module] = (service_settings, stop, task)
        alive = f"nats://127.0.0.1:{nodes.ports[(killed + 1) % nodes.size]}"
        for s, _, task in running.values():
            await support.wait_for_health(alive, namespace, s.service, s.instance, task, timeout=90)
        assert all_there.is_set()
        assert [m for m, (_, _, t) in running.items() if t.done()] == [], "a service ended"
        print(f"\nsix services started while {leaders.count(busiest)} of {len(leaders)} streams elected")
    finally:
        for _, stop, _ in running.values():
            stop.set()
        await asyncio.gather(*(t for _, _, t in running.values()), return_exceptions=True)


@pytest.mark.timeout(240)
async def test_the_stack_rides_out_the_loss_of_the_event_streams_leader(cluster, namespace, tmp_path):
    """The six services, each its own process, on the 3-node cluster with 3 copies of
    everything. Sessions are created through REST while the node leading the events
    stream is SIGKILLed: during the election the gateway answers 503 with a retriable
    error (never a refused connection), no service exits, calls work again within
    seconds, every acknowledged session is in the stream once, the replay verifies, and
    the node rejoins."""
    import httpx

    nodes, nc = cluster
    js = nc.jetstream()
    port, key = support.free_port(), "k" * 32
    env = support.service_env(
        nodes.url, namespace, SBX_NATS_REPLICAS="3", SBX_POOL_MIN_IDLE="0", SBX_SANDBOX_EGRESS="none",
        SBX_STATE_DIR=str(tmp_path / "state"), SANDBOX_API_KEY=key, SBX_GATEWAY_PORT=str(port),
    )  # fmt: skip
    procs = {m: support.spawn_service(m, env, tmp_path / f"{m}.log") for m in SIX}
    try:
        url = f"http://127.0.0.1:{port}"
        auth = {"Authorization": f"Bearer {key}"}
        async with httpx.AsyncClient(base_url=url, headers=auth, timeout=30) as client:

            async def up() -> bool:
                with contextlib.suppress(httpx.HTTPError):
                    return (await client.get("/v1/sessions")).status_code == 200
                return False

            await support.eventually(up, timeout=60)
            acknowledged: list[str] = []
            refusals: list[int] = []
            outage = 0.0

            async def create(n: int) -> None:
                nonlocal outage
                failed_at = None
                sid = f"ha-{n}"
                while True:  # as a client does: retry a retriable error with the same key
                    reply = await client.post(
                        "/v1/sessions", json={"session_id": sid}, headers={"Idempotency-Key": f"key-{n}"}
                    )
                    if reply.status_code in (200, 201):
                        break
                    assert reply.status_code in (503, 504), reply.text
                    assert reply.json()["retriable"] is True, reply.text
                    refusals.append(reply.status_code)
                    failed_at = failed_at or time.monotonic()
                    await asyncio.sleep(0.1)
                if failed_at is not None:
                    outage = max(outage, time.monotonic() - failed_at)
                acknowledged.append(sid)

            for n in range(10):
                await create(n)
            topology = subjects.Topology(namespace)
            leader = (await js.stream_info(topology.events_stream)).cluster.leader
            killed = int(leader[1:])
            nodes.kill(killed)
            for n in range(10, 40):
                await create(n)
            _assert_none_exited(procs, tmp_path)

            store = eventstore.EventStore(js, topology)
            created = [
                s.event.session_id
                async for s in store.read(topology.events_of_kind(subjects.SESSION))
                if isinstance(s.event, events.SessionCreated)
            ]
            assert sorted(created) == sorted(acknowledged), "each acknowledged session once"
            verify = await asyncio.to_thread(
                subprocess.run,
                [sys.executable, "-m", "sbx.cli", "replay", "--verify"],
                env={**os.environ, "NATS_URL": nodes.url, "SBX_NAMESPACE": namespace},
                cwd=support.ROOT, capture_output=True, text=True, timeout=120,
            )  # fmt: skip
            assert verify.returncode == 0, verify.stdout + verify.stderr
            nodes.start(killed)
            await support.eventually(lambda: _rejoined(js, topology, nodes.name(killed)), timeout=30)
            print(
                f"\nevents-stream leader killed under REST load: {len(refusals)} retriable refusals, "
                f"calls worked again after {outage:.2f} s; no service exited"
            )
    finally:
        _stop_all(procs)

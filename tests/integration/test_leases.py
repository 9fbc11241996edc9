"""Leases over real NATS KV: one holder at a time, renewed while working, and work that
loses its lease is cancelled."""

from __future__ import annotations

import asyncio

from shared.infrastructure import leases


async def test_one_holder_and_renewal_while_working(bus):
    nc, topology = bus
    kv = await nc.jetstream().key_value(topology.leases_bucket)
    a, b = leases.Lease(kv, "job", "a"), leases.Lease(kv, "job", "b")
    assert await a.hold() and not await b.hold()

    async def work() -> str:
        await asyncio.sleep(0.5)
        return "done"

    assert await leases.while_held(a, work(), renew_every=0.1) == "done"
    assert not await b.hold()
    await a.release()
    assert await b.hold()


async def test_work_is_cancelled_when_the_lease_is_lost(bus):
    nc, topology = bus
    kv = await nc.jetstream().key_value(topology.leases_bucket)
    a, b = leases.Lease(kv, "job2", "a"), leases.Lease(kv, "job2", "b")
    assert await a.hold()
    finished = asyncio.Event()

    async def slow() -> None:
        await asyncio.sleep(5)
        finished.set()

    async def steal() -> None:
        await asyncio.sleep(0.2)
        await kv.purge("job2")  # as if it had expired
        assert await b.hold()

    thief = asyncio.create_task(steal())
    assert await leases.while_held(a, slow(), renew_every=0.1) is None
    await thief
    assert not finished.is_set()


async def test_a_fresh_lease_is_not_written_again_when_asked_with_fresh_for(bus):
    """Loops ask before every round; within ``fresh_for`` of the last renewal the answer
    needs no write, after it the lease is renewed (a write, a new revision)."""
    nc, topology = bus
    kv = await nc.jetstream().key_value(topology.leases_bucket)
    a = leases.Lease(kv, "job3", "a")
    assert await a.hold(fresh_for=5.0)  # not held yet: taken (written)
    taken = a.revision
    assert (await kv.get("job3")).revision == taken
    assert await a.hold(fresh_for=5.0) and a.revision == taken
    assert (await kv.get("job3")).revision == taken
    await asyncio.sleep(0.2)
    assert await a.hold(fresh_for=0.1) and a.revision > taken
    assert (await kv.get("job3")).revision == a.revision
    renewed = a.revision
    assert await a.hold() and a.revision > renewed  # by default it always renews
    assert (await kv.get("job3")).revision == a.revision

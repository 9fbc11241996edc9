"""Counting the offers waiting in the pool's work queue over a real nats-server: what the
refill compares with each pool's idle sandboxes before offering any again (one request,
not a message per idle sandbox)."""

from __future__ import annotations

import asyncio

from shared.infrastructure import warmpool


async def test_offers_waiting_are_counted_by_pool_and_leave_when_taken(bus):
    nc, topology = bus
    js = nc.jetstream()
    for pool_id in ("pool-a", "pool-b"):
        await warmpool.ensure_consumer(js, topology, pool_id)
    for sandbox_id in ("sb-1", "sb-2", "sb-3"):
        await warmpool.offer(js, topology, "pool-a", sandbox_id)
    await warmpool.offer(js, topology, "pool-b", "sb-4")
    await warmpool.offer(js, topology, "pool-a", "sb-1")  # offered again: dropped by id
    a, b = topology.pool_offers("pool-a"), topology.pool_offers("pool-b")
    assert await warmpool.waiting_offers(js, topology) == {a: 3, b: 1}

    taken = await warmpool.take(nc, topology, "pool-a")
    assert taken is not None
    assert (await warmpool.waiting_offers(js, topology))[a] == 3  # taken, not yet acknowledged
    await warmpool.done(nc, taken)
    for _ in range(50):  # (the acknowledgement is a publish: the stream removes it a moment later)
        if (await warmpool.waiting_offers(js, topology)).get(a) == 2:
            break
        await asyncio.sleep(0.02)
    assert await warmpool.waiting_offers(js, topology) == {a: 2, b: 1}

"""Leases over real NATS KV: one holder at a time, renewed while working, and work that
loses its lease is cancelled."""

from __future__ import annotations

import asyncio
import subprocess
import sys

from sbx_api import errors
from shared.infrastructure import leases
from tests import support


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


async def test_lead_runs_rounds_only_while_it_holds_the_lease(bus):
    """The loop every leader runs (pool refill, reaper, proxy-scaler): rounds while held,
    standby while another instance holds the key, a failed round retried, a round
    woken early, and an error retrying cannot fix stops the rounds and lets the key go."""
    nc, topology = bus
    kv = await nc.jetstream().key_value(topology.leases_bucket)
    other = leases.Lease(kv, "lead", "other")
    assert await other.hold()
    mine = leases.Lease(kv, "lead", "mine")
    rounds: list[int] = []
    standbys: list[None] = []
    disabled: list[str] = []
    wake = asyncio.Event()

    async def round_() -> int:
        rounds.append(len(rounds))
        if len(rounds) == 2:
            raise errors.Unavailable("a round fails")
        if len(rounds) == 4:
            raise errors.ConfigError("cannot work here")
        return len(rounds)

    task = asyncio.ensure_future(
        leases.lead(
            mine,
            round_,
            name="test",
            pace=leases.Pace(interval=30.0, min_gap=0.01, wake=wake),
            on_standby=lambda: standbys.append(None),
            disable_on=(errors.ConfigError,),
            on_disabled=lambda exc: disabled.append(exc.message),
        )
    )
    try:
        for _ in range(50):
            if standbys:
                break
            await asyncio.sleep(0.02)
        assert standbys and rounds == [], "no round while another instance holds the lease"
        await other.release()
        for want in (1, 2, 3, 4):  # each woken early; the second fails, the fourth disables
            wake.set()
            for _ in range(200):
                if len(rounds) >= want:
                    break
                await asyncio.sleep(0.02)
            assert len(rounds) == want
        for _ in range(100):
            if disabled:
                break
            await asyncio.sleep(0.02)
        assert disabled == ["cannot work here"]
        assert await other.hold(), "the disabled leader let the lease go"
        wake.set()
        await asyncio.sleep(0.2)
        assert len(rounds) == 4 and not task.done(), "disabled for good, the task still running"
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


HOLD_IN_A_PROCESS = """
import asyncio, sys
import nats
from shared.infrastructure import leases

async def main():
    nc = await nats.connect(sys.argv[1])
    lease = leases.Lease(await nc.jetstream().key_value(sys.argv[2]), "crashy", "doomed")
    assert await lease.hold()
    print("held", flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


async def test_a_lease_whose_holder_process_died_is_taken_over_at_once(bus, nats_server):
    """The holder, another process here, is SIGKILLed: the next contender takes the key
    on its first try instead of waiting out the key's time to live. A live holder in
    another process is never taken over."""
    nc, topology = bus
    kv = await nc.jetstream().key_value(topology.leases_bucket)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_IN_A_PROCESS, nats_server.url, topology.leases_bucket],
        cwd=support.ROOT, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        contender = leases.Lease(kv, "crashy", "next")
        assert not await contender.hold()  # alive: it keeps it
        holder.kill()
        holder.wait(10)
        assert await contender.hold()  # dead: taken over, not waited out
        assert (await kv.get("crashy")).revision == contender.revision
        assert not await leases.Lease(kv, "crashy", "third").hold()  # and it is the new holder's
    finally:
        holder.kill()


def test_only_a_process_of_this_pid_namespace_is_judged():
    me = leases.Holder("me", "boot/1", 10, 500)
    assert not leases.gone(me, "boot/1", lambda pid: 500)  # alive
    assert leases.gone(me, "boot/1", lambda pid: None)  # no such process
    assert leases.gone(me, "boot/1", lambda pid: 900)  # the pid was reused
    assert not leases.gone(me, "boot/2", lambda pid: None)  # another namespace: wait it out
    assert not leases.gone(me, "other-boot/1", lambda pid: None)  # another machine

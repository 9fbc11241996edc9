"""The proxy fleet with real parts: proxy-scaler, pool-manager and scheduler in-process over
a real nats-server, real sandboxes with proxy-only egress, real `sbx-proxy` processes.
0 → 1 proxy with the first sandbox, about one per N, a killed proxy's sandboxes moved
and served again, back to 0 when no sandbox runs."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from services.pool_manager import app as pool_app
from services.proxy_scaler import app as scaler_app
from services.scheduler import app as scheduler_app
from shared.contract import commands, ids, subjects
from shared.domain import projections
from shared.infrastructure import eventstore, projector
from shared.infrastructure.settings import lifecycle
from shared.infrastructure.settings import proxies as proxies_settings
from shared.infrastructure.settings import runtime as runtime_settings
from shared.runtime.local import network, proxies
from shared.runtime.local import runtime as local
from tests import support

pytestmark = [
    pytest.mark.needs_root("veth pairs and nftables need root"),
    pytest.mark.skipif(network.Network().unavailable() is not None, reason="ip/nft missing"),
    pytest.mark.skipif(
        not proxies_settings.DEFAULT_PROXY_BIN.exists(), reason="proxy/.venv missing: run scripts/setup"
    ),
    pytest.mark.slow,
]
RUNTIME = runtime_settings.RuntimeSettings(memory_bytes=256 * 1024**2, egress="proxy")
LIFECYCLE = lifecycle.LifecycleSettings(pool_min_idle=0, max_running=20)
FLEET = proxies_settings.ProxySettings(sandboxes_per_proxy=2, drain=0.5, keep_warm=0)


@pytest.fixture
async def fleet(nats_server, namespace, tmp_path):
    state = tmp_path / "state"
    setups = [  # the scaler first: it creates the CA that sandboxes trust from their start
        ("proxy-scaler", scaler_app.make_setup(RUNTIME, FLEET)),
        ("scheduler", scheduler_app.make_setup(LIFECYCLE)),
        ("pool-manager", pool_app.make_setup(RUNTIME, LIFECYCLE)),
    ]
    running = [
        await support.start_in_process(nats_server.url, namespace, name, setup, state_dir=state)
        for name, setup in setups
    ]
    nc, topology = await support.connect(nats_server.url, namespace)
    js = nc.jetstream()
    store = eventstore.EventStore(js, topology)
    rt = local.LocalRuntime(state, egress="proxy")
    world = {
        "nc": nc,
        "topology": topology,
        "rt": rt,
        "proxies": await projector.ProjectionStore.open(js, projections.PROXIES, store),
        "sandboxes": await projector.ProjectionStore.open(js, projections.SANDBOXES, store),
        "local": proxies.LocalProxies(state, rt, binary=FLEET.binary),
    }
    yield world
    for r in reversed(running):
        await r.stop()
    await nc.close()
    for info in await rt.list():
        await rt.delete(info.sandbox_id)
    await world["local"].stop_all()


async def ensure(world, session: str) -> str:
    reply = await support.send(
        world["nc"],
        world["topology"],
        commands.EnsureSession(command_id=ids.new_id(), session_id=session),
        timeout=60,
    )
    assert reply.ok, reply.error
    return reply.session.sandbox_id


async def delete(world, session: str) -> None:
    reply = await support.send(
        world["nc"],
        world["topology"],
        commands.DeleteSession(command_id=ids.new_id(), session_id=session),
        timeout=60,
    )
    assert reply.ok, reply.error


async def live_proxies(world) -> list:
    return [p for p in (await world["proxies"].all()).values() if p.status == "running"]


async def probe(world, sandbox: str) -> str:
    """Through whatever proxy the sandbox is routed to: 502 is the proxy refusing a
    loopback target, i.e. a live proxy answered."""
    _, out, _ = await world["rt"].run(
        sandbox,
        ["sh", "-c", "curl -sS -o /dev/null -w '%{http_code}' --max-time 10 http://127.0.0.2:9/"],
        timeout=30,
    )
    return out.decode()


async def eventually(check, timeout: float = 30.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        result = await check()
        if result:
            return result
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.1)


async def test_the_fleet_follows_the_sandboxes(fleet):
    await asyncio.sleep(1.5)
    assert await live_proxies(fleet) == [] and fleet["local"].records() == [], "no sandbox, no proxy"

    first = await ensure(fleet, "f1")
    state = await fleet["sandboxes"].get(first)
    assert state.proxy_id is not None, "handed out only once it had a proxy"
    assert [p.proxy_id for p in await live_proxies(fleet)] == [state.proxy_id]
    assert await probe(fleet, first) == "502"

    others = [await ensure(fleet, f"f{n}") for n in (2, 3)]
    await eventually(lambda: _count(live_proxies(fleet), 2))  # ceil(3 / 2)
    states = [await fleet["sandboxes"].get(s) for s in (first, *others)]
    assert all(s.proxy_id for s in states)
    assert len({s.proxy_id for s in states}) == 2, "spread over both proxies"
    for sandbox in (first, *others):
        assert await probe(fleet, sandbox) == "502"

    victim = (await fleet["sandboxes"].get(first)).proxy_id
    record = next(r for r in fleet["local"].records() if r.proxy_id == victim)
    os.killpg(record.pid, signal.SIGKILL)

    async def moved():
        s = await fleet["sandboxes"].get(first)
        return s.proxy_id not in (None, victim) and s

    await eventually(moved)
    assert await probe(fleet, first) == "502", "served again by another proxy"
    now_on = (await fleet["sandboxes"].get(first)).proxy_id
    port = next(r.port for r in fleet["local"].records() if r.proxy_id == now_on)

    async def routed():
        return (await fleet["rt"].network.routes()).get(fleet["rt"].egress_link(first)) == port

    await eventually(routed)  # the route itself follows the assignment
    history = [e.event for e in await support.stream_events(fleet["nc"], fleet["topology"], subjects.PROXY)]
    assert any(getattr(e, "reason", None) == "died" and e.proxy_id == victim for e in history)
    assigned = [
        e.event for e in await support.stream_events(fleet["nc"], fleet["topology"], subjects.SANDBOX)
        if e.event.__struct_config__.tag == "sandbox.proxy_assigned" and e.event.sandbox_id == first
    ]  # fmt: skip
    assert [a.reason for a in assigned] == ["new", "reassigned"]

    for session in ("f1", "f2", "f3"):
        await delete(fleet, session)
    await eventually(lambda: _none(live_proxies(fleet)))
    await eventually(lambda: _empty_records(fleet))
    import subprocess

    confdir = str(fleet["rt"].state_dir / "proxy" / "ca")
    leftovers = subprocess.run(["pgrep", "-f", f"confdir={confdir}"], capture_output=True, text=True).stdout
    assert leftovers.strip() == "", "no proxy process is left behind"
    drained = [e.event for e in await support.stream_events(fleet["nc"], fleet["topology"], subjects.PROXY)]
    assert {getattr(e, "reason", None) for e in drained if e.__struct_config__.tag == "proxy.stopped"} >= {
        "drained"
    }


@pytest.mark.serial  # deletes the host's NAT table: every other sandbox's routes with it
async def test_routes_lost_to_an_nftables_reset_come_back_for_every_sandbox(fleet):
    """Someone deletes the host's NAT table (an nftables reload, `nft flush ruleset`) while
    a new sandbox is being assigned: the scaler's round that routes it fails or finds the
    map gone. Every sandbox, the ones routed long before included, is routed again and
    reaches its proxy; nothing is left believing an old route."""
    import subprocess

    first = [await ensure(fleet, f"r{n}") for n in (1, 2)]
    for sandbox in first:
        assert await probe(fleet, sandbox) == "502"
    await asyncio.sleep(2.5)  # routes listed again since: the first two are verified
    subprocess.run(["nft", "delete", "table", "inet", network.NAT_TABLE], check=True)
    late = await ensure(fleet, "r3")  # its round runs against the missing map
    everyone = [*first, late]

    async def all_routed() -> bool:
        routes = await fleet["rt"].network.routes()
        records = {r.proxy_id: r.port for r in fleet["local"].records()}
        for sandbox in everyone:
            state = await fleet["sandboxes"].get(sandbox)
            if state.proxy_id is None or routes.get(fleet["rt"].egress_link(sandbox)) != records.get(
                state.proxy_id
            ):
                return False
        return True

    await eventually(all_routed)
    for sandbox in everyone:
        assert await probe(fleet, sandbox) == "502", "reaches its proxy again"
    for session in ("r1", "r2", "r3"):
        await delete(fleet, session)


async def _count(coro, n: int) -> bool:
    return len(await coro) == n


async def _none(coro) -> bool:
    return not await coro


async def _empty_records(world) -> bool:
    return not [r for r in world["local"].records() if world["local"].alive(r)]


async def test_two_stacks_starting_proxies_at_once_never_share_a_port(tmp_path):
    """Stacks on one host share the proxy address: each start holds the host's ports lock
    from choosing a free port until its proxy listens, so stacks starting proxies at the
    same moment get different ports and every proxy stays up (without the lock both
    picked the lowest free port, and one stack took the other's proxy for its own)."""
    fleets = []
    for name in ("one", "two"):
        state = tmp_path / name
        rt = local.LocalRuntime(state, egress="proxy")
        fleet = proxies.LocalProxies(state, rt, binary=FLEET.binary)
        await fleet.ensure_ca()
        fleets.append(fleet)
    try:
        started = await asyncio.gather(
            *(fleet.start(f"px-{n}{i}") for n, fleet in enumerate(fleets) for i in range(2))
        )
        ports = [record.port for record in started]
        assert len(set(ports)) == len(ports), ports
        await asyncio.sleep(1.0)  # (a proxy whose port was taken exits at once)
        for fleet in fleets:
            assert all(fleet.alive(record) for record in fleet.records()), fleet.records()
    finally:
        for fleet in fleets:
            await fleet.stop_all()

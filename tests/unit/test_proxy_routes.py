"""The proxy-scaler's routing step (services.proxy_scaler.handlers.Scaler._route) against
a fake of the local fleet's routing: an nftables map of interface index -> proxy port
that can be wiped (an nftables reload), with the same contract as
``LocalProxies.route_many`` (routing fails while the map is gone; a retry lists it
again). The real thing runs in tests/integration/test_proxy_fleet.py; this pins the
interleaving that is hard to hit there: a reset landing between two listings, while a
new sandbox is routed."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

import pytest

from sbx_api import errors
from services.proxy_scaler import handlers
from shared.contract import states

T0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


@dataclass(frozen=True)
class Record:
    proxy_id: str
    port: int


class FakeFleet:
    def __init__(self, links: dict[str, int]) -> None:
        self.links = links  # sandbox id -> host-side interface index
        self.generation = 0  # nftables' generation: any change to the ruleset moves it
        self.map: dict[int, int] | None = {}  # None: the table is gone
        self.routed_calls: list[set[str]] = []
        self.listings = 0

    @property
    def map(self) -> dict[int, int] | None:
        return self._map

    @map.setter
    def map(self, value: dict[int, int] | None) -> None:
        self._map = value
        self.generation += 1

    async def ensure_network(self) -> None:
        if self.map is None:
            self.map = {}  # the table comes back empty

    async def routes(self) -> dict[int, int]:
        self.listings += 1
        return dict(self.map or {})

    def routes_generation(self) -> int | None:
        return self.generation

    async def prune_routes(self, routes: dict[int, int]) -> int:
        return 0

    def routed_port(self, sandbox_id: str, routes: dict[int, int]) -> int | None:
        return routes.get(self.links[sandbox_id])

    async def route_many(self, wanted: dict, current: dict[int, int]) -> tuple[set[str], bool]:
        self.routed_calls.append(set(wanted))
        for attempt in range(2):
            if attempt:
                current.clear()
                current.update(await self.routes())
            if self.map is not None:
                entries = {self.links[sid]: record.port for sid, record in wanted.items()}
                self.map.update(entries)
                self.generation += 1
                current.update(entries)
                return set(wanted), attempt > 0
        raise errors.InfrastructureError("cannot route sandboxes to their proxies: no such table")


def running(sandbox_id: str, seq: int = 1) -> states.SandboxState:
    return states.SandboxState(
        sandbox_id=sandbox_id,
        status="running",
        proxy_id="px-1",
        created_at=T0,
        updated_at=T0,
        last_seq=seq,
    )


def scaler(fleet: FakeFleet) -> handlers.Scaler:
    return handlers.Scaler(
        None,
        fleet,
        None,
        None,
        per_proxy=100,
        drain_grace=30.0,
        backend="local",  # type: ignore[arg-type]
    )


RECORDS = {"px-1": Record("px-1", 3130)}


@pytest.fixture
async def verified(monkeypatch):
    """A scaler that routed a and b, then verified both against a fresh listing; the
    clock is the test's to move."""
    fleet = FakeFleet({"sb-a": 1, "sb-b": 2, "sb-c": 3})
    scale = scaler(fleet)
    clock = [1000.0]
    monkeypatch.setattr(handlers.time, "monotonic", lambda: clock[0])
    a, b = running("sb-a"), running("sb-b")
    assert await scale._route([a, b], RECORDS, {"sb-a": "px-1", "sb-b": "px-1"}) == {"sb-a", "sb-b"}
    clock[0] += handlers.ROUTES_EVERY
    assert await scale._route([a, b], RECORDS, {}) == set()
    assert fleet.routed_calls == [{"sb-a", "sb-b"}], "verified: nothing routed again"
    return fleet, scale, clock, a, b


async def test_a_reset_during_a_routing_round_leaves_no_sandbox_believed_routed(verified):
    fleet, scale, clock, a, b = verified
    records = RECORDS

    # The table is wiped just after that listing; c's assignment is routed within the
    # same ROUTES_EVERY, so against the remembered map: it fails.
    fleet.map = None
    c = running("sb-c")
    with pytest.raises(errors.InfrastructureError):
        await scale._route([a, b, c], records, {"sb-c": "px-1"})

    # The next round lists the map again (the table is back, empty) and routes everyone.
    clock[0] += 0.1
    routed = await scale._route([a, b, c], records, {"sb-c": "px-1"})
    assert routed == {"sb-a", "sb-b", "sb-c"}
    assert fleet.map == {1: 3130, 2: 3130, 3: 3130}


async def test_a_map_found_different_on_a_retry_makes_every_route_checked_again(verified):
    """route_many's first try fails on a stale copy of the map, the retry lists it and
    succeeds: the scaler's other beliefs came from the stale copy, so the next round
    checks every route (here b's entry vanished with the reset that staled the copy)."""
    fleet, scale, clock, a, b = verified
    records = RECORDS

    original = fleet.route_many

    async def stale_first(wanted: dict, current: dict[int, int]) -> tuple[set[str], bool]:
        fleet.map = {}  # wiped and recreated between the listing and this round
        fleet.route_many = original  # type: ignore[method-assign]
        fleet.routed_calls.append(set(wanted))
        current.clear()
        current.update(await fleet.routes())
        entries = {fleet.links[sid]: record.port for sid, record in wanted.items()}
        fleet.map.update(entries)
        current.update(entries)
        return set(wanted), True

    fleet.route_many = stale_first  # type: ignore[method-assign]
    c = running("sb-c")
    assert await scale._route([a, b, c], records, {"sb-c": "px-1"}) == {"sb-c"}
    clock[0] += 0.1
    assert await scale._route([a, b, c], records, {}) == {"sb-a", "sb-b"}
    assert fleet.map == {1: 3130, 2: 3130, 3: 3130}


async def test_an_idle_fleet_lists_the_map_only_when_something_changed(verified):
    """Rounds come every half second: the map is listed again (an nft process, every
    entry read) only when nftables' generation moved or sandboxes changed, and at least
    every ROUTES_AT_LEAST; otherwise the remembered map serves."""
    fleet, scale, clock, a, b = verified
    listed = fleet.listings
    for _ in range(20):  # ten seconds of rounds, nothing changing
        clock[0] += handlers.ROUTES_EVERY / 4
        assert await scale._route([a, b], RECORDS, {}) == set()
    assert fleet.listings == listed

    fleet.map = {}  # another hand changes the ruleset (a reset): listed, and both routed again
    clock[0] += handlers.ROUTES_EVERY
    assert await scale._route([a, b], RECORDS, {}) == {"sb-a", "sb-b"}
    assert fleet.listings == listed + 1

    listed = fleet.listings
    clock[0] += handlers.ROUTES_EVERY
    await scale._route([a, b], RECORDS, {})  # (our own routing moved the generation)
    assert fleet.listings == listed + 1
    clock[0] += handlers.ROUTES_EVERY
    await scale._route([a, b], RECORDS, {})
    assert fleet.listings == listed + 1  # settled

    scale.changes += 1  # a sandbox stopped: its entry is pruned at the next listing
    clock[0] += handlers.ROUTES_EVERY
    await scale._route([a], RECORDS, {})
    assert fleet.listings == listed + 2

    clock[0] += handlers.ROUTES_AT_LEAST
    await scale._route([a], RECORDS, {})
    assert fleet.listings == listed + 3  # the safety net

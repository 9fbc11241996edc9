"""Egress records from every proxy into the audit stream (the lease holder's job).

Each proxy keeps a record of every sandbox connection until it is collected
(``proxy/sbx_proxy/records.py``). The scaler, which knows the fleet and holds the NATS
credentials the proxies never get, follows each live proxy over its private unix socket
with one held request at a time (``GET /egress?ack=N&wait=WAIT``: the proxy answers as
soon as a connection is recorded, or after WAIT seconds with nothing), turns each batch
into ``egress.recorded`` events on the sessions' subjects (``shared/domain/egress.py``),
and acknowledges it on the next request once they are stored. An idle fleet costs one
request per proxy every WAIT seconds, not one every half second. A batch read twice (this service restarted
between storing and acknowledging) is stored once: event ids are derived from it.

Which sandbox a connection came from is its address on the proxy link: read from the
runtime for every routed sandbox whose record changed since the last read, and kept
after the sandbox stops (its last connections are collected a moment later) until
another sandbox holds the address. (A connection of a stopped sandbox collected after
its address went to a new one is counted as the new one's: slots are spread over
16,000 addresses by sandbox id, so this needs a slot reused within half a second.)
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import msgspec
import structlog

from services.proxy_scaler import fleetmetrics
from shared.contract import events, states, subjects
from shared.domain import egress
from shared.domain import sandbox as sandbox_rules
from shared.infrastructure import projector, service

log = structlog.get_logger(__name__)
INTERVAL = 0.5
"""Between two requests to a proxy that answers at once with nothing (an older proxy that
does not hold requests), and between two rounds."""
WAIT = 20
"""Seconds a proxy holds a request while it has nothing to hand out."""
FOLLOW_FOR = 60.0
"""Seconds one round follows the fleet (the lease is renewed during it, and the round is
cancelled if it is lost)."""
REFRESH = 2.0
"""How often a round looks for proxies started or gone."""
LEASE_KEY = "proxy-scaler-egress"


@dataclass
class Report:
    proxies: int = 0
    connections: int = 0
    events: int = 0
    failed: int = 0


class Collector:
    def __init__(
        self,
        ctx: service.Context,
        fleet: Any,
        sandboxes: projector.ProjectionStore[states.SandboxState],
    ) -> None:
        self.ctx, self.fleet, self.sandboxes = ctx, fleet, sandboxes
        self.acked: dict[str, int] = {}
        """Per proxy: the last batch whose events are stored (sent as ``ack`` next time)."""
        self.owners: dict[str, egress.Owner] = {}
        """Sandbox address -> the sandbox that last held it."""
        self._read: dict[str, int] = {}
        """Sandbox id -> its record's ``last_seq`` when its address was read."""

    async def round(self) -> Report:
        """Follow every live proxy (a task each) for FOLLOW_FOR seconds."""
        report = Report()
        loop = asyncio.get_running_loop()
        end = loop.time() + FOLLOW_FOR
        following: dict[str, asyncio.Task[None]] = {}
        try:
            while loop.time() < end:
                records = {r.proxy_id: r for r in self.fleet.records() if self.fleet.alive(r)}
                self.acked = {p: n for p, n in self.acked.items() if p in records}
                for proxy_id, record in records.items():
                    task = following.get(proxy_id)
                    if task is None or task.done():
                        following[proxy_id] = asyncio.create_task(self._follow(record, report, end))
                report.proxies = len(records)
                await asyncio.sleep(min(REFRESH, max(0.0, end - loop.time())))
            await asyncio.gather(*following.values())
        finally:
            for task in following.values():
                task.cancel()
            await asyncio.gather(*following.values(), return_exceptions=True)
        return report

    async def _follow(self, record: Any, report: Report, end: float) -> None:
        """One proxy's batches until ``end``; a failure ends it (the round starts it again
        within REFRESH if the proxy is still alive; it keeps its records meanwhile)."""
        loop = asyncio.get_running_loop()
        while (left := end - loop.time()) > 0:
            asked = loop.time()
            wait = int(min(WAIT, left))
            try:
                got = await self._collect(record, report, wait)
            except FileNotFoundError:
                report.failed += 1  # a proxy starting: its socket comes once it serves
                return
            except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
                report.failed += 1
                log.warning("egress.collect_failed", proxy=record.proxy_id, error=str(exc)[:200])
                return
            if not got and wait and loop.time() - asked < wait / 2:
                await asyncio.sleep(INTERVAL)  # it did not hold the request (an older proxy)

    async def _collect(self, record: Any, report: Report, wait: int = 0) -> bool:
        """One batch from the proxy (held up to ``wait`` seconds while it has none): stored,
        and acknowledged by the next request. Whether it held anything."""
        target = f"/egress?ack={self.acked.get(record.proxy_id, 0)}&wait={wait}"
        socket = self.fleet.metrics_socket(record)
        data = await fleetmetrics.aget(socket, target, timeout=wait + fleetmetrics.TIMEOUT)
        batch = egress.decode_batch(data)
        if batch.records or batch.lost:
            await self._learn()  # (reads only sandboxes that changed: a new one may hold an old address)
            for event in egress.recorded(record.proxy_id, batch, self._owner, self._meta):
                subject = self.ctx.topology.aggregate_subject(subjects.EGRESS, event.aggregate_id)
                await self.ctx.store.record(subject, event)
                report.events += 1
            report.connections += sum(r.connections for r in batch.records)
        self.acked[record.proxy_id] = batch.batch
        return bool(batch.records or batch.lost)

    def _owner(self, peer: str | None) -> egress.Owner | None:
        return None if peer is None else self.owners.get(peer)

    def _meta(self, event_id: str, owner: egress.Owner | None) -> events.Meta:
        meta = self.ctx.meta(session_id=owner.session_id if owner else None)
        return msgspec.structs.replace(meta, event_id=event_id)

    async def _learn(self) -> None:
        """Read the address of every routed sandbox whose record changed since."""
        routed = [s for s in (await self.sandboxes.all()).values() if s.status in sandbox_rules.ROUTED]
        self._read = {s.sandbox_id: n for s in routed if (n := self._read.get(s.sandbox_id)) is not None}
        for sandbox in routed:
            if self._read.get(sandbox.sandbox_id) == sandbox.last_seq:
                continue
            address = await asyncio.to_thread(self.fleet.peer_address, sandbox.sandbox_id)
            if address is None:
                continue
            self._read[sandbox.sandbox_id] = sandbox.last_seq
            self.owners[address] = egress.Owner(sandbox.sandbox_id, sandbox.session_id)

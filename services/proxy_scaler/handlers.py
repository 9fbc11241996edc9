"""One scaling round: read state, plan (logic.py), then record events and apply them.

Every change is an event first where something could be left behind (``proxy.started``
is recorded once the proxy listens; a crash before that leaves a process with a record
file but no event, which the next round adopts or stops), and the fleet's own records
(pid files, the routing map) are reconciled with the events every round, so a crash
anywhere converges on the next one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import structlog

from sbx_api import errors
from services.proxy_scaler import logic
from shared.contract import events, ids, states
from shared.domain import proxy as proxy_rules
from shared.domain import sandbox as sandbox_rules
from shared.infrastructure import aggregates, projector, service

log = structlog.get_logger(__name__)
ROUTES_EVERY = 2.0
"""The routing map is listed at most this often, and only when nftables' generation
changed (a route added or pruned, a reset) or sandboxes changed (a stopped one's entry to
prune) since the last listing: an idle fleet lists it only every ROUTES_AT_LEAST."""
ROUTES_AT_LEAST = 60.0
START_RETRY = 10.0
"""After a proxy failed to start, full proxies take new sandboxes for this long."""
PLAN_EVERY = 30.0
"""A round plans over every sandbox at least this often even when nothing was heard to
change (a safety net: rounds in between that hear of no change skip the planning)."""


@dataclass
class Report:
    started: int = 0
    stopped: int = 0
    died: int = 0
    assigned: int = 0
    rerouted: int = 0
    serving: int = 0
    """Proxies serving at the end of the round."""
    planned: bool = True
    """False: nothing had changed, the round skipped planning over every sandbox."""
    notes: list[str] = field(default_factory=list)


class Scaler:
    def __init__(
        self,
        ctx: service.Context,
        fleet,
        sandboxes: projector.ProjectionStore[states.SandboxState],
        proxies: projector.ProjectionStore[states.ProxyState],
        *,
        per_proxy: int,
        drain_grace: float,
        backend: str,
        keep_warm: float = 0.0,
    ) -> None:
        self.ctx, self.fleet = ctx, fleet
        self.sandboxes, self.proxies = sandboxes, proxies
        self.per_proxy, self.drain_grace, self.backend = per_proxy, drain_grace, backend
        self.keep_warm = keep_warm
        self._route_cache: dict[int, int] = {}
        self._verified: dict[str, tuple[int, int]] = {}
        """Sandboxes whose route matched the listed map: id -> (record's last_seq, port).
        Checking a route reads the sandbox's files, so a round checks only sandboxes
        that changed since, and all of them when the listed map is not what this scaler
        last knew (an nftables reset, entries pruned)."""
        self._start_failed_at = -START_RETRY
        self._routes_at = 0.0
        self._routes_seen: tuple[int | None, int] | None = None
        """(nftables' generation, ``changes``) at the last listing."""
        self.room = 0
        """Sandboxes the serving proxies could still take after the last round, less the
        requests heard since (``app``'s wake-up rule counts them down)."""
        self.last_active: datetime | None = None
        """When a sandbox was last wanted (the scaler's start counts): one proxy stays up
        for ``keep_warm`` after it, then the fleet goes to zero."""
        self.changes = 0
        """Changes heard to the sandboxes and proxies (``app`` counts them as the followed
        copies hear them)."""
        self._settled: tuple | None = None
        """What a round that had nothing to do started from (changes heard, the proxies'
        records and liveness, keep-one and can-start): a round starting from the same
        skips the planning over every sandbox, so an idle fleet costs no work per sandbox."""
        self._holding = False
        self._planned_at = 0.0

    async def _proxy_event(self, proxy_id: str, event: events.Event) -> bool:
        outcome = await aggregates.transact(
            self.proxies, proxy_id, lambda state: proxy_rules.decide(state, event)
        )
        return bool(outcome.appended)

    async def round(self, now: datetime) -> Report:
        report = Report()
        changes = self.changes
        records = {r.proxy_id: r for r in self.fleet.records()}
        proxies = [p for p in (await self.proxies.all()).values() if p.status != "stopped"]
        await self._stop_unrecorded(records, {p.proxy_id for p in proxies}, report)
        alive = {pid for pid, r in records.items() if self.fleet.alive(r)}
        if self._holding:  # (as the last plan saw them: nothing was heard to change since)
            self.last_active = now
        can_start = time.monotonic() - self._start_failed_at > START_RETRY
        ports = {r.port for r in records.values()}
        if await self._unchanged(self._inputs(changes, records, alive, now, can_start), proxies, ports):
            report.serving, report.planned = len(alive), False
            return report
        sandboxes = list((await self.sandboxes.all()).values())
        self._holding = any(s.status in sandbox_rules.HOLDING for s in sandboxes)
        if self.last_active is None or self._holding:
            self.last_active = now
        plan = logic.plan(
            sandboxes,
            proxies,
            alive,
            per_proxy=self.per_proxy,
            drain_grace=self.drain_grace,
            now=now,
            keep_one=self._keep_one(now),
            can_start=can_start,
        )
        self._planned_at = time.monotonic()
        meta = self.ctx.meta
        for proxy_id in plan.died:
            await self._proxy_event(
                proxy_id, events.ProxyStopped(meta=meta(), proxy_id=proxy_id, reason="died")
            )
            if proxy_id in records:
                self.fleet.forget(records[proxy_id])
            report.died += 1
        await self._start(plan.start, records, report)
        for proxy_id in plan.drain:
            await self._proxy_event(proxy_id, events.ProxyDraining(meta=meta(), proxy_id=proxy_id))
        for proxy_id in plan.stop:
            if proxy_id in records:
                await self.fleet.stop(records.pop(proxy_id))
            await self._proxy_event(
                proxy_id, events.ProxyStopped(meta=meta(), proxy_id=proxy_id, reason="drained")
            )
            report.stopped += 1
        # Routes first (one transaction for the round), then the events that record them.
        routed = await self._route(sandboxes, records, plan.assign)
        seen_on = {s.sandbox_id: s.proxy_id for s in sandboxes}
        for sandbox_id, proxy_id in plan.assign.items():
            if sandbox_id in routed and await self._record_assignment(
                sandbox_id, proxy_id, seen_on.get(sandbox_id)
            ):
                report.assigned += 1
        report.rerouted = len(routed - set(plan.assign))
        report.serving = sum(1 for r in records.values() if self.fleet.alive(r))
        self.room = plan.room
        busy = plan.died or plan.start or plan.drain or plan.stop or plan.assign or routed or report.notes
        self._settled = None if busy else self._inputs(changes, records, alive, now, can_start)
        return report

    def _inputs(self, changes: int, records: dict, alive: set[str], now: datetime, can_start: bool) -> tuple:
        """What a plan depends on besides the sandboxes and proxies (counted in ``changes``)."""
        return (changes, frozenset(records), frozenset(alive), self._keep_one(now), can_start)

    async def _stop_unrecorded(self, records: dict[str, Any], known: set[str], report: Report) -> None:
        """Stop processes without a running record: not ours to keep."""
        for proxy_id, record in records.items():
            if proxy_id not in known:
                await self.fleet.stop(record)
                report.notes.append(f"stopped unrecorded {proxy_id}")

    def _keep_one(self, now: datetime) -> bool:
        return self.last_active is not None and (now - self.last_active).total_seconds() < self.keep_warm

    async def _unchanged(self, inputs: tuple, proxies: list[states.ProxyState], ports: set[int]) -> bool:
        """Whether this round may skip planning: it starts from what the last one, which
        had nothing to do, started from; no proxy drains (a deadline to keep); the routing
        map's entries to this fleet's ``ports``, when listed again (every ROUTES_EVERY),
        are what this scaler knew (other stacks on the host route their own sandboxes in
        the same map); and the last plan is less than PLAN_EVERY old."""
        if inputs != self._settled or any(p.status == "draining" for p in proxies):
            return False
        if time.monotonic() - self._planned_at >= PLAN_EVERY:
            return False
        known = {link: port for link, port in self._route_cache.items() if port in ports}
        try:
            listed = await self._routes()
        except errors.SandboxError:
            return False
        return {link: port for link, port in listed.items() if port in ports} == known

    async def _start(self, count: int, records: dict[str, Any], report: Report) -> None:
        """Start ``count`` proxies (recorded as they come up); a failure stops this round's
        starts and holds the next ones back for ``START_RETRY``."""
        for _ in range(count):
            proxy_id = "px-" + ids.new_id()[:12]
            try:
                record = await self.fleet.start(proxy_id)
            except errors.SandboxError as exc:
                self._start_failed_at = time.monotonic()
                log.error("proxy.start_failed", error=exc.message)
                report.notes.append(f"start failed: {exc.message[:200]}")
                return
            await self._proxy_event(
                proxy_id,
                events.ProxyStarted(
                    meta=self.ctx.meta(), proxy_id=proxy_id, backend=self.backend, endpoint=record.endpoint
                ),
            )
            records[proxy_id] = record
            report.started += 1

    async def _route(
        self,
        sandboxes: list[states.SandboxState],
        records: dict,
        assign: dict[str, str],
    ) -> set[str]:
        """Route the new assignments and every assigned sandbox whose route is missing or
        wrong, in one nftables transaction; the ids routed. A failure, or a map that was
        not what this scaler knew, makes the next round list it again and check every
        route (an nftables reset must not leave sandboxes believed routed)."""
        wanted = {sid: records[pid] for sid, pid in assign.items() if pid in records}
        routes = await self._routes()
        wanted |= self._stale_routes(sandboxes, records, routes, exclude=set(wanted))
        if not wanted:
            return set()
        try:
            routed, relisted = await self.fleet.route_many(wanted, routes)
        except errors.SandboxError:
            self._routes_at = 0.0
            self._verified.clear()
            raise
        if relisted:
            self._verified.clear()
        return routed

    async def _record_assignment(self, sandbox_id: str, proxy_id: str, moving_from: str | None) -> bool:
        def decide(state: states.SandboxState | None) -> list[events.Event]:
            return sandbox_rules.decide_proxy_assigned(
                state,
                sandbox_id,
                proxy_id,
                lambda session_id: self.ctx.meta(session_id=session_id),
                moving_from=moving_from,
            )

        outcome = await aggregates.transact(self.sandboxes, sandbox_id, decide)
        return bool(outcome.appended)

    async def _routes(self) -> dict[int, int]:
        """The routing map, listed at most every ROUTES_EVERY seconds and only when
        something changed (listing spawns nft and reads every entry; rounds can come
        several a second), and kept up to date with what this scaler routes in between."""
        since = time.monotonic() - self._routes_at
        if since < ROUTES_EVERY:
            return self._route_cache
        seen = (self.fleet.routes_generation(), self.changes)
        if since < ROUTES_AT_LEAST and seen[0] is not None and seen == self._routes_seen:
            return self._route_cache  # nothing changed: an idle fleet costs no listing
        await self.fleet.ensure_network()  # an nftables reset is repaired here
        listed = await self.fleet.routes()
        await self.fleet.prune_routes(listed)  # entries of sandboxes that stopped
        if listed != self._route_cache:  # changed behind our back: check every route again
            self._verified.clear()
        self._route_cache = listed
        self._routes_at = time.monotonic()
        self._routes_seen = seen
        return self._route_cache

    def _stale_routes(
        self,
        sandboxes: list[states.SandboxState],
        records: dict,
        routes: dict[int, int],
        exclude: set[str],
    ) -> dict:
        """Assigned sandboxes whose route is missing or wrong (a resumed sandbox has a new
        address; an nftables reset empties the map): to be routed again this round."""
        stale = {}
        verified = {}
        for sandbox in sandboxes:
            record = records.get(sandbox.proxy_id) if sandbox.status in sandbox_rules.ROUTED else None
            if record is None or sandbox.sandbox_id in exclude:
                continue
            seen = (sandbox.last_seq, record.port)
            if self._verified.get(sandbox.sandbox_id) != seen:
                if self.fleet.routed_port(sandbox.sandbox_id, routes) != record.port:
                    stale[sandbox.sandbox_id] = record
                    continue
            verified[sandbox.sandbox_id] = seen
        self._verified = verified  # sandboxes gone or stopped drop out
        return stale


class ReplicaScaler(Scaler):
    """The round for a fleet the platform runs behind one address (Kubernetes: the proxy
    Deployment, sized through its scale subresource). Proxies are recorded as they start
    serving and stop; sandboxes are not assigned, the Service balances them."""

    async def round(self, now: datetime) -> Report:
        report = Report()
        sandboxes = list((await self.sandboxes.all()).values())
        if self.last_active is None or any(s.status in sandbox_rules.HOLDING for s in sandboxes):
            self.last_active = now
        proxies = list((await self.proxies.all()).values())
        serving = await self.fleet.ready()
        plan = logic.replica_plan(
            sandboxes,
            proxies,
            serving,
            per_proxy=self.per_proxy,
            keep_one=(now - self.last_active).total_seconds() < self.keep_warm,
        )
        current = await self.fleet.replicas()
        if current != plan.replicas:
            await self.fleet.scale(plan.replicas)
            report.notes.append(f"scaled {current} -> {plan.replicas}")
        meta = self.ctx.meta
        for proxy_id, endpoint in plan.started.items():
            started = events.ProxyStarted(
                meta=meta(), proxy_id=proxy_id, backend=self.backend, endpoint=endpoint
            )
            report.started += await self._proxy_event(proxy_id, started)
        for proxy_id, reason in plan.stopped.items():
            stopped = events.ProxyStopped(meta=meta(), proxy_id=proxy_id, reason=reason)
            if await self._proxy_event(proxy_id, stopped):
                report.died += reason == "died"
                report.stopped += reason != "died"
        report.serving = len(serving)
        self.room = plan.room
        return report

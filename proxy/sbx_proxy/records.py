"""Egress records: one per sandbox connection, kept until the proxy-scaler has them in the
event stream (an :class:`egress.Sink`; no I/O here).

When a connection closes, its :class:`egress.Record` (where it went, the verdict, the
rule, the refusal and why, requests, injections, bytes each way, how long; never a
header, a path or a secret) joins the pending records; one that closed before it said
where it goes (verdict ``empty``: a port probe, a health check) is only counted in the
metrics. The proxy-scaler collects them
over the proxy's private unix socket (``GET /egress?ack=N``, served by ``metrics.serve``)
and appends them to the sessions' subjects as ``egress.recorded`` events: the proxy holds
no NATS credential and needs none.

Delivery is at least once and de-duplicated downstream: a collection cuts the pending
records into a numbered :class:`Batch`, and the same batch is answered again until a
later collection acknowledges its number (the scaler does once its events are stored);
the scaler derives each event's id from the proxy, the batch and the session, so a batch
collected twice (a scaler restarted between storing and acknowledging) is stored once.

Bounded: a sandbox that opens thousands of connections between two collections does not
make thousands of records. Past ``PER_PEER`` records of one sandbox address, further
connections to the same place with the same verdict are folded into one aggregate record
(``connections`` > 1, bytes and requests summed); past ``2 * PER_PEER`` entries of that
address, by verdict alone (no host: "many destinations"), so one sandbox holds at most
about ``2 * PER_PEER`` + a few entries; past ``PENDING_MAX`` entries in all, new
connections are only counted (``lost``, reported with the next batch and on the proxy's
metrics).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sbx_proxy import egress

PER_PEER = 200
"""Records of one sandbox address kept one by one in a batch; the rest are aggregated."""
PENDING_MAX = 20_000
"""Entries (records and aggregates) waiting for collection; beyond, connections are lost."""
BATCH_MAX = 5_000
"""Entries handed over per collection (the rest wait for the next one)."""

Key = tuple[Any, ...]


@dataclass
class Entry:
    """One connection, or an aggregate of several with the same key."""

    peer: str | None
    host: str | None
    port: int | None
    verdict: str
    rule: str | None
    reason: str | None
    detail: str | None
    started: float
    """Wall-clock time the (first) connection opened."""
    seconds: float
    """How long it stayed open (an aggregate: the sum)."""
    requests: int
    injected: int
    refused: int
    upstream_errors: int
    bytes_up: int
    bytes_down: int
    connections: int = 1
    folded: bool = False
    """An aggregate (it takes further connections with its key)."""

    def key(self) -> Key:
        return (self.peer, self.host, self.port, self.verdict, self.rule, self.reason)

    def fold(self, other: Entry) -> None:
        self.connections += other.connections
        self.seconds += other.seconds
        self.started = min(self.started, other.started)
        for name in ("requests", "injected", "refused", "upstream_errors", "bytes_up", "bytes_down"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def wire(self) -> dict[str, Any]:
        return {
            "peer": self.peer,
            "host": self.host,
            "port": self.port,
            "verdict": self.verdict,
            "rule": self.rule,
            "reason": self.reason,
            "detail": self.detail,
            "started": round(self.started, 3),
            "ms": int(self.seconds * 1000),
            "requests": self.requests,
            "injected": self.injected,
            "refused": self.refused,
            "upstream_errors": self.upstream_errors,
            "bytes_up": self.bytes_up,
            "bytes_down": self.bytes_down,
            "connections": self.connections,
        }


def entry_of(record: egress.Record, closed_at: float) -> Entry:
    return Entry(
        peer=record.peer[0] if record.peer else None,
        host=record.host,
        port=record.port,
        verdict=record.verdict.value,
        rule=record.rule,
        reason=record.reason.value if record.reason else None,
        detail=record.detail,
        started=closed_at - record.seconds,
        seconds=record.seconds,
        requests=record.requests,
        injected=record.injected,
        refused=record.refused,
        upstream_errors=record.upstream_errors,
        bytes_up=record.bytes_up,
        bytes_down=record.bytes_down,
    )


@dataclass
class Batch:
    number: int
    entries: list[Entry]
    lost: int = 0
    aggregated: int = 0
    """Connections folded into aggregates (beyond the first of each)."""

    def wire(self) -> dict[str, Any]:
        return {
            "batch": self.number,
            "records": [e.wire() for e in self.entries],
            "lost": self.lost,
            "aggregated": self.aggregated,
        }


@dataclass
class EgressLog:
    """The pending records and the batch handed out (an :class:`egress.Sink`)."""

    wall: Callable[[], float] = time.time
    per_peer: int = PER_PEER
    pending_max: int = PENDING_MAX
    batch_max: int = BATCH_MAX
    pending: list[Entry] = field(default_factory=list)
    _aggregates: dict[Key, Entry] = field(default_factory=dict)
    _per_peer: dict[str | None, int] = field(default_factory=dict)
    _lost: int = 0
    _aggregated: int = 0
    _out: Batch | None = None
    _numbers: int = 0
    recorded: int = 0
    """Connections recorded since start (metrics)."""
    lost_total: int = 0
    listeners: list[Callable[[], object]] = field(default_factory=list)
    """Called after each connection is kept (a collector waiting for records wakes)."""

    # ---- egress.Sink: only the close matters --------------------------------------

    def opened(self, conn: egress.Connection) -> None:
        pass

    def requested(self, conn: egress.Connection, outcome: egress.Outcome, rule: str | None) -> None:
        pass

    def refused(self, conn: egress.Connection, reason: egress.Reason) -> None:
        pass

    def upstream_failed(self, conn: egress.Connection, stage: egress.Stage) -> None:
        pass

    def transferred(self, direction: egress.Direction, count: int) -> None:
        pass

    def closed(self, conn: egress.Connection) -> None:
        record = conn.record()
        if record.verdict is not egress.Verdict.EMPTY:  # port probes, health checks: metrics only
            self.add(entry_of(record, self.wall()))

    # ---- keeping -------------------------------------------------------------------

    def add(self, entry: Entry) -> None:
        """Keep one connection's entry: as it is while its address has had fewer than
        ``per_peer`` entries; else folded by destination (a new aggregate while it has
        fewer than twice that), else by verdict alone (``host`` and ``port`` dropped: a
        sandbox naming thousands of hosts keeps a bounded share of the pending entries,
        so it cannot crowd the others' records out)."""
        self.recorded += 1
        for listener in self.listeners:
            listener()
        seen = self._per_peer.get(entry.peer, 0)
        if seen < self.per_peer and len(self.pending) < self.pending_max:
            self._per_peer[entry.peer] = seen + 1
            self.pending.append(entry)
            return
        key = entry.key()
        if key not in self._aggregates and seen >= 2 * self.per_peer:
            entry.host = entry.port = entry.detail = None  # "many destinations"
            key = entry.key()
        aggregate = self._aggregates.get(key)
        if aggregate is not None:
            aggregate.fold(entry)
            self._aggregated += 1
        elif len(self.pending) < self.pending_max:
            entry.folded = True
            self._aggregates[key] = entry
            self._per_peer[entry.peer] = seen + 1
            self.pending.append(entry)
        else:
            self._lost += 1
            self.lost_total += 1

    def collect(self, ack: int) -> Batch:
        """The batch to hand over: the one out, unless ``ack`` acknowledges it; else a new
        one cut from the pending entries (possibly empty)."""
        if self._out is not None and ack >= self._out.number:
            self._out = None
        if self._out is None:
            self._numbers += 1
            taken, self.pending = self.pending[: self.batch_max], self.pending[self.batch_max :]
            self._out = Batch(self._numbers, taken, self._lost, self._aggregated)
            self._lost = self._aggregated = 0
            # Entries left waiting keep their places; counts start again for the next batch.
            self._aggregates = {e.key(): e for e in self.pending if e.folded}
            self._per_peer = {}
            for e in self.pending:
                self._per_peer[e.peer] = self._per_peer.get(e.peer, 0) + 1
        return self._out

    @property
    def waiting(self) -> int:
        """Entries not yet acknowledged (pending, and the batch out)."""
        return len(self.pending) + (len(self._out.entries) if self._out else 0)

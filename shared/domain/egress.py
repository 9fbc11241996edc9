"""Egress records into events (pure): a batch collected from a proxy becomes one
``egress.recorded`` event per sandbox address, on the subject of the session that
sandbox served.

The proxy hands over what it saw (``proxy/sbx_proxy/records.py`` says how a batch is
made and bounded); which sandbox an address belonged to is the collector's knowledge,
given here as ``owner``. An event's id is derived from the proxy, the batch, the address
and the chunk, so a batch collected twice (the collector restarted before acknowledging
it) is stored once (the stream de-duplicates by event id).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

import msgspec

from shared.contract import events

CHUNK = 500
"""Connections per event at most (an event stays far below the stream's message size)."""


class WireRecord(msgspec.Struct, kw_only=True):
    """One entry of a proxy's batch, as it sends it."""

    peer: str | None = None
    host: str | None = None
    port: int | None = None
    verdict: str
    rule: str | None = None
    reason: str | None = None
    detail: str | None = None
    started: float
    ms: int = 0
    requests: int = 0
    injected: int = 0
    refused: int = 0
    upstream_errors: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    connections: int = 1


class WireBatch(msgspec.Struct, kw_only=True):
    batch: int
    records: list[WireRecord]
    lost: int = 0
    aggregated: int = 0


def decode_batch(data: bytes) -> WireBatch:
    """A proxy's answer to ``GET /egress`` (msgspec.ValidationError/DecodeError if not one)."""
    return msgspec.json.decode(data, type=WireBatch)


@dataclass(frozen=True)
class Owner:
    sandbox_id: str
    session_id: str | None


def event_id(proxy_id: str, batch: int, peer: str | None, chunk: int) -> str:
    return hashlib.sha256(f"egress:{proxy_id}:{batch}:{peer}:{chunk}".encode()).hexdigest()[:32]


def connection(record: WireRecord) -> events.EgressConnection:
    return events.EgressConnection(
        host=record.host,
        port=record.port,
        verdict=record.verdict,
        rule=record.rule,
        reason=record.reason,
        detail=record.detail,
        started=datetime.fromtimestamp(record.started, UTC),
        duration_ms=record.ms,
        requests=record.requests,
        injected=record.injected,
        refused=record.refused,
        upstream_errors=record.upstream_errors,
        bytes_up=record.bytes_up,
        bytes_down=record.bytes_down,
        connections=record.connections,
    )


MetaFor = Callable[[str, Owner | None], events.Meta]
"""The meta of an event, given its id and its owner."""


def recorded(
    proxy_id: str,
    batch: WireBatch,
    owner: Callable[[str | None], Owner | None],
    meta: MetaFor,
) -> list[events.EgressRecorded]:
    """The events a batch makes: per address, in the order the proxy recorded them, at
    most ``CHUNK`` connections each; the batch's lost connections on an event of their
    own (no address: the proxy could not say whose they were)."""
    by_peer: dict[str | None, list[WireRecord]] = {}
    for record in batch.records:
        by_peer.setdefault(record.peer, []).append(record)
    out: list[events.EgressRecorded] = []
    for peer, found in by_peer.items():
        who = owner(peer)
        for chunk, start in enumerate(range(0, len(found), CHUNK)):
            part = [connection(r) for r in found[start : start + CHUNK]]
            out.append(
                events.EgressRecorded(
                    meta=meta(event_id(proxy_id, batch.batch, peer, chunk), who),
                    session_id=who.session_id if who else None,
                    sandbox_id=who.sandbox_id if who else None,
                    proxy_id=proxy_id,
                    peer=peer,
                    connections=part,
                    aggregated=sum(c.connections - 1 for c in part),
                )
            )
    if batch.lost:
        out.append(
            events.EgressRecorded(
                meta=meta(event_id(proxy_id, batch.batch, None, -1), None),
                proxy_id=proxy_id,
                connections=[],
                lost=batch.lost,
            )
        )
    return out


def summary(event: events.EgressRecorded) -> str:
    """One line for people: how many connections, where, what was refused."""
    total = sum(c.connections for c in event.connections)
    places: dict[str, int] = {}
    for c in event.connections:
        where = f"{c.host or '?'}:{c.port or '?'} {c.verdict}"
        if c.rule:
            where += f" by {c.rule}" + (f" ({c.injected} injected)" if c.injected else "")
        if c.reason:
            where += f" ({c.reason})"
        places[where] = places.get(where, 0) + c.connections
    shown = ", ".join(f"{w}" + (f" x{n}" if n > 1 else "") for w, n in list(places.items())[:5])
    more = f", +{len(places) - 5} more" if len(places) > 5 else ""
    lost = f"; {event.lost} not recorded" if event.lost else ""
    return f"egress: {total} connection{'s' if total != 1 else ''}: {shown}{more}{lost}"

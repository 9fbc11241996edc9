"""Offering idle pool sandboxes and claiming one, through a JetStream work queue.

The pool-manager *offers* a sandbox once it is ready (``Nats-Msg-Id`` = sandbox id, so
re-offering is harmless). A scheduler *takes* the next offer with a no-wait pull (an
empty pool answers at once, so a cold start pays nothing extra), then claims the
sandbox with a CAS on its aggregate; the offer is acked either way. An offer for a
sandbox that is gone or already claimed simply fails the CAS and the next is taken.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from nats.aio.client import Client
from nats.js import api
from nats.js.client import JetStreamContext

from shared.contract import subjects
from shared.infrastructure import eventstore, tracing

NO_MESSAGES = ("404", "408", "409")
OFFER_ACK_WAIT = 5.0
"""Seconds after which an offer taken but not acknowledged (its scheduler died between
taking and claiming, or it was delivered to the wait of one that died) is offered again.
Short on purpose: offering a sandbox twice is harmless (the second claim fails its CAS)."""


@dataclass(frozen=True)
class Offer:
    sandbox_id: str
    ack_subject: str | None


async def offer(js: JetStreamContext, topology: subjects.Topology, pool_id: str, sandbox_id: str) -> None:
    try:
        await js.publish(
            topology.pool_offers(pool_id),
            sandbox_id.encode(),
            headers=tracing.inject({subjects.MSG_ID: sandbox_id}),  # (the refill's trace)
            stream=topology.pool_stream,
        )
    except Exception as exc:
        raise eventstore.translate(exc, f"offering {sandbox_id}") from exc


async def waiting_offers(js: JetStreamContext, topology: subjects.Topology) -> dict[str, int]:
    """How many offers wait in the work queue, by pool subject (taken but unacknowledged
    ones included): one request, whatever the number of offers."""
    try:
        info = await js.stream_info(topology.pool_stream, subjects_filter=topology.every_pool_offers())
    except Exception as exc:
        raise eventstore.translate(exc, "counting the pools' offers") from exc
    return dict(info.state.subjects or {})


async def ensure_consumer(
    js: JetStreamContext, topology: subjects.Topology, pool_id: str, *, snapshot: str | None = None
) -> None:
    """One durable consumer per pool, shared by every scheduler instance (a snapshot's pool:
    marked with its snapshot, so that ``drop_snapshot_pools`` can remove it when unused)."""
    config = api.ConsumerConfig(
        durable_name=topology.claims_consumer(pool_id),
        filter_subject=topology.pool_offers(pool_id),
        ack_policy=api.AckPolicy.EXPLICIT,
        ack_wait=OFFER_ACK_WAIT,
        max_ack_pending=10_000,
        metadata={SNAPSHOT_KEY: snapshot, POOL_KEY: pool_id} if snapshot else None,
    )
    try:
        await js.add_consumer(topology.pool_stream, config)
    except Exception as exc:
        raise eventstore.translate(exc, f"creating the claims consumer of {pool_id}") from exc


SNAPSHOT_KEY = "sbx.snapshot"
POOL_KEY = "sbx.pool"


async def drop_snapshot_pools(js: JetStreamContext, topology: subjects.Topology, keep: set[str]) -> list[str]:
    """Remove the claims consumer and any offers left of every snapshot's pool not in
    ``keep`` (its snapshot no longer kept warm, or deleted, and none of its sandboxes
    idle); returns their pool ids. Configured pools' consumers are never touched."""
    dropped: list[str] = []
    try:
        for info in await _consumers(js, topology.pool_stream):
            pool_id = (info.config.metadata or {}).get(POOL_KEY)
            if not (info.config.metadata or {}).get(SNAPSHOT_KEY) or not pool_id or pool_id in keep:
                continue
            await js.delete_consumer(topology.pool_stream, info.name)
            await js.purge_stream(topology.pool_stream, subject=topology.pool_offers(pool_id))
            dropped.append(pool_id)
    except Exception as exc:
        raise eventstore.translate(exc, "removing unused snapshot pools") from exc
    return dropped


async def _consumers(js: JetStreamContext, stream: str) -> list[api.ConsumerInfo]:
    """Every consumer of the stream (the server answers a page at a time)."""
    found: list[api.ConsumerInfo] = []
    while page := await js.consumers_info(stream, offset=len(found)):
        found += page
    return found


async def take(nc: Client, topology: subjects.Topology, pool_id: str, wait: float = 0.0) -> Offer | None:
    """The next offer, or None if the pool is empty: at once, or after ``wait`` seconds
    without one (a sandbox being prepared is offered when it is ready)."""
    subject = f"$JS.API.CONSUMER.MSG.NEXT.{topology.pool_stream}.{topology.claims_consumer(pool_id)}"
    pull = {"batch": 1, "expires": int(wait * 1e9)} if wait > 0 else {"batch": 1, "no_wait": True}
    with tracing.span("pool.take", kind=tracing.CONSUMER, attributes={"sbx.pool_id": pool_id}):
        try:
            # A dedicated inbox: delivered messages keep their own subject, which the shared
            # request inbox of nats-py would not route back to us.
            msg = await nc.request(subject, json.dumps(pull).encode(), timeout=wait + 2, old_style=True)
        except Exception as exc:
            raise eventstore.translate(exc, "taking a pool offer") from exc
        status = (msg.headers or {}).get("Status")
        if status in NO_MESSAGES or not msg.data:
            tracing.annotate({"sbx.offer": "none"})
            return None
        tracing.link(msg.headers)  # to the refill that made and offered this sandbox
        tracing.annotate({"sbx.offer": "taken", "sbx.sandbox_id": msg.data.decode()})
        return Offer(msg.data.decode(), msg.reply or None)


async def done(nc: Client, taken: Offer) -> None:
    if taken.ack_subject:
        await nc.publish(taken.ack_subject, b"+ACK")

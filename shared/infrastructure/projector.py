"""Writing projections into KV, and keeping them caught up with the stream.

A projection entry stores the state *and* the stream sequence it reflects
(``state.last_seq``). Applying a stored event is idempotent and order-safe:

* already reflected (``last_seq >= seq``): nothing to do;
* the next one (``last_seq == prev_seq``): fold it in;
* a gap (an earlier event was never projected): rebuild the aggregate from its
  subject in the stream.

Every KV write is a revision CAS, so concurrent appliers never clobber each
other. Writers apply right after appending (read-your-writes), and a durable
pull consumer per kind (:func:`catch_up`) re-applies everything, so an update
lost to a crash between append and KV write is caught up, never left stale.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Generic

import nats.errors
import nats.js.errors
import structlog
from nats.js import api
from nats.js.client import JetStreamContext
from nats.js.kv import KeyValue

from sbx_api import errors
from shared.contract import codec
from shared.domain import projections
from shared.infrastructure import aio, bus, eventstore, kvmirror

log = structlog.get_logger(__name__)

#: An event handed to a projector that dies before acking is redelivered after this
#: long. Applying one event takes milliseconds; this bounds how long a crash can
#: leave a projection behind.
ACK_WAIT_SECONDS = 5.0
RETRY_SECONDS = 0.5
"""How long a projector waits before fetching again while JetStream is unavailable."""


class ProjectionStore(Generic[projections.S]):
    """One kind's KV bucket, read and written through its projection."""

    def __init__(
        self,
        js: JetStreamContext,
        kv: KeyValue,
        projection: projections.Projection[projections.S],
        store: eventstore.EventStore,
    ) -> None:
        self.store_js = js
        self.kv = kv
        self.kv_bucket = store.topology.bucket(projection.kind)
        self.projection: projections.Projection[projections.S] = projection
        self.store = store
        self._mirror: kvmirror.Mirror[projections.S] | None = None

    @classmethod
    async def open(
        cls,
        js: JetStreamContext,
        projection: projections.Projection[projections.S],
        store: eventstore.EventStore,
    ) -> ProjectionStore[projections.S]:
        bucket = store.topology.bucket(projection.kind)
        # The JetStream API does not answer while a cluster elects a leader (a node was
        # lost, maybe as this service starts): wait, do not exit.
        kv = await eventstore.patiently(lambda: js.key_value(bucket), f"opening the {projection.kind}s")
        return cls(js, kv, projection, store)

    async def get_entry(self, key: str) -> tuple[projections.S | None, int | None]:
        try:
            entry = await self.kv.get(key)
        except nats.js.errors.KeyNotFoundError:
            return None, None
        except Exception as exc:
            raise eventstore.translate(exc, f"reading {self.projection.kind} {key}") from exc
        if entry.value is None:
            return None, entry.revision
        return codec.decode_state(entry.value, self.projection.state_type), entry.revision

    async def get(self, aggregate_id: str) -> projections.S | None:
        state, _ = await self.get_entry(self.projection.key_of(aggregate_id))
        return state

    async def _write(self, key: str, state: projections.S, revision: int | None) -> int:
        """Write the entry expecting ``revision`` (None: that there is none); its new revision."""
        payload = codec.encode(state)
        if revision is None:
            try:
                return await self.kv.create(key, payload)
            except nats.js.errors.KeyNotFoundError as exc:
                # nats-py's create, told the key exists, reads it back to see whether it was
                # deleted; a replica not caught up yet (during an election) says it is not
                # there. Another writer came first all the same: the caller looks again.
                raise nats.js.errors.KeyWrongLastSequenceError(f"{key} was created meanwhile") from exc
        return await self.kv.update(key, payload, last=revision)

    async def apply(self, stored: eventstore.Stored) -> projections.S:
        """Make the projection reflect ``stored`` (and everything before it).

        Where the kind is followed and the copy has heard of an entry at or past the event
        (the usual case for the catch-up consumer: the writer projected it right after
        appending), nothing is read: entries only move forward."""
        key = self.projection.key_of_subject(stored.subject)
        heard = self._mirror.heard(key) if self._mirror is not None else None
        if heard is not None and heard.last_seq >= stored.seq:
            return heard
        while True:
            state, revision = await self.get_entry(key)
            last = state.last_seq if state is not None else 0
            if last >= stored.seq:
                assert state is not None
                return state
            if last == stored.prev_seq:
                new = self.projection.evolve(state, stored.event, stored.seq)
            else:
                log.info(
                    "projection.gap", kind=self.projection.kind, key=key, have=last, event_seq=stored.seq
                )
                history = await self.store.load(stored.subject)
                rebuilt = self.projection.fold((s.seq, s.event) for s in history)
                if rebuilt is None:
                    raise errors.CorruptEvent(f"{stored.subject} has no events but seq {stored.seq} was seen")
                new = rebuilt
            try:
                await self._write(key, new, revision)
            except nats.js.errors.KeyWrongLastSequenceError:
                continue  # someone else wrote in between: look again
            except Exception as exc:
                raise eventstore.translate(exc, f"writing {self.projection.kind} {key}") from exc
            return new

    async def apply_appended(
        self, before: projections.S | None, revision: int | None, stored: list[eventstore.Stored]
    ) -> tuple[projections.S, int | None]:
        """Apply events this writer just appended on top of ``before``, the state it read
        at KV ``revision``: one write, no second read; the new state and its revision
        (None when not known). If the entry moved meanwhile (a catch-up consumer got
        there first), the ordinary ``apply`` sorts it out."""
        last = before.last_seq if before is not None else 0
        if stored and stored[0].prev_seq == last:
            state = before
            for item in stored:
                state = self.projection.evolve(state, item.event, item.seq)
            assert state is not None
            try:
                written = await self._write(
                    self.projection.key_of_subject(stored[0].subject), state, revision
                )
                return state, written
            except nats.js.errors.KeyWrongLastSequenceError:
                pass
            except Exception as exc:
                raise eventstore.translate(exc, f"writing {self.projection.kind}") from exc
        for item in stored:
            state = await self.apply(item)
        assert state is not None
        return state, None

    async def rebuild(self, aggregate_subject: str) -> projections.S | None:
        """Fold one aggregate from the stream and write it (used after a lost CAS race)."""
        history = await self.store.load(aggregate_subject)
        if not history:
            return None
        return await self.apply(history[-1])

    async def follow(
        self,
        keep: Callable[[projections.S], bool] | None = None,
        on_change: Callable[[projections.S | None, projections.S | None], None] | None = None,
    ) -> None:
        """Keep the bucket in memory from now on, so ``all()`` costs one stream-info request
        instead of a snapshot (services that list a kind often call this once). With
        ``keep``, ``all()`` lists only the entries it accepts (e.g. not deleted ones);
        ``on_change(old, new)`` hears of every kept entry that changes (``kvmirror``)."""
        if self._mirror is not None:
            return
        mirror = kvmirror.Mirror(self.store_js, self.kv_bucket, self._decode, keep, on_change)
        doing = f"following {self.projection.kind}s"
        try:
            await eventstore.patiently(mirror.start, doing)
        except Exception as exc:
            raise eventstore.translate(exc, doing) from exc
        self._mirror = mirror

    def heard(self, aggregate_id: str) -> projections.S | None:
        """The followed copy's entry of this aggregate as last heard: no read, so possibly
        behind the bucket (None: not followed, not kept, or not heard of)."""
        if self._mirror is None:
            return None
        return self._mirror.heard(self.projection.key_of(aggregate_id))

    async def unfollow(self) -> None:
        if self._mirror is not None:
            mirror, self._mirror = self._mirror, None
            await mirror.stop()

    async def sync(self) -> dict[str, projections.S] | None:
        """Wait until the followed copy holds every write finished before the call (None),
        or, if it cannot catch up in time, the entries of a snapshot (``Mirror.sync``)."""
        if self._mirror is None:
            raise RuntimeError(f"the {self.projection.kind}s are not followed")
        try:
            return await self._mirror.sync()
        except errors.SandboxError:
            raise
        except Exception as exc:
            raise eventstore.translate(exc, f"listing {self.projection.kind}s") from exc

    async def all(self) -> dict[str, projections.S]:
        """Every entry of the bucket, decoded, keyed by projection key, as of the end of
        the call (from the followed copy when ``follow()`` was called: only the entries
        its ``keep`` accepts)."""
        if self._mirror is not None:
            try:
                return await self._mirror.current()
            except errors.SandboxError:
                raise
            except Exception as exc:
                raise eventstore.translate(exc, f"listing {self.projection.kind}s") from exc
        try:
            raw = await bus.snapshot(self.store_js, self.kv_bucket)
        except Exception as exc:
            raise eventstore.translate(exc, f"listing {self.projection.kind}s") from exc
        return kvmirror.decode_all(raw, self._decode, self.kv_bucket)

    def _decode(self, raw: bytes) -> projections.S:
        return codec.decode_state(raw, self.projection.state_type)

    def decode(self, raw: bytes) -> projections.S:
        """A raw entry of this bucket, decoded."""
        return self._decode(raw)


async def catch_up(js: JetStreamContext, target: ProjectionStore[projections.S], *, batch: int = 256) -> None:
    """Run forever: apply every event of one kind through a shared durable consumer.

    Any number of instances may run this; the durable pull consumer hands each
    event to one of them and redelivers it if that one dies before acking.
    """
    topology = target.store.topology
    kind = target.projection.kind
    durable = topology.projector_consumer(kind)
    config = api.ConsumerConfig(
        ack_policy=api.AckPolicy.EXPLICIT,
        ack_wait=ACK_WAIT_SECONDS,
        max_ack_pending=10_000,
        deliver_policy=api.DeliverPolicy.ALL,
    )
    sub = await eventstore.patiently(
        lambda: js.pull_subscribe(
            topology.events_of_kind(kind), durable=durable, stream=topology.events_stream, config=config
        ),
        f"subscribing the {kind} projector",
    )
    try:
        while True:
            try:
                msgs = await sub.fetch(batch, timeout=1.0)
            except (nats.errors.TimeoutError, TimeoutError):
                msgs = []
            except eventstore.TRANSIENT as exc:  # the stream or consumer is electing a leader
                aio.raise_if_cancelling()
                log.warning("projection.waiting_for_jetstream", kind=kind, error=repr(exc))
                await asyncio.sleep(RETRY_SECONDS)
                continue
            aio.raise_if_cancelling()  # the client may have swallowed our cancellation
            for msg in msgs:
                try:
                    stored = eventstore.stored_from_message(
                        msg.metadata.sequence.stream, msg.subject, msg.headers, msg.data
                    )
                    await target.apply(stored)
                except (errors.CorruptEvent, errors.InvalidTransition) as exc:
                    log.error(
                        "projection.corrupt_event",
                        kind=kind,
                        seq=msg.metadata.sequence.stream,
                        error=str(exc),
                    )
                    await msg.term()
                    continue
                except errors.InfrastructureError as exc:
                    aio.raise_if_cancelling()
                    log.warning("projection.retry_later", kind=kind, error=str(exc))
                    await msg.nak(delay=1)
                    continue
                await msg.ack()
    finally:
        try:
            await sub.unsubscribe()
        except Exception as exc:  # connection already closing
            log.debug("projection.unsubscribe_failed", error=str(exc))

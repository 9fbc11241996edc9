"""Appending events to, and reading them back from, the JetStream event stream.

Each aggregate (one session, one service instance) has its own subject. An
append carries ``Nats-Expected-Last-Subject-Sequence`` = the aggregate's last
sequence as the writer saw it, so two writers deciding on the same state cannot
both win (invariant 3: no lost updates); the loser gets
:class:`~sbx_api.errors.ConcurrencyError` and must reload and decide again.
``Nats-Msg-Id`` (command id + position) makes a re-sent publish a no-op.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import nats.errors
import nats.js.errors
import structlog
from nats.js import api
from nats.js.client import JetStreamContext

from sbx_api import errors
from shared.contract import codec, events, subjects
from shared.infrastructure import tracing
from shared.infrastructure.settings import bus

log = structlog.get_logger(__name__)
T = TypeVar("T")

WRONG_LAST_SEQUENCE = 10071
NO_MESSAGE_FOUND = 10037


class AlreadyAppended(errors.ConcurrencyError):
    """JetStream recognised the ``Nats-Msg-Id``: an earlier attempt of the same command
    already appended this event to this aggregate (within the duplicate window)."""


@dataclass(frozen=True)
class Stored:
    """An event as stored: where it is and what came before it on its subject."""

    seq: int
    subject: str
    prev_seq: int
    """The aggregate's last sequence when this was appended (0: it was the first)."""
    event: events.Event


def nothing_to_read(info: api.ConsumerInfo) -> bool:
    """True if a fresh consumer has neither delivered nor pending messages.

    Messages may already be in flight to us when the info is taken, so pending
    alone can be 0 although messages are on their way.
    """
    return info.num_pending == 0 and (info.delivered is None or not info.delivered.consumer_seq)


def _prev_seq(headers: dict[str, str] | None) -> int:
    raw = (headers or {}).get(subjects.EXPECTED_LAST_SUBJECT_SEQUENCE)
    return int(raw) if raw and raw.isdigit() else -1


def stored_from_message(seq: int, subject: str, headers: dict[str, str] | None, data: bytes) -> Stored:
    return Stored(seq=seq, subject=subject, prev_seq=_prev_seq(headers), event=codec.decode_event(data))


TRANSIENT: tuple[type[Exception], ...] = (
    nats.js.errors.ServiceUnavailableError,
    nats.errors.NoRespondersError,
    nats.js.errors.NoStreamResponseError,
    nats.errors.TimeoutError,
    TimeoutError,
    nats.errors.ConnectionReconnectingError,
)
"""What a JetStream call raises while a stream or consumer has no leader (an election
after a node died) or the connection is being re-established: retry, do not give up."""


READ_PATIENCE = 30.0
"""How long a reader of the stream waits for JetStream to answer before giving up."""
_PATIENT_WITH: tuple[type[Exception], ...] = (*TRANSIENT, errors.Unavailable, errors.Timeout)


async def patiently(call: Callable[[], Awaitable[T]], doing: str, timeout: float = 60.0) -> T:
    """``call()``, retried while JetStream is briefly unavailable (see ``TRANSIENT``; also
    the product's ``Unavailable`` and ``Timeout`` it was translated to), for ``timeout``
    seconds at most."""
    deadline = asyncio.get_running_loop().time() + timeout
    delay = 0.1
    while True:
        try:
            return await call()
        except _PATIENT_WITH as exc:
            if asyncio.get_running_loop().time() + delay > deadline:
                raise
            log.warning("jetstream.waiting", doing=doing, error=repr(exc), retry_in=delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)


def translate(exc: Exception, doing: str) -> errors.SandboxError:
    """Map a NATS client error to the product's hierarchy."""
    if isinstance(exc, nats.js.errors.ServiceUnavailableError):
        return errors.Unavailable(f"{doing}: JetStream is briefly unavailable (electing a leader?); retry")
    # getattr: some of nats-py's errors (KeyNotFoundError) are made without calling APIError.__init__
    if isinstance(exc, nats.js.errors.APIError) and getattr(exc, "err_code", None) == WRONG_LAST_SEQUENCE:
        return errors.ConcurrencyError(f"{doing}: another writer appended first ({exc.description})")
    if isinstance(exc, nats.errors.NoRespondersError | nats.js.errors.NoStreamResponseError):
        return errors.Unavailable(f"{doing}: JetStream did not answer (is the stream created?)")
    if isinstance(exc, nats.errors.TimeoutError | TimeoutError):
        return errors.Timeout(f"{doing}: NATS did not answer in time")
    if isinstance(exc, nats.errors.ConnectionClosedError | nats.errors.ConnectionReconnectingError):
        return errors.Unavailable(f"{doing}: not connected to NATS")
    return errors.InfrastructureError(f"{doing}: {type(exc).__name__}: {exc}")


class EventStore:
    def __init__(
        self,
        js: JetStreamContext,
        topology: subjects.Topology,
        *,
        audit_ttl: float = bus.RetentionSettings.audit_max_age,
    ) -> None:
        """``audit_ttl``: seconds an audit record lives (``SBX_AUDIT_MAX_AGE``; 0: no TTL)."""
        self._js = js
        self.topology = topology
        self.audit_ttl = audit_ttl

    async def append(
        self,
        subject: str,
        new_events: Sequence[events.Event],
        *,
        expected_last_seq: int,
    ) -> list[Stored]:
        """Append ``new_events`` to ``subject`` iff its last sequence is ``expected_last_seq``.

        Several events are chained: each expects the previous one's sequence, so a
        concurrent writer can interleave at most before the first. Each carries the trace
        it was appended in (``traceparent``), if traced.
        """
        with tracing.appending("events.append", subject, new_events):
            return await self._append(subject, new_events, expected_last_seq)

    async def _append(
        self, subject: str, new_events: Sequence[events.Event], expected_last_seq: int
    ) -> list[Stored]:
        stored: list[Stored] = []
        expected = expected_last_seq
        for position, event in enumerate(new_events):
            # Scoped to the aggregate: the same command id (or Idempotency-Key) used on
            # another aggregate must never be mistaken for a duplicate.
            # One command may append several events to one aggregate in separate steps
            # (requested, then started): the type keeps their ids apart.
            dedup = ":".join(
                (
                    subject.rsplit(".", 1)[1],
                    event.meta.command_id or event.meta.event_id,
                    events.tag_of(type(event)),
                    str(position),
                )
            )
            headers = tracing.inject(
                {subjects.EXPECTED_LAST_SUBJECT_SEQUENCE: str(expected), subjects.MSG_ID: dedup}
            )
            try:
                ack = await self._js.publish(
                    subject,
                    codec.encode(event),
                    headers=headers,
                    stream=self.topology.events_stream,
                )
            except Exception as exc:
                raise translate(exc, f"appending to {subject}") from exc
            if ack.duplicate:
                raise AlreadyAppended(f"{dedup} was already appended to {subject} (seq {ack.seq})")
            stored.append(Stored(ack.seq, subject, expected, event))
            expected = ack.seq
        return stored

    async def record(self, subject: str, event: events.Event) -> int:
        """Append to an append-only subject (audit records): no expected sequence, only
        de-duplication by event id, and the audit TTL. Returns the stream sequence."""
        headers = {subjects.MSG_ID: event.meta.event_id}
        if self.audit_ttl > 0 and self.topology.kind_of(subject) in subjects.AUDIT_KINDS:
            headers[subjects.MSG_TTL] = str(max(1, round(self.audit_ttl)))
        with tracing.appending("events.record", subject, [event]):
            try:
                ack = await self._js.publish(
                    subject,
                    codec.encode(event),
                    headers=tracing.inject(headers),
                    stream=self.topology.events_stream,
                )
            except Exception as exc:
                raise translate(exc, f"recording to {subject}") from exc
            return ack.seq

    async def load(self, subject: str, *, after: int = 0) -> list[Stored]:
        """Every event on one aggregate subject after sequence ``after``, in order."""
        out: list[Stored] = []
        seq = after + 1
        while True:
            try:
                msg = await self._js.get_msg(
                    self.topology.events_stream, seq, subject=subject, next=True, direct=True
                )
            except nats.js.errors.NotFoundError:
                return out
            except Exception as exc:
                raise translate(exc, f"reading {subject}") from exc
            assert msg.seq is not None and msg.data is not None
            out.append(stored_from_message(msg.seq, subject, msg.headers, msg.data))
            seq = msg.seq + 1

    async def last_seq(self) -> int:
        info = await self._js.stream_info(self.topology.events_stream)
        return info.state.last_seq

    async def read(
        self,
        filter_subject: str | list[str] | None = None,
        *,
        start_seq: int = 1,
        follow: bool = False,
    ) -> AsyncGenerator[Stored, None]:
        """Stream stored events in order (one subject filter or several); stop at the
        current end unless ``follow``. Uses an ordered consumer: no server-side state is
        left behind."""
        filters = (
            [filter_subject]
            if isinstance(filter_subject, str)
            else filter_subject or [self.topology.events_all]
        )
        config = api.ConsumerConfig(
            opt_start_seq=max(1, start_seq), filter_subjects=filters if len(filters) > 1 else None
        )
        try:  # patiently: right after a leader election the consumer takes a moment
            sub = await patiently(
                lambda: self._js.subscribe(
                    filters[0] if len(filters) == 1 else "",
                    stream=self.topology.events_stream,
                    ordered_consumer=True,
                    deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE,
                    config=config,
                    pending_msgs_limit=-1,
                    pending_bytes_limit=-1,
                ),
                "reading the event stream",
                timeout=READ_PATIENCE,
            )
        except Exception as exc:
            raise translate(exc, "reading the event stream") from exc
        try:
            if not follow:
                info = await patiently(sub.consumer_info, "reading the event stream", timeout=READ_PATIENCE)
                if nothing_to_read(info):
                    return
            while True:
                msg = await sub.next_msg(timeout=None)
                meta = msg.metadata
                yield stored_from_message(meta.sequence.stream, msg.subject, msg.headers, msg.data)
                if not follow and meta.num_pending == 0:
                    return
        finally:
            await sub.unsubscribe()

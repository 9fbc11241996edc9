"""Keeping the event stream under its byte limit by removing the oldest audit records
(the reaper's lease holder, each pass; the rule: :mod:`shared.domain.audit`).

JetStream's own byte limit cannot tell kinds apart: with ``discard=old`` it would remove a
session's first events as readily as a command's record, and the projections (the fold of
each aggregate's events) could no longer be rebuilt. So the stream refuses new events at
its limit (``discard=new``), and this module purges audit subjects, oldest first, well
before that happens.
"""

from __future__ import annotations

from dataclasses import dataclass

import nats.js.errors
from nats.js.client import JetStreamContext

from shared.contract import subjects
from shared.domain import audit
from shared.infrastructure import eventstore

ROUNDS = 8
"""Purges per call at most (each one re-estimates from what the last one left)."""


@dataclass(frozen=True)
class Trimmed:
    bytes_before: int
    bytes_after: int
    below: int
    """Audit records with a sequence below this are gone (0: none was removed)."""


async def usage(js: JetStreamContext, topology: subjects.Topology) -> tuple[int, int]:
    """The event stream's bytes and last sequence."""
    state = (await js.stream_info(topology.events_stream)).state
    return state.bytes, state.last_seq


async def oldest_audit(js: JetStreamContext, topology: subjects.Topology) -> int | None:
    """The sequence of the oldest audit record there is (None: no audit record)."""
    found: list[int] = []
    for kind in subjects.AUDIT_KINDS:
        try:
            msg = await js.get_msg(
                topology.events_stream, 1, subject=topology.events_of_kind(kind), next=True, direct=True
            )
        except nats.js.errors.NotFoundError:
            continue
        if msg.seq is not None:
            found.append(msg.seq)
    return min(found) if found else None


async def trim_audit(js: JetStreamContext, topology: subjects.Topology, limit: int) -> Trimmed:
    """Remove the oldest audit records while the stream is past ``audit.TRIM_AT`` of
    ``limit``; what was done."""
    try:
        used, last = await usage(js, topology)
        before, below = used, 0
        for _ in range(ROUNDS):
            first = await oldest_audit(js, topology)
            if first is None:
                break
            cut = audit.trim_below(used=used, limit=limit, first_seq=first, last_seq=last)
            if cut is None:
                break
            for kind in subjects.AUDIT_KINDS:
                await js.purge_stream(topology.events_stream, seq=cut, subject=topology.events_of_kind(kind))
            below = cut
            used, last = await usage(js, topology)
    except Exception as exc:
        raise eventstore.translate(exc, "trimming audit records") from exc
    return Trimmed(before, used, below)

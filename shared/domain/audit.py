"""How much audit the stack takes and keeps (pure): a session's audit-rate allowance, and
which audit records the byte limit removes first.

**Rate.** Each audited call costs the bytes of the command text its record carries plus a
fixed overhead (the record's other fields), so a flood of tiny calls counts too. A
session's allowance is a leaky bucket: it may cause ``allowance`` bytes at once, and the
bucket drains at ``allowance / window`` bytes a second. A call that would overflow it is
refused before it runs (never recorded partly, never dropped), with how long until it fits.

**Bytes.** Past :data:`TRIM_AT` of the stream's byte limit, the oldest audit records go
until the stream is back at :data:`TRIM_TO`; the aggregates' events never do (their
projections are the fold of all of them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import msgspec

from shared.domain import describe

RECORD_OVERHEAD = 512
"""What one audit record costs beyond its command text: the encoded record's other fields
(ids, times, outcome) and its headers, about 400-500 bytes."""


class Level(msgspec.Struct, frozen=True, kw_only=True):
    """A session's bucket as last written: ``used`` bytes at ``at`` (epoch seconds)."""

    used: float
    at: float


@dataclass(frozen=True)
class Refused:
    """The call does not fit: ``wait`` seconds until it does (if nothing else is charged)."""

    wait: float
    used: float


def cost(command_text: str) -> int:
    """What recording a call whose record carries ``command_text`` costs."""
    return len(command_text.encode()) + RECORD_OVERHEAD


def charge(level: Level | None, amount: int, now: float, *, allowance: int, window: float) -> Level | Refused:
    """The bucket after charging ``amount`` at ``now``, or why it is refused."""
    rate = allowance / window
    used = 0.0 if level is None else max(0.0, level.used - max(0.0, now - level.at) * rate)
    if used + amount > allowance:
        return Refused(wait=(used + amount - allowance) / rate, used=used)
    return Level(used=used + amount, at=now)


def refusal(session_id: str, refused: Refused, *, allowance: int, window: float) -> str:
    """What a refused call says: what happened, why, and when it can go on."""
    wait = max(1, math.ceil(refused.wait))
    return (
        f"not run: session {session_id!r} has used its audit allowance ({describe.size(allowance)} of "
        f"recorded command text per {_duration(window)}, SBX_AUDIT_RATE); every call is "
        f"recorded, so calls are refused until it refills: retry in {wait} s"
    )


TRIM_AT = 0.9
"""Past this share of the stream's byte limit the oldest audit records are removed..."""
TRIM_TO = 0.8
"""...until the stream holds about this share."""


def trim_below(*, used: int, limit: int, first_seq: int, last_seq: int) -> int | None:
    """The sequence below which audit records go, or None while the stream is below
    :data:`TRIM_AT` of ``limit``. An estimate from the stream's average message (audit
    records and aggregates interleave); a pass that removes too little is followed by
    another, one that removes too much only removes audit records a little earlier."""
    if limit <= 0 or used <= limit * TRIM_AT or last_seq < first_seq:
        return None
    share = (used - limit * TRIM_TO) / used
    return first_seq + max(1, math.ceil((last_seq - first_seq + 1) * share))


def _duration(seconds: float) -> str:
    for unit, scale in (("h", 3600), ("min", 60)):
        if seconds >= scale and seconds % scale == 0:
            return f"{seconds / scale:g} {unit}"
    return f"{seconds:g} s"

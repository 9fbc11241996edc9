"""Pure rules of the E2B surface: ids, deadlines, states, filters and paging cursors."""

from __future__ import annotations

import base64
import binascii
import hashlib
import math
import urllib.parse
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta

import msgspec

from sbx_api import errors
from services.gateway.e2b import wire
from shared.contract import execution, states

MAX_TIMEOUT = 24 * 3600
"""Longest ``timeout`` taken (E2B's own ceiling); the stack's ``SBX_MAX_LIFETIME`` still
stops a sandbox earlier (docs/e2b.md)."""
DEFAULT_TEMPLATES = frozenset({"base", "default"})
"""Template ids that mean the stack's default image."""
LIST_LIMIT_MAX = 100


def sandbox_id(org: str | None, idempotency_key: str | None, fresh: str) -> str:
    """The new sandbox's id (its session id): derived from the Idempotency-Key and the
    organisation, so a retried create finds the same sandbox; else from ``fresh``."""
    if idempotency_key is None:
        return f"e2b{fresh[:20]}"
    digest = hashlib.sha256(msgspec.json.encode(["e2b-create", org, idempotency_key])).hexdigest()
    return f"e2b{digest[:20]}"


def deadline(now: datetime, timeout: int) -> datetime:
    """``timeout`` seconds from ``now`` (1 s to 24 h)."""
    if not 1 <= timeout <= MAX_TIMEOUT:
        raise errors.InvalidInput(f"timeout must be from 1 to {MAX_TIMEOUT} seconds")
    return now + timedelta(seconds=timeout)


def visible(org: str | None, session: states.SessionState | None) -> bool:
    """Whether a caller acting for ``org`` (None: the operator) sees this live session.
    An org-bound key sees only its organisation's, never a session of no organisation."""
    if session is None or session.status != "active":
        return False
    return org is None or session.org_id == org


def state_of(sandbox: states.SandboxState | None) -> wire.State | None:
    """E2B's state of our sandbox: running or paused; None when it is neither (gone)."""
    if sandbox is None:
        return None
    if sandbox.status == "running":
        return "running"
    if sandbox.status in ("paused", "stopped"):  # hibernated: the next call starts it
        return "paused"
    return None


def end_of(session: states.SessionState, max_lifetime: float) -> datetime:
    """When the sandbox ends: its deadline, or its maximum lifetime."""
    return session.end_at or session.created_at + timedelta(seconds=max_lifetime)


def parse_metadata_filter(raw: str | None) -> dict[str, str]:
    """``metadata=k1%3Dv1%26k2%3Dv2`` (the SDK's encoding: url-encoded pairs of quoted keys and values)."""
    if not raw:
        return {}
    try:
        pairs = urllib.parse.parse_qsl(raw, keep_blank_values=True, strict_parsing=True, max_num_fields=64)
    except ValueError:
        raise errors.InvalidInput("metadata must be url-encoded key=value pairs") from None
    return {urllib.parse.unquote(k): urllib.parse.unquote(v) for k, v in pairs}


def parse_states(raw: str | None) -> frozenset[str]:
    if not raw:
        return frozenset({"running", "paused"})
    wanted = frozenset(s.strip() for s in raw.split(","))
    if not wanted <= {"running", "paused"}:
        raise errors.InvalidInput("state must be a comma-separated list of: running, paused")
    return wanted


def parse_limit(raw: str | None) -> int:
    if raw is None:
        return LIST_LIMIT_MAX
    if not raw.isdigit() or not 1 <= int(raw) <= LIST_LIMIT_MAX:
        raise errors.InvalidInput(f"limit must be an integer from 1 to {LIST_LIMIT_MAX}")
    return int(raw)


Cursor = tuple[str, str]
"""(created_at in ISO form, session id): the last item of the page before."""


def encode_cursor(session: states.SessionState) -> str:
    raw = msgspec.json.encode([session.created_at.isoformat(), session.session_id])
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(token: str | None) -> Cursor | None:
    if not token:
        return None
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        created, sid = msgspec.json.decode(raw, type=tuple[str, str])
    except (binascii.Error, ValueError, msgspec.DecodeError):
        raise errors.InvalidInput("nextToken is not a token this API gave") from None
    return created, sid


def page(
    sessions: Iterable[states.SessionState], cursor: Cursor | None, limit: int, *, descending: bool = False
) -> tuple[list[states.SessionState], str | None]:
    """One page in start order (a stable order: start time, then id) after ``cursor``, and
    the token of the next page (None: this is the last)."""
    ordered = sorted(sessions, key=lambda s: (s.created_at.isoformat(), s.session_id), reverse=descending)
    if cursor is not None:
        if descending:
            ordered = [s for s in ordered if (s.created_at.isoformat(), s.session_id) < cursor]
        else:
            ordered = [s for s in ordered if (s.created_at.isoformat(), s.session_id) > cursor]
    shown = ordered[:limit]
    more = len(ordered) > limit
    return shown, (encode_cursor(shown[-1]) if more and shown else None)


def matches(session: states.SessionState, metadata: dict[str, str]) -> bool:
    return all(session.metadata.get(k) == v for k, v in metadata.items())


METRICS_SLACK = timedelta(seconds=60)
"""How far a metrics range may end before now (or start after it) and still get the
reading taken now: the SDK sends whole seconds, and clocks differ."""


def parse_unix(raw: str | None, name: str) -> datetime | None:
    """A ``start``/``end`` query value: Unix seconds."""
    if raw is None or raw == "":
        return None
    if not raw.isdigit() or len(raw) > 12:
        raise errors.InvalidInput(f"{name} must be a Unix time in seconds")
    return datetime.fromtimestamp(int(raw), UTC)


def now_in(now: datetime, start: datetime | None, end: datetime | None) -> bool:
    """Whether a metrics range (either end open) includes now, give or take the slack."""
    return (start is None or start <= now + METRICS_SLACK) and (end is None or end >= now - METRICS_SLACK)


def metric(usage: execution.Usage) -> wire.Metric:
    """A usage reading as E2B's metric: ``cpuCount`` whole cores (a fractional limit rounded up)."""
    return wire.Metric(
        timestamp=usage.at,
        timestampUnix=int(usage.at.timestamp()),
        cpuCount=max(1, math.ceil(usage.cpus)),
        cpuUsedPct=usage.cpu_percent,
        memUsed=usage.memory_bytes,
        memTotal=usage.memory_limit,
        memCache=usage.memory_cache_bytes,
        diskUsed=usage.disk_bytes,
        diskTotal=usage.disk_limit,
    )

"""The reaper's idle clock: when a session last called a tool, and until when a call in
flight may still run (so a long ``shell`` or ``shell_wait`` never counts as idle)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import msgspec
import nats.js.errors
from nats.js.kv import KeyValue

from shared.contract import codec, ids
from shared.infrastructure import eventstore


class Activity(msgspec.Struct, frozen=True, kw_only=True):
    at: datetime
    """When the last call started or ended."""
    busy_until: datetime
    """The latest a call in flight may still be running."""

    def last(self, now: datetime) -> datetime:
        """The moment idleness counts from: now while a call may still run."""
        return now if self.busy_until > now else max(self.at, self.busy_until)


async def touch(kv: KeyValue, session_id: str, *, busy_for: float = 0.0) -> None:
    now = datetime.now(UTC)
    entry = Activity(at=now, busy_until=now + timedelta(seconds=busy_for))
    try:
        await kv.put(ids.token(session_id), codec.encode(entry))
    except Exception as exc:
        raise eventstore.translate(exc, "recording activity") from exc


async def read(kv: KeyValue, session_id: str) -> Activity | None:
    try:
        entry = await kv.get(ids.token(session_id))
    except nats.js.errors.KeyNotFoundError:
        return None
    except Exception as exc:
        raise eventstore.translate(exc, "reading activity") from exc
    return codec.decode_state(entry.value, Activity) if entry.value else None

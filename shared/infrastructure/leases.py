"""Leases: work that one instance at a time should do (pool refill, reaper passes).

A lease is a key in the leases bucket (TTL ``LEASE_TTL_SECONDS``) created by its holder
and renewed with a revision CAS; if the holder dies, the key expires and another
instance's ``hold()`` succeeds.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import TypeVar

import nats.js.errors
import structlog
from nats.js.kv import KeyValue

from shared.contract import subjects
from shared.infrastructure import aio

log = structlog.get_logger(__name__)
T = TypeVar("T")
#: Renewal period while working: well inside the lease's time to live.
RENEW_SECONDS = subjects.LEASE_TTL_SECONDS / 4
#: A loop asking before every round may skip the write if it renewed this recently: the
#: key cannot have passed to anyone else (it lives LEASE_TTL_SECONDS after a renewal).
FRESH_SECONDS = RENEW_SECONDS / 2


class Lease:
    """Holds a KV key while renewing it; another instance gets it once this one stops renewing."""

    def __init__(self, kv: KeyValue, key: str, holder: str) -> None:
        self.kv, self.key, self.holder = kv, key, holder
        self.revision: int | None = None
        self._renewed = 0.0

    async def hold(self, *, fresh_for: float = 0.0) -> bool:
        """Take or renew the lease; True while this instance holds it. ``fresh_for``: if
        the last renewal is younger than this, say so without writing (a loop that asks
        before every round, up to ten times a second, need not write every time)."""
        if self.revision is not None and time.monotonic() - self._renewed < fresh_for:
            return True
        asked = time.monotonic()  # the key lives TTL from its write, which is after this
        try:
            if self.revision is None:
                self.revision = await self.kv.create(self.key, self.holder.encode())
            else:
                self.revision = await self.kv.update(self.key, self.holder.encode(), last=self.revision)
            self._renewed = asked
            return True
        except nats.js.errors.KeyWrongLastSequenceError:
            self.revision = None
            return False
        except Exception as exc:
            aio.raise_if_cancelling()
            log.warning("lease.failed", error=repr(exc))
            self.revision = None
            return False

    async def release(self) -> None:
        if self.revision is not None:
            try:
                await self.kv.delete(self.key, last=self.revision)
            except Exception as exc:  # expired already, or the connection is closing
                log.debug("lease.release_failed", error=repr(exc))
            self.revision = None


async def while_held(lease: Lease, work: Awaitable[T], *, renew_every: float = RENEW_SECONDS) -> T | None:
    """Run ``work`` while renewing ``lease``; if a renewal fails (another instance took
    over), cancel the work and return None. Long rounds never outlive their lease."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait([task], timeout=renew_every)
            if done:
                return task.result()
            if not await lease.hold():
                log.warning("lease.lost_while_working", key=lease.key)
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                return None
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

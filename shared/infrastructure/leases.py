"""Leases: work that one instance at a time should do (pool refill, reaper passes, the
proxy fleet), and :func:`lead`, the loop every such leader runs.

A lease is a key in the leases bucket (TTL ``LEASE_TTL_SECONDS``) created by its holder
and renewed with a revision CAS; if the holder dies, the key expires and another
instance's ``hold()`` succeeds.

The key's value says who holds it (:class:`Holder`: instance, and which process on which
kernel and pid namespace). A contender that sees the holder is a process of its own pid
namespace that no longer exists (SIGKILLed and restarted by its supervisor, the common
case on one machine) takes the key over at once with a CAS on its revision instead of
waiting for it to expire; a holder anywhere else, or one it cannot judge, is waited out.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import msgspec
import nats.js.errors
import structlog
from nats.js.kv import KeyValue

from sbx_api import errors
from shared.contract import subjects
from shared.infrastructure import aio, processes

log = structlog.get_logger(__name__)
T = TypeVar("T")
#: Renewal period while working: well inside the lease's time to live.
RENEW_SECONDS = subjects.LEASE_TTL_SECONDS / 4
#: A loop asking before every round may skip the write if it renewed this recently: the
#: key cannot have passed to anyone else (it lives LEASE_TTL_SECONDS after a renewal).
FRESH_SECONDS = RENEW_SECONDS / 2


class Holder(msgspec.Struct, frozen=True):
    """Who holds a lease: the instance, and the process it runs as."""

    instance: str
    place: str
    """The kernel (boot id) and pid namespace the process runs in."""
    pid: int
    started: int
    """The process's start time (clock ticks after boot): tells a reused pid apart."""


def gone(holder: Holder, place: str, started_of: Callable[[int], int | None]) -> bool:
    """Whether ``holder`` is surely dead, judged from ``place`` (this process's) with
    ``started_of(pid)`` (a live process's start time, None if there is none): only a
    process of this very pid namespace can be judged."""
    return holder.place == place and started_of(holder.pid) != holder.started


def _decode(value: bytes | None) -> Holder | None:
    try:
        return msgspec.json.decode(value or b"", type=Holder)
    except msgspec.DecodeError:  # empty, or written by an older version: wait it out
        return None


class Lease:
    """Holds a KV key while renewing it; another instance gets it once this one stops
    renewing, or at once when its holder's process is gone (see the module)."""

    def __init__(self, kv: KeyValue, key: str, holder: str) -> None:
        self.kv, self.key, self.holder = kv, key, holder
        self.revision: int | None = None
        self._renewed = 0.0
        try:
            me = Holder(holder, processes.place(), os.getpid(), processes.start_time(os.getpid()) or 0)
            self._value = msgspec.json.encode(me)
        except OSError:  # no /proc: holders are only waited out
            self._value = msgspec.json.encode({"instance": holder})

    async def _take_over(self) -> int | None:
        """The key's new revision if its holder is surely dead and this CAS won."""
        try:
            entry = await self.kv.get(self.key)
        except nats.js.errors.KeyNotFoundError:
            return None
        holder = _decode(entry.value)
        if holder is None or holder.instance == self.holder:
            return None
        if not gone(holder, processes.place(), processes.start_time):
            return None
        revision = await self.kv.update(self.key, self._value, last=entry.revision)
        log.info("lease.taken_over", key=self.key, dead=holder.instance)
        return revision

    async def hold(self, *, fresh_for: float = 0.0) -> bool:
        """Take or renew the lease; True while this instance holds it. ``fresh_for``: if
        the last renewal is younger than this, say so without writing (a loop that asks
        before every round, up to ten times a second, need not write every time)."""
        if self.revision is not None and time.monotonic() - self._renewed < fresh_for:
            return True
        asked = time.monotonic()  # the key lives TTL from its write, which is after this
        try:
            if self.revision is None:
                try:
                    self.revision = await self.kv.create(self.key, self._value)
                except nats.js.errors.KeyWrongLastSequenceError:
                    self.revision = await self._take_over()
                    if self.revision is None:
                        return False
            else:
                self.revision = await self.kv.update(self.key, self._value, last=self.revision)
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


@dataclass(frozen=True)
class Pace:
    """When a leader's rounds come."""

    interval: float
    """Seconds between rounds, unless woken."""
    min_gap: float = 0.0
    """At least this between rounds, even when woken: events that come during a round or
    just after it wait for one more round together."""
    wake: asyncio.Event | None = None
    """Set when a round is wanted sooner (at most ``min_gap`` after the last)."""


async def lead(
    lease: Lease,
    round_: Callable[[], Awaitable[T]],
    *,
    name: str,
    pace: Pace,
    on_round: Callable[[T], None] | None = None,
    on_standby: Callable[[], None] | None = None,
    backoff: Callable[[T, float], float] | None = None,
    disable_on: tuple[type[errors.SandboxError], ...] = (),
    on_disabled: Callable[[errors.SandboxError], None] | None = None,
) -> None:
    """Rounds of work only one instance should do, for as long as the task runs: each
    round while this instance holds ``lease`` (renewed during it; a round whose lease is
    lost is cancelled), none while another does. A round's failure is logged and the
    next round tries again; an error of ``disable_on`` (retrying cannot fix it) stops the
    rounds for good and lets the lease go. ``backoff(result, delay)``: the delay before
    the next round; while it is longer than ``pace.interval``, wake-ups do not cut it
    short."""
    delay = pace.interval
    try:
        while True:
            if await lease.hold(fresh_for=FRESH_SECONDS):
                try:
                    result = await while_held(lease, round_())
                    if result is not None:
                        delay = backoff(result, delay) if backoff is not None else pace.interval
                        if on_round is not None:
                            on_round(result)
                except disable_on as exc:
                    log.error(f"{name}.disabled", error=exc.message)
                    if on_disabled is not None:
                        on_disabled(exc)
                    await lease.release()
                    await asyncio.Event().wait()
                except errors.SandboxError as exc:
                    log.warning(f"{name}.round_failed", error=exc.message)
            elif on_standby is not None:
                on_standby()
            await asyncio.sleep(pace.min_gap)
            if pace.wake is None or delay > pace.interval:
                await asyncio.sleep(max(0.0, delay - pace.min_gap))
            else:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(max(0.0, delay - pace.min_gap)):
                        await pace.wake.wait()
            if pace.wake is not None:
                pace.wake.clear()
    finally:
        await lease.release()

"""Pure pool sizing: how many idle sandboxes a configured pool keeps, from recent demand.

A pool keeps its floor (``min_idle``) plus the largest number of new sessions it had to
serve within any ``horizon`` seconds of the last ``window`` seconds (claims from it, and
cold starts it could have served), up to a cap (and, as ever, ``max_running``). So a
burst of 50 at once teaches the pool to hold 50 more for the next ``window``; a quiet
pool shrinks back to its floor. The refill's own pacing (``held``) keeps it from
starting sandboxes while a burst is still being served.

No I/O, no clock: times are ``time.monotonic`` seconds passed in.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Sizing:
    """How a configured pool sizes itself (``SBX_POOL_AUTOSIZE``, ``SBX_POOL_MAX_IDLE``,
    ``SBX_POOL_HORIZON``, ``SBX_POOL_DEMAND_WINDOW``)."""

    enabled: bool = True
    max_idle: int = 100
    """Most idle sandboxes a pool keeps however busy it was (its floor may be higher)."""
    horizon: float = 10.0
    """Seconds of its busiest recent demand a pool keeps ready."""
    window: float = 600.0
    """How far back demand is remembered; after as long without it, the pool is at its floor."""


def peak(times: Iterable[float], now: float, sizing: Sizing) -> int:
    """The most demand times within any ``horizon``-second span of the last ``window``
    seconds (``times`` in any order; those older than the window are ignored)."""
    recent = sorted(t for t in times if now - sizing.window <= t <= now)
    best, start = 0, 0
    for end, t in enumerate(recent):
        while t - recent[start] >= sizing.horizon:
            start += 1
        best = max(best, end - start + 1)
    return best


def target(floor: int, demand: int, sizing: Sizing) -> int:
    """Idle sandboxes to keep: the floor, plus the recent peak demand up to the cap."""
    if not sizing.enabled:
        return floor
    return max(floor, min(floor + demand, sizing.max_idle))


class Demand:
    """Recent demand per pool (claims and cold starts it could have served), bounded: at
    most ``KEPT`` times per pool, the oldest dropped first."""

    KEPT = 10_000

    def __init__(self, sizing: Sizing) -> None:
        self.sizing = sizing
        self._times: dict[str, collections.deque[float]] = {}

    def add(self, pool_id: str, now: float) -> None:
        times = self._times.setdefault(pool_id, collections.deque(maxlen=self.KEPT))
        times.append(now)
        while times and now - times[0] > self.sizing.window:
            times.popleft()

    def peak(self, pool_id: str, now: float) -> int:
        return peak(self._times.get(pool_id, ()), now, self.sizing)

    def target(self, pool_id: str, floor: int, now: float) -> int:
        return target(floor, self.peak(pool_id, now), self.sizing)

"""Pure warm-pool decisions: how many sandboxes to make or remove, as a function of state.

A pool is identified by its name *and* a hash of its spec, so changing the spec (say,
the image) makes a new pool: idle sandboxes of the old one are removed, claimed ones are
never touched, and the new pool fills up. A pool with more idle sandboxes than its
``min_idle`` (lowered, say) gives back the oldest; an idle sandbox older than the
maximum age is recycled (removed, and the refill makes a fresh one).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime

from shared.contract import states
from shared.domain import pools as pool_specs
from shared.domain import sandbox as sandbox_rules

PoolSpec = pool_specs.PoolSpec

SNAPSHOT_QUIET = 2.0
"""Seconds without a claim before a snapshot's pool is refilled: a burst of forks runs its
first commands without the refill's sandbox starts taking the CPU from them (100 forks
on 2 cores, bench/snapshots.py)..."""
SNAPSHOT_HOLD_MAX = 10.0
"""...but never held longer than this from its burst's first claim (forks coming one
every second or two still find the pool refilled)."""
CLAIM_QUIET = 0.3
"""A configured pool is not refilled while its claims come closer together than this: the
sandbox starts would take the CPU from the sessions being served (a burst of 50 at once
on 2 cores, bench/burst.py)..."""
CLAIM_HOLD_MAX = 2.0
"""...but never held longer than this from the burst's first claim (a steady stream of
claims is refilled as it goes)."""
SNAPSHOT_RETRY = 30.0
"""A snapshot's pool whose sandbox failed to start is left alone this long (its failure
is its own: the other pools go on)."""


@dataclass(frozen=True)
class Claims:
    """A pool's claims as the pool-manager heard them (``time.monotonic`` seconds)."""

    first: float
    """The first claim of the current burst (after a quiet of SNAPSHOT_QUIET)."""
    last: float

    def after(self, now: float, quiet: float = SNAPSHOT_QUIET) -> Claims:
        """These claims and one more at ``now`` (a new burst after ``quiet`` seconds without one)."""
        return Claims(now if now - self.last >= quiet else self.first, now)


@dataclass(frozen=True)
class Plan:
    create: dict[str, int]
    """pool_id -> how many to provision now."""
    remove: list[str]
    """Idle sandboxes to remove: of pools that no longer exist (spec changed), above a
    pool's ``min_idle`` (oldest first), or older than the maximum age."""
    running: int
    idle: dict[str, int]
    """pool_id -> idle sandboxes now (those to remove included)."""


def idle(sandbox: states.SandboxState) -> bool:
    """An unclaimed pool sandbox, ready or being made (only a session's is ever paused)."""
    return (
        sandbox.pool is not None and sandbox.session_id is None and sandbox.status in ("requested", "running")
    )


def leaves_room(old: states.SandboxState | None, new: states.SandboxState | None) -> bool:
    """Whether a sandbox's change may leave a pool short: an idle one claimed or gone, or
    a live one gone (room under ``max_running``). Pure; ``None`` is absent."""
    if old is None or old.status not in sandbox_rules.HOLDING:
        return False
    if new is None or new.status not in sandbox_rules.HOLDING:
        return True
    return idle(old) and not idle(new)


def held(
    pools: Iterable[PoolSpec],
    claims: Mapping[str, Claims],
    now: float,
    failed: Mapping[str, float] | None = None,
) -> frozenset[str]:
    """The pools not refilled now. A snapshot's pool: claimed from within SNAPSHOT_QUIET
    (its forks are still coming, unless the burst began SNAPSHOT_HOLD_MAX ago), or failed
    within SNAPSHOT_RETRY (``failed``: when). A configured pool: claimed from within
    CLAIM_QUIET, unless its burst began CLAIM_HOLD_MAX ago (its failures are everyone's:
    never held for them)."""
    failed = failed or {}
    out = set()
    for pool in pools:
        seen = claims.get(pool.pool_id)
        if pool.snapshot is None:
            if seen is not None and now - seen.last < CLAIM_QUIET and now - seen.first < CLAIM_HOLD_MAX:
                out.add(pool.pool_id)
            continue
        if seen is not None and now - seen.last < SNAPSHOT_QUIET and now - seen.first < SNAPSHOT_HOLD_MAX:
            out.add(pool.pool_id)
        if now - failed.get(pool.pool_id, -math.inf) < SNAPSHOT_RETRY:
            out.add(pool.pool_id)
    return frozenset(out)


def plan(
    sandboxes: Iterable[states.SandboxState],
    pools: Iterable[PoolSpec],
    max_running: int,
    *,
    now: datetime | None = None,
    max_age: float | None = None,
    hold: Collection[str] = (),
) -> Plan:
    """Refill every pool up to ``min_idle`` without taking the total past ``max_running``
    (none for the pools in ``hold`` this time); give back what a pool has above
    ``min_idle`` and, given ``now``, recycle idle sandboxes older than ``max_age`` seconds.
    Only running idle sandboxes are removed: one still being made counts towards its pool
    but is left to finish."""
    pools = list(pools)
    current = {p.pool_id: p for p in pools}
    running = 0
    idle_by_pool = dict.fromkeys(current, 0)
    ready: dict[str, list[states.SandboxState]] = {pool_id: [] for pool_id in current}
    remove: list[str] = []
    kept: dict[str, int] = {}
    for sandbox in sandboxes:
        if sandbox.status not in sandbox_rules.HOLDING:
            continue
        running += 1
        if not idle(sandbox):
            continue
        if sandbox.pool not in current:
            remove.append(sandbox.sandbox_id)
            continue
        assert sandbox.pool is not None
        idle_by_pool[sandbox.pool] += 1
        if sandbox.status == "running":
            ready[sandbox.pool].append(sandbox)
    for pool_id, spec in current.items():
        oldest_first = sorted(ready[pool_id], key=lambda s: (s.created_at, s.sandbox_id))
        surplus = max(0, idle_by_pool[pool_id] - spec.min_idle)
        gone = oldest_first[: min(surplus, len(oldest_first))]
        if now is not None and max_age is not None:
            gone += [s for s in oldest_first[len(gone) :] if (now - s.created_at).total_seconds() >= max_age]
        remove += [s.sandbox_id for s in gone]
        kept[pool_id] = idle_by_pool[pool_id] - len(gone)
    # Removals happen in the same round as creations, so they free no room until the next.
    budget = max(0, max_running - running)
    create: dict[str, int] = {}
    for pool in pools:
        want = 0 if pool.pool_id in hold else min(max(0, pool.min_idle - kept[pool.pool_id]), budget)
        if want:
            create[pool.pool_id] = want
            budget -= want
    return Plan(create=create, remove=sorted(remove), running=running, idle=idle_by_pool)


def over_limit(sandboxes: Iterable[states.SandboxState], max_running: int) -> tuple[bool, int]:
    """Whether one more sandbox would exceed ``max_running`` (and how many run now)."""
    running = sum(1 for s in sandboxes if s.status in sandbox_rules.HOLDING)
    return running >= max_running, running


def short_of_offers(idle: Mapping[str, int], waiting: Mapping[str, int]) -> set[str]:
    """Pools with fewer offers waiting in the work queue than idle sandboxes: one was
    lost (a crash between a sandbox's start and its offer), so theirs are offered again."""
    return {pool for pool, count in idle.items() if waiting.get(pool, 0) < count}

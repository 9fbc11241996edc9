"""Pure warm-pool decisions: how many sandboxes to make or remove, as a function of state.

A pool is identified by its name *and* a hash of its spec, so changing the spec (say,
the image) makes a new pool: idle sandboxes of the old one are removed, claimed ones are
never touched, and the new pool fills up.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from shared.contract import states
from shared.domain import pools as pool_specs

PoolSpec = pool_specs.PoolSpec

LIVE = ("requested", "running")


@dataclass(frozen=True)
class Plan:
    create: dict[str, int]
    """pool_id -> how many to provision now."""
    remove: list[str]
    """Idle sandboxes of pools that no longer exist (spec changed)."""
    running: int
    idle: dict[str, int]


def idle(sandbox: states.SandboxState) -> bool:
    return sandbox.pool is not None and sandbox.session_id is None and sandbox.status in LIVE


def leaves_room(old: states.SandboxState | None, new: states.SandboxState | None) -> bool:
    """Whether a sandbox's change may leave a pool short: an idle one claimed or gone, or
    a live one gone (room under ``max_running``). Pure; ``None`` is absent."""
    if old is None or old.status not in LIVE:
        return False
    if new is None or new.status not in LIVE:
        return True
    return idle(old) and not idle(new)


def plan(sandboxes: Iterable[states.SandboxState], pools: Iterable[PoolSpec], max_running: int) -> Plan:
    """Refill every pool up to ``min_idle`` without taking the total past ``max_running``."""
    pools = list(pools)
    current = {p.pool_id for p in pools}
    running = 0
    idle_by_pool = dict.fromkeys(current, 0)
    remove: list[str] = []
    for sandbox in sandboxes:
        if sandbox.status not in LIVE:
            continue
        running += 1
        if idle(sandbox):
            if sandbox.pool in current:
                idle_by_pool[sandbox.pool] += 1
            else:
                remove.append(sandbox.sandbox_id)
    # Removals happen in the same round as creations, so they free no room until the next.
    budget = max(0, max_running - running)
    create: dict[str, int] = {}
    for pool in pools:
        want = min(max(0, pool.min_idle - idle_by_pool[pool.pool_id]), budget)
        if want:
            create[pool.pool_id] = want
            budget -= want
    return Plan(create=create, remove=sorted(remove), running=running, idle=idle_by_pool)


def over_limit(sandboxes: Iterable[states.SandboxState], max_running: int) -> tuple[bool, int]:
    """Whether one more sandbox would exceed ``max_running`` (and how many run now)."""
    running = sum(1 for s in sandboxes if s.status in LIVE)
    return running >= max_running, running

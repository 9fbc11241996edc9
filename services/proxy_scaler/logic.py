"""Pure fleet decisions: how many proxies, which to drain or stop, where each sandbox goes.

A function of recorded state (sandboxes, proxies), what is alive, the ratio and the
time; no I/O. The caller appends the events and applies them to the fleet.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime

from shared.contract import states
from shared.domain import sandbox as sandbox_rules


@dataclass(frozen=True)
class Plan:
    died: tuple[str, ...] = ()
    """Proxies recorded as running or draining whose process is gone."""
    start: int = 0
    """New proxies to start."""
    drain: tuple[str, ...] = ()
    """Running proxies to take out of service (their sandboxes move now)."""
    stop: tuple[str, ...] = ()
    """Draining proxies whose grace period is over."""
    assign: dict[str, str] = field(default_factory=dict)
    """sandbox_id → proxy_id, for sandboxes without a serving proxy."""
    room: int = 0
    """Sandboxes the serving proxies can still take once this plan is applied, less the
    requested ones (negative: requests wait for a proxy to start)."""


def wanted(active_sandboxes: int, per_proxy: int) -> int:
    """About one proxy per ``per_proxy`` sandboxes; none when no sandbox is wanted."""
    return math.ceil(active_sandboxes / per_proxy) if active_sandboxes else 0


def plan(
    sandboxes: Iterable[states.SandboxState],
    proxies: Iterable[states.ProxyState],
    alive: set[str],
    *,
    per_proxy: int,
    drain_grace: float,
    now: datetime,
    keep_one: bool = False,
    can_start: bool = True,
) -> Plan:
    """``keep_one``: keep a proxy even with no sandbox (the stack was busy or started
    recently), so the next sandbox does not wait for a proxy to start. ``can_start``:
    False while starting proxies fails (no free port, a config that stops them); then
    full proxies take more sandboxes rather than leaving them without a way out."""
    sandboxes, proxies = list(sandboxes), list(proxies)
    # Requested sandboxes count: the first proxy starts while the first sandbox does.
    active = [s for s in sandboxes if s.status in sandbox_rules.HOLDING]
    running = sorted((s for s in sandboxes if s.status in sandbox_rules.ROUTED), key=lambda s: s.sandbox_id)
    died = tuple(
        p.proxy_id for p in proxies if p.status in ("running", "draining") and p.proxy_id not in alive
    )
    live = [p for p in proxies if p.status == "running" and p.proxy_id in alive]
    load = Counter(s.proxy_id for s in running if s.proxy_id)
    want = wanted(len(active), per_proxy) or (1 if keep_one else 0)
    drain: tuple[str, ...] = ()
    if len(live) > want:
        extra = sorted(live, key=lambda p: (load[p.proxy_id], p.proxy_id))[: len(live) - want]
        drain = tuple(p.proxy_id for p in extra)
    serving = {p.proxy_id: load[p.proxy_id] for p in live if p.proxy_id not in drain}
    start = max(0, want - len(live))
    assign: dict[str, str] = {}
    for sandbox in running:
        if sandbox.proxy_id in serving:
            continue
        # Proxies with room first; when all are full and more are starting, the sandbox
        # waits a round for a new one rather than overloading the old ones.
        with_room = {pid: n for pid, n in serving.items() if n < per_proxy}
        choices = with_room or ({} if start and can_start else serving)
        if not choices:
            continue
        target = min(choices, key=lambda pid: (choices[pid], pid))
        assign[sandbox.sandbox_id] = target
        serving[target] += 1
    stop = tuple(
        p.proxy_id
        for p in proxies
        if p.status == "draining"
        and p.proxy_id in alive
        and (now - p.updated_at).total_seconds() >= drain_grace
    )
    requested = sum(1 for s in active if s.status == "requested")
    room = sum(max(0, per_proxy - n) for n in serving.values()) - requested
    return Plan(died=died, start=start, drain=drain, stop=stop, assign=assign, room=room)


@dataclass(frozen=True)
class ReplicaPlan:
    """For a fleet behind a load-balanced address (Kubernetes: a Deployment and its
    Service), where the platform chooses which proxy goes and no sandbox is routed."""

    replicas: int
    started: dict[str, str] = field(default_factory=dict)
    """Serving proxies not recorded yet: proxy_id → endpoint."""
    stopped: dict[str, str] = field(default_factory=dict)
    """Recorded proxies no longer serving: proxy_id → ``drained`` (the fleet was larger
    than wanted) or ``died`` (the platform replaces it)."""
    room: int = 0
    """Sandboxes the serving proxies can still take (as ``Plan.room``)."""


def is_new_request(old: states.SandboxState | None, new: states.SandboxState | None) -> bool:
    return old is None and new is not None and new.status == "requested"


def wants_round(
    old: states.SandboxState | None, new: states.SandboxState | None, *, room: int, routed: bool
) -> bool:
    """Whether a sandbox's change needs a round now rather than the next periodic one:
    it started running where sandboxes are routed (it needs its route, and its start
    waits for it), or it was requested and the serving proxies have no room left for it
    (``room``, counting this request: a proxy starts while the sandbox does)."""
    if new is None:
        return False
    if new.status == "running":
        return routed and (old is None or old.status != "running")
    return is_new_request(old, new) and room < 0


def replica_plan(
    sandboxes: Iterable[states.SandboxState],
    proxies: Iterable[states.ProxyState],
    serving: dict[str, str],
    *,
    per_proxy: int,
    keep_one: bool = False,
) -> ReplicaPlan:
    active = sum(1 for s in sandboxes if s.status in sandbox_rules.HOLDING)
    want = wanted(active, per_proxy) or (1 if keep_one else 0)
    recorded = {p.proxy_id for p in proxies if p.status in ("running", "draining")}
    reason = "drained" if len(recorded) > want else "died"
    return ReplicaPlan(
        replicas=want,
        started={pid: endpoint for pid, endpoint in sorted(serving.items()) if pid not in recorded},
        stopped={pid: reason for pid in sorted(recorded - set(serving))},
        room=len(serving) * per_proxy - active,
    )

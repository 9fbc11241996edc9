"""Keeping the warm pool full: one instance at a time (a lease in KV), any instance can take over.

As soon as a sandbox is claimed or goes away (``wake``, set by the pool-manager's
followed copy of the sandboxes once the change is in the bucket), and at least every
``INTERVAL``, the lease holder reads the sandboxes projection, asks the pure
``logic.plan`` what to do, provisions what is missing (each new sandbox is recorded,
started, then offered on the pool's work queue), removes idle sandboxes of pools whose
spec changed (or whose snapshot is no longer kept warm, or was deleted), and every
``REOFFER_EVERY`` re-offers the idle sandboxes of any pool with fewer offers waiting than
idle sandboxes (de-duplicated by id, so an offer lost to a crash between start and offer
is made good). The pools are the configured ones and one per snapshot kept warm
(``snapshot.warm_set``), read again every round.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any

import structlog

from sbx_api import errors
from services.pool_manager import handlers, logic
from shared.contract import execution, ids, provisioning, states
from shared.domain import pools as pool_specs
from shared.infrastructure import leases, metrics, projector, rpc, service, tracing, warmpool

log = structlog.get_logger(__name__)

INTERVAL = 2.0
"""Rounds without any wake-up (a pool whose spec changed, an offer to make good)."""
MIN_GAP = 0.5
"""Rounds start at least this far apart, however many claims come: a round batches the
claims of a burst, and stays out of the way of the claiming agents' first calls (warm
first shell at 10 claims/s on 2 cores, bench probe of 40 sessions, two runs each: p50
~20 ms with 0.1 s, ~18 ms with 0.3 s, ~17 ms with 0.5 s)."""
MAX_BACKOFF = 30.0
REOFFER_EVERY = 10.0
"""Seconds between rounds that offer every idle sandbox again."""
LEASE_KEY = "pool-refill"
CREATE_AT_ONCE = 2
"""Pool sandboxes created at the same time. Refilling is CPU-bound (namespaces, mounts,
network); a round that made every missing sandbox at once took the CPU from the claims
it refills after (warm first shell at 10 claims/s on 2 cores: p50 46 -> 33 ms, bench/agents.py).
Two at a time still refill about 40 sandboxes a second there."""


Pools = Callable[[], Awaitable[list[logic.PoolSpec]]]
"""The pools to keep full now: the configured ones and those of the snapshots kept warm."""


def pools_with_snapshots(
    configured: Callable[[], list[logic.PoolSpec]],
    snapshots: projector.ProjectionStore[states.SnapshotState],
) -> Pools:
    """``configured``: the configured pools as sized now (``shared.domain.poolsizing``)."""

    async def current() -> list[logic.PoolSpec]:
        return configured() + pool_specs.warm_snapshots((await snapshots.all()).values())

    return current


async def run(
    ctx: service.Context,
    pool: handlers.PoolHandlers,
    pools: Pools,
    max_running: int,
    wake: asyncio.Event | None = None,
    *,
    max_age: float | None = None,
    claimed: Mapping[str, logic.Claims] | None = None,
) -> None:
    """Refill rounds while this instance holds the lease; ``wake``: set when a pool may
    be short (a round then starts at most MIN_GAP after the last); ``claimed``: when each
    pool was claimed from (``time.monotonic``), which holds back snapshots' pools."""
    lease = leases.Lease(await ctx.key_value(ctx.topology.leases_bucket), LEASE_KEY, ctx.settings.instance)
    reoffered = -REOFFER_EVERY
    failed: dict[str, float] = {}
    """A snapshot's pool -> when one of its sandboxes last failed to start."""

    async def round_() -> int:
        nonlocal reoffered
        ctx.details["pool"] = "filling"
        reoffer = time.monotonic() - reoffered >= REOFFER_EVERY
        if reoffer:
            reoffered = time.monotonic()
        current = await pools()
        hold = logic.held(current, claimed or {}, time.monotonic(), failed)
        return await refill_once(
            ctx, pool, current, max_running, reoffer=reoffer, max_age=max_age, hold=hold, failed=failed
        )

    def backoff(failures: int, delay: float) -> float:
        """Failing provisions back off (up to 30 s) instead of flooding the stream."""
        return INTERVAL if not failures else min(max(delay, INTERVAL) * 2, MAX_BACKOFF)

    def standby() -> None:
        ctx.details["pool"] = "standby"

    def disabled(exc: errors.SandboxError) -> None:  # e.g. no cgroups: keep serving requests
        ctx.details["pool"] = f"disabled: {exc.message[:120]}"

    await leases.lead(
        lease,
        round_,
        name="pool.refill",
        pace=leases.Pace(INTERVAL, MIN_GAP, wake or asyncio.Event()),
        backoff=backoff,
        on_standby=standby,
        disable_on=(errors.ConfigError,),
        on_disabled=disabled,
    )


async def refill_once(
    ctx: service.Context,
    pool: handlers.PoolHandlers,
    pools: list[logic.PoolSpec],
    max_running: int,
    *,
    reoffer: bool,
    max_age: float | None = None,
    hold: frozenset[str] = frozenset(),
    failed: dict[str, float] | None = None,
) -> int:
    """One round; returns how many steps failed. A configuration error (no cgroups, say)
    is raised: retrying cannot fix it. ``hold``: pools not refilled this round. A
    snapshot's pool's failure is its own (noted in ``failed``, which holds that pool back
    for a while): neither raised nor counted, so it never stops or slows the others."""
    failed = {} if failed is None else failed
    sandboxes = list((await pool.sandboxes.all()).values())
    plan = logic.plan(sandboxes, pools, max_running, now=service.now(), max_age=max_age, hold=hold)
    by_state = collections.Counter(s.status for s in sandboxes)
    for state in ("requested", "running", "paused", "stopped"):
        metrics.pool_sandboxes.labels(state).set(by_state.get(state, 0))
    metrics.pool_sandboxes.labels("idle").set(sum(plan.idle.values()))
    by_id = {p.pool_id: p for p in pools}
    jobs = _creations(ctx, pool, plan, by_id, failed)
    for sandbox_id in plan.remove:
        jobs.append(pool.retire(sandbox_id))
    if reoffer:
        # Only a pool with fewer offers waiting than idle sandboxes lost one (a crash
        # between start and offer): its idle sandboxes are offered again (duplicates are
        # dropped by id). Others cost one count, not a message per idle sandbox.
        offerable = [s for s in sandboxes if logic.idle(s) and s.status == "running" and s.pool in by_id]
        waiting = await warmpool.waiting_offers(ctx.js, ctx.topology)
        short = logic.short_of_offers(
            collections.Counter(s.pool for s in offerable if s.pool is not None),
            {p: waiting.get(ctx.topology.pool_offers(p), 0) for p in by_id},
        )
        for sandbox in offerable:
            if sandbox.pool in short:
                jobs.append(warmpool.offer(ctx.js, ctx.topology, sandbox.pool, sandbox.sandbox_id))
        # Pools with idle sandboxes are still in use: their offers are for those.
        in_use = set(by_id) | {s.pool for s in sandboxes if logic.idle(s) and s.pool}
        jobs.append(_drop_unused(ctx, in_use))
    results = await asyncio.gather(*jobs, return_exceptions=True)
    failures = [r for r in results if isinstance(r, Exception)]
    for failure in failures:
        if isinstance(failure, errors.ConfigError):
            raise failure
        log.warning("pool.refill_step_failed", error=repr(failure))
    # Losing max_running to sessions' own sandboxes is no reason to back off: the next
    # sandbox that goes away wakes the refill.
    failures = [f for f in failures if not isinstance(f, errors.LimitExceeded)]
    for key in [k for k in ctx.details if k.startswith("idle:")]:
        del ctx.details[key]  # (a snapshot no longer kept warm is not reported any more)
    for pool_id, count in plan.idle.items():
        ctx.details[f"idle:{by_id[pool_id].name}"] = str(count + plan.create.get(pool_id, 0))
    return len(failures)


def _creations(
    ctx: service.Context,
    pool: handlers.PoolHandlers,
    plan: logic.Plan,
    by_id: dict[str, logic.PoolSpec],
    failed: dict[str, float],
) -> list[Coroutine[Any, Any, object]]:
    """The plan's new sandboxes, CREATE_AT_ONCE at a time (a snapshot's pool's on its own)."""
    pace = asyncio.Semaphore(CREATE_AT_ONCE)
    jobs: list[Coroutine[Any, Any, object]] = []
    for pool_id, count in plan.create.items():
        spec = by_id[pool_id]
        for _ in range(count):
            request = provisioning.Provision(
                sandbox_id="sb-" + ids.new_id()[:20],
                command_id=ids.new_id(),
                image=spec.image,
                run_as_root=spec.run_as_root,
                writable_root=spec.writable_root,
                pool=pool_id,
                org_id=spec.org,
                snapshot=spec.snapshot,
            )
            make = _make(ctx, pool, request)
            if spec.snapshot is not None:
                make = _on_its_own(make, pool_id, failed)
            jobs.append(_paced(pace, make))
    return jobs


async def _on_its_own(make: Coroutine[Any, Any, None], pool_id: str, failed: dict[str, float]) -> None:
    """A snapshot's pool's sandbox: what goes wrong is logged and noted for that pool."""
    try:
        await make
    except errors.SandboxError as exc:
        failed[pool_id] = time.monotonic()
        log.warning(
            "pool.snapshot_pool_failed", pool_id=pool_id, error=exc.message, retry_in=logic.SNAPSHOT_RETRY
        )
    for stale in [p for p, when in failed.items() if time.monotonic() - when >= logic.SNAPSHOT_RETRY]:
        del failed[stale]


async def _drop_unused(ctx: service.Context, in_use: set[str]) -> None:
    """The claims consumer and stale offers of each snapshot's pool no longer in use."""
    for pool_id in await warmpool.drop_snapshot_pools(ctx.js, ctx.topology, in_use):
        log.info("pool.snapshot_pool_dropped", pool_id=pool_id)


#: Run once in every new pool sandbox before it is offered, when no executor prepared it:
#: the first command entering a fresh sandbox pays about 10 ms of one-off set-up that the
#: agent's first call then skips.
WARM_UP = ["/bin/sh", "-c", "command -v bash >/dev/null && exec bash -c true; true"]
PREPARE_TIMEOUT = 10.0


async def _prepared_by_executor(ctx: service.Context, sandbox_id: str) -> bool:
    """Ask an executor to start the sandbox's shell server now, so the claiming session's
    first ``shell`` call finds it running (tens of milliseconds less on a small machine)."""
    request = execution.Prepare(sandbox_id=sandbox_id)
    try:
        reply = await rpc.Client(ctx.nc, ctx.topology, rpc.PREPARE).ask(request, timeout=PREPARE_TIMEOUT)
    except Exception as exc:  # no executor, a slow one, a garbled answer: warm it up here
        log.info("pool.prepare_skipped", sandbox_id=sandbox_id, error=repr(exc))
        return False
    if not reply.ok and reply.error is not None:
        log.info("pool.prepare_refused", sandbox_id=sandbox_id, error=reply.error.message)
    return reply.ok and reply.status == "running"


async def _paced(pace: asyncio.Semaphore, job: Coroutine[Any, Any, None]) -> None:
    async with pace:
        await job


async def _make(ctx: service.Context, pool: handlers.PoolHandlers, request: provisioning.Provision) -> None:
    """One pool sandbox: provisioned, prepared, offered (one trace; a claim links to it)."""
    with tracing.span("pool-manager/refill", attributes=tracing.message_attributes(request)):
        await _make_traced(ctx, pool, request)


async def _make_traced(
    ctx: service.Context, pool: handlers.PoolHandlers, request: provisioning.Provision
) -> None:
    state = await pool.provision(request, fresh=True)
    assert request.pool is not None
    if state.status == "running" and state.session_id is None:
        if not await _prepared_by_executor(ctx, request.sandbox_id):
            try:
                await pool.runtime.run(request.sandbox_id, WARM_UP, timeout=10)
            except errors.SandboxError as exc:
                log.warning("pool.warm_up_failed", sandbox_id=request.sandbox_id, error=exc.message)
        await warmpool.offer(ctx.js, ctx.topology, request.pool, request.sandbox_id)

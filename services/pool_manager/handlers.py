"""Thin glue: provisioning requests → events around runtime calls.

Every transition is recorded as an event *before* the runtime is asked where the
runtime call could leave something behind (``sandbox.requested`` precedes creation),
and after it where the event reports what happened (``sandbox.started``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

import structlog
from nats.js.kv import KeyValue

from sbx_api import errors
from services.pool_manager import logic
from services.pool_manager import snapshots as pool_snapshots
from shared.contract import events, ids, provisioning, references, states, subjects
from shared.domain import sandbox as sandbox_rules
from shared.infrastructure import aggregates, faults, leases, metrics, projector, rpc, service
from shared.runtime import api

log = structlog.get_logger(__name__)

ADMISSION_KEY = "pool-admission"
PROXY_WAIT = 20.0
"""How long a new sandbox waits for its proxy assignment (proxy egress) before it is used anyway."""
PROXY_RECHECK = 1.0
"""A start waiting for its proxy reads the record itself when it has heard nothing for this
long (it is told of each change by the followed copy and looks there: no read)."""
ADMISSION_WAIT = 15.0
"""How long a provision waits for another instance's admission to finish."""


class PoolHandlers:
    def __init__(
        self,
        ctx: service.Context,
        runtime: api.Runtime,
        sandboxes: projector.ProjectionStore[states.SandboxState],
        limits: api.Limits,
        max_running: int = 1_000_000,
        leases_kv: KeyValue | None = None,
        snapshots: pool_snapshots.SnapshotHandlers | None = None,
    ) -> None:
        self.ctx = ctx
        self.runtime = runtime
        self.sandboxes = sandboxes
        self.limits = limits
        self.max_running = max_running
        self.leases_kv = leases_kv
        self._admission = asyncio.Lock()
        self._awaiting: dict[str, set[asyncio.Event]] = {}
        self._pulls: dict[str, asyncio.Future[api.PulledImage | None]] = {}
        self._snapshots = snapshots

    @property
    def snapshots(self) -> pool_snapshots.SnapshotHandlers:
        if self._snapshots is None:
            raise errors.NotBuiltYet("this pool-manager was started without snapshots")
        return self._snapshots

    @contextlib.asynccontextmanager
    async def _admitting(self) -> AsyncIterator[None]:
        """Count-then-record under one lock for all pool-manager instances: a lock in this
        process, then a short lease in KV (``pool-admission``) shared by every instance,
        so two instances admitting at once never take the total past ``max_running``.
        A holder that dies releases it by expiry."""
        async with self._admission:
            if self.leases_kv is None:
                yield
                return
            lease = leases.Lease(self.leases_kv, ADMISSION_KEY, self.ctx.settings.instance)
            deadline = time.monotonic() + ADMISSION_WAIT
            delay = 0.002
            while not await lease.hold():
                if time.monotonic() > deadline:
                    raise errors.Unavailable("another pool-manager is admitting sandboxes; retry shortly")
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.05)
            try:
                yield
            finally:
                await lease.release()

    async def handle(self, raw: bytes) -> bytes:
        return await rpc.answer(rpc.POOL, raw, self._answer, crashed="pool.request_crashed")

    async def _answer(self, request: provisioning.AnyPoolRequest) -> provisioning.PoolReply:
        state: states.SandboxState | None
        match request:
            case provisioning.Provision():
                ids.validate_attribution(request.org_id, what="org_id")
                state = await self.provision(request)
            case provisioning.Start():
                state = await self.start(request)
            case provisioning.Stop():
                state = await self.stop(request)
            case provisioning.Delete():
                state = await self.delete(request)
            case provisioning.Pause():
                state = await self.pause(request)
            case provisioning.Resume():
                state = await self.resume(request, request.reason)
            case provisioning.Snapshot():
                return provisioning.PoolReply(ok=True, snapshot=await self.snapshots.take(request))
            case provisioning.DropSnapshot():
                return provisioning.PoolReply(ok=True, snapshot=await self.snapshots.drop(request))
        return provisioning.PoolReply(ok=True, sandbox=state)

    def _meta(self, request: provisioning.PoolRequest, session_id: str | None = None) -> events.Meta:
        return self.ctx.meta(
            command_id=request.command_id,
            correlation_id=request.correlation_id,
            actor=request.actor,
            session_id=session_id,
        )

    async def _record(
        self,
        request: provisioning.PoolRequest,
        decide: Callable[..., list[events.Event]],
        read: tuple[states.SandboxState | None, int | None] | None = None,
        **fields: object,
    ) -> states.SandboxState | None:
        """Record what ``decide`` (a rule of ``shared.domain.sandbox``) makes of the
        sandbox's current state (``read``: as this instance last wrote it, if it knows)."""

        def meta(session_id: str | None) -> events.Meta:
            return self._meta(request, session_id)

        outcome = await aggregates.transact(
            self.sandboxes,
            request.sandbox_id,
            lambda state: decide(state, request.sandbox_id, meta, **fields),
            read=read,
        )
        return outcome.state

    async def _refuse_if_full(self, request: provisioning.Provision) -> None:
        full, running = logic.over_limit((await self.sandboxes.all()).values(), self.max_running)
        if full and request.session_id is not None and await self._evict_idle():
            # Sessions before the pool: an idle pool sandbox makes room for a session's own.
            full, running = logic.over_limit((await self.sandboxes.all()).values(), self.max_running)
        if not full:
            return
        reason = f"max_running ({self.max_running}) reached"
        metrics.refusals.labels("max_running").inc()

        meta = self._meta(request, request.session_id)
        await aggregates.transact(
            self.sandboxes,
            request.sandbox_id,
            lambda state: sandbox_rules.decide_refused(
                state,
                meta,
                sandbox_id=request.sandbox_id,
                session_id=request.session_id,
                reason=reason,
                running=running,
                limit=self.max_running,
            ),
        )
        raise errors.LimitExceeded(
            f"{running} sandboxes are running, the limit is {self.max_running}: retry later, "
            "or clear sessions you no longer need"
        )

    async def _evict_idle(self) -> bool:
        """Retire the oldest idle pool sandbox (a claim racing it wins); True if one went."""
        idle = sorted(
            (s for s in (await self.sandboxes.all()).values() if logic.idle(s) and s.status == "running"),
            key=lambda s: (s.created_at, s.sandbox_id),
        )
        for sandbox in idle:
            if await self.retire(sandbox.sandbox_id):
                metrics.evictions.inc()
                return True
        return False

    def _cache_org(self, request: provisioning.Provision) -> str | None:
        """The organisation whose cache the new sandbox shows from its start, if any."""
        return request.org_id if self.runtime.tenant_caches else None

    async def _record_requested(
        self, request: provisioning.Provision, *, fresh: bool
    ) -> aggregates.Outcome[states.SandboxState]:
        meta = self._meta(request, request.session_id)
        return await aggregates.transact(
            self.sandboxes,
            request.sandbox_id,
            lambda state: sandbox_rules.decide_requested(
                state,
                meta,
                sandbox_id=request.sandbox_id,
                session_id=request.session_id,
                image=request.image,
                run_as_root=request.run_as_root,
                writable_root=request.writable_root,
                use_kata=request.use_kata,
                backend=self.runtime.name,
                pool=request.pool,
                cache_org=self._cache_org(request),
                snapshot=request.snapshot,
            ),
            read=(None, None) if fresh else None,  # (a taken id only fails its append)
        )

    async def provision(self, request: provisioning.Provision, *, fresh: bool = False) -> states.SandboxState:
        """``fresh``: the id was just made by this instance (a refill), so it has no record:
        none is read first."""
        current = None if fresh else await self.sandboxes.get(request.sandbox_id)
        if current is not None and current.status == "running":
            return current
        if current is not None and current.status == "refused":
            raise errors.LimitExceeded(f"sandbox {request.sandbox_id} was refused: {current.error}")
        requested = None
        if current is None:
            async with self._admitting():  # count-then-record is atomic across instances
                await self._refuse_if_full(request)
                requested = (await self._record_requested(request, fresh=fresh)).read
        if request.pool is not None:
            await faults.pause_point(self.ctx.settings.faults, "pool.slow_pool_start")
        spec = api.SandboxSpec(
            sandbox_id=request.sandbox_id,
            image=request.image,
            run_as_root=request.run_as_root,
            writable_root=request.writable_root,
            isolation="strong" if request.use_kata else "standard",
            limits=self.limits,
            labels={"session": request.session_id or "", "pool": request.pool or ""},
            cache=ids.token(org) if (org := self._cache_org(request)) else None,
            snapshot=request.snapshot,
        )
        try:
            await self._ensure_image(request)
            created = await self.runtime.create(spec)
            await self.runtime.start(request.sandbox_id)
            faults.crash_point(self.ctx.settings.faults, "pool.after_runtime_start")
        except errors.SandboxError as exc:
            await self._record(request, sandbox_rules.decide_failed, error=exc.message)
            await self._quietly_delete(request.sandbox_id)
            raise
        state = await self._record(
            request, sandbox_rules.decide_started, read=requested, image_digest=created.image_digest
        )
        assert state is not None
        state = await self._await_proxy(state)
        log.info(
            "sandbox.started",
            sandbox_id=request.sandbox_id,
            session_id=request.session_id,
            image=request.image,
        )
        return state

    async def _ensure_image(self, request: provisioning.Provision) -> None:
        """Pull the sandbox's image first where the runtime needs that: once for every
        request of this instance that needs it at the same time (the runtime's store
        makes instances on one machine share one download), each pull recorded."""
        if await self.runtime.image_present(request.image):
            metrics.image_requests.labels("hit").inc()
            return
        ref = str(references.parse(request.image))
        pull = self._pulls.get(ref)
        if pull is None:
            pull = asyncio.ensure_future(self._pull(ref, request))
            self._pulls[ref] = pull
            pull.add_done_callback(lambda _: self._pulls.pop(ref, None))
        try:
            await asyncio.shield(pull)
        except (errors.InvalidInput, errors.NotFound) as exc:
            # The request that needs the image is well-formed; the image named is not to be
            # had. Said as a conflict with the session's state (409), the registry's words kept.
            raise errors.ImageUnavailable(exc.message) from None

    async def _pull(self, ref: str, request: provisioning.Provision) -> api.PulledImage | None:
        subject = self.ctx.topology.aggregate_subject(subjects.IMAGE, ref)
        meta = self._meta(request, request.session_id)
        await self.ctx.store.record(
            subject, events.ImagePullStarted(meta=meta, reference=ref, sandbox_id=request.sandbox_id)
        )
        log.info("image.pull_started", reference=ref, sandbox_id=request.sandbox_id)
        try:
            pulled = await self._pulled(ref, request.image)
        except errors.SandboxError as exc:
            metrics.image_requests.labels("failed").inc()
            log.warning("image.pull_failed", reference=ref, error=exc.message)
            failed = events.ImagePullFailed(
                meta=self._meta(request, request.session_id),
                reference=ref,
                error=exc.code,
                reason=exc.message,
            )
            await self.ctx.store.record(subject, failed)
            raise
        metrics.image_requests.labels("miss").inc()
        if pulled is not None:
            metrics.image_pull_seconds.observe(pulled.seconds)
            metrics.image_pull_bytes.inc(pulled.downloaded)
            log.info("image.pulled", reference=ref, digest=pulled.digest, seconds=round(pulled.seconds, 3))
            done = events.ImagePulled(
                meta=self._meta(request, request.session_id),
                reference=ref,
                digest=pulled.digest,
                size=pulled.size,
                layers=pulled.layers,
                fetched=pulled.fetched,
                seconds=round(pulled.seconds, 3),
            )
            await self.ctx.store.record(subject, done)
        return pulled

    async def _pulled(self, ref: str, image: str) -> api.PulledImage | None:
        try:
            return await self.runtime.pull(image)
        except errors.SandboxError:
            raise
        except Exception as exc:  # a bug (or a case not foreseen): said as such, recorded all the same
            log.exception("image.pull_crashed", reference=ref)
            raise errors.InfrastructureError(
                f"pulling {ref} failed unexpectedly ({type(exc).__name__})"
            ) from exc

    async def _await_proxy(self, state: states.SandboxState) -> states.SandboxState:
        """With proxy egress, hand out a sandbox only once the proxy-scaler has given it a
        proxy (the first proxy starts while the first sandbox does), so its first request
        finds a way out. If none comes in time, go on: the sandbox gets one later."""
        if self.runtime.egress != "proxy" or not self.runtime.pinned_proxies:
            return state
        deadline = time.monotonic() + PROXY_WAIT
        changed = asyncio.Event()
        self._awaiting.setdefault(state.sandbox_id, set()).add(changed)
        try:
            read = False  # what the followed copy heard (it may be behind; see below)
            while (left := deadline - time.monotonic()) > 0:
                changed.clear()  # before looking: a change after the look is not missed
                if read:
                    current = await self.sandboxes.get(state.sandbox_id)
                else:
                    current = self.sandboxes.heard(state.sandbox_id)
                    if current is None or current.last_seq < state.last_seq:
                        current = state  # (not heard of since this start was recorded: nothing new)
                if current is None or current.proxy_id is not None or current.status != "running":
                    return current or state
                try:
                    async with asyncio.timeout(min(left, PROXY_RECHECK)):
                        await changed.wait()
                    read = False
                except TimeoutError:
                    read = True  # nothing heard for a while: the record itself
        finally:
            waiting = self._awaiting.get(state.sandbox_id, set())
            waiting.discard(changed)
            if not waiting:
                self._awaiting.pop(state.sandbox_id, None)
        log.warning("sandbox.no_proxy_yet", sandbox_id=state.sandbox_id, waited=PROXY_WAIT)
        return state

    def noticed(self, sandbox_id: str) -> None:
        """The sandbox's record changed (heard from the followed copy, once it is in the
        bucket): a start waiting for its proxy looks at the copy again."""
        for changed in self._awaiting.get(sandbox_id, ()):
            changed.set()

    async def _quietly_delete(self, sandbox_id: str) -> None:
        try:
            await self.runtime.delete(sandbox_id)
        except Exception as exc:
            log.warning("sandbox.cleanup_failed", sandbox_id=sandbox_id, error=repr(exc))

    async def start(self, request: provisioning.Start) -> states.SandboxState:
        state = await self.sandboxes.get(request.sandbox_id)
        if state is None or state.status in ("deleted", "failed"):
            raise errors.NotFound(f"sandbox {request.sandbox_id!r} does not exist")
        if state.status == "paused":  # counted under max_running already: no admission
            return await self.resume(request, "call", state)
        if state.status == "stopped":  # a resume adds a running sandbox: the limit applies
            async with self._admitting():  # held until the start is recorded
                full, running = logic.over_limit((await self.sandboxes.all()).values(), self.max_running)
                if full:
                    metrics.refusals.labels("max_running").inc()
                    raise errors.LimitExceeded(
                        f"{running} sandboxes are running, the limit is {self.max_running}: retry later"
                    )
                started = await self._start(request, state)
            return await self._await_proxy(started)  # outside: other admissions need not wait
        return await self._await_proxy(await self._start(request, state))

    async def _start(self, request: provisioning.Start, state: states.SandboxState) -> states.SandboxState:
        """Start the sandbox and record it (its proxy is awaited by the caller)."""
        info = await self.runtime.get(request.sandbox_id)
        if info is None:
            raise errors.NotFound(f"sandbox {request.sandbox_id!r} is gone from the runtime")
        if info.status == "running" and state.status == "running":
            return state
        if info.status == "paused" and state.status == "running":
            # Frozen, recorded running (a pause that died before it was recorded): thaw it.
            await self.runtime.resume(request.sandbox_id)
            return state
        if state.status == "running":  # the runtime lost it (host restart): say so, then restart
            await self._record(request, sandbox_rules.decide_stopped, reason="lost")
        await self.runtime.start(request.sandbox_id)
        started = await self._record(request, sandbox_rules.decide_started)
        assert started is not None
        return started

    async def stop(self, request: provisioning.Stop) -> states.SandboxState:
        state = await self.sandboxes.get(request.sandbox_id)
        if state is None:
            raise errors.NotFound(f"sandbox {request.sandbox_id!r} does not exist")
        if await self.runtime.get(request.sandbox_id) is not None:
            await self.runtime.stop(request.sandbox_id)
        stopped = await self._record(request, sandbox_rules.decide_stopped, reason=request.reason)
        assert stopped is not None
        return stopped

    async def pause(self, request: provisioning.Pause) -> states.SandboxState:
        """Freeze a running sandbox, then record it (``sandbox.paused`` says every process
        is frozen). Recorded running again meanwhile, or the same command again: nothing
        recorded. A crash between the two leaves it frozen but recorded running: the next
        call is refused by the runtime (NotRunning), and its ``Start`` thaws it."""
        state = await self.sandboxes.get(request.sandbox_id)
        if state is None or state.status in sandbox_rules.DEAD:
            raise errors.NotFound(f"sandbox {request.sandbox_id!r} does not exist")
        if state.status == "paused":
            return state
        if state.status != "running":
            raise errors.NotRunning(f"sandbox {request.sandbox_id!r} is {state.status}: nothing to pause")
        started = time.perf_counter()
        await self.runtime.pause(request.sandbox_id)
        try:
            paused = await self._record(request, sandbox_rules.decide_paused, reason=request.reason)
        except BaseException:
            await self.runtime.resume(request.sandbox_id)
            raise
        assert paused is not None
        if paused.status != "paused":  # not recorded (a retry, or it changed): leave it as recorded
            await self.runtime.resume(request.sandbox_id)
        metrics.pause_seconds.labels("pause").observe(time.perf_counter() - started)
        log.info("sandbox.paused", sandbox_id=request.sandbox_id, reason=request.reason)
        return paused

    async def resume(
        self, request: provisioning.PoolRequest, reason: str, state: states.SandboxState | None = None
    ) -> states.SandboxState:
        """Thaw a paused sandbox, then record it (``sandbox.resumed``); running: nothing to do.
        (``state``: its record, when the caller just read it.)"""
        state = state or await self.sandboxes.get(request.sandbox_id)
        if state is None or state.status in sandbox_rules.DEAD:
            raise errors.NotFound(f"sandbox {request.sandbox_id!r} does not exist")
        if state.status == "running":
            return state
        if state.status != "paused":
            raise errors.NotRunning(f"sandbox {request.sandbox_id!r} is {state.status}, not paused")
        started = time.perf_counter()
        await self.runtime.resume(request.sandbox_id)
        resumed = await self._record(request, sandbox_rules.decide_resumed, reason=reason)
        assert resumed is not None
        metrics.pause_seconds.labels("resume").observe(time.perf_counter() - started)
        log.info("sandbox.resumed", sandbox_id=request.sandbox_id, reason=reason)
        return resumed

    async def retire(self, sandbox_id: str) -> bool:
        """Remove an idle pool sandbox the refill no longer wants, unless a session claims
        it first (whichever records first wins); True if it was removed."""
        request = provisioning.Delete(sandbox_id=sandbox_id, command_id=ids.new_id())
        meta = self._meta(request)
        outcome = await aggregates.transact(
            self.sandboxes, sandbox_id, lambda state: sandbox_rules.decide_retired(state, sandbox_id, meta)
        )
        if not outcome.appended:
            return False
        await self.delete(request)
        log.info("sandbox.retired", sandbox_id=sandbox_id)
        return True

    async def delete(self, request: provisioning.Delete) -> states.SandboxState | None:
        await self.runtime.delete(request.sandbox_id)
        return await self._record(request, sandbox_rules.decide_deleted)

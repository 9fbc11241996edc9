"""Thin glue: decode a command, decide on the session, append, project, and drive the
pool-manager for the session's sandbox; reply with the session's state."""

from __future__ import annotations

import contextlib
import functools
import time
from typing import TypedDict

import structlog

from sbx_api import errors
from services.scheduler import pausing, snapshots
from shared.contract import commands, events, ids, provisioning, states
from shared.domain import pools
from shared.domain import sandbox as sandbox_rules
from shared.domain import session as session_rules
from shared.infrastructure import aggregates, metrics, projector, rpc, service, warmpool

log = structlog.get_logger(__name__)

CRASH_AFTER_APPEND = "scheduler.after_append"
#: Offers tried before falling back to a cold start (stale offers fail their CAS).
CLAIM_ATTEMPTS = 8
CONSUMERS_KNOWN = 10_000
"""Most snapshots' pools whose claims consumer an instance remembers having made."""
PREPARING_WAIT = 20.0
"""How long a session refused a cold start at ``max_running`` waits for a pool sandbox
that is being prepared."""


class _PoolFields(TypedDict):
    """What every request to the pool-manager for a session's command carries."""

    sandbox_id: str
    command_id: str
    correlation_id: str | None
    actor: commands.Actor


class SessionCommands:
    def __init__(
        self,
        ctx: service.Context,
        sessions: projector.ProjectionStore[states.SessionState],
        sandboxes: projector.ProjectionStore[states.SandboxState],
        pool: rpc.PoolClient,
        warm: list[pools.PoolSpec] | None = None,
        *,
        caches_at_create: bool = False,
        snapshot_store: projector.ProjectionStore[states.SnapshotState] | None = None,
    ) -> None:
        self.ctx = ctx
        self.sessions = sessions
        self.sandboxes = sandboxes
        self.pool = pool
        self.warm = warm or []
        self.caches_at_create = caches_at_create
        self.pausing = pausing.Pausing(ctx, sessions, sandboxes, pool)
        self.snapshotting = snapshots.Snapshotting(self, snapshot_store) if snapshot_store else None
        self._consumers: set[str] = set()
        """Snapshots' pools whose claims consumer this instance made sure of."""
        self._waiting: dict[str, int] = {}
        """Sessions of this instance waiting for a pool sandbox being prepared, per pool."""

    async def handle(self, raw: bytes) -> bytes:
        """Answer one request; every failure becomes an error reply, never a crash."""
        return await rpc.answer(
            rpc.SESSIONS,
            raw,
            self._answer,
            crashed="scheduler.command_crashed",
            on_error=lambda e: metrics.commands.labels("-", e.code).inc(),
        )

    async def _answer(self, command: commands.SessionCommand) -> commands.CommandReply:
        session_rules.validate(command)
        if isinstance(command, commands.PauseSession | commands.ResumeSession | commands.HibernateSession):
            reply = await self.pausing.handle(command)
            metrics.commands.labels(events.tag_of(type(command)), "ok").inc()
            return reply
        if isinstance(command, commands.SnapshotCommand):
            if self.snapshotting is None:
                raise errors.NotBuiltYet("this scheduler was started without snapshots")
            reply = await self.snapshotting.handle(command)
            metrics.commands.labels(events.tag_of(type(command)), "ok").inc()
            return reply
        state, appended = await self.execute(command)
        metrics.commands.labels(events.tag_of(type(command)), "ok").inc()
        return commands.CommandReply(ok=True, appended=appended, session=state)

    # ---- steps -------------------------------------------------------------------

    async def _decide(
        self,
        command: commands.SessionCommand,
        read: tuple[states.SessionState | None, int | None] | None = None,
    ) -> aggregates.Outcome[states.SessionState]:
        meta = self.ctx.meta(command=command, session_id=command.session_id)
        outcome = await aggregates.transact(
            self.sessions,
            command.session_id,
            lambda state: session_rules.decide(state, command, meta),
            crash_points=self.ctx.settings.faults,
            crash_point=CRASH_AFTER_APPEND,
            read=read,
        )
        _log_transition(command, outcome)
        return outcome

    def pool_fields(self, command: commands.SessionCommand, sandbox_id: str) -> _PoolFields:
        return {
            "sandbox_id": sandbox_id,
            "command_id": command.command_id,
            "correlation_id": command.correlation_id,
            "actor": command.actor,
        }

    async def _claim(
        self,
        command: commands.SessionCommand,
        options: session_rules.SandboxOptions,
        org: str | None,
        *,
        preparing: bool = False,
        warm: list[pools.PoolSpec] | None = None,
    ) -> str | None:
        """A warm sandbox for this session, if a pool it may use (``warm``, else the
        configured ones) has one that fits (CAS on the sandbox). ``preparing``: if none is
        ready but some are being prepared, wait for one (up to ``PREPARING_WAIT``)."""
        specs = self.warm if warm is None else warm
        pool = pools.serving(specs, options, org, caches_at_create=self.caches_at_create)
        if pool is None:
            return None
        until = time.monotonic()
        if preparing:
            coming = pools.preparing((await self.sandboxes.all()).values(), pool.pool_id)
            if self._waiting.get(pool.pool_id, 0) >= coming:
                return None  # each sandbox being prepared can serve one waiting session
            until += PREPARING_WAIT
        if preparing:
            self._waiting[pool.pool_id] = self._waiting.get(pool.pool_id, 0) + 1
        try:
            return await self._take_and_claim(command, pool, org, until)
        finally:
            if preparing:  # (no entry kept at zero: a snapshot's pool comes and goes)
                left = self._waiting.get(pool.pool_id, 1) - 1
                if left > 0:
                    self._waiting[pool.pool_id] = left
                else:
                    self._waiting.pop(pool.pool_id, None)

    async def _take_and_claim(
        self, command: commands.SessionCommand, pool: pools.PoolSpec, org: str | None, until: float
    ) -> str | None:
        meta = self.ctx.meta(command=command, session_id=command.session_id)
        for _ in range(CLAIM_ATTEMPTS):
            wait = max(0.0, until - time.monotonic())
            offer = await self._take(pool, wait)
            if offer is None:
                return None  # empty pool: cold start
            sandbox_id = offer.sandbox_id
            try:
                outcome = await aggregates.transact(
                    self.sandboxes,
                    sandbox_id,
                    functools.partial(
                        sandbox_rules.decide_claim,
                        sandbox_id=sandbox_id,
                        session_id=command.session_id,
                        meta=meta,
                        pool_id=pool.pool_id,
                        org=org,
                        snapshot=pool.snapshot,
                    ),
                )
            finally:
                await warmpool.done(self.ctx.nc, offer)
            if outcome.appended:
                log.info("sandbox.claimed", sandbox_id=sandbox_id, session_id=command.session_id)
                return sandbox_id
        return None

    async def _take(self, pool: pools.PoolSpec, wait: float) -> warmpool.Offer | None:
        """The pool's next offer. A snapshot's pool gets its claims consumer here, the first
        time this instance takes from it, and again if the pool-manager removed it when
        the pool was unused (configured pools get theirs at start)."""
        if pool.snapshot is not None and pool.pool_id not in self._consumers:
            await self._ensure_consumer(pool)
        try:
            return await warmpool.take(self.ctx.nc, self.ctx.topology, pool.pool_id, wait=wait)
        except errors.Unavailable:
            if pool.snapshot is None:
                raise
        await self._ensure_consumer(pool)  # (dropped since: made again, then taken from once more)
        return await warmpool.take(self.ctx.nc, self.ctx.topology, pool.pool_id, wait=wait)

    async def _ensure_consumer(self, pool: pools.PoolSpec) -> None:
        if len(self._consumers) >= CONSUMERS_KNOWN:
            self._consumers.clear()  # (made sure of again at the next take: harmless)
        await warmpool.ensure_consumer(self.ctx.js, self.ctx.topology, pool.pool_id, snapshot=pool.snapshot)
        self._consumers.add(pool.pool_id)

    async def obtain(
        self,
        command: commands.SessionCommand,
        options: session_rules.SandboxOptions,
        org: str | None,
        *,
        warm: list[pools.PoolSpec] | None = None,
    ) -> str:
        """A running sandbox for this session (of organisation ``org``): claimed from a
        pool (``warm``: these pools instead of the configured ones), else cold-started.
        Raises (with nothing assigned) if the options are refused or a limit is reached."""
        started = time.perf_counter()
        sandbox_id = await self._claim(command, options, org, warm=warm)
        kind = "warm" if sandbox_id else "cold"
        if sandbox_id is None:
            sandbox_id = "sb-" + ids.new_id()[:20]
            try:
                await self.pool.send(
                    provisioning.Provision(
                        session_id=command.session_id,
                        org_id=org,
                        **options,
                        **self.pool_fields(command, sandbox_id),
                    )
                )
            except errors.LimitExceeded:
                # No room for a sandbox of its own: one the pool is preparing will do.
                waited = await self._claim(command, options, org, preparing=True, warm=warm)
                if waited is None:
                    raise
                sandbox_id, kind = waited, "warm"
        metrics.claims.labels(kind).inc()
        metrics.claim_seconds.labels(kind).observe(time.perf_counter() - started)
        return sandbox_id

    async def _provision(
        self, command: commands.SessionCommand, state: states.SessionState
    ) -> states.SessionState:
        """Obtain a sandbox and assign it; if another request assigned one first, discard
        ours and use theirs."""
        options = session_rules.sandbox_options(command, state)
        sandbox_id = await self.obtain(command, options, state.org_id)
        meta = self.ctx.meta(command=command, session_id=command.session_id)
        outcome = await aggregates.transact(
            self.sessions,
            command.session_id,
            lambda s: session_rules.decide_assign(s, sandbox_id, options["image"], meta),
        )
        if not outcome.appended:
            await self.pool.send(provisioning.Delete(**self.pool_fields(command, sandbox_id)))
        assert outcome.state is not None
        return outcome.state

    async def _first_request(
        self, command: commands.EnsureSession, read: tuple[states.SessionState | None, int | None]
    ) -> tuple[states.SessionState | None, int]:
        """A new session's first call (the common case: an agent's first tool call). The
        sandbox is obtained first, then the session is created with it in one append: one
        write to the session's stream, not two. A crash in between leaves a claimed
        sandbox no session points to, which the reaper's sweep deletes (``delete_unowned``)."""
        image, org = command.image or "default", command.actor.org_id
        sandbox_id = await self.obtain(command, {"image": image}, org)
        meta = self.ctx.meta(command=command, session_id=command.session_id)
        try:
            outcome = await aggregates.transact(
                self.sessions,
                command.session_id,
                lambda s: session_rules.decide_new_with_sandbox(s, command, sandbox_id, image, org, meta),
                crash_points=self.ctx.settings.faults,
                crash_point=CRASH_AFTER_APPEND,
                read=read,
            )
        except BaseException:  # refused (another organisation took the id) or failed: ours goes
            with contextlib.suppress(Exception):
                await self.pool.send(provisioning.Delete(**self.pool_fields(command, sandbox_id)))
            raise
        state = outcome.state
        assert state is not None
        if state.sandbox_id != sandbox_id:  # another request got there first: theirs stands
            await self.pool.send(provisioning.Delete(**self.pool_fields(command, sandbox_id)))
            state = await (
                self._ensure_running(command, state) if state.sandbox_id else self._provision(command, state)
            )
        _log_transition(command, outcome)
        return state, len(outcome.appended)

    async def _replace(
        self, command: commands.SessionCommand, state: states.SessionState
    ) -> states.SessionState:
        """``create_sandbox``: the new sandbox is obtained first, so a refused option or a
        full pool leaves the old sandbox and workspace intact; then release-and-assign is
        one append (whatever sandbox the session has by then: one claimed at connect is
        replaced, never adopted), and only then is the released one deleted."""
        options = session_rules.sandbox_options(command, state)
        new = await self.obtain(command, options, state.org_id)
        meta = self.ctx.meta(command=command, session_id=command.session_id)
        outcome = await aggregates.transact(
            self.sessions,
            command.session_id,
            lambda s: session_rules.decide_install(s, new, options["image"], meta),
        )
        assert outcome.state is not None
        appended = [stored.event for stored in outcome.appended]
        gone = session_rules.released(appended) if outcome.state.sandbox_id == new else [new]
        for sandbox_id in gone:
            await self.pool.send(provisioning.Delete(**self.pool_fields(command, sandbox_id)))
        return outcome.state

    async def _release(
        self, command: commands.SessionCommand, state: states.SessionState
    ) -> states.SessionState:
        old = state.sandbox_id
        assert old is not None
        meta = self.ctx.meta(command=command, session_id=command.session_id)
        outcome = await aggregates.transact(
            self.sessions, command.session_id, lambda s: session_rules.decide_release(s, old, meta)
        )
        await self.pool.send(provisioning.Delete(**self.pool_fields(command, old)))
        assert outcome.state is not None
        return outcome.state

    async def _ensure_running(
        self, command: commands.SessionCommand, state: states.SessionState
    ) -> states.SessionState:
        """The session's sandbox, running: start it again, or replace it if it is gone.

        A record that says "running" is not trusted blindly: the gateway only asks when
        its own read of the projections found nothing usable or the executor refused,
        so the pool-manager checks the runtime (``Start`` is idempotent and records a
        lost-then-started sandbox when the runtime had stopped it)."""
        assert state.sandbox_id is not None
        sandbox = await self.sandboxes.get(state.sandbox_id)
        if sandbox is not None and sandbox.status in sandbox_rules.LIVE:  # a paused one is resumed
            try:
                await self.pool.send(provisioning.Start(**self.pool_fields(command, state.sandbox_id)))
                return state
            except errors.NotFound:
                pass
        # Deleted, failed or lost: the session gets a fresh sandbox (its workspace is gone).
        released = await self._release(command, state)
        return await self._provision(command, released)

    # ---- commands ----------------------------------------------------------------

    async def execute(self, command: commands.SessionCommand) -> tuple[states.SessionState | None, int]:
        match command:
            case commands.CreateSession() | commands.SetDeadline():
                outcome = await self._decide(command)
                return outcome.state, len(outcome.appended)
            case commands.StopSession():
                outcome = await self._decide(command)
                if outcome.appended and outcome.state and outcome.state.sandbox_id:
                    await self.pool.send(
                        provisioning.Stop(**self.pool_fields(command, outcome.state.sandbox_id))
                    )
                return outcome.state, len(outcome.appended)
            case commands.DeleteSession() | commands.ClearSession():
                outcome = await self._decide(command)
                # The sandbox of the state the deletion was decided on (not an earlier read).
                gone = outcome.before.sandbox_id if outcome.before is not None else None
                if outcome.appended and gone:
                    await self.pool.send(provisioning.Delete(**self.pool_fields(command, gone)))
                return outcome.state, len(outcome.appended)
            case commands.EnsureSession():
                read = await self.sessions.get_entry(self.sessions.projection.key_of(command.session_id))
                current = read[0]
                if current is None or current.status == "deleted":
                    return await self._first_request(command, read)
                outcome = await self._decide(command, read)
                state = outcome.state
                assert state is not None
                state = await (
                    self._ensure_running(command, state)
                    if state.sandbox_id
                    else self._provision(command, state)
                )
                return state, len(outcome.appended)
            case commands.ProvisionSandbox():
                outcome = await self._decide(command)
                state = outcome.state
                assert state is not None
                return await self._replace(command, state), len(outcome.appended)
            case commands.PauseSession() | commands.ResumeSession() | commands.HibernateSession():
                reply = await self.pausing.handle(command)
                return reply.session, reply.appended
            case _:  # snapshots: see ``_answer``
                raise errors.InvalidInput(f"{events.tag_of(type(command))} is answered elsewhere")


def _log_transition(
    command: commands.SessionCommand, outcome: aggregates.Outcome[states.SessionState]
) -> None:
    if outcome.appended:
        log.info(
            "session.transition",
            session_id=command.session_id,
            events=[type(s.event).__name__ for s in outcome.appended],
            seq=outcome.appended[-1].seq,
            command_id=command.command_id,
        )

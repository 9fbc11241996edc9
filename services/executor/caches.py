"""Per-tenant package caches: on a session's first call on a sandbox, the executor shows
its organisation's cache in it (``Runtime.attach_cache``) and records that
(``SandboxCacheAttached``). Idempotent on both sides, so any executor may do it, and a
crash between the mount and the event is repaired by the next call.
"""

from __future__ import annotations

import asyncio

import structlog

from sbx_api import errors
from shared.contract import execution, ids, states
from shared.domain import sandbox as sandbox_rules
from shared.infrastructure import aggregates, bounded, projector, service
from shared.runtime import api

log = structlog.get_logger(__name__)

REMEMBERED = 10_000


class TenantCaches:
    def __init__(
        self,
        ctx: service.Context,
        runtime: api.Runtime,
        sessions: projector.ProjectionStore[states.SessionState],
        sandboxes: projector.ProjectionStore[states.SandboxState],
    ) -> None:
        self.ctx = ctx
        self.runtime = runtime
        self.sessions = sessions
        self.sandboxes = sandboxes
        self._done: bounded.Bounded[str, None] = bounded.Bounded(REMEMBERED)

    def pending(self, sandbox_id: str) -> bool:
        """Whether the next call on this sandbox has the check to make (and reads the
        session's record for it)."""
        return self.runtime.tenant_caches and sandbox_id not in self._done

    async def ensure(
        self,
        request: execution.Request,
        sandbox: states.SandboxState | None = None,
        session: states.SessionState | None = None,
    ) -> None:
        """Make the sandbox show its session's organisation's cache (once per sandbox).
        ``sandbox``, ``session``: their records, if the caller just read them."""
        session_id, sandbox_id = request.session_id, request.sandbox_id
        if not self.pending(sandbox_id):
            return
        if sandbox is None and session is None:
            session, sandbox = await asyncio.gather(
                self.sessions.get(session_id), self.sandboxes.get(sandbox_id)
            )
        elif session is None:
            session = await self.sessions.get(session_id)
        elif sandbox is None:
            sandbox = await self.sandboxes.get(sandbox_id)
        if session is None:
            return  # the projection is behind: the next call looks again
        org_id = session.org_id
        if sandbox is not None and sandbox.cache_org not in (None, org_id):
            # Made for (or showing) another organisation's cache, or one for a session of
            # none: never this session's to use, whatever put it here.
            raise errors.Conflict("this sandbox shows another organisation's package cache")
        if org_id:
            try:
                await self.runtime.attach_cache(sandbox_id, ids.token(org_id))
            except errors.NotRunning:
                return  # not running yet or any more: the call itself will say so
            except errors.Conflict:
                raise  # it shows another organisation's cache: this call must not run there
            except errors.SandboxError as exc:
                # The call still runs, without the shared cache; said once per sandbox.
                log.warning("executor.cache_not_attached", sandbox_id=sandbox_id, error=exc.message)
                self._remember(sandbox_id)
                return
            meta = self.ctx.meta(
                session_id=session_id, correlation_id=request.correlation_id, actor=request.actor
            )
            await aggregates.transact(
                self.sandboxes,
                sandbox_id,
                lambda state: sandbox_rules.decide_cache_attached(state, session_id, org_id, meta),
            )
        self._remember(sandbox_id)

    def _remember(self, sandbox_id: str) -> None:
        self._done[sandbox_id] = None

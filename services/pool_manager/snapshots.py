"""Thin glue: snapshot requests → the runtime's copy, then ``snapshot.created``; deletions
and the retention rule → ``snapshot.deleted`` (rules in ``shared.domain.snapshot``).

The copy is made first and recorded after: a crash in between leaves a snapshot the
runtime holds and no event says exists, which the same request again (its id is the
sender's) records, since the runtime's snapshot is idempotent by id.
"""

from __future__ import annotations

import time

import structlog

from sbx_api import errors
from shared.contract import events, provisioning, states
from shared.domain import snapshot as snapshot_rules
from shared.infrastructure import aggregates, metrics, projector, service
from shared.runtime import api

log = structlog.get_logger(__name__)


class SnapshotHandlers:
    def __init__(
        self,
        ctx: service.Context,
        runtime: api.Runtime,
        sandboxes: projector.ProjectionStore[states.SandboxState],
        snapshots: projector.ProjectionStore[states.SnapshotState],
        *,
        per_session: int = 20,
    ) -> None:
        self.ctx = ctx
        self.runtime = runtime
        self.sandboxes = sandboxes
        self.snapshots = snapshots
        self.per_session = per_session

    def _meta(self, request: provisioning.PoolRequest, session_id: str | None) -> events.Meta:
        return self.ctx.meta(
            command_id=request.command_id,
            correlation_id=request.correlation_id,
            actor=request.actor,
            session_id=session_id,
        )

    async def take(self, request: provisioning.Snapshot) -> states.SnapshotState:
        known = await self.snapshots.get(request.snapshot_id)
        if known is not None:
            if known.sandbox_id != request.sandbox_id:
                raise errors.Conflict(f"snapshot id {request.snapshot_id!r} is taken; choose another")
            return known
        sandbox = await self.sandboxes.get(request.sandbox_id)
        if sandbox is None or sandbox.status not in ("running", "paused", "stopped"):
            status = sandbox.status if sandbox else "gone"
            raise errors.Conflict(f"the session's sandbox is {status}: there is nothing to snapshot")
        if not self.runtime.snapshots:
            raise errors.NotBuiltYet(f"snapshots are not available on the {self.runtime.name} runtime yet")
        started = time.perf_counter()
        info = await self.runtime.snapshot(request.sandbox_id, request.snapshot_id)
        created = events.SnapshotCreated(
            meta=self._meta(request, request.session_id),
            snapshot_id=request.snapshot_id,
            session_id=request.session_id,
            sandbox_id=request.sandbox_id,
            org_id=request.org_id,
            digest=info.digest,
            layers=info.layers,
            parent=info.parent,
            size=info.size,
            total_size=info.total_size,
            files=info.files,
            image=sandbox.image,
            image_digest=info.image_digest,
            run_as_root=info.run_as_root,
            writable_root=info.writable_root,
            frozen_ms=round(info.frozen_seconds * 1000, 3),
        )
        outcome = await aggregates.transact(
            self.snapshots, request.snapshot_id, lambda state: snapshot_rules.decide_created(state, created)
        )
        assert outcome.state is not None
        metrics.snapshot_seconds.labels("frozen").observe(info.frozen_seconds)
        metrics.snapshot_seconds.labels("total").observe(time.perf_counter() - started)
        log.info(
            "snapshot.created",
            snapshot_id=request.snapshot_id,
            session_id=request.session_id,
            size=info.size,
            frozen_ms=created.frozen_ms,
        )
        await self._retain(request)
        return outcome.state

    async def _retain(self, request: provisioning.Snapshot) -> None:
        """The session's oldest snapshots past ``per_session`` go (``retention``)."""
        mine = snapshot_rules.of_session(
            (await self.snapshots.all()).values(), request.session_id, request.org_id
        )
        for old in snapshot_rules.over_retention(mine, self.per_session):
            await self.drop(
                provisioning.DropSnapshot(
                    sandbox_id=old.sandbox_id,
                    snapshot_id=old.snapshot_id,
                    command_id=f"{request.command_id}:retain:{old.snapshot_id}",
                    correlation_id=request.correlation_id,
                    actor=request.actor,
                    reason="retention",
                )
            )

    async def drop(self, request: provisioning.DropSnapshot) -> states.SnapshotState:
        """Forget it in the runtime (its layers stay while a sandbox uses them), then record it."""
        state = await self.snapshots.get(request.snapshot_id)
        if state is None:
            raise errors.NotFound(f"snapshot {request.snapshot_id!r} does not exist")
        if state.status == "deleted":
            return state
        await self.runtime.delete_snapshot(request.snapshot_id)
        deleted = events.SnapshotDeleted(
            meta=self._meta(request, state.session_id),
            snapshot_id=request.snapshot_id,
            session_id=state.session_id,
            reason=request.reason,
        )
        outcome = await aggregates.transact(
            self.snapshots, request.snapshot_id, lambda s: snapshot_rules.decide_deleted(s, deleted)
        )
        assert outcome.state is not None
        log.info("snapshot.deleted", snapshot_id=request.snapshot_id, reason=request.reason)
        return outcome.state

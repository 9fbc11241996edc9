"""Thin glue of the reaper: one pass = read projections and the runtime, apply the pure
rules, and carry out what they say through the scheduler (session transitions), the
sandbox aggregate (``sandbox.lost``) and the runtime (orphans)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime

import structlog
from nats.js.kv import KeyValue

from sbx_api import errors
from services.reaper import logic
from shared.contract import commands, events, ids, provisioning, states
from shared.domain import sandbox as sandbox_rules
from shared.infrastructure import activity, aggregates, metrics, projector, retention, rpc, service
from shared.infrastructure.settings import lifecycle
from shared.runtime import api

log = structlog.get_logger(__name__)

#: Runtime sandboxes younger than this, or records changed more recently, are left alone:
#: something may be provisioning them right now.
GRACE_SECONDS = 60.0


@dataclass
class Report:
    reaps: Counter[str] = field(default_factory=Counter)
    findings: Counter[str] = field(default_factory=Counter)


class Reaper:
    def __init__(
        self,
        ctx: service.Context,
        runtime: api.Runtime,
        sessions: projector.ProjectionStore[states.SessionState],
        sandboxes: projector.ProjectionStore[states.SandboxState],
        rules: lifecycle.LifecycleSettings,
        grace: float = GRACE_SECONDS,
        snapshots: projector.ProjectionStore[states.SnapshotState] | None = None,
    ) -> None:
        self.ctx = ctx
        self.runtime = runtime
        self.sessions = sessions
        self.sandboxes = sandboxes
        self.rules = rules
        self.grace = grace
        self.snapshots = snapshots
        self.scheduler = rpc.SessionClient(ctx.nc, ctx.topology)
        self.pool = rpc.PoolClient(ctx.nc, ctx.topology)
        self._activity_kv: KeyValue | None = None

    async def follow(self) -> None:
        """Keep what every pass lists in memory (``ProjectionStore.follow``). Deleted
        sessions and dead sandbox records stay in KV for good; a pass needs neither (to
        the sweep a dead record and no record are alike)."""
        await self.sessions.follow(keep=lambda s: s.status != "deleted")
        await self.sandboxes.follow(keep=lambda s: s.status in sandbox_rules.LIVE)

    async def unfollow(self) -> None:
        await self.sessions.unfollow()
        await self.sandboxes.unfollow()

    async def last_activity(self, session_id: str, now: datetime) -> datetime | None:
        """When the session last called a tool (``now`` while a call may still be running)."""
        if self._activity_kv is None:
            self._activity_kv = await self.ctx.key_value(self.ctx.topology.activity_bucket)
        entry = await activity.read(self._activity_kv, session_id)
        return entry.last(now) if entry is not None else None

    async def pass_once(self, now: datetime | None = None) -> Report:
        with metrics.reaper_pass_seconds.time():
            return await self._pass(now or datetime.now(UTC))

    async def _pass(self, now: datetime) -> Report:
        report = Report()
        sessions = list((await self.sessions.all()).values())
        records = {s.sandbox_id: s for s in (await self.sandboxes.all()).values()}
        activity: dict[str, datetime] = {}
        for session in sessions:
            sandbox = records.get(session.sandbox_id or "")
            if session.status == "active" and sandbox is not None and sandbox.status in sandbox_rules.LIVE:
                if logic.needs_activity(session, sandbox, now, self.rules, self.runtime.pausable):
                    last = await self.last_activity(session.session_id, now)
                    if last is not None:
                        activity[session.session_id] = last
        reaps = logic.decide_reaps(
            sessions, records, activity, now, self.rules, pausable=self.runtime.pausable
        )
        for reap in reaps:
            if await self._reap(reap):
                counted = reap.action if reap.action in ("pause", "hibernate") else reap.reason
                report.reaps[counted] += 1
                metrics.reaps.labels(counted).inc()
        seen = {
            info.sandbox_id: logic.RuntimeView(info.sandbox_id, info.status, info.created_at)
            for info in await self.runtime.list()
        }
        by_session = {s.session_id: s for s in sessions}
        for finding in logic.reconcile(records, seen, now, self.grace, by_session):
            if await self._fix(finding):
                report.findings[finding.action] += 1
                metrics.reconcile_findings.labels(finding.action).inc()
        for snapshot_id in await self._orphan_snapshots(now):
            if await self.runtime.delete_snapshot(snapshot_id):
                log.warning("reaper.orphan_snapshot_deleted", snapshot_id=snapshot_id)
                report.findings["delete_orphan_snapshot"] += 1
                metrics.reconcile_findings.labels("delete_orphan_snapshot").inc()
        await self._trim_audit(report)
        if report.reaps or report.findings:
            log.info("reaper.pass", reaps=dict(report.reaps), findings=dict(report.findings))
        return report

    async def _trim_audit(self, report: Report) -> None:
        """The oldest audit records go while the event stream nears its byte limit."""
        limit = self.ctx.settings.bus.retention.events_max_bytes
        try:
            trimmed = await retention.trim_audit(self.ctx.js, self.ctx.topology, limit)
        except errors.SandboxError as exc:
            log.warning("reaper.audit_trim_failed", error=exc.message)
            return
        metrics.events_bytes.set(trimmed.bytes_after)
        if not trimmed.below:
            return
        freed = max(0, trimmed.bytes_before - trimmed.bytes_after)
        log.warning(
            "reaper.audit_trimmed",
            below_seq=trimmed.below,
            bytes_before=trimmed.bytes_before,
            bytes_after=trimmed.bytes_after,
            limit=limit,
        )
        report.findings["trim_audit"] += 1
        metrics.audit_trimmed_bytes.inc(freed)

    async def _orphan_snapshots(self, now: datetime) -> list[str]:
        """Snapshots the runtime holds that no event names (see ``logic.orphan_snapshots``)."""
        if self.snapshots is None or not self.runtime.snapshots:
            return []
        held = {s.snapshot_id: s.created_at for s in await self.runtime.list_snapshots()}
        if not held:
            return []
        recorded = {s.snapshot_id: s for s in (await self.snapshots.all()).values()}  # (keyed by token)
        return logic.orphan_snapshots(recorded, held, now)

    def _command(self, reap: logic.Reap) -> commands.SessionCommand:
        actor, command_id = commands.Actor(via="reaper"), ids.new_id()
        if reap.action == "hibernate":
            return commands.HibernateSession(
                command_id=command_id,
                session_id=reap.session_id,
                actor=actor,
                if_last_seq=reap.last_seq,
                reason=reap.reason,
                quiet_since=reap.quiet_since,
                unless_jobs=not self.rules.pause_running_jobs,
            )
        if reap.action == "pause":
            return commands.PauseSession(
                command_id=command_id,
                session_id=reap.session_id,
                actor=actor,
                if_last_seq=reap.last_seq,
                reason=reap.reason,
                quiet_since=reap.quiet_since,
                unless_jobs=not self.rules.pause_running_jobs,
            )
        kind = commands.StopSession if reap.action == "stop" else commands.DeleteSession
        return kind(
            command_id=command_id,
            session_id=reap.session_id,
            actor=actor,
            if_last_seq=reap.last_seq,
            reason=reap.reason,
        )

    async def _reap(self, reap: logic.Reap) -> bool:
        command = self._command(reap)
        try:
            reply = await self.scheduler.ask(command)
        except errors.SandboxError as exc:
            log.warning("reaper.reap_failed", session_id=reap.session_id, error=exc.message)
            return False
        if not reply.ok and reply.error and reply.error.code != "not_found":
            log.warning("reaper.reap_refused", session_id=reap.session_id, error=reply.error.message)
        return reply.ok and reply.appended > 0

    async def _fix(self, finding: logic.Finding) -> bool:
        # Re-read the record now: a claim or a provision may have happened since the snapshot.
        fresh = await self.sandboxes.get(finding.sandbox_id)
        if finding.action == "delete_unowned":
            if fresh is None or fresh.status not in sandbox_rules.LIVE or not fresh.session_id:
                return False
            owner = await self.sessions.get(fresh.session_id)
            if owner is not None and owner.status != "deleted" and owner.sandbox_id == fresh.sandbox_id:
                return False  # re-assigned since the snapshot
            request = provisioning.Delete(
                sandbox_id=finding.sandbox_id, command_id=ids.new_id(), actor=commands.Actor(via="reaper")
            )
            return (await self.pool.ask(request)).ok
        if finding.action == "delete_orphan":
            if fresh is not None and fresh.status not in sandbox_rules.DEAD:
                return False
            await self.runtime.delete(finding.sandbox_id)
            log.warning("reaper.orphan_deleted", sandbox_id=finding.sandbox_id, detail=finding.detail)
            return True
        meta = self.ctx.meta(command_id=ids.new_id(), actor=commands.Actor(via="reaper"))
        stuck = finding.action == "fail_stuck"

        def decide(state: states.SandboxState | None) -> list[events.Event]:
            if stuck:
                return sandbox_rules.decide_failed(
                    state, finding.sandbox_id, lambda _: meta, finding.detail, stuck=True
                )
            return sandbox_rules.decide_lost(state, finding.sandbox_id, meta, finding.detail)

        outcome = await aggregates.transact(self.sandboxes, finding.sandbox_id, decide)
        if stuck and outcome.appended:
            await self.runtime.delete(finding.sandbox_id)
        return bool(outcome.appended)

"""Pausing and resuming a session's sandbox (``session.pause`` / ``session.resume``): the
session's checks here, the freeze and the thaw by the pool-manager, which records them
(``sandbox.paused`` / ``sandbox.resumed``). The session itself stays active: its next
call resumes its sandbox (``EnsureSession`` → ``Start``), as it restarts a stopped one.

An idle pause (the reaper's) is careful twice: it leaves a sandbox alone while one of its
async jobs runs (``unless_jobs``: asked of the executor), and a call that came while the
sandbox was being frozen (seen in the idle clock once it is frozen) resumes it at once.
"""

from __future__ import annotations

from datetime import UTC, datetime

import structlog
from nats.js.kv import KeyValue

from sbx_api import errors
from shared.contract import commands, execution, provisioning, states
from shared.domain import session as session_rules
from shared.infrastructure import activity, projector, rpc, service

log = structlog.get_logger(__name__)

PauseCommand = commands.PauseSession | commands.ResumeSession | commands.HibernateSession


class Pausing:
    def __init__(
        self,
        ctx: service.Context,
        sessions: projector.ProjectionStore[states.SessionState],
        sandboxes: projector.ProjectionStore[states.SandboxState],
        pool: rpc.PoolClient,
    ) -> None:
        self.ctx = ctx
        self.sessions = sessions
        self.sandboxes = sandboxes
        self.pool = pool
        self.jobs: rpc.Client[execution.Jobs, execution.Reply] = rpc.Client(ctx.nc, ctx.topology, rpc.JOBS)
        self._activity_kv: KeyValue | None = None

    async def handle(self, command: PauseCommand) -> commands.CommandReply:
        session = await self.sessions.get(command.session_id)
        sandbox_id = session_rules.pause_target(session, command)
        if sandbox_id is None:  # the session moved on since the sender looked
            return commands.CommandReply(ok=True, session=session)
        before = await self.sandboxes.get(sandbox_id)
        try:
            if isinstance(command, commands.ResumeSession):
                after = await self._send(provisioning.Resume, command, sandbox_id, command.reason)
            elif isinstance(command, commands.HibernateSession):
                after = await self._hibernate(command, sandbox_id, before)
            else:
                after = await self._pause(command, sandbox_id, before)
        except errors.NotFound:
            raise errors.Conflict(
                f"session {command.session_id!r} has no sandbox to pause or resume: its sandbox is "
                "gone (its next call gets a new one)"
            ) from None
        moved = after is not None and (before is None or after.last_seq != before.last_seq)
        return commands.CommandReply(ok=True, appended=int(moved), session=session, sandbox=after)

    async def _pause(
        self, command: commands.PauseSession, sandbox_id: str, before: states.SandboxState | None
    ) -> states.SandboxState | None:
        if before is not None and before.status == "paused":
            return before
        if command.unless_jobs and await self._jobs_running(command, sandbox_id):
            log.debug("session.pause_skipped", session_id=command.session_id, reason="async job running")
            return before
        paused = await self._send(provisioning.Pause, command, sandbox_id, command.reason)
        if (
            paused is not None
            and paused.status == "paused"
            and command.quiet_since is not None
            and await self._used_since(command.session_id, command.quiet_since)
        ):
            log.info("session.pause_undone", session_id=command.session_id, reason="a call came")
            return await self._send(provisioning.Resume, command, sandbox_id, "activity")
        return paused

    async def _hibernate(
        self, command: commands.HibernateSession, sandbox_id: str, before: states.SandboxState | None
    ) -> states.SandboxState | None:
        """Stop it, files kept, the session left active; unlike a pause, a stop cannot be
        undone, so a call since ``quiet_since`` (or a job that runs) leaves it as it is."""
        if before is None or before.status not in ("running", "paused"):
            return before
        if command.quiet_since is not None and await self._used_since(
            command.session_id, command.quiet_since
        ):
            return before
        if (
            before.status == "running"
            and command.unless_jobs
            and await self._jobs_running(command, sandbox_id)
        ):
            log.debug("session.hibernate_skipped", session_id=command.session_id, reason="async job running")
            return before
        return await self.pool.send(
            provisioning.Stop(
                sandbox_id=sandbox_id,
                command_id=command.command_id,
                correlation_id=command.correlation_id,
                actor=command.actor,
                reason="hibernated",
            )
        )

    async def _send(
        self,
        kind: type[provisioning.Pause] | type[provisioning.Resume],
        command: PauseCommand,
        sandbox_id: str,
        reason: str,
    ) -> states.SandboxState | None:
        return await self.pool.send(
            kind(
                sandbox_id=sandbox_id,
                command_id=command.command_id,
                correlation_id=command.correlation_id,
                actor=command.actor,
                reason=reason,
            )
        )

    async def _jobs_running(self, command: PauseCommand, sandbox_id: str) -> bool:
        reply = await self.jobs.call(execution.Jobs(session_id=command.session_id, sandbox_id=sandbox_id))
        return reply.status == "running"

    async def _used_since(self, session_id: str, since: datetime) -> bool:
        if self._activity_kv is None:
            self._activity_kv = await self.ctx.key_value(self.ctx.topology.activity_bucket)
        entry = await activity.read(self._activity_kv, session_id)
        return entry is not None and entry.last(datetime.now(UTC)) > since

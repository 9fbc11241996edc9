"""Snapshots, forks and restores of sessions (``session.snapshot``, ``session.fork``,
``session.restore``, ``snapshot.delete``): the session's checks here, the copy and the
deletion by the pool-manager, which records them (``snapshot.created``/``deleted``).

A fork is a new session created with its sandbox in one append, the sandbox started from
the snapshot: claimed from the snapshot's own pool when it is kept warm (``snapshot.warm``,
the pool-manager keeps that many idle sandboxes started from it), else cold-started (a
configured pool's sandbox cannot take a snapshot's files: they are below its own). A
restore gives the session a new sandbox started from the snapshot and deletes the old one,
as ``create_sandbox`` replaces one: the new sandbox is obtained first, so a refusal leaves
the session as it was.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import structlog

from sbx_api import errors
from shared.contract import commands, events, provisioning, states
from shared.domain import pools
from shared.domain import session as session_rules
from shared.domain import snapshot as snapshot_rules
from shared.infrastructure import aggregates, projector

if TYPE_CHECKING:
    from services.scheduler.handlers import SessionCommands

log = structlog.get_logger(__name__)


def _kept(snapshot: states.SnapshotState) -> list[pools.PoolSpec]:
    """The snapshot's own pool, if it is kept warm (else none: a cold start)."""
    return [pools.PoolSpec.of_snapshot(snapshot)] if snapshot.warm > 0 else []


class Snapshotting:
    def __init__(
        self, owner: SessionCommands, snapshots: projector.ProjectionStore[states.SnapshotState]
    ) -> None:
        self.owner = owner
        self.snapshots = snapshots

    async def handle(self, command: commands.SnapshotCommand) -> commands.CommandReply:
        match command:
            case commands.SnapshotSession():
                return await self._take(command)
            case commands.ForkSession():
                return await self._fork(command)
            case commands.RestoreSession():
                return await self._restore(command)
            case commands.DeleteSnapshot():
                return await self._delete(command)
            case commands.WarmSnapshot():
                return await self._warm(command)

    def _meta(self, command: commands.SessionCommand) -> events.Meta:
        return self.owner.ctx.meta(command=command, session_id=command.session_id)

    async def _take(self, command: commands.SnapshotSession) -> commands.CommandReply:
        session = await self.owner.sessions.get(command.session_id)
        session_rules.decide(session, command, self._meta(command))  # raises: gone, foreign, stopped
        assert session is not None
        if session.sandbox_id is None:
            raise errors.Conflict(
                f"session {command.session_id!r} has no sandbox yet: there is nothing to snapshot"
            )
        reply = await self.owner.pool.call(
            provisioning.Snapshot(
                snapshot_id=command.snapshot_id,
                session_id=command.session_id,
                org_id=session.org_id,
                **self.owner.pool_fields(command, session.sandbox_id),
            )
        )
        return commands.CommandReply(ok=True, appended=1, session=session, snapshot=reply.snapshot)

    async def _usable(self, command: commands.SnapshotCommand) -> states.SnapshotState:
        return snapshot_rules.usable(
            await self.snapshots.get(command.snapshot_id), command.snapshot_id, command.actor.org_id
        )

    async def _fork(self, command: commands.ForkSession) -> commands.CommandReply:
        snapshot = await self._usable(command)
        meta = self._meta(command)
        read = await self.owner.sessions.get_entry(self.owner.sessions.projection.key_of(command.session_id))
        if read[0] is not None and read[0].last_command_id == command.command_id:
            return commands.CommandReply(ok=True, session=read[0])  # the same fork again: done
        session_rules.decide(read[0], command, meta)  # the id is taken: said before any sandbox is made
        options = session_rules.snapshot_options(snapshot)
        sandbox_id = await self.owner.obtain(command, options, snapshot.org_id, warm=_kept(snapshot))
        try:
            outcome = await aggregates.transact(
                self.owner.sessions,
                command.session_id,
                lambda s: session_rules.decide_fork(s, command, snapshot, sandbox_id, meta),
                read=read,
            )
        except BaseException:
            with contextlib.suppress(Exception):
                await self._delete_sandbox(command, sandbox_id)
            raise
        state = outcome.state
        if not outcome.appended:  # created meanwhile by another request
            await self._delete_sandbox(command, sandbox_id)
            if state is None or state.last_command_id != command.command_id:
                raise errors.Conflict(f"session {command.session_id!r} already exists")
        log.info("session.forked", session_id=command.session_id, snapshot_id=command.snapshot_id)
        return commands.CommandReply(ok=True, appended=len(outcome.appended), session=state)

    async def _restore(self, command: commands.RestoreSession) -> commands.CommandReply:
        session = await self.owner.sessions.get(command.session_id)
        meta = self._meta(command)
        session_rules.decide(session, command, meta)  # raises: gone, foreign, stopped
        assert session is not None
        snapshot = await self._usable(command)
        foreign = snapshot.org_id != session.org_id  # another tenant's files never enter a session
        if foreign or (command.own and snapshot.session_id != command.session_id):
            raise errors.NotFound(f"snapshot {command.snapshot_id!r} does not exist")
        options = session_rules.snapshot_options(snapshot)
        new = await self.owner.obtain(command, options, session.org_id, warm=_kept(snapshot))
        outcome = await aggregates.transact(
            self.owner.sessions,
            command.session_id,
            lambda s: session_rules.decide_install(s, new, snapshot.image, meta),
        )
        assert outcome.state is not None
        appended = [stored.event for stored in outcome.appended]
        gone = session_rules.released(appended) if outcome.state.sandbox_id == new else [new]
        for sandbox_id in gone:
            await self._delete_sandbox(command, sandbox_id)
        log.info("session.restored", session_id=command.session_id, snapshot_id=command.snapshot_id)
        return commands.CommandReply(ok=True, appended=len(appended), session=outcome.state)

    async def _delete(self, command: commands.DeleteSnapshot) -> commands.CommandReply:
        state = await self.snapshots.get(command.snapshot_id)
        org = command.actor.org_id
        if state is None or (org is not None and state.org_id not in (None, org)):
            raise errors.NotFound(f"snapshot {command.snapshot_id!r} does not exist")
        if state.status == "deleted":
            return commands.CommandReply(ok=True, snapshot=state)
        reply = await self.owner.pool.call(
            provisioning.DropSnapshot(
                snapshot_id=command.snapshot_id,
                reason=command.reason,
                **self.owner.pool_fields(command, state.sandbox_id),
            )
        )
        return commands.CommandReply(ok=True, appended=1, snapshot=reply.snapshot)

    async def _warm(self, command: commands.WarmSnapshot) -> commands.CommandReply:
        meta = self.owner.ctx.meta(command=command, session_id=command.session_id)
        every = await self.snapshots.all()
        target = every.get(self.snapshots.projection.key_of(command.snapshot_id))
        others = snapshot_rules.warm_elsewhere(
            every.values(), command.snapshot_id, target.org_id if target else None
        )  # (two raised at once may pass the organisation's total together: bounded, by 2x)
        outcome = await aggregates.transact(
            self.snapshots,
            command.snapshot_id,
            lambda s: snapshot_rules.decide_warm(s, command, meta, others),
        )
        log.info("snapshot.warm_set", snapshot_id=command.snapshot_id, count=command.count)
        return commands.CommandReply(ok=True, appended=len(outcome.appended), snapshot=outcome.state)

    async def _delete_sandbox(self, command: commands.SessionCommand, sandbox_id: str) -> None:
        await self.owner.pool.send(provisioning.Delete(**self.owner.pool_fields(command, sandbox_id)))

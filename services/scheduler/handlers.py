"""Thin glue: decode a command, load state, decide, append, project, reply."""

from __future__ import annotations

import structlog

from services.scheduler import logic
from shared import codec, commands, errors, eventstore, faults, projector, service, states, subjects

log = structlog.get_logger(__name__)

#: Attempts before giving up under contention on one session.
MAX_ATTEMPTS = 16


class SessionCommands:
    def __init__(
        self, ctx: service.Context, sessions: projector.ProjectionStore[states.SessionState]
    ) -> None:
        self.ctx = ctx
        self.sessions = sessions

    async def handle(self, raw: bytes) -> bytes:
        """Answer one request; every failure becomes an error reply, never a crash."""
        try:
            command = codec.decode_command(raw)
            logic.validate(command)
            reply = await self.execute(command)
        except errors.SandboxError as exc:
            reply = commands.CommandReply(ok=False, error=commands.ErrorInfo(exc.code, exc.message))
        except Exception as exc:
            log.exception("scheduler.command_crashed")
            reply = commands.CommandReply(
                ok=False, error=commands.ErrorInfo("internal", f"internal error: {type(exc).__name__}")
            )
        return codec.encode(reply)

    async def execute(self, command: commands.SessionCommand) -> commands.CommandReply:
        subject = self.ctx.topology.aggregate_subject(subjects.SESSION, command.session_id)
        state = await self.sessions.get(command.session_id)
        for _ in range(MAX_ATTEMPTS):
            new_events = logic.decide(
                state, command, self.ctx.meta(command=command, session_id=command.session_id)
            )
            if not new_events:
                return commands.CommandReply(ok=True, session=state)
            try:
                stored = await self.ctx.store.append(
                    subject, new_events, expected_last_seq=state.last_seq if state else 0
                )
            except eventstore.AlreadyAppended:
                # This very command was applied before (a redelivery): answer with the
                # current state and change nothing.
                return commands.CommandReply(ok=True, session=await self.sessions.rebuild(subject))
            except errors.ConcurrencyError:
                # Our view was behind (another writer, or a projection that lagged):
                # fold the truth from the stream, write it, and decide again.
                state = await self.sessions.rebuild(subject)
                continue
            faults.crash_point(self.ctx.settings.faults, "scheduler.after_append")
            for item in stored:
                state = await self.sessions.apply(item)
            log.info(
                "session.transition",
                session_id=command.session_id,
                events=[type(e).__name__ for e in new_events],
                seq=stored[-1].seq,
                command_id=command.command_id,
            )
            return commands.CommandReply(ok=True, appended=len(stored), session=state)
        raise errors.ConcurrencyError(
            f"session {command.session_id!r} is changing too fast; retry the request"
        )

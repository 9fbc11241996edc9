"""Sending commands to the deciding service and requests to the executor, turning their
replies into results or errors."""

from __future__ import annotations

from nats.aio.client import Client

from shared.contract import codec, commands, errors, execution, states, subjects
from shared.infrastructure import bus


class CommandClient:
    def __init__(self, nc: Client, topology: subjects.Topology, timeout: float) -> None:
        self.nc = nc
        self.topology = topology
        self.timeout = timeout

    async def session(self, command: commands.SessionCommand) -> states.SessionState | None:
        """Send a session command; return the resulting state or raise its error."""
        raw = await bus.request(
            self.nc,
            self.topology.session_commands,
            codec.encode(command),
            timeout=self.timeout,
            who="scheduler",
        )
        reply = codec.decode_reply(raw)
        if not reply.ok:
            assert reply.error is not None
            raise errors.from_code(reply.error.code, reply.error.message)
        return reply.session


class ExecClient:
    """Requests to the executor. ``budget`` is the request's own time; a margin is added."""

    MARGIN = 10.0

    def __init__(self, nc: Client, topology: subjects.Topology) -> None:
        self.nc = nc
        self.topology = topology

    async def run(self, request: execution.AnyRequest, *, budget: float) -> execution.Reply:
        """Send one request; return the reply, or raise its error."""
        raw = await bus.request(
            self.nc,
            self.topology.exec_requests,
            codec.encode(request),
            timeout=budget + self.MARGIN,
            who="executor",
        )
        reply = execution.decode_reply(raw)
        if not reply.ok:
            assert reply.error is not None
            raise errors.from_code(reply.error.code, reply.error.message)
        return reply

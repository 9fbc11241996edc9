"""Sending commands to the deciding service and turning replies into results or errors."""

from __future__ import annotations

import nats.errors
from nats.aio.client import Client

from shared import codec, commands, errors, execution, states, subjects


def _translate(exc: Exception, who: str) -> errors.SandboxError:
    if isinstance(exc, nats.errors.NoRespondersError):
        return errors.Unavailable(f"no {who} is running; retry shortly")
    if isinstance(exc, nats.errors.TimeoutError | TimeoutError):
        return errors.Timeout(
            f"the {who} did not answer in time; the outcome is unknown, retrying with the same "
            "Idempotency-Key is safe"
        )
    return errors.Unavailable(f"the gateway is not connected to NATS ({type(exc).__name__}); retry shortly")


class CommandClient:
    def __init__(self, nc: Client, topology: subjects.Topology, timeout: float) -> None:
        self.nc = nc
        self.topology = topology
        self.timeout = timeout

    async def session(self, command: commands.SessionCommand) -> states.SessionState | None:
        """Send a session command; return the resulting state or raise its error."""
        try:
            msg = await self.nc.request(
                self.topology.session_commands, codec.encode(command), timeout=self.timeout
            )
        except (
            nats.errors.NoRespondersError,
            nats.errors.TimeoutError,
            TimeoutError,
            nats.errors.ConnectionClosedError,
            nats.errors.ConnectionReconnectingError,
        ) as exc:
            raise _translate(exc, "scheduler") from None
        reply = codec.decode_reply(msg.data)
        if not reply.ok:
            assert reply.error is not None
            raise errors.from_code(reply.error.code, reply.error.message)
        return reply.session


class ExecClient:
    """Requests to the executor. ``timeout`` is the request's own budget plus a margin."""

    MARGIN = 10.0

    def __init__(self, nc: Client, topology: subjects.Topology) -> None:
        self.nc = nc
        self.topology = topology

    async def run(self, request: execution.AnyRequest, *, budget: float) -> execution.Reply:
        """Send one request; return the reply, or raise its error."""
        try:
            msg = await self.nc.request(
                self.topology.exec_requests, codec.encode(request), timeout=budget + self.MARGIN
            )
        except (
            nats.errors.NoRespondersError,
            nats.errors.TimeoutError,
            TimeoutError,
            nats.errors.ConnectionClosedError,
            nats.errors.ConnectionReconnectingError,
        ) as exc:
            raise _translate(exc, "executor") from None
        reply = execution.decode_reply(msg.data)
        if not reply.ok:
            assert reply.error is not None
            raise errors.from_code(reply.error.code, reply.error.message)
        return reply

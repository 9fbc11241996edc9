"""Sending commands to the deciding service and turning replies into results or errors."""

from __future__ import annotations

import nats.errors
from nats.aio.client import Client

from shared import codec, commands, errors, states, subjects


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
        except nats.errors.NoRespondersError:
            raise errors.Unavailable("no scheduler is running; retry shortly") from None
        except (nats.errors.TimeoutError, TimeoutError):
            raise errors.Timeout(
                "the scheduler did not answer in time; the outcome is unknown, "
                "retrying with the same Idempotency-Key is safe"
            ) from None
        except (nats.errors.ConnectionClosedError, nats.errors.ConnectionReconnectingError):
            raise errors.Unavailable("the gateway is not connected to NATS; retry shortly") from None
        reply = codec.decode_reply(msg.data)
        if not reply.ok:
            assert reply.error is not None
            raise errors.from_code(reply.error.code, reply.error.message)
        return reply.session

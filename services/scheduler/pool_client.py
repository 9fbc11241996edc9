"""Asking the pool-manager to provision, start, stop or delete a sandbox."""

from __future__ import annotations

import nats.errors
from nats.aio.client import Client

from shared import codec, errors, provisioning, states, subjects

TIMEOUT = 60.0


class PoolClient:
    def __init__(self, nc: Client, topology: subjects.Topology) -> None:
        self.nc = nc
        self.topology = topology

    async def send(self, request: provisioning.AnyPoolRequest) -> states.SandboxState | None:
        try:
            msg = await self.nc.request(self.topology.pool_requests, codec.encode(request), timeout=TIMEOUT)
        except nats.errors.NoRespondersError:
            raise errors.Unavailable("no pool-manager is running; retry shortly") from None
        except (nats.errors.TimeoutError, TimeoutError):
            raise errors.Timeout("the pool-manager did not answer in time; retry") from None
        reply = provisioning.decode_reply(msg.data)
        if not reply.ok:
            assert reply.error is not None
            raise errors.from_code(reply.error.code, reply.error.message)
        return reply.sandbox

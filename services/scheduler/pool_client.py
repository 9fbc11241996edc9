"""Asking the pool-manager to provision, start, stop or delete a sandbox."""

from __future__ import annotations

from nats.aio.client import Client

from shared.contract import codec, errors, provisioning, states, subjects
from shared.infrastructure import bus

TIMEOUT = 60.0


class PoolClient:
    def __init__(self, nc: Client, topology: subjects.Topology) -> None:
        self.nc = nc
        self.topology = topology

    async def send(self, request: provisioning.AnyPoolRequest) -> states.SandboxState | None:
        raw = await bus.request(
            self.nc, self.topology.pool_requests, codec.encode(request), timeout=TIMEOUT, who="pool-manager"
        )
        reply = provisioning.decode_reply(raw)
        if not reply.ok:
            assert reply.error is not None
            raise errors.from_code(reply.error.code, reply.error.message)
        return reply.sandbox

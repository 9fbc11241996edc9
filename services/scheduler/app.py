"""Wiring of the scheduler: its subscriber, its projections, its catch-up task."""

from __future__ import annotations

from faststream.nats import NatsMessage

from services.scheduler import handlers, pool_client
from shared import projections, projector, service

#: Queue group: every scheduler instance joins it, each command goes to one.
QUEUE = "scheduler"
#: Commands handled concurrently per instance (bounded: back-pressure).
MAX_WORKERS = 64


async def setup(ctx: service.Context) -> service.Workload:
    sessions = await projector.ProjectionStore.open(ctx.js, projections.SESSIONS, ctx.store)
    sandboxes = await projector.ProjectionStore.open(ctx.js, projections.SANDBOXES, ctx.store)
    commands = handlers.SessionCommands(
        ctx, sessions, sandboxes, pool_client.PoolClient(ctx.nc, ctx.topology)
    )

    @ctx.broker.subscriber(ctx.topology.session_commands, queue=QUEUE, max_workers=MAX_WORKERS)
    async def on_session_command(msg: NatsMessage) -> bytes:
        return await commands.handle(msg.body)

    return service.Workload(tasks=[projector.catch_up(ctx.js, sessions)])

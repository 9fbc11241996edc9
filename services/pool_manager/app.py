"""Wiring of the pool-manager: the runtime, its provisioning subscriber, its projection."""

from __future__ import annotations

from collections.abc import Mapping

from faststream.nats import NatsMessage

from services.pool_manager import handlers
from shared import projections, projector, service, settings
from shared.runtime import api, backends

QUEUE = "pool-manager"
MAX_WORKERS = 32


def make_setup(runtime_settings: settings.RuntimeSettings) -> service.Setup:
    async def setup(ctx: service.Context) -> service.Workload:
        runtime = backends.open_runtime(runtime_settings.backend, ctx.settings.state_dir)
        sandboxes = await projector.ProjectionStore.open(ctx.js, projections.SANDBOXES, ctx.store)
        limits = api.Limits(
            memory_bytes=runtime_settings.memory_bytes, cpus=runtime_settings.cpus, pids=runtime_settings.pids
        )
        pool = handlers.PoolHandlers(ctx, runtime, sandboxes, limits)
        ctx.details["runtime"] = runtime.name

        @ctx.broker.subscriber(ctx.topology.pool_requests, queue=QUEUE, max_workers=MAX_WORKERS)
        async def on_pool_request(msg: NatsMessage) -> bytes:
            return await pool.handle(msg.body)

        return service.Workload(tasks=[projector.catch_up(ctx.js, sandboxes)])

    return setup


def build(env: Mapping[str, str]) -> tuple[settings.ServiceSettings, service.Setup]:
    return settings.ServiceSettings.from_env("pool-manager", env), make_setup(
        settings.RuntimeSettings.from_env(env)
    )

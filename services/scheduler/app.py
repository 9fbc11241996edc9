"""Wiring of the scheduler: its subscriber, its projections, its catch-up task."""

from __future__ import annotations

import functools
from collections.abc import Mapping

from services.scheduler import handlers
from shared.domain import pools, projections
from shared.infrastructure import eventstore, projector, rpc, service, warmpool
from shared.infrastructure.settings import lifecycle as lifecycle_settings
from shared.infrastructure.settings import service as service_settings

#: Commands handled concurrently per instance (bounded: back-pressure).
MAX_WORKERS = 64


def make_setup(lifecycle: lifecycle_settings.LifecycleSettings | None = None) -> service.Setup:
    async def setup(ctx: service.Context) -> service.Workload:
        sessions = await projector.ProjectionStore.open(ctx.js, projections.SESSIONS, ctx.store)
        sandboxes = await projector.ProjectionStore.open(ctx.js, projections.SANDBOXES, ctx.store)
        snapshots = await projector.ProjectionStore.open(ctx.js, projections.SNAPSHOTS, ctx.store)
        warm = pools.configured(lifecycle) if lifecycle else []
        for spec in warm:
            await eventstore.patiently(
                functools.partial(warmpool.ensure_consumer, ctx.js, ctx.topology, spec.pool_id),
                f"creating the claims consumer of {spec.pool_id}",
            )
        commands = handlers.SessionCommands(
            ctx,
            sessions,
            sandboxes,
            rpc.PoolClient(ctx.nc, ctx.topology),
            warm,
            caches_at_create=lifecycle.caches_at_create if lifecycle else False,
            snapshot_store=snapshots,
        )

        ctx.answer(rpc.SESSIONS, commands.handle, workers=MAX_WORKERS)

        return service.Workload(tasks=[projector.catch_up(ctx.js, sessions)])

    return setup


setup = make_setup()


def build(env: Mapping[str, str]) -> tuple[service_settings.ServiceSettings, service.Setup]:
    return service_settings.ServiceSettings.from_env("scheduler", env), make_setup(
        lifecycle_settings.LifecycleSettings.from_env(env)
    )

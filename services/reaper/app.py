"""Wiring of the reaper: one pass at start-up and every ``SBX_REAPER_INTERVAL``, by the lease holder."""

from __future__ import annotations

from collections.abc import Mapping

import structlog

from services.reaper import handlers
from shared.domain import projections
from shared.infrastructure import leases, projector, service
from shared.infrastructure.settings import lifecycle as lifecycle_settings
from shared.infrastructure.settings import runtime as runtime_settings
from shared.infrastructure.settings import service as service_settings
from shared.runtime import backends

log = structlog.get_logger(__name__)
LEASE_KEY = "reaper"


def make_setup(
    runtime_settings: runtime_settings.RuntimeSettings,
    lifecycle: lifecycle_settings.LifecycleSettings,
    grace: float = handlers.GRACE_SECONDS,
) -> service.Setup:
    async def setup(ctx: service.Context) -> service.Workload:
        runtime = backends.open_runtime(
            runtime_settings.backend,
            ctx.settings.state_dir,
            egress=runtime_settings.egress,
        )
        sessions = await projector.ProjectionStore.open(ctx.js, projections.SESSIONS, ctx.store)
        sandboxes = await projector.ProjectionStore.open(ctx.js, projections.SANDBOXES, ctx.store)
        snapshots = await projector.ProjectionStore.open(ctx.js, projections.SNAPSHOTS, ctx.store)
        reaper = handlers.Reaper(ctx, runtime, sessions, sandboxes, lifecycle, grace, snapshots)
        await reaper.follow()
        lease = leases.Lease(
            await ctx.key_value(ctx.topology.leases_bucket), LEASE_KEY, ctx.settings.instance
        )

        passes = 0

        def passed(report: handlers.Report) -> None:
            nonlocal passes
            passes += 1
            ctx.details["passes"] = str(passes)
            ctx.details["last_pass"] = (
                ",".join(f"{k}={v}" for k, v in (report.reaps + report.findings).items()) or "clean"
            )

        loop = leases.lead(
            lease,
            reaper.pass_once,
            name="reaper",
            pace=leases.Pace(lifecycle.reaper_interval),
            on_round=passed,
        )
        return service.Workload(tasks=[loop], on_stop=[runtime.close, reaper.unfollow])

    return setup


def build(env: Mapping[str, str]) -> tuple[service_settings.ServiceSettings, service.Setup]:
    return service_settings.ServiceSettings.from_env("reaper", env), make_setup(
        runtime_settings.RuntimeSettings.from_env(env), lifecycle_settings.LifecycleSettings.from_env(env)
    )

"""Wiring of the executor: the runtime, its request subscriber, the sandboxes projection."""

from __future__ import annotations

from collections.abc import Mapping

from services.executor import caches, handlers, shells
from shared.domain import projections
from shared.infrastructure import auditrate, projector, rpc, service
from shared.infrastructure.settings import audit
from shared.infrastructure.settings import runtime as runtime_settings
from shared.infrastructure.settings import service as service_settings
from shared.runtime import backends

#: Requests served concurrently per instance: long shell calls wait, they do not block others.
MAX_WORKERS = 256


def make_setup(
    runtime_settings: runtime_settings.RuntimeSettings,
    audit_rate: audit.AuditRateSettings | None = None,
) -> service.Setup:
    async def setup(ctx: service.Context) -> service.Workload:
        runtime = backends.open_runtime(
            runtime_settings.backend,
            ctx.settings.state_dir,
            egress=runtime_settings.egress,
        )
        sandboxes = await projector.ProjectionStore.open(ctx.js, projections.SANDBOXES, ctx.store)
        activity_kv = await ctx.key_value(ctx.topology.activity_bucket)
        servers = shells.ShellServers(runtime)
        sessions = await projector.ProjectionStore.open(ctx.js, projections.SESSIONS, ctx.store)
        tenant_caches = caches.TenantCaches(ctx, runtime, sessions, sandboxes)
        rate = auditrate.AuditRate(
            await ctx.key_value(ctx.topology.audit_rate_bucket), audit_rate or audit.AuditRateSettings()
        )
        executor = handlers.Executor(
            ctx, runtime, sandboxes, runtime_settings.output_limit, activity_kv, servers, tenant_caches, rate
        )
        ctx.details["runtime"] = runtime.name

        ctx.answer(rpc.EXEC, executor.handle, workers=MAX_WORKERS)
        ctx.answer(rpc.PREPARE, executor.prepare)
        ctx.answer(rpc.JOBS, executor.jobs)
        await ctx.nc.subscribe(ctx.topology.exec_cancels, cb=executor.cancel)

        return service.Workload(
            tasks=[servers.run_sweeps()],
            on_drain=[executor.streamed.close, servers.close],
            on_stop=[runtime.close],
        )

    return setup


def build(env: Mapping[str, str]) -> tuple[service_settings.ServiceSettings, service.Setup]:
    return service_settings.ServiceSettings.from_env("executor", env), make_setup(
        runtime_settings.RuntimeSettings.from_env(env), audit.AuditRateSettings.from_env(env)
    )

"""Wiring of the pool-manager: the runtime, its provisioning subscriber, the warm pool."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from services.pool_manager import demand, handlers, refill, snapshots
from shared.contract import states
from shared.domain import pools as pool_specs
from shared.domain import poolsizing, projections
from shared.domain import sandbox as sandbox_rules
from shared.infrastructure import projector, rpc, service
from shared.infrastructure.settings import lifecycle as lifecycle_settings
from shared.infrastructure.settings import runtime as runtime_settings
from shared.infrastructure.settings import service as service_settings
from shared.runtime import api, backends

MAX_WORKERS = 32


def make_setup(
    runtime_settings: runtime_settings.RuntimeSettings,
    lifecycle: lifecycle_settings.LifecycleSettings | None = None,
) -> service.Setup:
    lifecycle = lifecycle or lifecycle_settings.LifecycleSettings(pool_min_idle=0)

    async def setup(ctx: service.Context) -> service.Workload:
        runtime = backends.open_runtime(
            runtime_settings.backend,
            ctx.settings.state_dir,
            egress=runtime_settings.egress,
            disk_reserve=runtime_settings.disk_reserve,
            images=runtime_settings,
            tune_host=runtime_settings.cgroup_favor_dynmods,
        )
        sandboxes = await projector.ProjectionStore.open(ctx.js, projections.SANDBOXES, ctx.store)
        snapshot_store = await projector.ProjectionStore.open(ctx.js, projections.SNAPSHOTS, ctx.store)
        limits = api.Limits(
            memory_bytes=runtime_settings.memory_bytes,
            cpus=runtime_settings.cpus,
            pids=runtime_settings.pids,
            disk_bytes=runtime_settings.disk_bytes,
            disk_inodes=runtime_settings.disk_inodes if runtime_settings.disk_bytes else 0,
        )
        pool = handlers.PoolHandlers(
            ctx,
            runtime,
            sandboxes,
            limits,
            max_running=lifecycle.max_running,
            leases_kv=await ctx.key_value(ctx.topology.leases_bucket),
            snapshots=snapshots.SnapshotHandlers(
                ctx,
                runtime,
                sandboxes,
                snapshot_store,
                per_session=runtime_settings.snapshots_per_session,
            ),
        )
        ctx.details["runtime"] = runtime.name
        # Listed by every refill round (which also reports how many are requested,
        # running and stopped) and before every provision. Records of deleted, failed,
        # lost and refused sandboxes stay in KV for good: not followed.
        # Heard once a change is in the bucket: one that leaves a pool short wakes the
        # refill; any wakes a start waiting for its sandbox's proxy.
        short = asyncio.Event()
        heard = demand.Heard(pool_specs.configured(lifecycle), sizing(lifecycle), short)

        def on_change(old: states.SandboxState | None, new: states.SandboxState | None) -> None:
            heard.changed(old, new)
            changed = new or old
            if changed is not None:
                pool.noticed(changed.sandbox_id)

        await sandboxes.follow(keep=lambda s: s.status in sandbox_rules.LIVE, on_change=on_change)

        def on_snapshot(old: states.SnapshotState | None, new: states.SnapshotState | None) -> None:
            if (old.warm if old else 0) != (new.warm if new else 0):
                short.set()  # a snapshot kept warm, no longer, or deleted: its pool changes

        await snapshot_store.follow(keep=lambda s: s.status == "ready", on_change=on_snapshot)

        ctx.answer(rpc.POOL, pool.handle, workers=MAX_WORKERS)

        tasks = [projector.catch_up(ctx.js, sandboxes), projector.catch_up(ctx.js, snapshot_store)]
        pools = refill.pools_with_snapshots(heard.sized, snapshot_store)
        tasks.append(
            refill.run(
                ctx,
                pool,
                pools,
                lifecycle.max_running,
                short,
                max_age=lifecycle.pool_max_age,
                claimed=heard.claimed,
            )
        )
        return service.Workload(
            tasks=tasks, on_stop=[runtime.close, sandboxes.unfollow, snapshot_store.unfollow]
        )

    return setup


def sizing(lifecycle: lifecycle_settings.LifecycleSettings) -> poolsizing.Sizing:
    return poolsizing.Sizing(
        enabled=lifecycle.pool_autosize,
        max_idle=lifecycle.pool_max_idle,
        horizon=lifecycle.pool_horizon,
        window=lifecycle.pool_demand_window,
    )


def build(env: Mapping[str, str]) -> tuple[service_settings.ServiceSettings, service.Setup]:
    return service_settings.ServiceSettings.from_env("pool-manager", env), make_setup(
        runtime_settings.RuntimeSettings.from_env(env), lifecycle_settings.LifecycleSettings.from_env(env)
    )

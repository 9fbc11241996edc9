"""Wiring of the proxy-scaler: one round at start-up and then continuously, by the lease holder.

With sandbox egress ``none`` there is nothing to scale: the service runs its lifecycle
and says so in its health details. Locally proxies are processes routed per sandbox
(``Scaler``); on Kubernetes the proxy Deployment is sized (``ReplicaScaler``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping

import structlog

from services.proxy_scaler import egresslog, fleetmetrics, handlers, logic
from shared.contract import states
from shared.domain import projections
from shared.domain import sandbox as sandbox_rules
from shared.infrastructure import leases, metrics, projector, service
from shared.infrastructure.settings import proxies as proxies_settings
from shared.infrastructure.settings import runtime as runtime_settings
from shared.infrastructure.settings import service as service_settings
from shared.runtime import backends

log = structlog.get_logger(__name__)
LEASE_KEY = "proxy-scaler"
INTERVAL = 0.5
MIN_GAP = 0.1
"""Rounds start at least this far apart, however many sandbox events come."""


# Long on purpose: wiring, each step building what the next one needs.
def make_setup(
    runtime_settings: runtime_settings.RuntimeSettings, proxy_settings: proxies_settings.ProxySettings
) -> service.Setup:
    async def setup(ctx: service.Context) -> service.Workload:
        if runtime_settings.egress != "proxy":
            ctx.details["fleet"] = "off: sandbox egress is none"
            return service.Workload()
        runtime = backends.open_runtime(runtime_settings.backend, ctx.settings.state_dir, egress="proxy")
        fleet = backends.open_proxy_fleet(
            runtime_settings.backend,
            ctx.settings.state_dir,
            runtime,
            binary=proxy_settings.binary,
            config=proxy_settings.config,
        )
        await fleet.ensure_ca()
        exported = _export_metrics(ctx, fleet)
        sandboxes = await projector.ProjectionStore.open(ctx.js, projections.SANDBOXES, ctx.store)
        proxies = await projector.ProjectionStore.open(ctx.js, projections.PROXIES, ctx.store)
        # A fleet whose sandboxes each reach one proxy (local) is routed per sandbox; one
        # behind a load-balanced address (Kubernetes) is only sized.
        kind = handlers.Scaler if fleet.pinned else handlers.ReplicaScaler
        scaler = kind(
            ctx,
            fleet,
            sandboxes,
            proxies,
            per_proxy=proxy_settings.sandboxes_per_proxy,
            drain_grace=proxy_settings.drain,
            backend=runtime_settings.backend,
            keep_warm=proxy_settings.keep_warm,
        )
        lease = leases.Lease(
            await ctx.key_value(ctx.topology.leases_bucket), LEASE_KEY, ctx.settings.instance
        )

        # A round runs as soon as a sandbox waits for it (logic.wants_round: it started
        # and needs a route, or it was requested with no room left), heard from the
        # followed copy once the change is in the bucket, so the round sees it; and at
        # least every INTERVAL (processes that died, drain deadlines).
        wake = asyncio.Event()

        def on_sandbox_change(old: states.SandboxState | None, new: states.SandboxState | None) -> None:
            scaler.changes += 1
            if logic.is_new_request(old, new):
                scaler.room -= 1
            if logic.wants_round(old, new, room=scaler.room, routed=fleet.pinned):
                wake.set()

        # Every round lists both; it plans with requested, running and paused sandboxes
        # only (records of deleted ones stay in KV for good).
        await sandboxes.follow(keep=lambda s: s.status in sandbox_rules.HOLDING, on_change=on_sandbox_change)

        def on_proxy_change(old: states.ProxyState | None, new: states.ProxyState | None) -> None:
            scaler.changes += 1

        await proxies.follow(keep=lambda p: p.status != "stopped", on_change=on_proxy_change)

        rounds = {True: 0, False: 0}

        def rounded(report: handlers.Report) -> None:
            exported.active = True  # the lease holder: it alone re-exports the fleet's metrics
            if report.started:
                wake.set()  # the sandboxes that waited for it are assigned next round
            ctx.details["fleet"] = f"{report.serving} proxies"
            rounds[report.planned] += 1
            ctx.details["rounds"] = f"{rounds[True]} planned, {rounds[False]} skipped (nothing changed)"
            if report.notes:
                ctx.details["last_note"] = report.notes[-1][:200]

        def standby() -> None:
            exported.active = False
            ctx.details["fleet"] = "standby"

        # Events that come while a round runs or just after wait for one more round together
        # (a refill starts many sandboxes at once; each round reads every sandbox record).
        loop = leases.lead(
            lease,
            lambda: scaler.round(service.now()),
            name="proxy_scaler",
            pace=leases.Pace(INTERVAL, MIN_GAP, wake),
            on_round=rounded,
            on_standby=standby,
        )
        tasks = [projector.catch_up(ctx.js, proxies), loop]
        if hasattr(fleet, "metrics_socket"):  # proxies that keep egress records on a socket
            tasks.append(_collect_egress(ctx, fleet, sandboxes))
        else:
            ctx.details["egress_records"] = "not collected on this backend"
        return service.Workload(
            tasks=tasks,
            on_stop=[runtime.close, sandboxes.unfollow, proxies.unfollow, lambda: _unregister(exported)],
        )

    return setup


async def _collect_egress(ctx: service.Context, fleet, sandboxes) -> None:
    """Egress records into the audit stream, by the instance holding their own lease."""
    collector = egresslog.Collector(ctx, fleet, sandboxes)
    lease = leases.Lease(
        await ctx.key_value(ctx.topology.leases_bucket), egresslog.LEASE_KEY, ctx.settings.instance
    )

    def collected(report: egresslog.Report) -> None:
        ctx.details["egress_records"] = f"collected from {report.proxies} proxies"

    await leases.lead(
        lease,
        collector.round,
        name="egress_records",
        pace=leases.Pace(egresslog.INTERVAL),
        on_round=collected,
    )


def _export_metrics(ctx: service.Context, fleet) -> fleetmetrics.FleetMetrics:
    """Re-export each proxy's metrics (its unix socket) on this service's ``/metrics``
    (registered only for a fleet of local processes)."""
    exported = fleetmetrics.FleetMetrics(fleet)
    if not hasattr(fleet, "metrics_socket"):
        ctx.details["proxy_metrics"] = "not collected by the scaler on this backend"
        return exported
    metrics.REGISTRY.register(exported)
    # (sbx status prints it: where the fleet's metrics are, in one line)
    ctx.details["proxy_metrics"] = f"re-exported on this /metrics; sockets {fleet.dir}/*.metrics.sock"
    return exported


async def _unregister(exported: fleetmetrics.FleetMetrics) -> None:
    exported.active = False
    with contextlib.suppress(KeyError):  # never registered (another backend)
        metrics.REGISTRY.unregister(exported)


def build(env: Mapping[str, str]) -> tuple[service_settings.ServiceSettings, service.Setup]:
    return service_settings.ServiceSettings.from_env("proxy-scaler", env), make_setup(
        runtime_settings.RuntimeSettings.from_env(env), proxies_settings.ProxySettings.from_env(env)
    )

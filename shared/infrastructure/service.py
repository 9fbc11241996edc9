"""The life of a service process: connect, join, serve, report health, drain.

Every service's entry point is ``service.main(name, setup)``. ``setup`` gets a
:class:`Context` (bus, event store, causation metadata), registers the requests it
answers (``ctx.answer``, :mod:`shared.infrastructure.responders`) and returns a
:class:`Workload` of long-running tasks. The runner then:

1. creates the stream and buckets if this is the first process (idempotent);
2. appends ``instance.started`` and starts reporting health;
3. keeps the instance projection caught up (every service helps);
4. on SIGTERM/SIGINT drains: stops taking work, lets in-flight handlers finish
   within ``SBX_DRAIN_TIMEOUT``, appends ``instance.stopped``, removes its
   health report, and exits 0. If any task dies, the process exits 1 so its
   supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.metadata
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import structlog
from nats.aio.client import Client
from nats.js.client import JetStreamContext
from nats.js.kv import KeyValue

from sbx_api import errors
from shared.contract import codec, commands, events, ids, subjects
from shared.domain import projections
from shared.infrastructure import (
    aio,
    bus,
    eventstore,
    health,
    logs,
    metrics,
    projector,
    responders,
    rpc,
    tracing,
)
from shared.infrastructure.settings import bus as bus_config
from shared.infrastructure.settings import service as service_config

log = structlog.get_logger(__name__)

try:
    VERSION = importlib.metadata.version("cloud-agent-sandbox")
except importlib.metadata.PackageNotFoundError:  # running from a plain checkout
    VERSION = "dev"

STARTUP_TIMEOUT = 30.0


def now() -> datetime:
    return datetime.now(UTC)


@dataclass
class Context:
    """What a service's wiring gets from the runner."""

    settings: service_config.ServiceSettings
    nc: Client
    js: JetStreamContext
    topology: subjects.Topology
    store: eventstore.EventStore
    started_at: datetime
    details: dict[str, str] = field(default_factory=dict)
    """Free-form facts added to every health report (kept short)."""
    status: health.Status = "starting"
    answering: list[responders.Responder] = field(default_factory=list)

    def answer(self, family: rpc.Family[Any, Any], handle: responders.Handle, *, workers: int = 1) -> None:
        """Answer ``family``'s requests with ``handle``, at most ``workers`` at once (from
        the end of the setup until the drain)."""
        self.answering.append(
            responders.Responder(
                self.nc,
                family.subject(self.topology),
                handle,
                queue=family.responder,
                workers=workers,
                busy=lambda e: codec.encode(family.failed(e)),
            )
        )

    async def key_value(self, bucket: str) -> KeyValue:
        """A KV bucket, waiting out a leader election (as at start-up on a cluster)."""
        return await eventstore.patiently(lambda: self.js.key_value(bucket), f"opening {bucket}")

    def meta(
        self,
        *,
        command: commands.Command | None = None,
        session_id: str | None = None,
        command_id: str | None = None,
        correlation_id: str | None = None,
        actor: commands.Actor | None = None,
    ) -> events.Meta:
        """Causation metadata for an event this instance appends now: from ``command``,
        or from the explicit fields of a request that is not a session command."""
        if command is not None:
            command_id, correlation_id, actor = command.command_id, command.correlation_id, command.actor
        return events.Meta(
            event_id=ids.new_id(),
            time=now(),
            service=self.settings.service,
            instance=self.settings.instance,
            command_id=command_id,
            correlation_id=correlation_id,
            org_id=actor.org_id if actor else None,
            user_id=actor.user_id if actor else None,
            session_id=session_id,
        )

    def report(self) -> health.HealthReport:
        return health.HealthReport(
            service=self.settings.service,
            instance=self.settings.instance,
            pid=os.getpid(),
            host=self.settings.hostname,
            version=VERSION,
            status=self.status,
            started_at=self.started_at,
            reported_at=now(),
            interval=self.settings.health_interval,
            details=dict(self.details),
        )


@dataclass
class Workload:
    """What a service runs besides the requests it answers."""

    tasks: list[Coroutine[Any, Any, None]] = field(default_factory=list)
    """Run until cancelled; if one ends or fails, the process exits non-zero."""
    on_drain: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    """Called first on shutdown, to stop taking new work (e.g. close a listener)."""
    on_stop: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    """Called last, once in-flight work is done: release clients (e.g. the runtime's)."""


Setup = Callable[[Context], Awaitable[Workload]]


async def _connect_with_retry(bus_settings: bus_config.BusSettings, name: str) -> Client:
    deadline = asyncio.get_running_loop().time() + STARTUP_TIMEOUT
    delay = 0.1
    while True:
        try:
            return await bus.connect(bus_settings, name)
        except errors.Unavailable as exc:
            if asyncio.get_running_loop().time() > deadline:
                raise
            log.warning("service.waiting_for_nats", error=str(exc), retry_in=delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)


async def _record_start(
    store: eventstore.EventStore, subject: str, started: events.InstanceStarted
) -> list[eventstore.Stored]:
    """Append ``instance.started`` (patiently: JetStream may be electing a leader). An
    attempt whose acknowledgement was lost landed anyway: the retry is refused as a
    duplicate, and the stored event is read back instead."""
    patiently = eventstore.patiently
    history = await patiently(lambda: store.load(subject), "reading this instance's events")
    last = history[-1].seq if history else 0  # non-zero only for a reused SBX_INSTANCE_ID
    try:
        return await patiently(
            lambda: store.append(subject, [started], expected_last_seq=last),
            "recording this instance's start",
        )
    except errors.ConcurrencyError:
        stored = await patiently(lambda: store.load(subject, after=last), "reading this instance's events")
        mine = [e for e in stored if e.event.meta.event_id == started.meta.event_id]
        if not mine:
            raise
        return mine


# Long on purpose: a service's whole life in order (connect, join, serve, drain, leave);
# its steps share what the ``finally`` cleans up.
async def run(  # noqa: C901
    service_settings: service_config.ServiceSettings, setup: Setup, *, stop: asyncio.Event | None = None
) -> int:
    """Run one service instance until signalled (or ``stop`` is set); return the exit code.

    Passing ``stop`` runs the service embedded in another program (tests do): no
    signal handlers are installed then.
    """
    s = service_settings
    name = f"{s.service}/{s.instance}"
    topology = subjects.Topology(s.bus.namespace)
    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)

    nc = await _connect_with_retry(s.bus, name)
    js = nc.jetstream()
    # A node of a cluster may be electing leaders while we start: wait, do not exit.
    patiently = eventstore.patiently
    await patiently(
        lambda: bus.ensure_topology(js, topology, replicas=service_settings.bus.replicas),
        "checking the streams",
    )
    store = eventstore.EventStore(js, topology, audit_ttl=service_settings.bus.retention.audit_max_age)
    ctx = Context(s, nc, js, topology, store, started_at=now())
    instances = await projector.ProjectionStore.open(js, projections.INSTANCES, store)  # (patient)
    health_kv = await ctx.key_value(topology.health_bucket)

    if s.metrics_port is not None:
        port = metrics.serve(s.metrics_port, s.metrics_host)
        shown = "127.0.0.1" if s.metrics_host in ("0.0.0.0", "::", "") else s.metrics_host  # noqa: S104
        ctx.details["metrics"] = f"http://{shown}:{port}/metrics"
    workload = await setup(ctx)
    for responder in ctx.answering:
        await responder.start()
    started = events.InstanceStarted(
        meta=ctx.meta(),
        service=s.service,
        instance=s.instance,
        pid=os.getpid(),
        host=s.hostname,
        version=VERSION,
    )
    for stored in await _record_start(
        store, topology.aggregate_subject(subjects.INSTANCE, s.instance), started
    ):
        await patiently(functools.partial(instances.apply, stored), "projecting this instance's start")
    ctx.status = "ok"
    log.info("service.started", nats=s.bus.nats_url, namespace=s.bus.namespace, pid=os.getpid())

    tasks = [
        asyncio.create_task(health.heartbeat(health_kv, ctx.report, s.health_interval), name="heartbeat"),
        asyncio.create_task(projector.catch_up(js, instances), name="projector:instances"),
        *(asyncio.create_task(t) for t in workload.tasks),
    ]
    stopper = asyncio.create_task(stop.wait(), name="stop-signal")
    done, _ = await asyncio.wait([stopper, *tasks], return_when=asyncio.FIRST_COMPLETED)
    exit_code, reason = 0, "signal"
    for task in done:
        if task is not stopper:
            exit_code, reason = 1, f"task {task.get_name()} ended"
            exc = task.exception() if not task.cancelled() else None
            log.error("service.task_failed", task=task.get_name(), error=repr(exc))

    log.info("service.draining", reason=reason)
    ctx.status = "draining"
    with contextlib.suppress(Exception):
        await health.publish(health_kv, ctx.report())
    for callback in workload.on_drain:
        try:
            async with asyncio.timeout(s.drain_timeout):
                await callback()
        except Exception as exc:
            log.warning("service.drain_callback_failed", error=repr(exc))
    # Requests in hand finish (their replies and events leave on the open connection).
    await asyncio.gather(*(r.stop(s.drain_timeout) for r in ctx.answering), return_exceptions=True)
    await aio.cancel_and_wait([stopper, *tasks])
    for callback in workload.on_stop:
        try:
            async with asyncio.timeout(s.drain_timeout):
                await callback()
        except Exception as exc:
            log.warning("service.stop_callback_failed", error=repr(exc))
    try:
        current = await instances.get(s.instance)
        stopped = events.InstanceStopped(
            meta=ctx.meta(), service=s.service, instance=s.instance, reason=reason
        )
        for stored in await store.append(
            topology.aggregate_subject(subjects.INSTANCE, s.instance),
            [stopped],
            expected_last_seq=current.last_seq if current else 0,
        ):
            await instances.apply(stored)
        await health_kv.delete(health.key(s.service, s.instance))
    except Exception as exc:
        log.warning("service.leave_failed", error=repr(exc))
    await nc.drain()
    log.info("service.stopped", exit_code=exit_code)
    return exit_code


Build = Callable[[Mapping[str, str]], tuple[service_config.ServiceSettings, Setup]]


def main(service: str, build: Build) -> None:
    """Entry point body for ``python -m services.<name>``."""
    try:
        service_settings, setup = build(os.environ)
    except errors.ConfigError as exc:
        print(f"{service}: configuration error: {exc.message}", file=sys.stderr)
        raise SystemExit(2) from None
    logs.configure(
        service=service,
        instance=service_settings.instance,
        level=service_settings.log_level,
        fmt=service_settings.log_format,
    )
    tracing.configure(service_settings, VERSION)  # (nothing at all unless OTEL_* asks for it)
    try:
        code = asyncio.run(run(service_settings, setup))
    except errors.SandboxError as exc:
        log.error("service.failed", error=exc.message, code=exc.code)
        code = 1
    finally:
        tracing.shutdown()  # the spans still in the batch are exported
    raise SystemExit(code)

"""Typed settings, read from the environment once at start-up and passed in.

Logic never reads ``os.environ``; each service's entry point calls
``*.from_env(os.environ)`` and hands the frozen result down. Invalid values stop
start-up with a :class:`~sbx_api.errors.ConfigError` naming the variable.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from sbx_api import errors
from shared.contract import ids

_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_NAMESPACE = re.compile(r"[a-z][a-z0-9_]{0,31}")
API_KEY_MIN_LENGTH = 16


def parse_duration(text: str, *, name: str = "duration") -> float:
    """Seconds in ``text``: ``90`` (seconds), ``90s``, ``500ms``, ``10m``, ``1h``, ``1h30m``, ``1d``."""
    raw = text.strip().lower()
    if not raw:
        raise errors.ConfigError(f"{name} is empty; use e.g. 90, 90s, 10m or 1h")
    try:
        seconds = float(raw)
    except ValueError:
        pos, seconds = 0, 0.0
        for match in _DURATION_PART.finditer(raw):
            if match.start() != pos:
                break
            seconds += float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
            pos = match.end()
        if pos != len(raw) or pos == 0:
            raise errors.ConfigError(
                f"{name}={text!r} is not a duration; use e.g. 90, 90s, 500ms, 10m, 1h or 1h30m"
            ) from None
    if seconds < 0 or seconds != seconds or seconds == float("inf"):
        raise errors.ConfigError(f"{name}={text!r} must be a finite, non-negative duration")
    return seconds


def _duration(env: Mapping[str, str], name: str, default: float, *, minimum: float = 0.0) -> float:
    if name not in env:
        return default
    value = parse_duration(env[name], name=name)
    if value < minimum:
        raise errors.ConfigError(f"{name}={env[name]!r} is below the minimum of {minimum}s")
    return value


def _yes(env: Mapping[str, str], name: str) -> bool:
    raw = env.get(name, "false").strip().lower()
    if raw not in ("true", "false", "1", "0", "yes", "no"):
        raise errors.ConfigError(f"{name}={env[name]!r} must be true or false")
    return raw in ("true", "1", "yes")


def _port(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None:
        return default
    if not raw.isdigit() or not 0 <= int(raw) <= 65535:
        raise errors.ConfigError(f"{name}={raw!r} is not a TCP port (0-65535)")
    return int(raw)


def _egress(env: Mapping[str, str]) -> str:
    return _choice(env, "SBX_SANDBOX_EGRESS", "none", ("proxy", "none"))


def _choice(env: Mapping[str, str], name: str, default: str, allowed: tuple[str, ...]) -> str:
    value = env.get(name, default).strip().lower()
    if value not in allowed:
        raise errors.ConfigError(f"{name}={value!r} must be one of: {', '.join(allowed)}")
    return value


@dataclass(frozen=True)
class BusSettings:
    """How to reach NATS and which slice of it this stack uses."""

    nats_url: str = "nats://127.0.0.1:4222"
    """NATS server URL(s), comma separated (``NATS_URL``)."""
    namespace: str = "sbx"
    """Prefix of every subject, stream and bucket (``SBX_NAMESPACE``); lets several
    stacks, or several tests, share one NATS server without seeing each other."""
    request_timeout: float = 5.0
    """How long a command waits for its reply (``SBX_REQUEST_TIMEOUT``)."""
    nats_token: str | None = field(default=None, repr=False)
    """Token for NATS authorization (``NATS_TOKEN``); ``sbx up`` generates one for the
    server it starts and hands it to its children."""
    replicas: int = 1
    """Copies of the event stream, the pool stream and every bucket in a NATS cluster
    (``SBX_NATS_REPLICAS``, 1-5), applied when they are created; a service that finds them
    never changes their count (``sbx replicas`` does, on purpose)."""
    retention: RetentionSettings = field(default_factory=lambda: RetentionSettings())
    """How much of the event stream is kept: audit records' TTL (every writer of one) and
    the byte budget (the reaper)."""

    @property
    def servers(self) -> list[str]:
        return [s.strip() for s in self.nats_url.split(",") if s.strip()]

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> BusSettings:
        namespace = env.get("SBX_NAMESPACE", cls.namespace)
        if not _NAMESPACE.fullmatch(namespace):
            raise errors.ConfigError(
                f"SBX_NAMESPACE={namespace!r} must be 1-32 characters: a-z, 0-9, '_', starting with a letter"
            )
        return cls(
            nats_url=env.get("NATS_URL", cls.nats_url),
            namespace=namespace,
            request_timeout=_duration(env, "SBX_REQUEST_TIMEOUT", cls.request_timeout, minimum=0.05),
            nats_token=env.get("NATS_TOKEN") or None,
            replicas=_replicas(env),
            retention=RetentionSettings.from_env(env),
        )


@dataclass(frozen=True)
class RetentionSettings:
    """What the event stream keeps. Audit records (``exec``, ``image``, ``egress``) expire;
    the aggregates' events (sessions, sandboxes, snapshots, instances, proxies) never do:
    the projections are their fold (docs/architecture.md, "Retention")."""

    audit_max_age: float = 30 * 86400.0
    """An audit record is removed this long after it was written (``SBX_AUDIT_MAX_AGE``;
    0: never, only the byte limit removes them). Each record carries it (``Nats-TTL``), so
    a change applies to records written from then on."""
    events_max_bytes: int = 8 * 1024**3
    """The event stream's byte budget (``SBX_EVENTS_MAX_BYTES``): past 90 % of it the
    reaper removes the oldest audit records, down to 80 %. The aggregates' events are never
    removed; should they alone fill the disk, the stream refuses new events."""

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> RetentionSettings:
        return cls(
            audit_max_age=_duration(env, "SBX_AUDIT_MAX_AGE", cls.audit_max_age, minimum=0),
            events_max_bytes=_size(env, "SBX_EVENTS_MAX_BYTES", cls.events_max_bytes, minimum=64 * 1024**2),
        )


@dataclass(frozen=True)
class AuditRateSettings:
    """How much audit text one session may cause (the executor refuses calls past it)."""

    bytes_per_window: int = 4 * 1024**2
    """Audit bytes one session may cause per window (``SBX_AUDIT_RATE``; 0: no limit):
    each audited call counts its recorded command text plus a fixed overhead per record."""
    window: float = 600.0
    """The window (``SBX_AUDIT_RATE_WINDOW``, at most a day): the allowance refills
    evenly over it."""

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> AuditRateSettings:
        made = cls(
            bytes_per_window=_size(env, "SBX_AUDIT_RATE", cls.bytes_per_window, minimum=0),
            window=_duration(env, "SBX_AUDIT_RATE_WINDOW", cls.window, minimum=1),
        )
        if 0 < made.bytes_per_window < AUDIT_RATE_MINIMUM:
            raise errors.ConfigError(
                f"SBX_AUDIT_RATE={env['SBX_AUDIT_RATE']!r} must be 0 (no limit) or at least 64k"
            )
        if made.window > AUDIT_RATE_WINDOW_MAX:
            raise errors.ConfigError(
                f"SBX_AUDIT_RATE_WINDOW={env['SBX_AUDIT_RATE_WINDOW']!r} must be at most a day (1d)"
            )
        return made


AUDIT_RATE_MINIMUM = 64 * 1024
"""Below this, a few ordinary calls would use a session's whole allowance."""
AUDIT_RATE_WINDOW_MAX = 86400.0
"""The audit-rate bucket forgets a session after a day (its TTL), so no window is longer."""


def _replicas(env: Mapping[str, str]) -> int:
    raw = env.get("SBX_NATS_REPLICAS", "1").strip()
    if raw not in ("1", "2", "3", "4", "5"):
        raise errors.ConfigError(f"SBX_NATS_REPLICAS={raw!r} must be 1 to 5 (3 on a 3-node cluster)")
    return int(raw)


TRACE_EXPORTERS = ("otlp", "console")
"""Where spans can go: an OTLP collector over HTTP/protobuf, or the process's stdout."""


@dataclass(frozen=True)
class TraceSettings:
    """Where this process's spans go, from OpenTelemetry's standard variables. Nothing
    configured: no SDK is loaded and every span is the API's no-op one. The exporter
    itself reads the rest (``OTEL_EXPORTER_OTLP_HEADERS``, ``..._TIMEOUT``, ``OTEL_BSP_*``,
    ``OTEL_TRACES_SAMPLER``, ``OTEL_RESOURCE_ATTRIBUTES``)."""

    exporters: tuple[str, ...] = ()
    """``OTEL_TRACES_EXPORTER`` (comma separated: ``otlp``, ``console``, ``none``). Unset:
    ``otlp`` if ``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``
    is set, else none; ``OTEL_SDK_DISABLED=true`` turns everything off."""
    delay: float = 5.0
    """Seconds between two exports of the spans ended meanwhile (``OTEL_BSP_SCHEDULE_DELAY``,
    in milliseconds as the SDK reads it)."""
    max_queue: int = 2048
    """Ended spans waiting for export, at most; past it the oldest are dropped
    (``OTEL_BSP_MAX_QUEUE_SIZE``)."""
    max_batch: int = 512
    """Spans per export, at most; that many waiting are exported at once
    (``OTEL_BSP_MAX_EXPORT_BATCH_SIZE``)."""

    @property
    def enabled(self) -> bool:
        return bool(self.exporters)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> TraceSettings:
        if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
            return cls()
        raw = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
        endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        named = [name.strip() for name in raw.split(",") if name.strip()]
        if not named and endpoint and endpoint.strip():
            named = ["otlp"]
        unknown = [name for name in named if name not in (*TRACE_EXPORTERS, "none")]
        if unknown:
            raise errors.ConfigError(
                f"OTEL_TRACES_EXPORTER={raw!r}: {', '.join(unknown)} is not available; "
                f"use {', '.join(TRACE_EXPORTERS)} or none"
            )
        exporters = tuple(dict.fromkeys(name for name in named if name != "none"))
        if "otlp" in exporters:
            protocol = (
                env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or ""
            ).strip().lower() or "http/protobuf"
            if protocol != "http/protobuf":
                raise errors.ConfigError(
                    f"OTLP protocol {protocol!r} is not available: traces are sent over http/protobuf "
                    "(a collector's port 4318); set OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf"
                )
        queue = _count(env, "OTEL_BSP_MAX_QUEUE_SIZE", cls.max_queue, 1, 10_000_000)
        return cls(
            exporters=exporters,
            delay=_count(env, "OTEL_BSP_SCHEDULE_DELAY", int(cls.delay * 1000), 1, 3_600_000) / 1000,
            max_queue=queue,
            max_batch=_count(env, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE", min(cls.max_batch, queue), 1, queue),
        )


@dataclass(frozen=True)
class ServiceSettings:
    """What every service process needs, whatever it does."""

    service: str
    """The service's name (``gateway``, ``scheduler``, ...)."""
    instance: str
    """This process's instance id (``SBX_INSTANCE_ID``; random by default)."""
    bus: BusSettings = field(default_factory=BusSettings)
    state_dir: Path = Path(".sbx")
    """Where local state lives (``SBX_STATE_DIR``)."""
    log_level: str = "info"
    """``debug``, ``info``, ``warning`` or ``error`` (``SBX_LOG_LEVEL``)."""
    log_format: str = "json"
    """``json`` (one object a line) or ``console`` (``SBX_LOG_FORMAT``)."""
    health_interval: float = 2.0
    """Seconds between heartbeats (``SBX_HEALTH_INTERVAL``); a report older than
    three intervals counts as lost."""
    drain_timeout: float = 10.0
    """Grace period for in-flight work on SIGTERM (``SBX_DRAIN_TIMEOUT``)."""
    metrics_port: int | None = None
    """Serve Prometheus ``/metrics`` on this port (``SBX_METRICS_PORT``; 0 = any free port;
    unset = off). The gateway always serves them on its own HTTP port."""
    metrics_host: str = "127.0.0.1"
    """Address the ``/metrics`` listener binds (``SBX_METRICS_HOST``; ``0.0.0.0`` in a pod,
    so probes and Prometheus reach it)."""
    traces: TraceSettings = field(default_factory=TraceSettings)
    """Where spans go (OpenTelemetry's ``OTEL_*`` variables; off unless configured)."""
    faults: frozenset[str] = frozenset()
    """Fault-injection points for crash tests (``SBX_FAULTS``, comma separated).
    Never set in production; see ``shared.infrastructure.faults``."""

    @classmethod
    def from_env(cls, service: str, env: Mapping[str, str]) -> ServiceSettings:
        instance = env.get("SBX_INSTANCE_ID") or f"{service}-{ids.new_id()[:12]}"
        if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", instance):
            raise errors.ConfigError(f"SBX_INSTANCE_ID={instance!r} must be 1-64 of A-Z a-z 0-9 _ -")
        return cls(
            service=service,
            instance=instance,
            bus=BusSettings.from_env(env),
            state_dir=Path(env.get("SBX_STATE_DIR", ".sbx")),
            log_level=_choice(env, "SBX_LOG_LEVEL", "info", ("debug", "info", "warning", "error")),
            log_format=_choice(env, "SBX_LOG_FORMAT", "json", ("json", "console")),
            health_interval=_duration(env, "SBX_HEALTH_INTERVAL", cls.health_interval, minimum=0.1),
            drain_timeout=_duration(env, "SBX_DRAIN_TIMEOUT", cls.drain_timeout),
            faults=frozenset(f for f in env.get("SBX_FAULTS", "").split(",") if f),
            traces=TraceSettings.from_env(env),
            metrics_port=_port(env, "SBX_METRICS_PORT", 0) if env.get("SBX_METRICS_PORT") else None,
            metrics_host=env.get("SBX_METRICS_HOST", cls.metrics_host).strip() or cls.metrics_host,
        )

    @property
    def hostname(self) -> str:
        return socket.gethostname()

    @property
    def pid(self) -> int:
        return os.getpid()


@dataclass(frozen=True)
class RuntimeSettings:
    """Which sandbox backend the pool-manager and executor use, and its defaults."""

    backend: str = "local"
    """``local`` (bubblewrap on this machine) or ``kubernetes`` (pods; see
    :class:`KubernetesSettings`) (``SBX_RUNTIME``)."""
    memory_bytes: int = 2 * 1024**3
    """Memory limit per sandbox (``SBX_SANDBOX_MEMORY``, e.g. ``2g``, ``512m``)."""
    cpus: float = 1.0
    """CPU limit per sandbox in cores (``SBX_SANDBOX_CPUS``)."""
    pids: int = 512
    """Process limit per sandbox (``SBX_SANDBOX_PIDS``)."""
    output_limit: int = 256 * 1024
    """Most bytes of command output returned by one tool call (``SBX_OUTPUT_LIMIT``)."""
    disk_bytes: int = 10 * 1024**3
    """Disk space per sandbox: workspace, copy-on-write root and ``/.sbx`` together
    (``SBX_SANDBOX_DISK``; ``off``: none of its own). Local runtime: a filesystem of
    that size for each sandbox; filling it gives ENOSPC inside and nothing else."""
    disk_inodes: int = 500_000
    """Files and directories per sandbox (``SBX_SANDBOX_INODES``)."""
    disk_reserve: int = 2 * 1024**3
    """Free space the state filesystem keeps for the event store: no sandbox starts
    while less is free (``SBX_DISK_RESERVE``), and snapshots and image pulls stop
    before they would leave less."""
    disk_reserve_inodes: int = 10_000
    """Free inodes the state filesystem keeps, the same way (``SBX_DISK_RESERVE_INODES``)."""
    egress: str = "none"
    """Sandbox network (``SBX_SANDBOX_EGRESS``): ``proxy`` (only the credential proxy is
    reachable) or ``none`` (loopback only). ``sbx up`` chooses ``proxy`` where it can."""
    registries_file: Path | None = None
    """The operator's registry configuration (``SBX_REGISTRIES_FILE``, TOML: credentials,
    insecure registries, mirrors; see docs/images.md). Read by the services only."""
    image_max_bytes: int = 8 * 1024**3
    """Most bytes one image may download, and most it may unpack to (``SBX_IMAGE_MAX_BYTES``)."""
    image_max_layers: int = 128
    """Most layers an image may have, refused from its manifest (``SBX_IMAGE_MAX_LAYERS``)."""
    image_max_entries: int = 500_000
    """Most files, directories and links one pull may unpack (``SBX_IMAGE_MAX_ENTRIES``)."""
    pull_timeout: float = 600.0
    """Longest an image pull may take (``SBX_IMAGE_PULL_TIMEOUT``)."""
    snapshot_budget: int = 20 * 1024**3
    """Most disk the snapshot store may hold, every layer counted once
    (``SBX_SNAPSHOT_BUDGET``): a snapshot that would pass it is refused."""
    snapshots_per_session: int = 20
    """Most snapshots kept per session (``SBX_SNAPSHOTS_PER_SESSION``; 0: no limit): a new
    one past it deletes the session's oldest (``snapshot.deleted``, reason ``retention``)."""
    cgroup_favor_dynmods: bool = True
    """Local runtime: the pool-manager turns on cgroup2's ``favordynmods`` on this host
    where it is off (``SBX_CGROUP_FAVOR_DYNMODS``, true/false): every process entering a
    sandbox moves into its cgroup, 7.5-15 ms without it after a quiet moment, 0.2 with."""

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> RuntimeSettings:
        backend = _choice(env, "SBX_RUNTIME", cls.backend, ("local", "kubernetes"))
        try:
            cpus = float(env.get("SBX_SANDBOX_CPUS", cls.cpus))
            pids = int(env.get("SBX_SANDBOX_PIDS", cls.pids))
        except ValueError as exc:
            raise errors.ConfigError(f"SBX_SANDBOX_CPUS / SBX_SANDBOX_PIDS: {exc}") from None
        if not 0 < cpus <= 256 or not 8 <= pids <= 1_000_000:
            raise errors.ConfigError("SBX_SANDBOX_CPUS must be in (0, 256] and SBX_SANDBOX_PIDS in [8, 1e6]")
        return cls(
            egress=_egress(env),
            backend=backend,
            memory_bytes=_size(env, "SBX_SANDBOX_MEMORY", cls.memory_bytes, minimum=16 * 1024**2),
            cpus=cpus,
            pids=pids,
            output_limit=_size(env, "SBX_OUTPUT_LIMIT", cls.output_limit, minimum=1024),
            disk_bytes=0
            if env.get("SBX_SANDBOX_DISK", "").strip().lower() in ("off", "0")
            else _size(env, "SBX_SANDBOX_DISK", cls.disk_bytes, minimum=64 * 1024**2),
            disk_inodes=_count(env, "SBX_SANDBOX_INODES", cls.disk_inodes, 1024, 100_000_000),
            disk_reserve=_size(env, "SBX_DISK_RESERVE", cls.disk_reserve, minimum=0),
            disk_reserve_inodes=_count(
                env, "SBX_DISK_RESERVE_INODES", cls.disk_reserve_inodes, 0, 1_000_000_000
            ),
            registries_file=Path(env["SBX_REGISTRIES_FILE"]) if env.get("SBX_REGISTRIES_FILE") else None,
            image_max_bytes=_size(env, "SBX_IMAGE_MAX_BYTES", cls.image_max_bytes, minimum=1024**2),
            image_max_layers=_count(env, "SBX_IMAGE_MAX_LAYERS", cls.image_max_layers, 1, 1000),
            image_max_entries=_count(env, "SBX_IMAGE_MAX_ENTRIES", cls.image_max_entries, 1000, 100_000_000),
            pull_timeout=_duration(env, "SBX_IMAGE_PULL_TIMEOUT", cls.pull_timeout, minimum=1),
            snapshot_budget=_size(env, "SBX_SNAPSHOT_BUDGET", cls.snapshot_budget, minimum=0),
            snapshots_per_session=_count(
                env, "SBX_SNAPSHOTS_PER_SESSION", cls.snapshots_per_session, 0, 1_000_000
            ),
            cgroup_favor_dynmods=_yes(
                {"SBX_CGROUP_FAVOR_DYNMODS": "true", **env}, "SBX_CGROUP_FAVOR_DYNMODS"
            ),
        )


@dataclass(frozen=True)
class LifecycleSettings:
    """The warm pool, the limits and the lifetimes (pool-manager, scheduler, reaper)."""

    pool_min_idle: int = 2
    """Ready, unclaimed sandboxes kept for the default pool (``SBX_POOL_MIN_IDLE``; 0 = no pool)."""
    pool_image: str = "default"
    """Image of the default pool's sandboxes (``SBX_POOL_IMAGE``); changing it rolls the pool over."""
    pool_max_age: float = 3600.0
    """An idle pool sandbox older than this is recycled: removed, and the refill makes a
    fresh one (``SBX_POOL_MAX_AGE``)."""
    pool_autosize: bool = True
    """Whether each configured pool keeps, beyond its ``min_idle``, its busiest recent
    demand (``SBX_POOL_AUTOSIZE``; see ``shared/domain/poolsizing.py``)."""
    pool_max_idle: int = 100
    """Most idle sandboxes an autosized pool keeps (``SBX_POOL_MAX_IDLE``; its
    ``min_idle`` may be higher, and ``max_running`` bounds all)."""
    pool_horizon: float = 10.0
    """An autosized pool keeps ready its most new sessions within this many seconds
    (``SBX_POOL_HORIZON``)..."""
    pool_demand_window: float = 600.0
    """...of the last this many seconds (``SBX_POOL_DEMAND_WINDOW``)."""
    extra_pools: tuple[tuple[str, str, bool, bool, int, str | None], ...] = ()
    """More pools (``SBX_POOLS``, JSON: ``[{"name": "py", "image": "py312", "min_idle": 2,
    "run_as_root": true, "writable_root": true, "org": "acme"}]``) as (name, image,
    run_as_root, writable_root, min_idle, org). A pool with ``org`` serves only that
    organisation's sessions, and its sandboxes show its package cache from the start."""
    caches_at_create: bool = False
    """Whether a sandbox's package cache must be chosen when it is created (Kubernetes with
    ``SBX_K8S_CACHE_STORAGE_CLASS``: a pod's volumes are fixed). Then a session of an
    organisation never takes a shared pool's sandbox: its organisation's pool, else a
    cold start with its cache. Read from ``SBX_RUNTIME`` and that setting."""
    max_running: int = 100
    """Most sandboxes running at once, idle pool included (``SBX_MAX_RUNNING``)."""
    max_stopped: int = 100
    """Most stopped sandboxes kept (``SBX_MAX_STOPPED``); the oldest are purged beyond it."""
    max_lifetime: float = 3600.0
    """A running session's sandbox is stopped this long after it started (``SBX_MAX_LIFETIME``)."""
    idle_timeout: float = 600.0
    """...or after this long without a tool call (``SBX_IDLE_TIMEOUT``), paused or not."""
    pause_timeout: float = 300.0
    """A running session's sandbox is paused (every process frozen, memory kept) after this
    long without a tool call, where the runtime can pause (``SBX_PAUSE_TIMEOUT``; 0: never;
    at or above ``idle_timeout``: it is stopped first). Its next call resumes it."""
    hibernate_timeout: float = 0.0
    """A session's sandbox, running or paused, is hibernated after this long without a tool
    call (``SBX_HIBERNATE_TIMEOUT``; 0, the default: never): stopped with its files kept
    (``sandbox.stopped``, reason ``hibernated``) while the session stays active, so its
    next call starts it again. Only below ``idle_timeout``, which then stops the session."""
    pause_running_jobs: bool = False
    """Whether an idle pause may freeze a sandbox while one of its async jobs runs
    (``SBX_PAUSE_RUNNING_JOBS=true``); by default a running job counts as activity."""
    stopped_retention: float = 86400.0
    """A stopped session (and its workspace) is purged after this long (``SBX_STOPPED_RETENTION``)."""
    reaper_interval: float = 30.0
    """How often the reaper applies the rules and runs the self-healing sweep (``SBX_REAPER_INTERVAL``)."""

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> LifecycleSettings:
        def count(name: str, default: int, minimum: int) -> int:
            raw = env.get(name)
            if raw is None:
                return default
            if not re.fullmatch(r"[0-9]{1,9}", raw.strip()) or int(raw) < minimum:
                raise errors.ConfigError(f"{name}={raw!r} must be a whole number of at least {minimum}")
            return int(raw)

        made = cls(
            pool_min_idle=count("SBX_POOL_MIN_IDLE", cls.pool_min_idle, 0),
            pool_image=_image(env.get("SBX_POOL_IMAGE", cls.pool_image)),
            extra_pools=_pools(env.get("SBX_POOLS", "")),
            pool_max_age=_duration(env, "SBX_POOL_MAX_AGE", cls.pool_max_age, minimum=1),
            pool_autosize=_yes({"SBX_POOL_AUTOSIZE": "true", **env}, "SBX_POOL_AUTOSIZE"),
            pool_max_idle=count("SBX_POOL_MAX_IDLE", cls.pool_max_idle, 0),
            pool_horizon=_duration(env, "SBX_POOL_HORIZON", cls.pool_horizon, minimum=0.1),
            pool_demand_window=_duration(env, "SBX_POOL_DEMAND_WINDOW", cls.pool_demand_window, minimum=1),
            max_running=count("SBX_MAX_RUNNING", cls.max_running, 1),
            max_stopped=count("SBX_MAX_STOPPED", cls.max_stopped, 0),
            max_lifetime=_duration(env, "SBX_MAX_LIFETIME", cls.max_lifetime, minimum=1),
            idle_timeout=_duration(env, "SBX_IDLE_TIMEOUT", cls.idle_timeout, minimum=1),
            pause_timeout=_duration(env, "SBX_PAUSE_TIMEOUT", cls.pause_timeout, minimum=0),
            pause_running_jobs=_yes(env, "SBX_PAUSE_RUNNING_JOBS"),
            hibernate_timeout=_duration(env, "SBX_HIBERNATE_TIMEOUT", cls.hibernate_timeout, minimum=0),
            stopped_retention=_duration(env, "SBX_STOPPED_RETENTION", cls.stopped_retention, minimum=1),
            reaper_interval=_duration(env, "SBX_REAPER_INTERVAL", cls.reaper_interval, minimum=0.1),
            caches_at_create=env.get("SBX_RUNTIME", "local").strip().lower() == "kubernetes"
            and bool(env.get("SBX_K8S_CACHE_STORAGE_CLASS", "").strip()),
        )
        if made.pool_min_idle + sum(p[4] for p in made.extra_pools) > made.max_running:
            raise errors.ConfigError(
                f"SBX_POOL_MIN_IDLE={made.pool_min_idle} cannot exceed SBX_MAX_RUNNING={made.max_running}"
            )
        return made


def _pools(raw: str) -> tuple[tuple[str, str, bool, bool, int, str | None], ...]:
    if not raw.strip():
        return ()
    try:
        items = json.loads(raw)
        if not isinstance(items, list):
            raise TypeError("a JSON list is expected")
        out = []
        for item in items:
            name = str(item["name"])
            if not re.fullmatch(r"[a-z0-9][a-z0-9_-]{0,31}", name) or name == "default":
                raise ValueError(f"pool name {name!r} must be 1-32 of a-z 0-9 _ - and not 'default'")
            min_idle = int(item.get("min_idle", 1))
            if min_idle < 0:
                raise ValueError("min_idle must be at least 0")
            org = item.get("org")
            if org is not None and (not isinstance(org, str) or not org.strip()):
                raise ValueError(f"pool {name!r}: org must be an organisation id")
            if org is not None:
                org = ids.validate_attribution(org, what=f"pool {name!r} org")
            out.append(
                (name, _image(str(item.get("image", "default"))), bool(item.get("run_as_root", True)),
                 bool(item.get("writable_root", True)), min_idle, org)
            )  # fmt: skip
    except (ValueError, TypeError, KeyError, errors.InvalidInput) as exc:
        raise errors.ConfigError(f"SBX_POOLS is not a valid pool list: {exc}") from None
    if len({p[0] for p in out}) != len(out):
        raise errors.ConfigError("SBX_POOLS has two pools with the same name")
    return tuple(out)


def _image(value: str) -> str:
    try:
        return ids.validate_image(value) or LifecycleSettings.pool_image
    except errors.InvalidInput as exc:
        raise errors.ConfigError(f"SBX_POOL_IMAGE: {exc.message}") from None


_SIZE = re.compile(r"(\d+)([kmg]?)i?b?")


def _count(env: Mapping[str, str], name: str, default: int, low: int, high: int) -> int:
    raw = env.get(name, str(default)).strip()
    if not raw.isdigit() or not low <= int(raw) <= high:
        raise errors.ConfigError(f"{name}={raw!r} must be a whole number from {low} to {high}")
    return int(raw)


def parse_size(raw: str, *, name: str = "size") -> int:
    """Bytes in ``raw``: ``65536``, ``512k``, ``512m``, ``2g`` (also ``2GiB``, ``2gb``)."""
    match = _SIZE.fullmatch(raw.strip().lower())
    if not match:
        raise errors.ConfigError(f"{name}={raw!r} is not a size; use e.g. 512m, 2g or 65536")
    return int(match.group(1)) * {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3}[match.group(2)]


def _size(env: Mapping[str, str], name: str, default: int, *, minimum: int) -> int:
    raw = env.get(name)
    if raw is None:
        return default
    value = parse_size(raw, name=name)
    if value < minimum:
        raise errors.ConfigError(f"{name}={raw!r} is below the minimum of {minimum} bytes")
    return value


@dataclass(frozen=True)
class GatewaySettings:
    """The gateway: the only service that listens on HTTP."""

    base: ServiceSettings
    api_key: str = field(repr=False)
    """Shared key every REST and MCP call must present (``SANDBOX_API_KEY``).
    Required: the gateway refuses to start without one."""
    host: str = "127.0.0.1"
    """Listen address (``SBX_GATEWAY_HOST``)."""
    port: int = 8080
    """Listen port (``SBX_GATEWAY_PORT``; 0 picks a free one)."""
    org_keys: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    """Keys bound to one organisation, ``(org, key)``, from the file named by
    ``SBX_ORG_KEYS`` (lines ``ORG KEY``; ``#`` starts a comment): a call with such a key
    acts for that organisation only (``X-Org-Id`` is set from it)."""
    mcp_checkpoints: bool = False
    """Two more MCP tools, ``checkpoint`` and ``restore_checkpoint``, for an agent to
    snapshot its own session and go back to one of its own snapshots
    (``SBX_MCP_CHECKPOINTS``, ``on``/``off``; off: the eight tools only)."""
    mcp_job_input: bool = False
    """One more MCP tool, ``shell_input``, and ``shell_async``'s ``stdin`` argument: an agent
    gives a background job input (``SBX_MCP_JOB_INPUT``, ``on``/``off``; off: the eight
    tools as they are)."""
    claim_on_connect: bool = True
    """An MCP ``initialize`` with an ``X-Session-Id`` starts getting that session's sandbox
    at once, so the agent's first tool call finds it ready (``SBX_CLAIM_ON_CONNECT``,
    ``on``/``off``). Off: the first tool call gets it."""
    sandbox_egress: str = "none"
    """What the sandboxes can reach (``SBX_SANDBOX_EGRESS``, as the runtime reads it): the
    tool texts an agent reads say so."""
    cors_origins: tuple[str, ...] = ()
    """Web origins whose pages may call the API from a browser (``SBX_CORS_ORIGINS``,
    comma-separated, e.g. ``https://app.example``); none by default. The key is still needed."""
    allowed_hosts: tuple[str, ...] = ()
    """Names a request's ``Host`` may carry besides loopback's (``SBX_ALLOWED_HOSTS``,
    comma-separated, no port: every port; ``*`` for any): the names clients reach the
    gateway by when it listens beyond loopback (a DNS name, a Kubernetes Service, an
    ingress). Any other ``Host`` is refused (403): DNS-rebinding protection. Listening
    beyond loopback, an IP address in ``Host`` is accepted too."""
    allowed_origins: tuple[str, ...] = ()
    """Web origins whose pages may send requests besides loopback's, the gateway's own and
    ``cors_origins`` (``SBX_ALLOWED_ORIGINS``, comma-separated, ``*`` for any): a request
    with any other ``Origin`` is refused (403), as the MCP spec requires. Requests without
    ``Origin`` (every client but a browser) are not affected."""
    e2b_domain: str = ""
    """The E2B SDK's sandbox domain (``SBX_E2B_DOMAIN``, a host name with an optional port,
    e.g. ``sbx.example.com``): E2B answers name it, so an SDK without ``E2B_SANDBOX_URL``
    sends a sandbox's traffic (and builds its signed file URLs) to
    ``https://49983-{sandboxId}.{domain}``, which wildcard DNS and TLS in front of the gateway
    bring here; the gateway routes such a host to that sandbox's envd. Empty (the default):
    answers name the host the request came to, and only ``E2B_SANDBOX_URL`` reaches envd."""

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> GatewaySettings:
        key = env.get("SANDBOX_API_KEY", "")
        if not key:
            raise errors.ConfigError(
                "SANDBOX_API_KEY is not set; the gateway refuses to start without an API key "
                "(`sbx up` generates one into <state-dir>/api-key)"
            )
        if len(key) < API_KEY_MIN_LENGTH or not key.isascii() or not key.isprintable() or " " in key:
            raise errors.ConfigError(
                f"SANDBOX_API_KEY must be at least {API_KEY_MIN_LENGTH} printable ASCII characters "
                "without spaces"
            )
        return cls(
            base=ServiceSettings.from_env("gateway", env),
            api_key=key,
            host=env.get("SBX_GATEWAY_HOST", cls.host),
            port=_port(env, "SBX_GATEWAY_PORT", cls.port),
            org_keys=_org_keys(env.get("SBX_ORG_KEYS", ""), key),
            claim_on_connect=_choice(env, "SBX_CLAIM_ON_CONNECT", "on", ("on", "off")) == "on",
            mcp_checkpoints=_choice(env, "SBX_MCP_CHECKPOINTS", "off", ("on", "off")) == "on",
            mcp_job_input=_choice(env, "SBX_MCP_JOB_INPUT", "off", ("on", "off")) == "on",
            sandbox_egress=_egress(env),
            cors_origins=_origins(env.get("SBX_CORS_ORIGINS", "")),
            allowed_hosts=_hosts(env.get("SBX_ALLOWED_HOSTS", "")),
            allowed_origins=_origins(env.get("SBX_ALLOWED_ORIGINS", ""), name="SBX_ALLOWED_ORIGINS"),
            e2b_domain=_e2b_domain(env.get("SBX_E2B_DOMAIN", "")),
        )


def _e2b_domain(text: str) -> str:
    """``SBX_E2B_DOMAIN``: a host name (at least two labels) with an optional port."""
    domain = text.strip().lower().removesuffix(".")
    name, _, port = domain.partition(":")
    if domain and (
        not _HOST_NAME.fullmatch(name) or "." not in name or (port and not re.fullmatch(r"[0-9]{1,5}", port))
    ):
        raise errors.ConfigError(
            f"SBX_E2B_DOMAIN: {domain!r:.80} is not a host name with an optional port, like "
            "sbx.example.com (its subdomains {port}-{sandboxId}.sbx.example.com must reach the gateway)"
        )
    return domain


_ORIGIN = re.compile(r"https?://[A-Za-z0-9.-]+(:[0-9]{1,5})?")


def _origins(text: str, *, name: str = "SBX_CORS_ORIGINS") -> tuple[str, ...]:
    """Exact origins (scheme, host, optional port); ``SBX_ALLOWED_ORIGINS`` also takes ``*``
    alone (any origin), ``SBX_CORS_ORIGINS`` no wildcard."""
    origins = tuple(o.strip().rstrip("/").lower() for o in text.split(",") if o.strip())
    if name != "SBX_CORS_ORIGINS" and "*" in origins:
        if len(origins) > 1:
            raise errors.ConfigError(f"{name}: '*' (any origin) stands alone")
        return origins
    for origin in origins:
        if not _ORIGIN.fullmatch(origin):
            raise errors.ConfigError(
                f"{name}: {origin!r:.80} is not an origin like https://app.example:8443 "
                "(no path, no wildcard)"
            )
    return origins


_HOST_NAME = re.compile(r"[a-z0-9_-]+(\.[a-z0-9_-]+)*")


def _hosts(text: str) -> tuple[str, ...]:
    """``SBX_ALLOWED_HOSTS``: host names or IP addresses without a port, or ``*`` alone."""
    hosts = tuple(h.strip().lower().removesuffix(".") for h in text.split(",") if h.strip())
    if "*" in hosts:
        if len(hosts) > 1:
            raise errors.ConfigError("SBX_ALLOWED_HOSTS: '*' (any Host) stands alone")
        return hosts
    out = []
    for host in hosts:
        bare = host.strip("[]")
        try:
            out.append(str(ipaddress.ip_address(bare)))
            continue
        except ValueError:
            pass
        if not _HOST_NAME.fullmatch(host):
            raise errors.ConfigError(
                f"SBX_ALLOWED_HOSTS: {host!r:.80} is not a host name or IP address "
                "(no scheme, no port: every port of a name is allowed)"
            )
        out.append(host)
    return tuple(out)


def _org_keys(path: str, master: str) -> tuple[tuple[str, str], ...]:
    """Parse the ``SBX_ORG_KEYS`` file; any mistake stops the gateway with its line."""
    if not path:
        return ()
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise errors.ConfigError(f"SBX_ORG_KEYS: cannot read {path}: {exc.strerror}") from None
    out: list[tuple[str, str]] = []
    seen: set[str] = {master}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        where = f"SBX_ORG_KEYS {path}:{number}"
        if len(parts) != 2:
            raise errors.ConfigError(f"{where}: expected 'ORG KEY'")
        org, key = parts
        try:
            ids.validate_attribution(org, what="org id")
        except errors.InvalidInput as exc:
            raise errors.ConfigError(f"{where}: {exc.message}") from None
        if len(key) < API_KEY_MIN_LENGTH or not key.isascii() or not key.isprintable():
            raise errors.ConfigError(
                f"{where}: a key is at least {API_KEY_MIN_LENGTH} printable ASCII characters"
            )
        if key in seen:
            raise errors.ConfigError(f"{where}: this key is used twice (or is SANDBOX_API_KEY)")
        seen.add(key)
        out.append((org, key))
    return tuple(out)


#: Where scripts/setup installs the proxy's own environment.
DEFAULT_PROXY_BIN = Path(__file__).resolve().parents[2] / "proxy" / ".venv" / "bin" / "sbx-proxy"


@dataclass(frozen=True)
class ProxySettings:
    """The credential-proxy fleet (proxy-scaler)."""

    config: str = ""
    """The proxies' TOML config (``SBX_PROXY_CONFIG``); empty: inject nothing, tunnel everything."""
    sandboxes_per_proxy: int = 100
    """About one proxy per this many running sandboxes (``SBX_SANDBOXES_PER_PROXY``)."""
    drain: float = 30.0
    """How long a proxy being removed keeps serving connections already open (``SBX_PROXY_DRAIN``)."""
    keep_warm: float = 600.0
    """One proxy stays up this long after the last sandbox (and after start-up), so the
    next sandbox does not wait for one to start; then the fleet scales to zero
    (``SBX_PROXY_KEEP_WARM``; 0 = scale to zero at once)."""
    binary: str = str(DEFAULT_PROXY_BIN)
    """The ``sbx-proxy`` program (``SBX_PROXY_BIN``)."""

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> ProxySettings:
        raw = env.get("SBX_SANDBOXES_PER_PROXY", str(cls.sandboxes_per_proxy)).strip()
        if not raw.isdigit() or not 1 <= int(raw) <= 100_000:
            raise errors.ConfigError(
                f"SBX_SANDBOXES_PER_PROXY={raw!r} must be a whole number from 1 to 100000"
            )
        return cls(
            config=env.get("SBX_PROXY_CONFIG", "").strip(),
            sandboxes_per_proxy=int(raw),
            drain=_duration(env, "SBX_PROXY_DRAIN", cls.drain),
            keep_warm=_duration(env, "SBX_PROXY_KEEP_WARM", cls.keep_warm),
            binary=env.get("SBX_PROXY_BIN", cls.binary),
        )


_K8S_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_K8S_QUANTITY = re.compile(r"\d+(\.\d+)?(Ki|Mi|Gi|Ti|k|M|G|T)?")


@dataclass(frozen=True)
class KubernetesSettings:
    """The Kubernetes runtime (``SBX_RUNTIME=kubernetes``): where sandbox pods go and how
    they are built. Every name here is checked at start-up, never at the first sandbox."""

    namespace: str = "sbx-sandboxes"
    """Namespace of the sandbox pods, their workspaces and NetworkPolicies (``SBX_K8S_NAMESPACE``)."""
    runtime_class: str = "gvisor"
    """RuntimeClass of ordinary sandboxes (``SBX_K8S_RUNTIME_CLASS``; empty: the node's
    default runtime, only for clusters without gVisor, and said so in the logs)."""
    strong_runtime_class: str = "kata"
    """RuntimeClass for ``use_kata`` (``SBX_K8S_STRONG_RUNTIME_CLASS``; empty: refused)."""
    images: tuple[tuple[str, str], ...] = (("default", "ghcr.io/cloud-agent-sandbox/sandbox:0.1.0"),)
    """Short names and the references they stand for (``SBX_K8S_IMAGES``:
    ``name=reference,...``; must name ``default``). Any other image is used as the
    reference it is: the kubelet pulls it."""
    image_pull_secrets: tuple[str, ...] = ()
    """Secrets (``kubernetes.io/dockerconfigjson``, in the sandboxes' namespace) the
    kubelet pulls sandbox images with (``SBX_K8S_IMAGE_PULL_SECRETS``: ``name,...``)."""
    storage_class: str = ""
    """StorageClass of workspace volumes (``SBX_K8S_STORAGE_CLASS``; empty: the cluster default)."""
    workspace_size: str = "10Gi"
    """Size of each workspace volume (``SBX_K8S_WORKSPACE_SIZE``)."""
    scratch_size: str = "10Gi"
    """Most node disk a sandbox may fill outside its workspace: root filesystem changes,
    ``/tmp``, logs (``SBX_K8S_SCRATCH_SIZE``; the pod is evicted beyond it)."""
    cache_storage_class: str = ""
    """StorageClass of the per-organisation package caches (``SBX_K8S_CACHE_STORAGE_CLASS``).
    It must offer ReadWriteMany (NFS, CephFS, EFS, Filestore...): every sandbox of one
    organisation mounts its cache at once. Empty: no package caches on Kubernetes."""
    cache_size: str = "20Gi"
    """Size of each organisation's package cache volume (``SBX_K8S_CACHE_SIZE``)."""
    proxy_service: str = "sbx-system/sbx-proxy"
    """The credential proxies' Service, ``namespace/name`` (``SBX_K8S_PROXY_SERVICE``)."""
    proxy_port: int = 3128
    seccomp_profile: str = "RuntimeDefault"
    """``RuntimeDefault`` or ``localhost/<file>`` installed on every node (``SBX_K8S_SECCOMP``;
    the product's profile is deploy/kubernetes/base/seccomp/sbx-sandbox.json)."""
    start_timeout: float = 120.0
    """How long a pod may take to become ready, image pull included (``SBX_K8S_START_TIMEOUT``)."""
    kubeconfig: str = ""
    """A kubeconfig file (``KUBECONFIG``); empty: the in-cluster service account."""
    snapshot_class: str = ""
    """The CSI VolumeSnapshotClass snapshots of workspace claims are made with
    (``SBX_K8S_SNAPSHOT_CLASS``; empty: no snapshots on this cluster, said plainly)."""

    def image(self, name: str) -> str:
        """The reference a sandbox of ``name`` runs: its alias's, or ``name`` itself."""
        return dict(self.images).get(name) or name

    @property
    def proxy_namespace(self) -> str:
        return self.proxy_service.split("/", 1)[0]

    @property
    def proxy_name(self) -> str:
        return self.proxy_service.split("/", 1)[1]

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> KubernetesSettings:
        def name(var: str, default: str, *, empty: bool = False) -> str:
            value = env.get(var, default).strip()
            if (value or not empty) and (len(value) > 63 or not _K8S_NAME.fullmatch(value)):
                raise errors.ConfigError(
                    f"{var}={value!r} is not a Kubernetes name (1-63 of a-z, 0-9 and '-')"
                )
            return value

        def name_of(var: str, value: str) -> str:
            value = value.strip()
            if len(value) > 253 or not re.fullmatch(r"[a-z0-9]([a-z0-9.-]*[a-z0-9])?", value):
                raise errors.ConfigError(f"{var}: {value!r} is not a Kubernetes object name")
            return value

        images = tuple(_k8s_images(env.get("SBX_K8S_IMAGES", ""))) or cls.images
        proxy = env.get("SBX_K8S_PROXY_SERVICE", cls.proxy_service).strip()
        parts = proxy.split("/")
        if len(parts) != 2 or not all(_K8S_NAME.fullmatch(p) for p in parts):
            raise errors.ConfigError(f"SBX_K8S_PROXY_SERVICE={proxy!r} must be namespace/name")
        size = env.get("SBX_K8S_WORKSPACE_SIZE", cls.workspace_size).strip()
        if not _K8S_QUANTITY.fullmatch(size):
            raise errors.ConfigError(f"SBX_K8S_WORKSPACE_SIZE={size!r} is not a quantity such as 10Gi")
        scratch = env.get("SBX_K8S_SCRATCH_SIZE", cls.scratch_size).strip()
        if not _K8S_QUANTITY.fullmatch(scratch):
            raise errors.ConfigError(f"SBX_K8S_SCRATCH_SIZE={scratch!r} is not a quantity such as 10Gi")
        cache_size = env.get("SBX_K8S_CACHE_SIZE", cls.cache_size).strip()
        if not _K8S_QUANTITY.fullmatch(cache_size):
            raise errors.ConfigError(f"SBX_K8S_CACHE_SIZE={cache_size!r} is not a quantity such as 20Gi")
        seccomp = env.get("SBX_K8S_SECCOMP", cls.seccomp_profile).strip()
        if seccomp != "RuntimeDefault" and not re.fullmatch(r"localhost/[A-Za-z0-9._/-]+\.json", seccomp):
            raise errors.ConfigError(
                f"SBX_K8S_SECCOMP={seccomp!r} must be RuntimeDefault or localhost/<profile>.json"
            )
        return cls(
            namespace=name("SBX_K8S_NAMESPACE", cls.namespace),
            runtime_class=name("SBX_K8S_RUNTIME_CLASS", cls.runtime_class, empty=True),
            strong_runtime_class=name("SBX_K8S_STRONG_RUNTIME_CLASS", cls.strong_runtime_class, empty=True),
            images=images,
            image_pull_secrets=tuple(
                name_of("SBX_K8S_IMAGE_PULL_SECRETS", part)
                for part in env.get("SBX_K8S_IMAGE_PULL_SECRETS", "").split(",")
                if part.strip()
            ),
            storage_class=name("SBX_K8S_STORAGE_CLASS", cls.storage_class, empty=True),
            workspace_size=size,
            scratch_size=scratch,
            cache_storage_class=name("SBX_K8S_CACHE_STORAGE_CLASS", cls.cache_storage_class, empty=True),
            cache_size=cache_size,
            proxy_service=proxy,
            seccomp_profile=seccomp,
            start_timeout=_duration(env, "SBX_K8S_START_TIMEOUT", cls.start_timeout, minimum=1),
            kubeconfig=env.get("KUBECONFIG", "").strip(),
            snapshot_class=name_of("SBX_K8S_SNAPSHOT_CLASS", env["SBX_K8S_SNAPSHOT_CLASS"])
            if env.get("SBX_K8S_SNAPSHOT_CLASS", "").strip()
            else "",
        )


def _k8s_images(raw: str) -> list[tuple[str, str]]:
    pairs: list[tuple[str, str]] = []
    for item in filter(None, (part.strip() for part in raw.split(","))):
        image_name, sep, reference = item.partition("=")
        if not sep or not image_name.strip() or not reference.strip():
            raise errors.ConfigError(f"SBX_K8S_IMAGES: {item!r} is not name=reference")
        try:
            ids.validate_image(reference.strip())
            ids.validate_image(image_name.strip())
        except errors.InvalidInput as exc:
            raise errors.ConfigError(f"SBX_K8S_IMAGES: {exc.message}") from None
        pairs.append((image_name.strip(), reference.strip()))
    if pairs and "default" not in dict(pairs):
        raise errors.ConfigError("SBX_K8S_IMAGES must name a 'default' image")
    return pairs

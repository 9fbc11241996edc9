"""What every service process needs, whatever it does: its name and instance, the bus,
logs, health, metrics, traces and fault points."""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from sbx_api import errors
from shared.contract import ids
from shared.infrastructure.settings import values
from shared.infrastructure.settings.bus import BusSettings
from shared.infrastructure.settings.traces import TraceSettings


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
            log_level=values.choice(env, "SBX_LOG_LEVEL", "info", ("debug", "info", "warning", "error")),
            log_format=values.choice(env, "SBX_LOG_FORMAT", "json", ("json", "console")),
            health_interval=values.duration(env, "SBX_HEALTH_INTERVAL", cls.health_interval, minimum=0.1),
            drain_timeout=values.duration(env, "SBX_DRAIN_TIMEOUT", cls.drain_timeout),
            faults=frozenset(f for f in env.get("SBX_FAULTS", "").split(",") if f),
            traces=TraceSettings.from_env(env),
            metrics_port=values.port(env, "SBX_METRICS_PORT", 0) if env.get("SBX_METRICS_PORT") else None,
            metrics_host=env.get("SBX_METRICS_HOST", cls.metrics_host).strip() or cls.metrics_host,
        )

    @property
    def hostname(self) -> str:
        return socket.gethostname()

    @property
    def pid(self) -> int:
        return os.getpid()

"""Where a process's spans go, read from OpenTelemetry's standard variables."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from sbx_api import errors
from shared.infrastructure.settings import values

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
        queue = values.count(env, "OTEL_BSP_MAX_QUEUE_SIZE", cls.max_queue, 1, 10_000_000)
        return cls(
            exporters=exporters,
            delay=values.count(env, "OTEL_BSP_SCHEDULE_DELAY", int(cls.delay * 1000), 1, 3_600_000) / 1000,
            max_queue=queue,
            max_batch=values.count(
                env, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE", min(cls.max_batch, queue), 1, queue
            ),
        )

"""Liveness: each instance reports to the health bucket every few seconds.

Reports are not state changes (nothing is decided on them), so they live in an
expiring KV bucket rather than the event stream. Whether a report still counts
is a pure function of the report and the time (:func:`liveness`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Literal

import msgspec
import structlog
from nats.js.client import JetStreamContext
from nats.js.kv import KeyValue

from shared.contract import codec
from shared.infrastructure import aio, bus

log = structlog.get_logger(__name__)

Status = Literal["starting", "ok", "draining"]
Liveness = Literal["ok", "starting", "draining", "stale"]
STALE_AFTER_INTERVALS = 3


class HealthReport(msgspec.Struct, frozen=True, kw_only=True):
    service: str
    instance: str
    pid: int
    host: str
    version: str
    status: Status
    started_at: datetime
    reported_at: datetime
    interval: float
    """Seconds between reports; three missed reports make the instance stale."""
    details: dict[str, str] = {}


def key(service: str, instance: str) -> str:
    return f"{service}.{instance}"


def liveness(report: HealthReport, now: datetime) -> Liveness:
    if now - report.reported_at > timedelta(seconds=STALE_AFTER_INTERVALS * report.interval):
        return "stale"
    return report.status


async def publish(kv: KeyValue, report: HealthReport) -> None:
    await kv.put(key(report.service, report.instance), codec.encode(report))


async def heartbeat(kv: KeyValue, make_report: Callable[[], HealthReport], interval: float) -> None:
    """Report forever; a failed report is logged and retried on the next tick."""
    while True:
        try:
            await publish(kv, make_report())
        except Exception as exc:
            log.warning("health.report_failed", error=str(exc))
        aio.raise_if_cancelling()  # the client may have swallowed our cancellation
        await asyncio.sleep(interval)


async def read_all(js: JetStreamContext, bucket: str) -> list[HealthReport]:
    raw = await bus.snapshot(js, bucket)
    reports = [codec.decode_state(value, HealthReport) for value in raw.values()]
    return sorted(reports, key=lambda r: (r.service, r.instance))

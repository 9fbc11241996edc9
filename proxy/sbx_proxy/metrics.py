"""The proxy's Prometheus metrics: an :class:`egress.Sink`, served on a unix socket.

Why a unix socket and not a port: sandboxes talk to the proxy's address, and the proxy
connects wherever a sandbox asks that its destination rules allow. A metrics port, on the
proxy's address or on loopback, would be one ``CONNECT`` away for any sandbox whose proxy
allows private networks (``[destinations] allow``), and would show every session's
counters. A unix socket is no TCP destination at all; its file lives in the fleet's state
directory (mode 0600), which no sandbox mounts. The proxy-scaler reads every proxy's
socket and re-exports the series on its own ``/metrics`` with a ``proxy`` label
(``services/proxy_scaler/fleetmetrics.py``); ``docs/proxy.md`` says where to scrape.

Labels are bounded: enums of :mod:`egress`, and configured rule names.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import stat
from collections.abc import Iterable, Iterator
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from sbx_proxy import egress, records

log = logging.getLogger("sbx_proxy")
CONNECTION_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 5, 30, 120, 600, 3600)
REQUEST_LIMIT = 8192
READ_TIMEOUT = 5.0
MAX_WAIT = 30.0
"""The longest ``GET /egress?wait=`` is held."""


class Metrics:
    """The proxy's counters (one registry of its own: a test can hold several)."""

    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry(auto_describe=True)
        # process CPU, memory and fds, as sbx_proxy_process_*: the scaler re-exports them
        # beside its own process_* without a clash.
        ProcessCollector(namespace="sbx_proxy", registry=registry)
        self.connections = Counter(
            "sbx_proxy_connections", "Sandbox connections closed, by verdict.", ["verdict"], registry=registry
        )
        self.connection_seconds = Histogram(
            "sbx_proxy_connection_seconds", "How long sandbox connections stayed open, by verdict.",
            ["verdict"], buckets=CONNECTION_BUCKETS, registry=registry,
        )  # fmt: skip
        self.active = Gauge(
            "sbx_proxy_active_connections", "Sandbox connections open now.", registry=registry
        )
        self.bytes = Counter(
            "sbx_proxy_bytes", "Bytes relayed on sandbox connections: up (from the sandbox) and down.",
            ["direction"], registry=registry,
        )  # fmt: skip
        self.requests = Counter(
            "sbx_proxy_requests", "HTTP requests the proxy saw (intercepted or plain HTTP), by outcome.",
            ["outcome"], registry=registry,
        )  # fmt: skip
        self.injections = Counter(
            "sbx_proxy_injections", "Requests that got a credential, by the configured rule's name.",
            ["rule"], registry=registry,
        )  # fmt: skip
        self.refusals = Counter(
            "sbx_proxy_refusals", "Connections, requests and answers refused, by reason.", ["reason"],
            registry=registry,
        )  # fmt: skip
        self.upstream_errors = Counter(
            "sbx_proxy_upstream_errors", "Upstream connections that failed, by stage.", ["stage"],
            registry=registry,
        )  # fmt: skip
        # Every series exists from the start (a rate over a counter that appears late is
        # wrong), and the hot paths use resolved children, not a label lookup each time.
        self._connections = {v: self.connections.labels(v) for v in egress.Verdict}
        self._seconds = {v: self.connection_seconds.labels(v) for v in egress.Verdict}
        self._bytes = {d: self.bytes.labels(d) for d in egress.Direction}
        self._requests = {o: self.requests.labels(o) for o in egress.Outcome}
        self._refusals = {r: self.refusals.labels(r) for r in egress.Reason}
        self._upstream = {s: self.upstream_errors.labels(s) for s in egress.Stage}
        self._injections: dict[str, Counter] = {}

    def rules(self, names: Iterable[str]) -> None:
        """The configured rules' names: the only values ``rule`` takes."""
        for name in names:
            if name not in self._injections:
                self._injections[name] = self.injections.labels(name)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # ---- egress.Sink -------------------------------------------------------------

    def opened(self, conn: egress.Connection) -> None:
        self.active.inc()

    def requested(self, conn: egress.Connection, outcome: egress.Outcome, rule: str | None) -> None:
        self._requests[outcome].inc()
        if outcome is egress.Outcome.INJECTED and rule is not None:
            counter = self._injections.get(rule)
            if counter is None:  # a rule of a config loaded since (names are the config's)
                self.rules([rule])
                counter = self._injections[rule]
            counter.inc()

    def refused(self, conn: egress.Connection, reason: egress.Reason) -> None:
        self._refusals[reason].inc()

    def upstream_failed(self, conn: egress.Connection, stage: egress.Stage) -> None:
        self._upstream[stage].inc()

    def transferred(self, direction: egress.Direction, count: int) -> None:
        self._bytes[direction].inc(count)

    def closed(self, conn: egress.Connection) -> None:
        self.active.dec()
        verdict = conn.verdict
        self._connections[verdict].inc()
        if conn.ended is not None:
            self._seconds[verdict].observe(conn.ended - conn.started)


class EgressCollector:
    """The egress log's own counts on the proxy's metrics (read at each scrape: the log
    keeps plain integers, counted on the event loop)."""

    def __init__(self, log: records.EgressLog) -> None:
        self.log = log

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(
            "sbx_proxy_egress_records", "Connections recorded for the audit stream.", self.log.recorded
        )
        yield CounterMetricFamily(
            "sbx_proxy_egress_records_lost",
            "Connections not recorded: too many waited for collection.",
            self.log.lost_total,
        )
        yield GaugeMetricFamily(
            "sbx_proxy_egress_records_waiting", "Egress records not yet collected.", self.log.waiting
        )


async def _egress(
    log: records.EgressLog | None, target: bytes, arrived: asyncio.Event
) -> tuple[bytes, bytes]:
    """``GET /egress?ack=N[&wait=S]``: the batch out, as JSON (see ``records.py``). With
    ``wait`` (seconds, at most MAX_WAIT) and nothing to hand out, the answer waits until
    a connection is recorded or the time is up: a collector follows the proxy with one
    request at a time instead of asking every half second."""
    if log is None:
        return b"egress records are off on this proxy\n", b"404 Not Found"
    _, _, query = target.partition(b"?")
    fields = dict(part.partition(b"=")[::2] for part in query.split(b"&") if part)
    try:
        ack = int(fields.get(b"ack", b"0"))
        wait = min(float(fields.get(b"wait", b"0")), MAX_WAIT)
    except ValueError:
        return b"ack must be a batch number and wait a number of seconds\n", b"400 Bad Request"
    batch = log.collect(ack)
    if wait > 0 and not batch.entries and not batch.lost:
        arrived.clear()
        if not log.pending:  # (one kept since the collect did not wait for the event)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await arrived.wait()
        batch = log.collect(batch.number)  # (the empty batch needs no storing: acknowledged)
    return json.dumps(batch.wire(), separators=(",", ":")).encode(), b"200 OK"


async def serve(
    metrics: Metrics, path: str | Path, egress_log: records.EgressLog | None = None
) -> asyncio.AbstractServer:
    """``GET /metrics`` and ``GET /egress?ack=N[&wait=S]`` (the egress records, for the
    proxy-scaler) over HTTP/1.0 on the unix socket at ``path`` (mode 0600; a stale socket
    file there is replaced, any other file is left alone and refused)."""
    path = Path(path)
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise FileExistsError(f"{path} exists and is not a socket")
        path.unlink()

    arrived = asyncio.Event()
    if egress_log is not None:
        loop = asyncio.get_running_loop()
        egress_log.listeners.append(lambda: loop.call_soon_threadsafe(arrived.set))

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(READ_TIMEOUT):
                head = await reader.readuntil(b"\r\n\r\n")
            line = head.split(b"\r\n", 1)[0].split()
            target = line[1] if len(line) >= 2 and line[0] == b"GET" else b""
            kind = b"text/plain; version=0.0.4; charset=utf-8"
            if target.split(b"?")[0] == b"/metrics":
                body, status = metrics.render(), b"200 OK"
            elif target.split(b"?")[0] == b"/egress":
                body, status = await _egress(egress_log, target, arrived)
                kind = b"application/json" if status == b"200 OK" else b"text/plain"
            else:
                body, status = b"only GET /metrics and GET /egress here\n", b"404 Not Found"
            writer.write(
                b"HTTP/1.0 " + status + b"\r\ncontent-type: " + kind + b"\r\n"
                b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body
            )
            await writer.drain()
        except (TimeoutError, OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()

    old = os.umask(0o177)  # the socket is created 0600: only the proxy's user may connect
    try:
        server = await asyncio.start_unix_server(answer, path, limit=REQUEST_LIMIT)
    finally:
        os.umask(old)
    return server

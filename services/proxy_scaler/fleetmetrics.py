"""Every proxy's metrics on the proxy-scaler's ``/metrics``: one place for ops to scrape.

Proxies serve their counters only on a unix socket each (``--metrics-socket``; a port
would be reachable through the proxy itself, see ``proxy/sbx_proxy/metrics.py``), so no
Prometheus can reach them directly. The scaler knows the fleet: at each scrape of its own
``/metrics`` (loopback, ``SBX_METRICS_PORT``) it reads every live proxy's socket and
re-exports the ``sbx_proxy_*`` series with a ``proxy`` label (the proxy id, as in
``proxy.*`` events), plus ``sbx_proxy_up{proxy}``: 1 when the socket answered.

Only the instance holding the scaler lease exports (``active``): two instances would
report every proxy twice. Reads are blocking and bounded (``TIMEOUT`` per proxy); they
run in the metrics server's thread, never on the event loop.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

TIMEOUT = 2.0
LIMIT = 4 * 1024 * 1024
"""A proxy's answer larger than this is cut (its label sets are bounded; it never is)."""
PREFIX = "sbx_proxy_"


class Fleet(Protocol):
    def records(self) -> list[Any]: ...

    def alive(self, record: Any) -> bool: ...

    def metrics_socket(self, record: Any) -> Path: ...


def get(path: Path, target: str, timeout: float = TIMEOUT, limit: int = LIMIT) -> bytes:
    """``GET target`` over a proxy's unix socket at ``path``: the body (OSError on any
    failure, or an answer longer than ``limit``)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(str(path))
        sock.sendall(_request(target))
        data = bytearray()
        while len(data) <= limit and (chunk := sock.recv(65536)):
            data += chunk
    return _body(path, target, bytes(data), limit)


async def aget(path: Path, target: str, timeout: float = TIMEOUT, limit: int = LIMIT) -> bytes:
    """:func:`get` on the event loop (no thread): for answers that are held (a long poll)."""
    async with asyncio.timeout(timeout):
        reader, writer = await asyncio.open_unix_connection(str(path))
        try:
            writer.write(_request(target))
            await writer.drain()
            data = await reader.read(limit + 1)
            while len(data) <= limit and (chunk := await reader.read(limit + 1 - len(data))):
                data += chunk
        finally:
            writer.close()
    return _body(path, target, data, limit)


def _request(target: str) -> bytes:
    return f"GET {target} HTTP/1.0\r\nHost: proxy\r\n\r\n".encode()


def _body(path: Path, target: str, data: bytes, limit: int) -> bytes:
    if len(data) > limit:
        raise OSError(f"{path}: answer to {target} longer than {limit} bytes")
    head, _, body = data.partition(b"\r\n\r\n")
    status = head.split(b" ", 2)[1:2]
    if status != [b"200"]:
        raise OSError(f"{path}: answered {head[:40]!r}")
    return body


def scrape(path: Path, timeout: float = TIMEOUT) -> str:
    """``GET /metrics`` over the unix socket at ``path``: the body (OSError on any failure)."""
    return get(path, "/metrics", timeout).decode("utf-8", errors="replace")


class FleetMetrics:
    """A Prometheus collector over the fleet's metric sockets."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.active = False
        """True while this instance leads the fleet (set by the app's round callbacks)."""

    def describe(self) -> list[Metric]:
        return []  # names vary with what proxies serve: never checked at registration

    def collect(self) -> Iterator[Metric]:
        if not self.active:
            return
        up = GaugeMetricFamily(
            "sbx_proxy_up", "1 if the proxy's metrics socket answered this scrape.", labels=["proxy"]
        )
        families: dict[str, Metric] = {}
        for record in self.fleet.records():
            if not self.fleet.alive(record):
                continue
            try:
                text = scrape(self.fleet.metrics_socket(record))
            except (OSError, UnicodeError):
                up.add_metric([record.proxy_id], 0)
                continue
            up.add_metric([record.proxy_id], 1)
            merge(families, text, record.proxy_id)
        yield up
        yield from families.values()


def merge(families: dict[str, Metric], text: str, proxy_id: str) -> None:
    """Add one proxy's ``sbx_proxy_*`` samples to ``families``, each labelled with it."""
    try:
        parsed = list(text_string_to_metric_families(text))
    except ValueError:
        return  # not exposition text: that proxy shows only as up
    for family in parsed:
        if not family.name.startswith(PREFIX):
            continue
        merged = families.get(family.name)
        if merged is None:
            merged = families[family.name] = Metric(family.name, family.documentation, family.type)
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue  # creation times: noise once many proxies come and go
            merged.add_sample(sample.name, {**sample.labels, "proxy": proxy_id}, sample.value)

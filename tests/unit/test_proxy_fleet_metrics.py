"""The proxy-scaler's re-export of its proxies' metrics (services/proxy_scaler/fleetmetrics.py),
against real unix sockets serving a proxy's exposition text, without any proxy process."""

from __future__ import annotations

import socket
import threading
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from sbx_proxy import egress, metrics
from services.proxy_scaler import fleetmetrics


@dataclass(frozen=True)
class Record:
    proxy_id: str
    port: int


class Fleet:
    def __init__(self, dir: Path, records: list[Record], dead: set[str] = frozenset()) -> None:
        self.dir, self._records, self.dead = dir, records, dead

    def records(self):
        return self._records

    def alive(self, record):
        return record.proxy_id not in self.dead

    def metrics_socket(self, record):
        return self.dir / f"{record.port}.metrics.sock"


def serve(path: Path, body: bytes) -> socket.socket:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(8)

    def loop() -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            with client:
                client.recv(4096)
                client.sendall(b"HTTP/1.0 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))

    threading.Thread(target=loop, daemon=True).start()
    return listener


def proxy_text(refusals: int) -> bytes:
    m = metrics.Metrics()
    m.rules(["github"])
    tracker = egress.Tracker([m])
    for _ in range(refusals):
        c = tracker.opened(None)
        tracker.refused(c, egress.Reason.PRIVATE_ADDRESS)
        tracker.closed(c)
    return m.render()


def scrape(collector) -> dict:
    registry = CollectorRegistry(auto_describe=True)
    registry.register(collector)
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_every_live_proxy_is_exported_with_its_label_and_a_dead_socket_shows_as_down(tmp_path):
    records = [Record("px-a", 3129), Record("px-b", 3130), Record("px-c", 3131), Record("px-gone", 3132)]
    fleet = Fleet(tmp_path, records, dead={"px-gone"})
    servers = [serve(fleet.metrics_socket(records[0]), proxy_text(1)),
               serve(fleet.metrics_socket(records[1]), proxy_text(3))]  # fmt: skip
    try:
        collector = fleetmetrics.FleetMetrics(fleet)
        assert scrape(collector) == {}, "a standby instance exports nothing"
        collector.active = True
        samples = scrape(collector)
    finally:
        for s in servers:
            s.close()
    refused = "sbx_proxy_refusals_total"
    assert samples[(refused, (("proxy", "px-a"), ("reason", "private_address")))] == 1
    assert samples[(refused, (("proxy", "px-b"), ("reason", "private_address")))] == 3
    assert samples[("sbx_proxy_up", (("proxy", "px-a"),))] == 1
    assert samples[("sbx_proxy_up", (("proxy", "px-c"),))] == 0, "no socket: down"
    assert not any(labels == (("proxy", "px-gone"),) for _, labels in samples), "dead: not scraped"
    assert (
        "sbx_proxy_connection_seconds_bucket",
        (("le", "0.01"), ("proxy", "px-a"), ("verdict", "refused")),
    ) in samples
    assert not any(name.endswith("_created") for name, _ in samples)
    assert not any(name.startswith(("process_", "python_")) for name, _ in samples)


def test_text_that_is_not_metrics_is_ignored():
    families: dict = {}
    fleetmetrics.merge(families, "<html>not metrics</html>\n{", "px-a")
    fleetmetrics.merge(families, "other_total 1\n", "px-a")
    assert families == {}

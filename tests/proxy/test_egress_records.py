"""Egress records and readable refusals against a real mitmdump (``sbx-proxy``): every
connection a client makes leaves one record on the proxy's private socket (where it went,
the verdict, the rule, the refusal and why, bytes, duration; never a header value, a path
or the token), handed out in batches that come again until acknowledged; and every
refusal tells the client what was refused, why and what could change it.
"""

from __future__ import annotations

import json
import socket
import time

import pytest

from tests.proxy import harness

pytestmark = [
    pytest.mark.needs_root("the proxy runs in its own mount namespace (root)"),
    pytest.mark.skipif(not harness.SBX_PROXY.exists(), reason="proxy/.venv missing: run scripts/setup"),
]
TOKEN = "ghp_" + "Egr3ssT0ken" * 3


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return harness.PKI(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def upstream(pki):
    server = harness.Upstream(pki)
    yield server
    server.close()


CONFIG = """
[destinations]
allow = ["127.0.0.1/32"]

[[rules]]
name = "github"
kind = "bearer"
hosts = ["github.com:{port}"]
token_env = "SBX_TEST_TOKEN"
"""


@pytest.fixture(scope="module")
def proxy(pki, upstream, tmp_path_factory):
    names = {n: "127.0.0.1" for n in harness.NAMES} | {"private.example": "10.1.2.3"}
    p = harness.Proxy(
        tmp_path_factory.mktemp("proxy"), CONFIG.format(port=upstream.port), pki.ca_cert, names,
        env={"SBX_TEST_TOKEN": TOKEN},
    )  # fmt: skip
    yield p
    p.close()


class Collector:
    """What the proxy-scaler does: read the batch out, acknowledge it on the next read."""

    def __init__(self, proxy) -> None:
        self.proxy = proxy
        self.acked = 0

    def read(self, ack: int | None = None) -> dict:
        text = harness.scrape_unix(
            self.proxy.metrics_socket, f"/egress?ack={self.acked if ack is None else ack}"
        )
        return json.loads(text)

    def read_held(self, wait: int) -> dict:
        return json.loads(
            harness.scrape_unix(self.proxy.metrics_socket, f"/egress?ack={self.acked}&wait={wait}")
        )

    def until(self, check, timeout: float = 10.0) -> list[dict]:
        """Records collected (and acknowledged) until ``check(all so far)`` holds."""
        seen: list[dict] = []
        deadline = time.monotonic() + timeout
        while True:
            batch = self.read()
            self.acked = batch["batch"]
            seen += batch["records"]
            if check(seen) or time.monotonic() > deadline:
                return seen
            time.sleep(0.05)


def _connect(proxy, target: str) -> bytes:
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
        sock.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
        data = b""
        while chunk := sock.recv(4096):
            data += chunk
        return data


def test_each_connection_leaves_one_record_and_nothing_secret(pki, proxy, upstream):
    collector = Collector(proxy)
    collector.until(lambda seen: False, timeout=0.2)  # whatever earlier tests left
    trust = [pki.ca_cert, proxy.ca_cert]
    answer = harness.request(
        proxy, f"github.com:{upstream.port}", sni="github.com", host=f"github.com:{upstream.port}",
        path="/echo/secret-path?q=secret-query", trust=trust, body=b"x" * 1000,
    )  # fmt: skip
    assert answer.status == 200
    tunnel = harness.request(
        proxy, f"other.example:{upstream.port}", sni="other.example", host=f"other.example:{upstream.port}",
        trust=trust, body=b"y" * 50_000,
    )  # fmt: skip
    assert tunnel.status == 200
    assert _connect(proxy, "private.example:8443").startswith(b"HTTP/1.1 403")

    records = collector.until(lambda seen: len(seen) >= 3)
    assert len(records) == 3, records
    by_host = {r["host"]: r for r in records}
    github = by_host["github.com"]
    assert github["verdict"] == "intercepted" and github["rule"] == "github"
    assert github["port"] == upstream.port and github["requests"] == 1 and github["injected"] == 1
    assert github["bytes_up"] > 1000 and github["bytes_down"] > len(answer.body)
    assert github["peer"] == "127.0.0.1" and github["connections"] == 1 and github["ms"] >= 0
    assert abs(github["started"] - time.time()) < 60
    other = by_host["other.example"]
    assert other["verdict"] == "tunnelled" and other["rule"] is None and other["requests"] == 0
    assert 50_000 < other["bytes_up"] < 60_000
    refused = by_host["private.example"]
    assert refused["verdict"] == "refused" and refused["reason"] == "private_address"
    assert "10.1.2.3" in refused["detail"] and refused["bytes_up"] == 0
    text = json.dumps(records)
    assert TOKEN not in text and "secret-path" not in text and "secret-query" not in text
    assert "authorization" not in text.lower()


def test_a_batch_comes_again_until_acknowledged(proxy):
    collector = Collector(proxy)
    collector.until(lambda seen: False, timeout=0.2)
    _connect(proxy, "169.254.169.254:80")
    first = None
    for _ in range(100):
        first = collector.read()
        if first["records"]:
            break
        collector.acked = first["batch"]
        time.sleep(0.05)
    assert first is not None and first["records"], "the refusal was recorded"
    again = collector.read()  # not acknowledged: the same batch, the same records
    assert again == first
    collector.acked = first["batch"]
    after = collector.read()
    assert after["batch"] == first["batch"] + 1 and after["records"] == []
    with pytest.raises(ConnectionError):
        harness.scrape_unix(proxy.metrics_socket, "/egress?ack=x")


def test_a_held_request_answers_when_a_connection_is_recorded(proxy):
    """``wait=S`` with nothing to hand out holds the request until a connection is
    recorded (the scaler follows each proxy so, instead of asking twice a second); with
    nothing recorded it answers an empty batch when the time is up."""
    import threading

    collector = Collector(proxy)
    collector.until(lambda seen: False, timeout=0.2)
    held: list[dict] = []
    reader = threading.Thread(target=lambda: held.append(collector.read_held(8)))
    reader.start()
    time.sleep(1.0)  # (an answer that did not wait would have come by now, empty)
    assert not held, "answered before anything was recorded"
    _connect(proxy, "169.254.169.254:80")
    reader.join(timeout=30)
    assert held and [r["reason"] for r in held[0]["records"]] == ["metadata_address"], held
    collector.acked = held[0]["batch"]
    empty = collector.read_held(1)
    assert empty["records"] == [] and empty["batch"] > held[0]["batch"]
    with pytest.raises(ConnectionError):
        harness.scrape_unix(proxy.metrics_socket, "/egress?ack=0&wait=soon")


def test_many_connections_to_one_place_are_aggregated_and_counted(proxy):
    """Past the per-address bound, connections with the same destination and verdict fold
    into one aggregate record (their number in ``connections``)."""
    collector = Collector(proxy)
    collector.until(lambda seen: False, timeout=0.2)
    count = 260
    for _ in range(count):
        _connect(proxy, "169.254.169.254:443")
    records = collector.until(lambda seen: sum(r["connections"] for r in seen) >= count, timeout=30)
    assert sum(r["connections"] for r in records) == count
    assert all(r["reason"] == "metadata_address" for r in records)
    assert len(records) < count, "aggregated"
    assert max(r["connections"] for r in records) > 1
    samples = proxy.metrics()
    assert harness.sample(samples, "sbx_proxy_egress_records_total") >= count
    assert harness.sample(samples, "sbx_proxy_egress_records_lost_total") == 0


@pytest.mark.parametrize(
    ("target", "status", "reason", "words"),
    [
        ("private.example:8443", 403, "private_address", "[destinations] allow"),
        ("169.254.169.254:80", 403, "metadata_address", "no configuration allows it"),
        ("no-such-host.invalid:443", 403, "unresolvable", "check the name"),
        ("private.example:443", 403, "private_address", "[destinations] allow"),  # a rule's host: mitmproxy
    ],
)
def test_a_refused_connect_says_what_why_and_what_can_change_it(proxy, target, status, reason, words):
    reply = _connect(proxy, target)
    head, _, body = reply.partition(b"\r\n\r\n")
    status_line, *fields = head.decode().split("\r\n")
    assert status_line.startswith(f"HTTP/1.1 {status} ") and len(status_line) > 13, status_line
    headers = {k.lower(): v.strip() for k, _, v in (f.partition(":") for f in fields)}
    assert headers["x-sbx-refused"] == reason
    text = body.decode()
    assert f"CONNECT {target}" in text and f"reason: {reason}" in text
    assert "why: " in text and words in text, text


def test_a_refused_request_says_so_too(pki, proxy, upstream):
    answer = harness.request(
        proxy, f"github.com:{upstream.port}", sni="github.com", host="evil.example",
        trust=[pki.ca_cert, proxy.ca_cert],
    )  # fmt: skip
    assert answer.status == 421 and answer.headers["x-sbx-refused"] == "host_mismatch"
    assert b"separate connection for each host" in answer.body
    plain = harness.plain_request(proxy, "http://169.254.169.254/latest/meta-data/")
    assert plain.status == 502 and plain.headers["x-sbx-refused"] == "metadata_address"
    assert b"refused by the sandbox's egress proxy: GET 169.254.169.254:80" in plain.body


def test_records_can_be_turned_off(pki, upstream, tmp_path):
    p = harness.Proxy(
        tmp_path,
        CONFIG.format(port=upstream.port),
        pki.ca_cert,
        {},
        env={"SBX_TEST_TOKEN": TOKEN},
        extra=("--no-egress-records",),
    )
    try:
        _connect(p, "169.254.169.254:80")
        with pytest.raises(ConnectionError):
            harness.scrape_unix(p.metrics_socket, "/egress?ack=0")
        assert harness.sample(p.metrics(), "sbx_proxy_refusals_total", reason="metadata_address") == 1
    finally:
        p.close()

"""The proxy's metrics against a real mitmdump: counters move as the traffic says (an
intercepted request with a credential, a tunnel, refusals of each kind, an upstream that is
down), labels stay bounded whatever hosts a client names, and the metrics are served on
the unix socket only (nothing on the proxy's port answers for them).

Each test reads the counters before and after its own traffic and checks the difference,
so the tests share one proxy and may run in any order.
"""

from __future__ import annotations

import socket
import time

import pytest

from sbx_proxy import egress
from tests.proxy import harness

pytestmark = [
    pytest.mark.needs_root("the proxy runs in its own mount namespace (root)"),
    pytest.mark.skipif(not harness.SBX_PROXY.exists(), reason="proxy/.venv missing: run scripts/setup"),
]
TOKEN = "ghp_" + "M3tricsT0ken" * 3
CLOSED = harness.free_port()
"""A port nothing listens on (a rule's host there: the upstream is down)."""
S = harness.sample


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return harness.PKI(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def upstream(pki):
    server = harness.Upstream(pki)
    yield server
    server.close()


@pytest.fixture(scope="module")
def plain_upstream():
    """A plain-HTTP server: an upstream that cannot speak TLS to the proxy."""
    import threading
    from http.server import ThreadingHTTPServer

    server = ThreadingHTTPServer(("127.0.0.1", 0), harness.Echo)
    server.seen = []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()


@pytest.fixture(scope="module")
def proxy(pki, upstream, plain_upstream, tmp_path_factory):
    config = f"""
[destinations]
allow = ["127.0.0.1/32"]

[[rules]]
name = "github"
kind = "bearer"
hosts = ["github.com:{upstream.port}"]
token_env = "SBX_TEST_TOKEN"

[[rules]]
name = "internal"
kind = "bearer"
hosts = ["private.example", "api.github.com:{plain_upstream.server_address[1]}", "gitlab.example:{CLOSED}"]
token_env = "SBX_TEST_TOKEN"
"""
    names = {n: "127.0.0.1" for n in harness.NAMES} | {"private.example": "10.1.2.3"}
    p = harness.Proxy(
        tmp_path_factory.mktemp("proxy"), config, pki.ca_cert, names, env={"SBX_TEST_TOKEN": TOKEN}
    )
    yield p
    p.close()


def trust(pki, proxy):
    return [pki.ca_cert, proxy.ca_cert]


def settled(proxy, check, timeout: float = 10.0) -> dict:
    """The proxy's samples once ``check(samples)`` holds (a connection's close is counted
    when both relays have ended, a moment after the client sees its answer)."""
    deadline = time.monotonic() + timeout
    while True:
        samples = proxy.metrics()
        if check(samples) or time.monotonic() > deadline:
            return samples
        time.sleep(0.05)


def delta(before: dict, after: dict, name: str, **labels: str) -> float:
    return S(after, name, **labels) - S(before, name, **labels)


def test_every_series_exists_from_the_start_and_nothing_secret_or_chosen_is_a_label(proxy):
    samples = proxy.metrics()
    for verdict in egress.Verdict:
        assert ("sbx_proxy_connections_total", (("verdict", verdict),)) in samples
    for reason in egress.Reason:
        assert ("sbx_proxy_refusals_total", (("reason", reason),)) in samples
    for stage in egress.Stage:
        assert ("sbx_proxy_upstream_errors_total", (("stage", stage),)) in samples
    assert ("sbx_proxy_injections_total", (("rule", "github"),)) in samples
    text = harness.scrape_unix(proxy.metrics_socket)
    assert TOKEN not in text and "github.com" not in text
    assert "sbx_proxy_process_resident_memory_bytes" in text


def test_an_intercepted_request_with_a_credential(pki, proxy, upstream):
    before = proxy.metrics()
    answer = harness.request(
        proxy, f"github.com:{upstream.port}", sni="github.com", host=f"github.com:{upstream.port}",
        trust=trust(pki, proxy), body=b"x" * 1000,
    )  # fmt: skip
    assert answer.status == 200
    after = settled(
        proxy, lambda s: delta(before, s, "sbx_proxy_connections_total", verdict="intercepted") >= 1
    )
    assert delta(before, after, "sbx_proxy_connections_total", verdict="intercepted") == 1
    assert delta(before, after, "sbx_proxy_injections_total", rule="github") == 1
    assert delta(before, after, "sbx_proxy_requests_total", outcome="injected") == 1
    assert sum(delta(before, after, "sbx_proxy_refusals_total", reason=r) for r in egress.Reason) == 0
    # up: CONNECT, TLS and the 1000-byte body; down: the 200, TLS and the echo
    assert delta(before, after, "sbx_proxy_bytes_total", direction="up") > 1000
    assert delta(before, after, "sbx_proxy_bytes_total", direction="down") > len(answer.body)
    assert S(after, "sbx_proxy_active_connections") == 0


def test_a_tunnel_counts_its_bytes_both_ways(pki, proxy, upstream):
    before = proxy.metrics()
    answer = harness.request(
        proxy, f"other.example:{upstream.port}", sni="other.example", host=f"other.example:{upstream.port}",
        trust=trust(pki, proxy), body=b"y" * 300_000,
    )  # fmt: skip
    assert answer.status == 200 and answer.json()["body_bytes"] == 300_000
    after = settled(
        proxy, lambda s: delta(before, s, "sbx_proxy_connections_total", verdict="tunnelled") >= 1
    )
    assert delta(before, after, "sbx_proxy_connections_total", verdict="tunnelled") == 1
    assert delta(before, after, "sbx_proxy_requests_total", outcome="passed") == 0, "not seen: a tunnel"
    assert sum(delta(before, after, "sbx_proxy_injections_total", rule="github") for _ in [0]) == 0
    up = delta(before, after, "sbx_proxy_bytes_total", direction="up")
    assert 300_000 < up < 310_000, up  # the body, the TLS records and headers around it
    assert delta(before, after, "sbx_proxy_bytes_total", direction="down") > len(answer.body)
    assert S(after, "sbx_proxy_connection_seconds_count", verdict="tunnelled") >= 1


def _connect(proxy, target: str) -> bytes:
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
        sock.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
        return sock.recv(4096)


@pytest.mark.parametrize(
    ("target", "reason"),
    [
        ("private.example:8443", "private_address"),  # resolves to 10.1.2.3; no rule on 8443
        ("127.0.0.2:443", "private_address"),
        ("169.254.169.254:80", "metadata_address"),
        ("no-such-host.invalid:443", "unresolvable"),
    ],
)
def test_a_refused_destination_counts_its_reason(proxy, target, reason):
    before = proxy.metrics()
    assert _connect(proxy, target).startswith(b"HTTP/1.1 403")
    after = settled(proxy, lambda s: delta(before, s, "sbx_proxy_connections_total", verdict="refused") >= 1)
    assert delta(before, after, "sbx_proxy_refusals_total", reason=reason) == 1
    assert delta(before, after, "sbx_proxy_connections_total", verdict="refused") == 1
    assert delta(before, after, "sbx_proxy_connections_total", verdict="tunnelled") == 0


def test_a_refused_destination_with_a_rule_is_refused_by_mitmproxy_and_counted_once(proxy):
    """A CONNECT to a host with a rule goes to mitmproxy, which checks it the same way."""
    before = proxy.metrics()
    assert _connect(proxy, "private.example:443").startswith(b"HTTP/1.1 403")
    after = settled(proxy, lambda s: delta(before, s, "sbx_proxy_connections_total", verdict="refused") >= 1)
    assert delta(before, after, "sbx_proxy_refusals_total", reason="private_address") == 1
    assert delta(before, after, "sbx_proxy_connections_total", verdict="refused") == 1


def test_a_host_mismatch_inside_a_credentialed_tunnel(pki, proxy, upstream):
    before = proxy.metrics()
    answer = harness.request(
        proxy, f"github.com:{upstream.port}", sni="github.com", host="evil.example",
        trust=trust(pki, proxy),
    )  # fmt: skip
    assert answer.status == 421
    after = settled(proxy, lambda s: delta(before, s, "sbx_proxy_connections_total", verdict="refused") >= 1)
    assert delta(before, after, "sbx_proxy_refusals_total", reason="host_mismatch") == 1
    assert delta(before, after, "sbx_proxy_requests_total", outcome="refused") == 1
    assert delta(before, after, "sbx_proxy_injections_total", rule="github") == 0


def test_a_smuggling_attempt_is_a_bad_request(pki, proxy, upstream):
    before = proxy.metrics()
    head = (
        b"POST /echo HTTP/1.1\r\nHost: github.com:%d\r\nContent-Length: 3\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n" % upstream.port
    )
    answer = harness.request(
        proxy, f"github.com:{upstream.port}", sni="github.com", host=None, trust=trust(pki, proxy),
        raw_head=head,
    )  # fmt: skip
    assert answer.status == 400
    after = settled(proxy, lambda s: delta(before, s, "sbx_proxy_refusals_total", reason="bad_request") >= 1)
    assert delta(before, after, "sbx_proxy_refusals_total", reason="bad_request") == 1
    assert delta(before, after, "sbx_proxy_injections_total", rule="github") == 0


def test_plain_http_is_forwarded_or_refused(proxy):
    before = proxy.metrics()
    assert harness.plain_request(proxy, "http://169.254.169.254/latest/meta-data/").status == 502
    after = settled(proxy, lambda s: delta(before, s, "sbx_proxy_connections_total", verdict="refused") >= 1)
    assert delta(before, after, "sbx_proxy_refusals_total", reason="metadata_address") == 1
    assert delta(before, after, "sbx_proxy_requests_total", outcome="refused") == 1


def test_an_upstream_that_is_down(proxy):
    closed = harness.free_port()  # nothing listens there
    before = proxy.metrics()
    reply = _connect(proxy, f"other.example:{closed}")
    assert reply.startswith(b"HTTP/1.1 502")
    after = settled(proxy, lambda s: delta(before, s, "sbx_proxy_connections_total", verdict="refused") >= 1)
    assert delta(before, after, "sbx_proxy_upstream_errors_total", stage="connect") == 1
    assert delta(before, after, "sbx_proxy_refusals_total", reason="upstream_failure") == 1


def test_hosts_a_client_names_never_become_labels(proxy):
    before = proxy.metrics()
    for n in range(10):
        _connect(proxy, f"host-{n}.invalid:443")
    after = settled(
        proxy, lambda s: delta(before, s, "sbx_proxy_refusals_total", reason="unresolvable") >= 10
    )
    assert len(after) == len(before), "no new series"
    assert "host-1" not in harness.scrape_unix(proxy.metrics_socket)


def test_the_proxy_port_serves_no_metrics(proxy):
    """Asked directly (origin-form), the proxy's own port never answers with its counters;
    the socket answers nothing but ``GET /metrics`` and only to its owner."""
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    assert data.startswith(b"HTTP/1.1 502") and b"sbx_proxy_" not in data
    with pytest.raises(ConnectionError):
        harness.scrape_unix(proxy.metrics_socket, "/other")
    assert oct(proxy.metrics_socket.stat().st_mode & 0o777) == "0o600"


def test_the_proxy_never_connects_to_itself(proxy):
    """127.0.0.1 is allowed here (as an operator may allow the proxy's own network): a
    request for the proxy's own port would loop through it until it ran out of
    descriptors. Refused, as a tunnel and as plain HTTP, with its own reason."""
    before = proxy.metrics()
    assert _connect(proxy, f"127.0.0.1:{proxy.port}").startswith(b"HTTP/1.1 403")
    answer = harness.plain_request(proxy, f"http://127.0.0.1:{proxy.port}/metrics")
    assert answer.status == 502 and b"is this proxy" in answer.body
    # (a refusal is counted when it is decided; its connection's close a moment later)
    after = settled(
        proxy,
        lambda s: (
            delta(before, s, "sbx_proxy_refusals_total", reason="proxy_itself") >= 2
            and S(s, "sbx_proxy_active_connections") == 0
        ),
    )
    assert delta(before, after, "sbx_proxy_refusals_total", reason="proxy_itself") == 2
    assert S(after, "sbx_proxy_active_connections") == 0
    assert "Too many open files" not in proxy.output()


def test_an_upstream_whose_tls_fails(pki, proxy, plain_upstream):
    """A host with a rule whose server speaks no TLS: mitmproxy's upstream handshake fails
    and the sandbox gets a 502."""
    port = plain_upstream.server_address[1]
    before = proxy.metrics()
    answer = harness.request(
        proxy, f"api.github.com:{port}", sni="api.github.com", host=f"api.github.com:{port}",
        trust=trust(pki, proxy),
    )  # fmt: skip
    assert answer.status == 502
    after = settled(
        proxy, lambda s: delta(before, s, "sbx_proxy_refusals_total", reason="upstream_failure") >= 1
    )
    assert delta(before, after, "sbx_proxy_upstream_errors_total", stage="tls") == 1
    assert delta(before, after, "sbx_proxy_refusals_total", reason="upstream_failure") == 1
    assert plain_upstream.seen == [], "nothing was sent in clear"


def test_a_head_mitmproxy_cannot_parse_is_a_bad_request(proxy):
    before = proxy.metrics()
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
        sock.sendall(b"NOT AN HTTP REQUEST AT ALL\r\n\r\n")
        reply = sock.recv(4096)
    assert reply.startswith(b"HTTP/1.1 400")
    after = settled(proxy, lambda s: delta(before, s, "sbx_proxy_connections_total", verdict="refused") >= 1)
    assert delta(before, after, "sbx_proxy_refusals_total", reason="bad_request") == 1
    assert delta(before, after, "sbx_proxy_connections_total", verdict="refused") == 1


def test_an_intercepted_request_whose_upstream_is_down(pki, proxy):
    before = proxy.metrics()
    answer = harness.request(
        proxy, f"gitlab.example:{CLOSED}", sni="gitlab.example", host=f"gitlab.example:{CLOSED}",
        trust=trust(pki, proxy),
    )  # fmt: skip
    assert answer.status == 502
    after = settled(
        proxy, lambda s: delta(before, s, "sbx_proxy_refusals_total", reason="upstream_failure") >= 1
    )
    assert delta(before, after, "sbx_proxy_upstream_errors_total", stage="connect") == 1
    assert delta(before, after, "sbx_proxy_refusals_total", reason="upstream_failure") == 1

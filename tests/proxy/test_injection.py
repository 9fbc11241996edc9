"""The credential proxy's rules against a real mitmdump and real HTTPS upstreams, attacked
the way tests/../security-checklist.md lists (credential-proxy section).

Each request is built by hand (CONNECT target, TLS SNI and Host chosen independently);
the upstreams record what reached them, so "no credential" is checked where it matters:
on the far side of the proxy.
"""

from __future__ import annotations

from http.server import ThreadingHTTPServer

import pytest

from tests.proxy import harness

pytestmark = [
    pytest.mark.needs_root("the proxy runs in its own mount namespace (root)"),
    pytest.mark.skipif(not harness.SBX_PROXY.exists(), reason="proxy/.venv missing: run scripts/setup"),
]
TOKEN = "ghp_" + "T0k3nForTests" * 3


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return harness.PKI(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def upstream(pki):
    server = harness.Upstream(pki)
    yield server
    server.close()


@pytest.fixture(scope="module")
def other_port(pki):
    """A second HTTPS upstream: github.com on a port without a rule."""
    server = harness.Upstream(pki)
    yield server
    server.close()


def plain_server(address: str):
    """A plain-HTTP echo upstream on ``address``, recording what reached it."""
    import threading

    server = ThreadingHTTPServer((address, 0), harness.Echo)
    server.seen = []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()


@pytest.fixture(scope="module")
def plain():
    """A plain-HTTP echo upstream on 127.0.0.1 (allowed) ..."""
    yield from plain_server("127.0.0.1")


@pytest.fixture(scope="module")
def forbidden():
    """... and one on 127.0.0.2, a loopback address the proxy must refuse to reach."""
    yield from plain_server("127.0.0.2")


@pytest.fixture(scope="module")
def proxy(pki, upstream, plain, tmp_path_factory):
    port, plain_port = upstream.port, plain.server_address[1]
    config = f"""
[destinations]
allow = ["127.0.0.1/32"]

[[rules]]
name = "github"
kind = "bearer"
hosts = ["github.com:{port}", "api.github.com:{port}", "github.com:{plain_port}"]
token_env = "SBX_TEST_TOKEN"
"""
    hosts = {n: "127.0.0.1" for n in harness.NAMES}
    hosts |= {
        "private.example": "10.1.2.3",
        "metadata.example": "169.254.169.254",
        "mixed.example": "127.0.0.1 10.1.2.3",  # one allowed and one refused address
        "loop.example": "127.0.0.2",
    }
    p = harness.Proxy(
        tmp_path_factory.mktemp("proxy"), config, pki.ca_cert, hosts, env={"SBX_TEST_TOKEN": TOKEN}
    )
    yield p
    p.close()
    assert TOKEN not in p.output(), "the token must never be logged"


def ask(proxy, pki, connect, sni, host, **kw):
    return harness.request(proxy, connect, sni=sni, host=host, trust=[proxy.ca_cert, pki.ca_cert], **kw)


def last(server) -> dict:
    seen = server.seen
    assert seen, "the upstream saw no request"
    return seen[-1]


def auth_of(seen: dict) -> list[str]:
    return [v for k, v in seen["headers"].items() if k.lower() == "authorization"]


def test_the_token_is_injected_for_the_configured_host_only_over_verified_tls(proxy, pki, upstream):
    h = f"github.com:{upstream.port}"
    answer = ask(proxy, pki, h, "github.com", h, headers={"Authorization": "Bearer the-sandbox-own"})
    assert answer.status == 200
    assert auth_of(last(upstream)) == [f"Bearer {TOKEN}"], "replaced, never forwarded alongside"
    assert TOKEN.encode() not in answer.body, "an echoed credential is masked"
    assert b"*" * len(TOKEN) in answer.body
    api = f"api.github.com:{upstream.port}"
    assert ask(proxy, pki, api, "api.github.com", api).status == 200
    assert auth_of(last(upstream)) == [f"Bearer {TOKEN}"]


def test_a_credential_echoed_in_a_response_header_is_masked(proxy, pki, upstream):
    h = f"github.com:{upstream.port}"
    answer = ask(proxy, pki, h, "github.com", h, path="/echo-auth")
    assert answer.status == 200 and TOKEN not in answer.headers["x-echo"]
    assert answer.headers["x-echo"] == "*" * len(f"Bearer {TOKEN}")  # the whole injected value


def test_connect_elsewhere_with_the_configured_sni_and_host_gets_nothing(proxy, pki, upstream):
    """CONNECT evil.example with SNI and Host github.com: the tunnel is not even intercepted
    (the client talks TLS with the upstream itself) and carries no credential."""
    before = len(upstream.seen)
    answer = ask(proxy, pki, f"evil.example:{upstream.port}", "github.com", f"github.com:{upstream.port}")
    assert answer.status == 200 and len(upstream.seen) == before + 1
    assert auth_of(last(upstream)) == []


@pytest.mark.parametrize(
    "sni, host",
    [
        ("github.com", "evil.example:{port}"),
        ("github.com", "github.com:1"),
        ("github.com", None),
        ("evil.example", "github.com:{port}"),
        (None, "github.com:{port}"),
    ],
)
def test_connect_to_the_configured_host_naming_another_is_refused(proxy, pki, upstream, sni, host):
    before = len(upstream.seen)
    h = host.format(port=upstream.port) if host else None
    answer = ask(proxy, pki, f"github.com:{upstream.port}", sni, h)
    assert answer.status in (400, 421), answer
    assert len(upstream.seen) == before, "nothing reached the upstream"


def test_plain_http_absolute_form_never_gets_a_credential(proxy, plain):
    url = f"http://github.com:{plain.server_address[1]}/echo"
    answer = harness.plain_request(proxy, url, {"Proxy-Authorization": "Basic c2VjcmV0"})
    assert answer.status == 200
    seen = plain.seen[-1]
    assert auth_of(seen) == [] and "Proxy-Authorization" not in seen["headers"]


@pytest.mark.parametrize(
    "connect, sni",
    [
        ("github.com.evil.net:{port}", "github.com.evil.net"),
        ("evilgithub.com:{port}", "evilgithub.com"),
        ("github.com:{other}", "github.com"),
    ],
)
def test_look_alike_hosts_and_other_ports_get_nothing(proxy, pki, upstream, other_port, connect, sni):
    target = connect.format(port=upstream.port, other=other_port.port)
    server = other_port if "{other}" in connect else upstream
    before = len(server.seen)
    answer = ask(proxy, pki, target, sni, target)
    assert answer.status == 200 and len(server.seen) == before + 1
    assert auth_of(last(server)) == []


def test_case_is_folded_deliberately_and_a_trailing_dot_matches_nothing(proxy, pki, upstream):
    """`GitHub.com` is github.com (DNS is case-insensitive; TLS is verified): injected.
    `github.com.` is not rewritten into github.com: it gets nothing."""
    h = f"GitHub.com:{upstream.port}"
    assert ask(proxy, pki, h, "GitHub.com", h).status == 200
    assert auth_of(last(upstream)) == [f"Bearer {TOKEN}"]
    before = len(upstream.seen)
    dotted = f"github.com.:{upstream.port}"
    try:
        ask(proxy, pki, dotted, "github.com", dotted)
    except OSError:
        pass  # the tunnel may fail on the client's side; what matters is the upstream
    assert all(auth_of(s) == [] for s in upstream.seen[before:])


def test_idn_look_alikes_get_nothing(proxy, pki, upstream):
    before = len(upstream.seen)
    punycode = "g\u0456thub.com".encode("idna").decode()  # a Cyrillic i
    try:
        answer = ask(proxy, pki, f"{punycode}:{upstream.port}", punycode, f"{punycode}:{upstream.port}")
        assert answer.status != 200 or all(auth_of(s) == [] for s in upstream.seen[before:])
    except OSError:
        pass  # unresolvable: refused
    assert all(auth_of(s) == [] for s in upstream.seen[before:])


def test_a_redirect_to_another_host_carries_nothing(proxy, pki, upstream):
    h = f"github.com:{upstream.port}"
    to = f"https://evil.example:{upstream.port}/echo"
    answer = ask(proxy, pki, h, "github.com", h, path=f"/redirect?to={to}")
    assert answer.status == 302 and answer.headers["location"] == to
    followed = ask(
        proxy, pki, f"evil.example:{upstream.port}", "evil.example", f"evil.example:{upstream.port}"
    )
    assert followed.status == 200 and auth_of(last(upstream)) == []


@pytest.mark.parametrize(
    "target",
    [
        "127.0.0.2", "2130706434", "0177.0.0.2", "0x7f000002", "127.2", "[::ffff:127.0.0.2]",
        "loop.example", "private.example", "10.1.2.3", "169.254.169.254", "metadata.example",
        "[fd00:ec2::254]", "[::1]", "0.0.0.0", "mixed.example",
    ],
)  # fmt: skip
def test_destinations_are_checked_after_resolution_in_every_notation(proxy, forbidden, target):
    """Plain HTTP to a loopback/private/metadata address, however written, or to a name
    resolving to one: refused by the proxy (a server listens on 127.0.0.2 and hears nothing)."""
    port = forbidden.server_address[1]
    answer = harness.plain_request(proxy, f"http://{target}:{port}/echo")
    assert answer.status == 502, answer
    assert forbidden.seen == []


def test_a_tunnel_to_a_refused_destination_is_closed(proxy, pki, forbidden):
    port = forbidden.server_address[1]
    answer = harness.request(proxy, f"127.0.0.2:{port}", sni=None, host="x", trust=[pki.ca_cert])
    assert answer.status == 403, answer  # the CONNECT itself is refused
    assert forbidden.seen == []
    assert "refused 127.0.0.2" in proxy.output()


@pytest.mark.parametrize(
    "head",
    [
        b"POST /echo HTTP/1.1\r\nHost: {h}\r\nContent-Length: 4\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        b"POST /echo HTTP/1.1\r\nHost: {h}\r\nContent-Length: 4\r\nContent-Length: 5\r\n\r\nabcd",
        b"GET /echo HTTP/1.1\r\nHost: {h}\r\nX-Folded: a\r\n b\r\n\r\n",
        b"GET /echo HTTP/1.1\r\nHost: {h}\r\nBad Name: x\r\n\r\n",
        b"GET /echo HTTP/1.1\r\nHost: {h}\r\nTransfer-Encoding: chunked, identity\r\n\r\n",
    ],
)
def test_request_smuggling_attempts_are_refused(proxy, pki, upstream, head):
    h = f"github.com:{upstream.port}"
    before = len(upstream.seen)
    answer = ask(proxy, pki, h, "github.com", h, raw_head=head.replace(b"{h}", h.encode()))
    assert answer.status == 400, answer
    assert len(upstream.seen) == before


def h2_request(proxy, connect: str, sni: str, authority: str, path: str = "/echo") -> dict:
    import json
    import subprocess

    python = harness.ROOT / "proxy" / ".venv" / "bin" / "python"
    script = harness.ROOT / "tests" / "proxy" / "h2client.py"
    args = [
        str(python),
        str(script),
        proxy.host,
        str(proxy.port),
        connect,
        sni,
        authority,
        path,
        str(proxy.ca_cert),
    ]
    result = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_sandboxes_cannot_speak_http2_to_the_proxy(proxy, upstream):
    """The proxy offers sandboxes HTTP/1.1 only: no :authority, no connection coalescing,
    one parser less. (HTTP/2 still works upstream where the server offers it.)"""
    h = f"github.com:{upstream.port}"
    answer = h2_request(proxy, h, "github.com", f"evil.example:{upstream.port}")
    assert answer["status"] is None and answer["alpn"] != "h2"


def test_an_absolute_form_request_inside_the_tunnel_is_refused(proxy, pki, upstream):
    """A server routes by the request line's URL, not Host: `GET https://evil.example/` in
    a github.com tunnel must never carry github's credential."""
    h = f"github.com:{upstream.port}"
    before = len(upstream.seen)
    for line in (f"https://evil.example:{upstream.port}/x", f"http://evil.example:{upstream.port}/y"):
        head = f"GET {line} HTTP/1.1\r\nHost: {h}\r\nContent-Length: 0\r\n\r\n".encode()
        answer = ask(proxy, pki, h, "github.com", h, raw_head=head)
        assert answer.status == 421, answer
    assert len(upstream.seen) == before


def test_requests_in_one_tunnel_share_one_upstream_connection(proxy, pki, upstream):
    """Pinning the checked address must not defeat connection reuse (else one sandbox
    could make the proxy open a connection per request)."""
    h = f"github.com:{upstream.port}"
    before = len(upstream.seen)
    answers = harness.keep_alive_requests(proxy, h, h, 3, [proxy.ca_cert])
    assert [a.status for a in answers] == [200, 200, 200]
    peers = {s["peer"] for s in upstream.seen[before:]}
    assert len(upstream.seen) == before + 3 and len(peers) == 1, peers


def test_a_compressed_answer_to_a_credentialed_request_is_dropped(proxy, pki, upstream):
    h = f"github.com:{upstream.port}"
    answer = ask(proxy, pki, h, "github.com", h, path="/gzip-echo")
    assert answer.status == 502 and answer.body == b""


def test_the_reason_phrase_is_masked_too(proxy, pki, upstream):
    h = f"github.com:{upstream.port}"
    answer = ask(proxy, pki, h, "github.com", h, path="/reason-auth")
    assert answer.status == 200 and TOKEN.encode() not in answer.body


def test_a_refused_request_with_a_body_is_answered(proxy, pki, upstream):
    before = len(upstream.seen)
    h = f"github.com:{upstream.port}"
    answer = ask(
        proxy, pki, h, "github.com", f"evil.example:{upstream.port}", method="POST", body=b"x" * 5000
    )
    assert answer.status == 421 and len(upstream.seen) == before

"""The proxy's front door (proxy/sbx_proxy/front.py) with a real mitmdump behind it: a
CONNECT to a host without a rule is relayed by the front itself with splice(2), after
the same destination checks as the addon; everything else reaches mitmproxy unchanged.
The attacks on both paths are in test_injection.py; these check the relay itself."""

from __future__ import annotations

import hashlib
import os
import socket
import threading

import pytest

from sbx_proxy import front
from tests.proxy import harness

pytestmark = [
    pytest.mark.needs_root("the proxy runs in its own mount namespace (root)"),
    pytest.mark.skipif(not harness.SBX_PROXY.exists(), reason="proxy/.venv missing: run scripts/setup"),
]


class EchoUntilEof:
    """A raw TCP upstream: sends back everything it reads, closes after the client's EOF."""

    def __init__(self, address: str = "127.0.0.1") -> None:
        self.sock = socket.create_server((address, 0))
        self.port = self.sock.getsockname()[1]
        self.peers: list[str] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, peer = self.sock.accept()
            except OSError:
                return
            self.peers.append(peer[0])
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    @staticmethod
    def _echo(conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(1 << 16):
                conn.sendall(data)

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(scope="module")
def echo():
    server = EchoUntilEof()
    yield server
    server.close()


@pytest.fixture(scope="module")
def proxy(tmp_path_factory, echo):
    pki = harness.PKI(tmp_path_factory.mktemp("pki"))
    config = f"""
[destinations]
allow = ["127.0.0.1/32"]

[[rules]]
name = "ruled"
kind = "bearer"
hosts = ["github.com:{echo.port}"]
token = "not-used-here"
"""
    hosts = {"echo.example": "127.0.0.1", "github.com": "127.0.0.1", "loop.example": "127.0.0.2"}
    p = harness.Proxy(tmp_path_factory.mktemp("proxy"), config, pki.ca_cert, hosts)
    yield p
    p.close()


def connect(proxy, target: str, extra: bytes = b"") -> tuple[socket.socket, bytes]:
    sock = socket.create_connection((proxy.host, proxy.port), timeout=20)
    sock.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode() + extra)
    answer = b""
    while b"\r\n\r\n" not in answer:
        chunk = sock.recv(4096)
        if not chunk:
            break
        answer += chunk
    return sock, answer


def test_a_tunnel_carries_bytes_sent_with_the_connect_and_a_large_stream_intact(proxy, echo):
    sock, answer = connect(proxy, f"echo.example:{echo.port}", extra=b"hello, pipelined")
    with sock:
        assert answer.startswith(b"HTTP/1.1 200"), answer
        rest = answer.split(b"\r\n\r\n", 1)[1]
        while len(rest) < len(b"hello, pipelined"):
            rest += sock.recv(4096)
        assert rest == b"hello, pipelined"

        payload = os.urandom(24 << 20)
        received = hashlib.sha256()
        count = 0

        def read_all() -> None:
            nonlocal count
            while data := sock.recv(1 << 20):
                received.update(data)
                count += len(data)

        reader = threading.Thread(target=read_all)
        reader.start()
        sock.sendall(payload)
        sock.shutdown(socket.SHUT_WR)  # the half-close travels: the echo closes, so do we
        reader.join(60)
        assert not reader.is_alive(), "the end of the stream never arrived"
        assert count == len(payload) and received.hexdigest() == hashlib.sha256(payload).hexdigest()


def test_a_refused_destination_gets_403_and_no_connection(proxy, echo):
    before = len(echo.peers)
    for target in (f"loop.example:{echo.port}", f"127.0.0.2:{echo.port}", f"2130706434:{echo.port}"):
        sock, answer = connect(proxy, target)
        with sock:
            assert answer.startswith(b"HTTP/1.1 403"), (target, answer)
            assert b"refused by the sandbox's egress proxy: CONNECT" in answer, answer
            assert b"x-sbx-refused: private_address" in answer.lower()
    assert len(echo.peers) == before


def test_a_host_with_a_rule_goes_to_mitmproxy_not_the_tunnel(proxy, echo):
    """github.com has a rule: mitmproxy answers the CONNECT and then parses what comes
    through (the front would have relayed it to the echo unchanged)."""
    before = len(echo.peers)
    sock, answer = connect(proxy, f"github.com:{echo.port}")
    with sock:
        assert answer.startswith(b"HTTP/1.1 200"), answer
        sock.sendall(b"not tls\r\n\r\n")
        sock.settimeout(5)
        reply = sock.recv(4096)
    assert reply.startswith(b"HTTP/1.1 400") and b"mitmproxy" in reply, reply
    assert len(echo.peers) == before, "nothing reached the upstream"


def test_what_the_front_does_not_parse_reaches_mitmproxy(proxy):
    for head in (b"CONNECT two words:1 HTTP/1.1\r\n\r\n", b"connect echo.example:1 HTTP/1.1\r\n\r\n"):
        with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
            sock.sendall(head)
            answer = sock.recv(4096)
            assert answer.startswith(b"HTTP/1.1 4"), (head, answer)  # mitmproxy's own refusal


@pytest.mark.parametrize(
    ("head", "expected"),
    [
        (b"CONNECT github.com:443 HTTP/1.1\r\n", ("github.com", 443)),
        (b"CONNECT GitHub.COM:443 HTTP/1.0\r\n", ("github.com", 443)),
        (b"CONNECT [::1]:8443 HTTP/1.1\r\n", ("::1", 8443)),
        (b"CONNECT github.com:0 HTTP/1.1\r\n", None),
        (b"CONNECT github.com:65536 HTTP/1.1\r\n", None),
        (b"CONNECT github.com HTTP/1.1\r\n", None),
        (b"CONNECT a b:443 HTTP/1.1\r\n", None),
        (b"CONNECT http://github.com:443 HTTP/1.1\r\n", None),
        (b"GET http://github.com/ HTTP/1.1\r\n", None),
        (b" CONNECT github.com:443 HTTP/1.1\r\n", None),
        (b"CONNECT github.com:443 HTTP/2\r\n", None),
    ],
)
def test_only_a_plain_well_formed_connect_is_parsed(head, expected):
    assert front.parse_connect(head) == expected


def test_a_connect_head_cut_short_never_opens_a_tunnel(proxy, echo):
    """``CONNECT ...\\r\\n`` and then end of input (no blank line): not a complete request,
    so the front tunnels nothing and hands it to mitmproxy; no error escapes."""
    before = len(echo.peers)
    with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
        sock.sendall(f"CONNECT echo.example:{echo.port} HTTP/1.1\r\n".encode())
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(10)
        answer = sock.recv(4096)
    assert not answer.startswith(b"HTTP/1.1 200"), answer
    assert len(echo.peers) == before
    assert "Traceback" not in proxy.output()


class Relayed:
    """client ↔ [one of the front's relays, in this process] ↔ the echo server."""

    def __init__(self, relay, echo: EchoUntilEof) -> None:
        import asyncio

        self.loop = asyncio.new_event_loop()
        listener = socket.create_server(("127.0.0.1", 0))
        self.client = socket.create_connection(listener.getsockname())
        inside, _ = listener.accept()
        listener.close()
        upstream = socket.create_connection(("127.0.0.1", echo.port))
        for sock in (inside, upstream):
            sock.setblocking(False)
        self.task = self.loop.create_task(relay(inside, upstream))
        self.sockets = (inside, upstream)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.loop.run_until_complete(self.task)
        except BaseException:  # cancelled on purpose
            pass
        finally:
            for sock in self.sockets:
                sock.close()

    def cancel(self) -> None:
        self.loop.call_soon_threadsafe(self.task.cancel)


@pytest.mark.parametrize("relay", [front.relay_in_threads, front.relay], ids=["threads", "event loop"])
def test_both_relays_carry_a_large_stream_intact_and_pass_the_half_close_on(relay):
    """The relays themselves, without the proxy around them: 24 MiB both ways through
    real sockets, byte for byte, and the client's half-close reaches the far end (whose
    close then ends the relay)."""
    echo = EchoUntilEof()
    relayed = Relayed(relay, echo)
    try:
        payload = os.urandom(24 << 20)
        received = hashlib.sha256()
        count = 0

        def read_all() -> None:
            nonlocal count
            while data := relayed.client.recv(1 << 20):
                received.update(data)
                count += len(data)

        reader = threading.Thread(target=read_all)
        reader.start()
        relayed.client.sendall(payload)
        relayed.client.shutdown(socket.SHUT_WR)
        reader.join(60)
        assert not reader.is_alive(), "the end of the stream never arrived"
        assert count == len(payload) and received.hexdigest() == hashlib.sha256(payload).hexdigest()
        relayed.thread.join(10)
        assert not relayed.thread.is_alive(), "the relay did not end after both ends closed"
    finally:
        relayed.client.close()
        echo.close()


@pytest.mark.parametrize("relay", [front.relay_in_threads, front.relay], ids=["threads", "event loop"])
def test_a_cancelled_relay_ends_at_once_and_closes_nothing_under_a_running_thread(relay):
    """Cancelling a relay (the proxy shutting down) ends it while both directions are idle
    and blocked: the client sees its connection end, and the relay returns only once its
    threads are done (so the sockets are never closed under them)."""
    echo = EchoUntilEof()
    relayed = Relayed(relay, echo)
    try:
        relayed.client.sendall(b"ping")
        assert relayed.client.recv(4) == b"ping"
        relayed.cancel()
        relayed.thread.join(10)
        assert not relayed.thread.is_alive(), "the cancelled relay did not end"
        relayed.client.settimeout(10)
        assert relayed.client.recv(1) == b"", "the client's connection did not end"
        for thread in [t for t in threading.enumerate() if t.name == "sbx-relay"]:
            thread.join(5)  # past its last use of the sockets, it may still be returning
            assert not thread.is_alive(), "a relay thread was left running"
    finally:
        relayed.client.close()
        echo.close()

"""Real parts for credential-proxy tests: a test PKI, HTTPS upstreams, a real mitmdump
(``proxy/.venv``) and a raw client that controls CONNECT, SNI and Host separately.

The proxy runs in its own mount namespace with a test ``/etc/hosts`` (``unshare -m`` +
a bind mount), so names like ``github.com`` resolve to this machine's upstreams for the
proxy only; nothing on the host changes. Needs root (for the namespace).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import ipaddress
import json
import os
import signal
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID

from shared.infrastructure.settings import proxies

ROOT = Path(__file__).resolve().parents[2]
SBX_PROXY = proxies.DEFAULT_PROXY_BIN
NAMES = [
    "github.com", "api.github.com", "gitlab.example", "evil.example", "github.com.evil.net",
    "evilgithub.com", "other.example", "private.example",
]  # fmt: skip


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


@dataclass
class PKI:
    """A test CA and one server certificate for every test host name."""

    dir: Path
    ca_cert: Path = field(init=False)
    server_cert: Path = field(init=False)
    server_key: Path = field(init=False)

    def __post_init__(self) -> None:
        now = dt.datetime.now(dt.UTC)
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca = (
            x509.CertificateBuilder()
            .subject_name(_name("sbx test CA"))
            .issuer_name(_name("sbx test CA"))
            .public_key(ca_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(days=1))
            .not_valid_after(now + dt.timedelta(days=30))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
            )
            .sign(ca_key, hashes.SHA256())
        )
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name("github.com"))
            .issuer_name(ca.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(days=1))
            .not_valid_after(now + dt.timedelta(days=30))
            .add_extension(
                x509.SubjectAlternativeName(
                    [*(x509.DNSName(n) for n in NAMES), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
                ),
                critical=False,
            )
            .sign(ca_key, hashes.SHA256())
        )
        self.dir.mkdir(parents=True, exist_ok=True)
        self.ca_cert = self.dir / "test-ca.pem"
        self.server_cert = self.dir / "server.pem"
        self.server_key = self.dir / "server-key.pem"
        self.ca_cert.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
        self.server_cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        self.server_key.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )


def rsa_key_pem() -> tuple[str, rsa.RSAPrivateKey]:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ).decode()
    return pem, key


class Echo(BaseHTTPRequestHandler):
    """GET/POST anything: answers JSON with what arrived. /redirect?to=URL answers 302.
    /echo-auth puts the Authorization it got into a response header and the body."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:
        pass

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        seen = {"method": self.command, "path": self.path, "headers": dict(self.headers.items()),
                "body_bytes": len(body), "peer": self.client_address[1]}  # fmt: skip
        self.server.seen.append(seen)  # type: ignore[attr-defined]
        if self.path in ("/gzip-echo", "/reason-auth"):
            import gzip

            data = json.dumps(seen).encode()
            compressed = self.path == "/gzip-echo"
            payload = gzip.compress(data) if compressed else data
            reason = self.headers.get("Authorization", "OK") if self.path == "/reason-auth" else "OK"
            self.send_response(200, reason)
            if compressed:
                self.send_header("Content-Encoding", "gzip")  # whatever the client asked for
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            return
        if self.path.startswith("/redirect?to="):
            self.send_response(302)
            self.send_header("Location", self.path.split("=", 1)[1])
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        data = json.dumps(seen).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if self.path == "/echo-auth":
            self.send_header("X-Echo", self.headers.get("Authorization", ""))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_PUT = _answer


class Upstream:
    """An HTTPS server on 127.0.0.1 with the test PKI's certificate."""

    def __init__(self, pki: PKI, handler: type[BaseHTTPRequestHandler] = Echo) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.server.seen = []  # type: ignore[attr-defined]
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(pki.server_cert, pki.server_key)
        self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def seen(self) -> list[dict]:
        return self.server.seen  # type: ignore[attr-defined]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Proxy:
    """``sbx-proxy`` (mitmdump) as a subprocess with a private /etc/hosts."""

    def __init__(self, workdir: Path, config_text: str | None, upstream_ca: Path, hosts: dict[str, str],
                 env: dict[str, str] | None = None, listen_host: str = "127.0.0.1",
                 port: int | None = None, metrics: bool = True,
                 extra: tuple[str, ...] = ()) -> None:  # fmt: skip
        workdir.mkdir(parents=True, exist_ok=True)
        self.confdir = workdir / "ca"
        self.log = workdir / "proxy.log"
        hosts_file = workdir / "hosts"
        lines = [f"{ip} {n}\n" for n, ips in hosts.items() for ip in ips.split()]  # "a b": two addresses
        hosts_file.write_text("127.0.0.1 localhost\n" + "".join(lines))
        args = [str(SBX_PROXY), "--listen-host", listen_host, "--listen-port", str(port or free_port()),
                "--confdir", str(self.confdir), "--upstream-ca", str(upstream_ca)]  # fmt: skip
        self.metrics_socket = workdir / "metrics.sock" if metrics else None
        if self.metrics_socket is not None:
            args += ["--metrics-socket", str(self.metrics_socket)]
        args += extra
        if config_text is not None:
            config = workdir / "config.toml"
            config.write_text(config_text)
            args += ["--config", str(config)]
        self.port = int(args[args.index("--listen-port") + 1])
        self.host = listen_host
        script = 'mount --bind "$0" /etc/hosts && exec "$@"'
        self.proc = subprocess.Popen(
            ["unshare", "-m", "--propagation", "private", "sh", "-c", script, str(hosts_file), *args],
            stdout=self.log.open("wb"),
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sbx-proxy exited: {self.log.read_text()}")
            with contextlib.suppress(OSError), socket.create_connection((listen_host, self.port), 0.2):
                break
            time.sleep(0.05)
        else:
            raise RuntimeError("sbx-proxy did not listen")
        self.ca_cert = self.confdir / "mitmproxy-ca-cert.pem"

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """The proxy's samples, read from its metrics socket: {(name, labels): value}."""
        assert self.metrics_socket is not None, "started without metrics"
        return parse_metrics(scrape_unix(self.metrics_socket))


def scrape_unix(path: Path, target: str = "/metrics") -> str:
    """GET ``target`` over the unix socket at ``path``; the body (raises on a non-200)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(str(path))
        sock.sendall(f"GET {target} HTTP/1.0\r\nHost: proxy\r\n\r\n".encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split()[1])
    if status != 200:
        raise ConnectionError(f"{target}: {status}")
    return body.decode()


def parse_metrics(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def sample(samples: dict, name: str, **labels: str) -> float:
    """One sample's value (0 when absent)."""
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> dict:
        return json.loads(self.body)


def _read_response(stream) -> Answer:  # type: ignore[no-untyped-def]
    status_line = stream.readline()
    if not status_line:
        raise ConnectionError("no answer")
    status = int(status_line.split()[1])
    headers: dict[str, str] = {}
    while (line := stream.readline()) not in (b"\r\n", b"\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    if "content-length" in headers:
        body = stream.read(int(headers["content-length"]))
    elif headers.get("transfer-encoding", "").lower() == "chunked":
        body = b""
        while (size := int(stream.readline().strip() or b"0", 16)) > 0:
            body += stream.read(size)
            stream.readline()
        stream.readline()
    else:
        body = stream.read()
    return Answer(status, headers, body)


def request(
    proxy: Proxy,
    connect: str,
    *,
    sni: str | None,
    host: str | None,
    path: str = "/echo",
    method: str = "GET",
    headers: dict[str, str] | None = None,
    body: bytes = b"",
    trust: list[Path],
    raw_head: bytes | None = None,
) -> Answer:
    """CONNECT ``connect`` through the proxy, TLS with ``sni``, then one HTTP/1.1 request
    with ``Host: host`` — each chosen independently, as an attacker would."""
    sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=20)
    sock.sendall(f"CONNECT {connect} HTTP/1.1\r\nHost: {connect}\r\n\r\n".encode())
    reply = b""
    while b"\r\n\r\n" not in reply:
        chunk = sock.recv(4096)
        if not chunk:
            raise ConnectionError(f"proxy closed after CONNECT: {reply!r}")
        reply += chunk
    if b" 200" not in reply.split(b"\r\n", 1)[0]:
        sock.close()
        return Answer(int(reply.split()[1]), {}, reply)
    context = ssl.create_default_context()
    context.load_default_certs()
    for ca in trust:
        context.load_verify_locations(ca)
    context.check_hostname = sni is not None
    tls = context.wrap_socket(sock, server_hostname=sni)
    if raw_head is not None:
        head = raw_head
    else:
        lines = [f"{method} {path} HTTP/1.1"]
        if host is not None:
            lines.append(f"Host: {host}")
        for k, v in (headers or {}).items():
            lines.append(f"{k}: {v}")
        lines += [f"Content-Length: {len(body)}", "Connection: close"]
        head = ("\r\n".join(lines) + "\r\n\r\n").encode()
    tls.sendall(head + body)
    with tls, tls.makefile("rb") as stream:
        return _read_response(stream)


def plain_request(proxy: Proxy, url: str, headers: dict[str, str] | None = None) -> Answer:
    """An absolute-form plain-HTTP request through the proxy (``GET http://host/...``)."""
    host = url.split("/")[2]
    lines = [f"GET {url} HTTP/1.1", f"Host: {host}", "Connection: close"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    with socket.create_connection((proxy.host, proxy.port), timeout=20) as sock:
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        with sock.makefile("rb") as stream:
            return _read_response(stream)


class GitSmartHTTP(BaseHTTPRequestHandler):
    """git's own ``http-backend`` (CGI) behind HTTPS, answering only requests that carry
    basic auth ``x-access-token:<server.token>`` (as GitHub does); bodies stream both ways."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:
        pass

    def _serve(self) -> None:
        import base64

        expected = "Basic " + base64.b64encode(f"x-access-token:{self.server.token}".encode()).decode()  # type: ignore[attr-defined]
        self.server.seen.append({"path": self.path, "headers": dict(self.headers.items())})  # type: ignore[attr-defined]
        if self.headers.get("Authorization") != expected:
            self.send_response(401)
            self.send_header("WWW-Authenticate", 'Basic realm="git"')
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        path, _, query = self.path.partition("?")
        env = {
            "PATH": os.environ["PATH"], "GIT_PROJECT_ROOT": str(self.server.root),  # type: ignore[attr-defined]
            "GIT_HTTP_EXPORT_ALL": "1", "REMOTE_USER": "x-access-token", "REQUEST_METHOD": self.command,
            "PATH_INFO": path, "QUERY_STRING": query, "CONTENT_TYPE": self.headers.get("Content-Type", ""),
            "GIT_HTTP_MAX_REQUEST_BUFFER": "1000M",
        }  # fmt: skip
        if self.headers.get("Content-Length"):
            env["CONTENT_LENGTH"] = self.headers["Content-Length"]
        if self.headers.get("Content-Encoding"):
            env["HTTP_CONTENT_ENCODING"] = self.headers["Content-Encoding"]
        cgi = subprocess.Popen(
            ["git", "http-backend"], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        assert cgi.stdin is not None and cgi.stdout is not None

        def feed() -> None:
            try:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    while (size := int(self.rfile.readline().strip().split(b";")[0] or b"0", 16)) > 0:
                        cgi.stdin.write(self.rfile.read(size))
                        self.rfile.readline()
                    self.rfile.readline()
                else:
                    left = int(self.headers.get("Content-Length") or 0)
                    while left > 0:
                        chunk = self.rfile.read(min(left, 65536))
                        if not chunk:
                            break
                        cgi.stdin.write(chunk)
                        left -= len(chunk)
            finally:
                cgi.stdin.close()

        feeder = threading.Thread(target=feed)
        feeder.start()
        status, headers = 200, []
        while (line := cgi.stdout.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode().partition(":")
            if name.lower() == "status":
                status = int(value.split()[0])
            else:
                headers.append((name, value.strip()))
        self.send_response(status)
        for name, value in headers:
            self.send_header(name, value)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        while chunk := cgi.stdout.read1(65536):
            self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        self.wfile.write(b"0\r\n\r\n")
        feeder.join()
        cgi.wait()

    do_GET = do_POST = _serve


def peak_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise RuntimeError("no VmHWM")


def keep_alive_requests(proxy: Proxy, connect: str, host: str, count: int, trust: list[Path]) -> list[Answer]:
    """``count`` GETs one after another in one tunnel, on one TLS connection (keep-alive)."""
    sock = socket.create_connection((proxy.host, proxy.port), timeout=20)
    sock.sendall(f"CONNECT {connect} HTTP/1.1\r\nHost: {connect}\r\n\r\n".encode())
    reply = b""
    while b"\r\n\r\n" not in reply:
        reply += sock.recv(4096)
    context = ssl.create_default_context()
    for ca in trust:
        context.load_verify_locations(ca)
    tls = context.wrap_socket(sock, server_hostname=host.split(":")[0])
    answers = []
    with tls, tls.makefile("rb") as stream:
        for _ in range(count):
            tls.sendall(f"GET /echo HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
            answers.append(_read_response(stream))
    return answers


def demo_wheel(name: str = "sbxdemo", version: str = "1.0") -> tuple[str, bytes]:
    """A minimal pure-Python wheel (file name, bytes): ``import sbxdemo; sbxdemo.GREETING``."""
    import base64
    import hashlib
    import io
    import zipfile

    dist = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": b'GREETING = "installed through the proxy"\n',
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }

    def digest(data: bytes) -> str:
        return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()

    record = "".join(f"{path},{digest(data)},{len(data)}\n" for path, data in files.items())
    files[f"{dist}/RECORD"] = (record + f"{dist}/RECORD,,\n").encode()
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as wheel:
        for path, data in files.items():
            wheel.writestr(path, data)
    return f"{name}-{version}-py3-none-any.whl", buffer.getvalue()


class PackageIndex(BaseHTTPRequestHandler):
    """A private PEP 503 index: /simple/<project>/ and /files/<wheel>, only with
    ``Authorization: Bearer <server.token>`` (as a private registry does)."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        server = self.server
        self.server.seen.append({"path": self.path, "auth": self.headers.get("Authorization")})  # type: ignore[attr-defined]
        if self.headers.get("Authorization") != f"Bearer {server.token}":  # type: ignore[attr-defined]
            return self._send(401, b"token required\n", "text/plain")
        filename, data = server.wheel  # type: ignore[attr-defined]
        project = filename.split("-")[0]
        if self.path.rstrip("/") == f"/simple/{project}":
            import hashlib

            sha = hashlib.sha256(data).hexdigest()
            page = f'<html><body><a href="/files/{filename}#sha256={sha}">{filename}</a></body></html>'
            return self._send(200, page.encode(), "text/html")
        if self.path == f"/files/{filename}":
            return self._send(200, data, "application/octet-stream")
        return self._send(404, b"not found\n", "text/plain")

    def _send(self, status: int, body: bytes, kind: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@contextlib.contextmanager
def git_remote(base: Path, token: str) -> Iterator[tuple[ThreadingHTTPServer, Path]]:
    """A bare repository ``org/remote.git`` under ``base`` served over plain HTTP by
    :class:`GitSmartHTTP` (pushes allowed), answering only with ``token``."""
    served = base / "served"
    repo = served / "org" / "remote.git"
    repo.parent.mkdir(parents=True)
    subprocess.run(["git", "init", "-q", "--bare", str(repo)], check=True)
    subprocess.run(["git", "config", "http.receivepack", "true"], cwd=repo, check=True)
    server = ThreadingHTTPServer(("127.0.0.1", 0), GitSmartHTTP)
    server.token, server.root, server.seen = token, served, []  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server, repo
    finally:
        server.shutdown()

"""The credential proxy's cost, all in one run against the same local HTTPS upstream:

* per request, on one kept-alive connection: direct, tunnelled (a host without a rule:
  CONNECT, no interception) and injected (a host with a rule: intercepted, credential
  added, answer masked) — p50/p99, requests/s and the added latency;
* per request with a new connection each time (TLS handshake included), same three;
* bulk download throughput, tunnelled vs direct (target: tunnelled within 10 %), and
  injected for reference: the median of three alternating rounds, with the proxy's CPU
  time per GiB (client, upstream and proxy share the machine's cores);
* the same bulk download through a **bare hop**: a relay that does nothing but accept a
  CONNECT and move the bytes with blocking ``splice(2)`` in two threads of its own
  process (no checks, no event loop). It is the floor of any relay on this machine: what
  one more TCP hop on loopback costs when client, upstream and relay share the cores.

Real mitmdump (`sbx-proxy`), real TLS. Needs root (the proxy runs with a private
/etc/hosts). Figures only; nothing is asserted.

    .venv/bin/python bench/proxy.py [--requests 500] [--bulk-mib 256]
"""

from __future__ import annotations

import argparse
import fcntl
import multiprocessing
import os
import socket
import ssl
import statistics
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common
from tests.proxy import harness

TOKEN = "ghp_" + "benchToken" * 4
ROUNDS = 3


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


CHUNK = b"x" * (1 << 20)


class Bench(BaseHTTPRequestHandler):
    """/small: a 200-byte answer; /bulk/<MiB>: that many MiB, in 1 MiB writes."""

    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go out as separate writes

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        if self.path.startswith("/bulk/"):
            mib = int(self.path.rsplit("/", 1)[1])
            self.send_response(200)
            self.send_header("Content-Length", str(mib << 20))
            self.end_headers()
            for _ in range(mib):
                self.wfile.write(CHUNK)
            return
        body = b"y" * 200
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class BareHop:
    """A CONNECT relay with nothing but the kernel's work in it (see the module docstring),
    in a process of its own, towards ``port`` on loopback whatever the CONNECT names."""

    def __init__(self, port: int) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.host, self.port = self.listener.getsockname()
        self.proc = multiprocessing.get_context("fork").Process(
            target=_serve_bare_hop, args=(self.listener, port), daemon=True
        )
        self.proc.start()

    def close(self) -> None:
        self.proc.kill()
        self.proc.join()
        self.listener.close()


def _serve_bare_hop(listener: socket.socket, port: int) -> None:
    while True:
        client, _ = listener.accept()
        head = b""
        while b"\r\n\r\n" not in head:
            head += client.recv(4096)
        upstream = socket.create_connection(("127.0.0.1", port))
        for sock in (client, upstream):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        client.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
        for src, dst in ((client, upstream), (upstream, client)):
            threading.Thread(target=_splice_all, args=(src, dst), daemon=True).start()


def _splice_all(src: socket.socket, dst: socket.socket) -> None:
    r, w = os.pipe()
    fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 1 << 20)
    try:
        while n := os.splice(src.fileno(), w, 1 << 20, flags=os.SPLICE_F_MOVE):
            while n:
                n -= os.splice(r, dst.fileno(), n, flags=os.SPLICE_F_MOVE)
        dst.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    finally:
        os.close(r)
        os.close(w)


class Client:
    """HTTP/1.1 over TLS, direct or through the proxy's CONNECT, kept alive."""

    def __init__(
        self, target: tuple[str, int], name: str, trust: list[Path], proxy: harness.Proxy | BareHop | None
    ):
        sock = socket.create_connection((proxy.host, proxy.port) if proxy else target, timeout=60)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if proxy:
            sock.sendall(f"CONNECT {name}:{target[1]} HTTP/1.1\r\nHost: {name}:{target[1]}\r\n\r\n".encode())
            reply = b""
            while b"\r\n\r\n" not in reply:
                reply += sock.recv(4096)
        context = ssl.create_default_context()
        for ca in trust:
            context.load_verify_locations(ca)
        self.tls = context.wrap_socket(sock, server_hostname=name)
        self.stream = self.tls.makefile("rb")
        self.host = f"{name}:{target[1]}"

    def get(self, path: str) -> int:
        self.tls.sendall(f"GET {path} HTTP/1.1\r\nHost: {self.host}\r\n\r\n".encode())
        status = int(self.stream.readline().split()[1])
        length = 0
        while (line := self.stream.readline()) not in (b"\r\n", b""):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        left = length
        while left:
            got = self.stream.read(min(left, 1 << 20))
            if not got:
                raise ConnectionError("short body")
            left -= len(got)
        return status

    def close(self) -> None:
        self.stream.close()
        self.tls.close()


def main(requests: int, bulk_mib: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        pki = harness.PKI(Path(tmp) / "pki")
        upstream = harness.Upstream(pki, Bench)
        port = upstream.port
        config = f"""
[destinations]
allow = ["127.0.0.1/32"]

[[rules]]
name = "bench"
kind = "bearer"
hosts = ["github.com:{port}"]
token_env = "SBX_BENCH_TOKEN"
"""
        proxy = harness.Proxy(
            Path(tmp) / "proxy",
            config,
            pki.ca_cert,
            {n: "127.0.0.1" for n in harness.NAMES},
            env={"SBX_BENCH_TOKEN": TOKEN},
        )
        trust = [pki.ca_cert, proxy.ca_cert]
        target = ("127.0.0.1", port)
        hop = BareHop(port)
        ways = {
            "direct": lambda: Client(target, "github.com", trust, None),
            "tunnelled (no rule)": lambda: Client(target, "other.example", trust, proxy),
            "injected (rule)": lambda: Client(target, "github.com", trust, proxy),
        }
        rows: list[str] = []
        p50: dict[str, float] = {}
        try:
            for make in ways.values():  # warm up each path once
                c = make()
                c.get("/small")
                c.close()
            for label, make in ways.items():
                client = make()
                samples: list[float] = []
                start = time.perf_counter()
                for _ in range(requests):
                    t0 = time.perf_counter()
                    assert client.get("/small") == 200
                    samples.append(time.perf_counter() - t0)
                elapsed = time.perf_counter() - start
                client.close()
                p50[label] = common.percentiles(samples)["p50"]
                rows.append(common.row(f"keep-alive GET, {label}", samples, elapsed))
            for label, make in ways.items():
                samples = []
                start = time.perf_counter()
                for _ in range(max(20, requests // 5)):
                    t0 = time.perf_counter()
                    client = make()
                    assert client.get("/small") == 200
                    client.close()
                    samples.append(time.perf_counter() - t0)
                rows.append(common.row(f"new connection, {label}", samples, time.perf_counter() - start))
            # Bulk: the three ways in turn, ROUNDS times (a shared 2-core VM is noisy), the
            # median of each; and the proxy's own CPU time per GiB moved.
            rates: dict[str, list[float]] = {label: [] for label in ways}
            cpu: dict[str, list[float]] = {label: [] for label in ways}
            for _ in range(ROUNDS):
                for label, make in ways.items():
                    client = make()
                    c0, t0 = cpu_seconds(proxy.proc.pid), time.perf_counter()
                    assert client.get(f"/bulk/{bulk_mib}") == 200
                    rates[label].append(bulk_mib / (time.perf_counter() - t0))
                    cpu[label].append((cpu_seconds(proxy.proc.pid) - c0) / (bulk_mib / 1024))
                    client.close()
            # The floor: a bare hop, alternating with direct again (its own pairs).
            pairs: dict[str, list[float]] = {"direct": [], "bare hop": []}
            for _ in range(ROUNDS):
                for label, way in (("direct", None), ("bare hop", hop)):
                    client = Client(target, "github.com", trust, way)
                    t0 = time.perf_counter()
                    assert client.get(f"/bulk/{bulk_mib}") == 200
                    pairs[label].append(bulk_mib / (time.perf_counter() - t0))
                    client.close()
            throughput = {label: statistics.median(r) for label, r in rates.items()}
            throughput["bare hop (floor)"] = statistics.median(pairs["bare hop"])
            rates["bare hop (floor)"] = pairs["bare hop"]
            floor = statistics.median(pairs["bare hop"]) / statistics.median(pairs["direct"])
        finally:
            hop.close()
            proxy.close()
            upstream.close()

    print(f"\nCredential proxy benchmark (mitmproxy 11, {os.cpu_count()} cores)\n")
    for line in rows:
        print(line)
    print()
    base = p50["direct"]
    for label in ("tunnelled (no rule)", "injected (rule)"):
        print(f"added latency p50, {label:20} {p50[label] - base:6.2f} ms  ({p50[label] / base:.2f}x direct)")
    print()
    for label, mib_s in throughput.items():
        spread = f"{min(rates[label]):.0f}-{max(rates[label]):.0f}"
        proxy_cpu = (
            f"proxy CPU {statistics.median(cpu[label]):5.2f} s/GiB"
            if label in cpu and label != "direct"
            else ""
        )
        print(
            f"bulk {bulk_mib} MiB, {label:20} {mib_s:8.1f} MiB/s (median of {ROUNDS}: {spread})  {proxy_cpu}"
        )
    ratio = throughput["tunnelled (no rule)"] / throughput["direct"]
    print(f"\ntunnelled / direct throughput: {ratio:.2f} (target >= 0.90)")
    print(f"bare hop / direct throughput:  {floor:.2f} (what one more hop costs on this machine)")
    print(f"tunnelled / bare hop:          {ratio / floor:.2f} (the proxy's own share of the gap)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--bulk-mib", type=int, default=256)
    args = parser.parse_args()
    main(args.requests, args.bulk_mib)

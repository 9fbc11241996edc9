"""The credential proxy's cost, all in one run against the same local HTTPS upstream:

* per request, on one kept-alive connection: direct, tunnelled (a host without a rule:
  CONNECT, no interception) and injected (a host with a rule: intercepted, credential
  added, answer masked) — p50/p99, requests/s and the added latency;
* per request with a new connection each time (TLS handshake included), same three;
* bulk download throughput, tunnelled vs direct (target: tunnelled within 10 %), and
  injected for reference: the median of three alternating rounds, with the proxy's CPU
  time per GiB (client, upstream and proxy share the machine's cores);
* each proxy path three times, through the same proxy without metrics, with metrics (the
  Prometheus sink on its unix socket) and with metrics and egress records (the default:
  a record per connection, collected every 0.5 s over the same socket as the
  proxy-scaler does), alternating, so each one's cost is a ratio of one run;
* the same bulk download through a **bare hop**: a relay that does nothing but accept a
  CONNECT and move the bytes with blocking ``splice(2)`` in two threads of its own
  process (no checks, no event loop). It is the floor of any relay on this machine: what
  one more TCP hop on loopback costs when client, upstream and relay share the cores.

Real mitmdump (`sbx-proxy`), real TLS. Needs root (the proxy runs with a private
/etc/hosts). Figures only; nothing is asserted.

    .venv/bin/python bench/proxy.py [--requests 500] [--bulk-mib 256] [--rounds 3] [--baseline DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
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
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "proxy"))

from bench import common
from sbx_proxy import egress, front, metrics, records
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


def _ways(target, trust, proxies):
    """direct, then each proxy path through each proxy (metrics off, on, records on)."""
    ways = {"direct": lambda: Client(target, "github.com", trust, None)}
    for name, host in (("tunnelled", "other.example"), ("injected", "github.com")):
        for state, proxy in proxies.items():
            ways[f"{name}, {state}"] = lambda h=host, p=proxy: Client(target, h, trust, p)
    return ways


def _rotated(ways: dict, turn: int) -> list:
    """The ways in another order each round (no way always runs right after another)."""
    items = list(ways.items())
    turn %= len(items)
    return items[turn:] + items[:turn]


def _keep_alive(ways, requests: int) -> tuple[list[str], dict[str, float]]:
    """Per way, ``requests`` GETs on kept-alive connections, in ROUNDS alternating slices
    (drift on a shared machine falls on every way alike)."""
    samples: dict[str, list[float]] = {label: [] for label in ways}
    elapsed = dict.fromkeys(ways, 0.0)
    for turn in range(ROUNDS):
        for label, make in _rotated(ways, turn):
            client = make()
            start = time.perf_counter()
            for _ in range(max(1, requests // ROUNDS)):
                t0 = time.perf_counter()
                assert client.get("/small") == 200
                samples[label].append(time.perf_counter() - t0)
            elapsed[label] += time.perf_counter() - start
            client.close()
    rows = [common.row(f"keep-alive GET, {label}", samples[label], elapsed[label]) for label in ways]
    return rows, {label: common.percentiles(samples[label])["p50"] for label in ways}


def _new_connections(ways, count: int) -> tuple[list[str], dict[str, float]]:
    """Per way, ``count`` requests each on a new connection, in ROUNDS alternating slices."""
    samples: dict[str, list[float]] = {label: [] for label in ways}
    elapsed = dict.fromkeys(ways, 0.0)
    for turn in range(ROUNDS):
        for label, make in _rotated(ways, turn):
            start = time.perf_counter()
            for _ in range(max(1, count // ROUNDS)):
                t0 = time.perf_counter()
                client = make()
                assert client.get("/small") == 200
                client.close()
                samples[label].append(time.perf_counter() - t0)
            elapsed[label] += time.perf_counter() - start
    rows = [common.row(f"new connection, {label}", samples[label], elapsed[label]) for label in ways]
    return rows, {label: common.percentiles(samples[label])["p50"] for label in ways}


class Collector(threading.Thread):
    """What the proxy-scaler does with a proxy's egress records: read the batch every
    ``every`` seconds, acknowledging the one before."""

    def __init__(self, proxy, every: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.proxy, self.every = proxy, every
        self.stopped = threading.Event()
        self.records = self.reads = 0
        self.read_seconds = 0.0

    def run(self) -> None:
        acked = 0
        while not self.stopped.wait(self.every):
            t0 = time.perf_counter()
            batch = json.loads(harness.scrape_unix(self.proxy.metrics_socket, f"/egress?ack={acked}"))
            self.read_seconds += time.perf_counter() - t0
            self.reads += 1
            if batch["batch"] != acked:
                self.records += sum(r["connections"] for r in batch["records"])
            acked = batch["batch"]


def _bulk(ways, bulk_mib: int, pids: dict[str, int]) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """The ways in turn, ROUNDS times; MiB/s and the serving proxy's CPU seconds per GiB."""
    rates: dict[str, list[float]] = {label: [] for label in ways}
    cpu: dict[str, list[float]] = {label: [] for label in ways}
    for turn in range(ROUNDS):
        for label, make in _rotated(ways, turn):
            pid = next((p for state, p in pids.items() if label.endswith(f", {state}")), None)
            client = make()
            c0, t0 = (cpu_seconds(pid) if pid else 0.0), time.perf_counter()
            assert client.get(f"/bulk/{bulk_mib}") == 200
            rates[label].append(bulk_mib / (time.perf_counter() - t0))
            if pid:
                cpu[label].append((cpu_seconds(pid) - c0) / (bulk_mib / 1024))
            client.close()
    return rates, cpu


def _relay_cpu(mib: int, meters: tuple | None) -> float:
    """Process CPU seconds to push ``mib`` MiB through front.relay_in_threads on loopback
    (sender and reader threads included: the same for every variant)."""
    import asyncio

    async def run() -> float:
        listener = socket.create_server(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        pairs = []
        for _ in range(2):
            outer = socket.create_connection(("127.0.0.1", port))
            inner, _ = listener.accept()
            pairs.append((outer, inner))
        listener.close()
        (sender, a), (b, reader) = pairs

        def send() -> None:
            for _ in range(mib):
                sender.sendall(CHUNK)
            sender.shutdown(socket.SHUT_WR)

        def drain() -> None:
            buffer = bytearray(1 << 20)
            while reader.recv_into(buffer):
                pass

        threads = [threading.Thread(target=send), threading.Thread(target=drain)]
        c0 = time.process_time()
        for t in threads:
            t.start()
        relay = asyncio.ensure_future(front.relay_in_threads(a, b, meters))
        await asyncio.to_thread(threads[0].join)
        b.shutdown(socket.SHUT_WR)
        await asyncio.to_thread(threads[1].join)
        relay.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await relay
        used = time.process_time() - c0
        for sock in (sender, a, b, reader):
            sock.close()
        return used

    return asyncio.run(run())


def unit_costs(mib: int = 1024) -> None:
    """What metrics add where they are counted, measured in this process: a relay's
    splice calls per GiB (each one calls a Meter), a Meter call and one connection with
    one injected request, without a sink (metrics off) and with the Prometheus sink
    (metrics on); the relay's own CPU per GiB for scale."""
    calls = [0]

    def count(_n: int) -> None:
        calls[0] += 1

    relay = statistics.median(_relay_cpu(mib, None) / (mib / 1024) for _ in range(ROUNDS))
    _relay_cpu(mib, (count, count))
    per_gib = calls[0] / (mib / 1024)
    sink = metrics.Metrics()
    sink.rules(["bench"])
    print(f"\nmetrics' own cost, in process (relay of {mib} MiB on loopback):")
    print(f"  relay: {per_gib:.0f} splice calls per GiB; {relay:.3f} s/GiB of CPU (sender, reader included)")
    log = records.EgressLog(per_peer=10**9, pending_max=10**9)
    trackers = (
        ("metrics off", egress.Tracker()),
        ("metrics on", egress.Tracker([sink])),
        ("records on", egress.Tracker([sink, log])),
    )
    for label, tracker in trackers:
        conn = tracker.opened(None)
        meter = tracker.counter(conn, egress.Direction.DOWN)
        n = 1_000_000
        t0 = time.process_time()
        for _ in range(n):
            meter(1 << 20)  # worst case: every call also passes a step to the sinks
        per_call = (time.process_time() - t0) / n
        tracker.closed(conn)
        n = 100_000
        t0 = time.process_time()
        for _ in range(n):
            conn = tracker.opened(None)
            tracker.routed(conn, egress.Mode.INTERCEPT, "github.com", 443, "bench")
            tracker.requested(conn, egress.Outcome.INJECTED, "bench")
            tracker.closed(conn)
        per_conn = (time.process_time() - t0) / n
        if log.pending:
            t0 = time.process_time()
            batch = log.collect(0)
            encoded = json.dumps(batch.wire())
            per_record = (time.process_time() - t0) / len(batch.entries)
            print(f"  (a batch of {len(batch.entries)} records: {per_record * 1e6:.1f} us and "
                  f"{len(encoded) / len(batch.entries):.0f} bytes a record to hand over)")  # fmt: skip
            log.pending.clear()
        print(
            f"  {label:11}: {per_call * 1e6:5.2f} us per byte count "
            f"-> {per_call * per_gib * 1e3:6.3f} ms/GiB "
            f"({per_call * per_gib / relay:.2%} of the relay); one connection with one injected request "
            f"{per_conn * 1e6:5.1f} us"
        )


def main(requests: int, bulk_mib: int, baseline: str | None = None) -> None:
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
        # The same proxy three times: without metrics (no sink: connections are still
        # tracked), with them (the Prometheus sink, served on its unix socket, no records),
        # and with records too (the default), side by side; and with --baseline, an older
        # checkout's proxy (its sbx_proxy first on PYTHONPATH).
        states: dict[str, dict[str, str]] = {"metrics off": {}, "metrics on": {}, "records on": {}}
        if baseline:
            states = {"before": {"PYTHONPATH": str(Path(baseline).resolve() / "proxy")}} | states
        proxies = {
            state: harness.Proxy(
                Path(tmp) / f"proxy-{state.replace(' ', '-')}",
                config,
                pki.ca_cert,
                {n: "127.0.0.1" for n in harness.NAMES},
                env={"SBX_BENCH_TOKEN": TOKEN, **extra},
                metrics=state in ("metrics on", "records on"),
                extra=("--no-egress-records",) if state == "metrics on" else (),
            )
            for state, extra in states.items()
        }
        trust = [pki.ca_cert, *(p.ca_cert for p in proxies.values())]
        target = ("127.0.0.1", port)
        hop = BareHop(port)
        collector = Collector(proxies["records on"])
        collector.start()
        ways = _ways(target, trust, proxies)
        try:
            for make in ways.values():  # warm up each path once
                c = make()
                c.get("/small")
                c.close()
            rows, p50 = _keep_alive(ways, requests)
            new_rows, new_p50 = _new_connections(ways, max(30, requests // 5))
            rows += new_rows
            rates, cpu = _bulk(ways, bulk_mib, {s: p.proc.pid for s, p in proxies.items()})
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
            counted = proxies["metrics on"].metrics()
            scrape_t0 = time.perf_counter()
            text = harness.scrape_unix(proxies["metrics on"].metrics_socket)
            scrape_ms = (time.perf_counter() - scrape_t0) * 1000
        finally:
            collector.stopped.set()
            collector.join(5)
            hop.close()
            for proxy in proxies.values():
                proxy.close()
            upstream.close()

    print(f"\nCredential proxy benchmark (mitmproxy 11, {os.cpu_count()} cores)\n")
    for line in rows:
        print(line)
    print()
    base = p50["direct"]
    for label in ways:
        if label != "direct":
            added = p50[label] - base
            print(f"added latency p50, {label:24} {added:6.3f} ms  ({p50[label] / base:.2f}x direct)")
    print()
    for label, mib_s in throughput.items():
        spread = f"{min(rates[label]):.0f}-{max(rates[label]):.0f}"
        proxy_cpu = f"proxy CPU {statistics.median(cpu[label]):5.2f} s/GiB" if cpu.get(label) else ""
        print(
            f"bulk {bulk_mib} MiB, {label:24} {mib_s:8.1f} MiB/s (median of {ROUNDS}: {spread})  {proxy_cpu}"
        )
    print("\nmetrics and egress records, on vs off (same run):")
    for name in ("tunnelled", "injected"):
        pairs_to_compare = [("metrics on", "metrics off"), ("records on", "metrics on")]
        pairs_to_compare += [("records on", "before")] if baseline else []
        for a, b in pairs_to_compare:
            on, off = f"{name}, {a}", f"{name}, {b}"
            print(
                f"  {name:9} {a} / {b:11}  throughput {throughput[on] / throughput[off]:.3f}   "
                f"proxy CPU/GiB {statistics.median(cpu[on]) / statistics.median(cpu[off]):.3f}   "
                f"keep-alive p50 {p50[on] - p50[off]:+.3f} ms   "
                f"new connection p50 {new_p50[on] - new_p50[off]:+.3f} ms"
            )
    print(
        f"  egress records collected: {collector.records} connections in {collector.reads} reads, "
        f"{collector.read_seconds / max(1, collector.reads) * 1000:.2f} ms a read"
    )
    up = harness.sample(counted, "sbx_proxy_bytes_total", direction="up")
    down = harness.sample(counted, "sbx_proxy_bytes_total", direction="down")
    print(f"  counted by the proxy with metrics: {down / 2**30:.2f} GiB down, {up / 2**20:.1f} MiB up; "
          f"one scrape {scrape_ms:.1f} ms, {len(text)} bytes")  # fmt: skip
    ratio = throughput["tunnelled, metrics on"] / throughput["direct"]
    print(f"\ntunnelled / direct throughput: {ratio:.2f} (target >= 0.90)")
    print(f"bare hop / direct throughput:  {floor:.2f} (what one more hop costs on this machine)")
    print(f"tunnelled / bare hop:          {ratio / floor:.2f} (the proxy's own share of the gap)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--bulk-mib", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="alternating rounds per measurement")
    parser.add_argument(
        "--baseline",
        help="a checkout of an older tree (git worktree add /tmp/base REF): its proxy runs beside",
    )
    parser.add_argument("--only-unit-costs", action="store_true", help="only the in-process costs")
    args = parser.parse_args()
    ROUNDS = args.rounds
    if not args.only_unit_costs:
        main(args.requests, args.bulk_mib, args.baseline)
    unit_costs()

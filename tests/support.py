"""Test support: a real nats-server, services run in-process or as processes.

Nothing here fakes NATS: every fixture talks to a real ``nats-server -js``
started from the project's environment on an ephemeral port with a temp store.
Each test gets its own namespace, so subjects, streams and buckets never mix.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import nats
from nats.aio.client import Client

from sbx import natsd
from shared.contract import codec, commands, ids, subjects
from shared.infrastructure import bus, service
from shared.infrastructure.settings import bus as bus_settings
from shared.infrastructure.settings import service as service_config

ROOT = Path(__file__).resolve().parent.parent
API_KEY = "test-key-0123456789abcdef"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reset_peak_memory(pid: int | str = "self") -> None:
    """Start measuring a process's peak resident memory afresh (``clear_refs`` 5)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def peak_memory(pid: int | str = "self") -> int:
    """A process's peak resident memory in bytes since it started or was reset (VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmHWM for {pid}")


def new_namespace() -> str:
    return "t" + uuid.uuid4().hex[:12]


@dataclass
class NatsServer:
    store: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            natsd.command(self.store, "127.0.0.1", self.port),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), 0.2):
                return
            time.sleep(0.02)
        raise RuntimeError("nats-server did not start")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(10)


@dataclass
class NatsCluster:
    """A real 3-node JetStream cluster on loopback (three ``nats-server`` processes routed
    to each other, each with its own store), for the tests where HA matters."""

    root: Path
    size: int = 3
    ports: list[int] = field(default_factory=list)
    cluster_ports: list[int] = field(default_factory=list)
    procs: list[subprocess.Popen[bytes] | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.ports = [free_port() for _ in range(self.size)]
        self.cluster_ports = [free_port() for _ in range(self.size)]
        self.procs = [None] * self.size

    @property
    def url(self) -> str:
        return ",".join(f"nats://127.0.0.1:{p}" for p in self.ports)

    def name(self, node: int) -> str:
        return f"n{node}"

    def start(self, node: int | None = None) -> None:
        for n in range(self.size) if node is None else [node]:
            routes = ",".join(f"nats://127.0.0.1:{p}" for i, p in enumerate(self.cluster_ports) if i != n)
            self.procs[n] = subprocess.Popen(
                [
                    natsd.binary(), "-js", "-sd", str(self.root / self.name(n)), "-a", "127.0.0.1",
                    "-p", str(self.ports[n]), "--server_name", self.name(n), "--cluster_name", "test",
                    "--cluster", f"nats://127.0.0.1:{self.cluster_ports[n]}", "--routes", routes,
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )  # fmt: skip
        for n in range(self.size) if node is None else [node]:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                address = ("127.0.0.1", self.ports[n])
                with contextlib.suppress(OSError), socket.create_connection(address, 0.2):
                    break
                time.sleep(0.02)
            else:
                raise RuntimeError(f"nats-server {self.name(n)} did not start")

    def kill(self, node: int) -> None:
        proc = self.procs[node]
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)
        self.procs[node] = None

    def stop(self) -> None:
        for n, proc in enumerate(self.procs):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(10)
            self.procs[n] = None

    async def ready(self, nc: Client, timeout: float = 30.0) -> None:
        """Until the cluster has elected a JetStream meta leader (account info answers)."""
        js = nc.jetstream()
        deadline = time.monotonic() + timeout
        while True:
            try:
                await js.account_info()
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)


def service_settings(
    server_url: str, namespace: str, name: str, **overrides: Any
) -> service_config.ServiceSettings:
    base = service_config.ServiceSettings(
        service=name,
        instance=f"{name}-{ids.new_id()[:8]}",
        bus=bus_settings.BusSettings(nats_url=server_url, namespace=namespace, request_timeout=5.0),
        health_interval=0.2,
        drain_timeout=2.0,
    )
    return replace(base, **overrides)


@dataclass
class Running:
    """A service running in this process's event loop."""

    settings: service_config.ServiceSettings
    task: asyncio.Task[int]
    stop_event: asyncio.Event

    async def stop(self) -> int:
        self.stop_event.set()
        done, _ = await asyncio.wait([self.task], timeout=15)
        if not done:
            import sys

            for t in asyncio.all_tasks():
                t.print_stack(file=sys.stderr)
            raise TimeoutError(f"{self.settings.service} did not stop")
        return self.task.result()


async def start_in_process(
    server_url: str, namespace: str, name: str, setup: service.Setup, **overrides: Any
) -> Running:
    s = service_settings(server_url, namespace, name, **overrides)
    stop = asyncio.Event()
    task = asyncio.create_task(service.run(s, setup, stop=stop))
    await wait_for_health(server_url, namespace, name, s.instance, task)
    return Running(s, task, stop)


async def wait_for_health(
    server_url: str,
    namespace: str,
    service_name: str,
    instance: str | None = None,
    task: asyncio.Future[Any] | None = None,
    *,
    key: str | None = None,
    timeout: float = 20.0,
) -> dict[str, str]:
    """Wait until an instance reports ``ok``; return its health details."""
    from shared.infrastructure import health

    topology = subjects.Topology(namespace)
    nc = await nats.connect(server_url)
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if task is not None and task.done():
                task.result()
                raise RuntimeError(f"{service_name} ended during start-up")
            with contextlib.suppress(Exception):
                for report in await health.read_all(nc.jetstream(), topology.health_bucket):
                    if (
                        report.service == service_name
                        and report.status == "ok"
                        and (instance is None or report.instance == instance)
                        and (key is None or key in report.details)
                    ):
                        return report.details
            await asyncio.sleep(0.05)
        raise TimeoutError(f"{service_name} did not become healthy")
    finally:
        await nc.close()


async def connect(server_url: str, namespace: str) -> tuple[Client, subjects.Topology]:
    topology = subjects.Topology(namespace)
    nc = await bus.connect(bus_settings.BusSettings(nats_url=server_url, namespace=namespace), "test")
    await bus.ensure_topology(nc.jetstream(), topology)
    return nc, topology


async def send(
    nc: Client, topology: subjects.Topology, command: commands.Command, timeout: float = 5.0
) -> commands.CommandReply:
    msg = await nc.request(topology.session_commands, codec.encode(command), timeout=timeout)
    return codec.decode_reply(msg.data)


async def stream_events(nc: Client, topology: subjects.Topology, kind: str | None = None) -> list[Any]:
    from shared.infrastructure import eventstore

    store = eventstore.EventStore(nc.jetstream(), topology)
    return [s async for s in store.read(topology.events_of_kind(kind) if kind else None)]


async def eventually(check: Callable[[], Any], timeout: float = 10.0, interval: float = 0.05) -> Any:
    """Poll an async or sync check until it returns a truthy value (not a timing assertion:
    the timeout only bounds a hang)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if asyncio.iscoroutine(last):
            last = await last
        if last:
            return last
        await asyncio.sleep(interval)
    raise AssertionError(f"condition not met within {timeout}s (last value: {last!r})")


def service_env(server_url: str, namespace: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SBX_", "NATS_", "SANDBOX_"))}
    env.update(
        NATS_URL=server_url,
        SBX_NAMESPACE=namespace,
        SBX_HEALTH_INTERVAL="0.2",
        SBX_DRAIN_TIMEOUT="2",
        SBX_LOG_LEVEL="info",
        PYTHONUNBUFFERED="1",
        **extra,
    )
    return env


def spawn_service(module: str, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", f"services.{module}"],
        cwd=ROOT,
        env=env,
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
    )


@contextlib.asynccontextmanager
async def http_front(
    target: str, *, headers: dict[str, str] | None = None, delay: Callable[[bytes], float] | None = None
) -> AsyncIterator[str]:
    """A loopback HTTP forwarder to ``target`` (``host:port``); its URL. It adds ``headers``
    to every request (replacing any of the same name), waits ``delay(request line)`` seconds
    before passing a request on (a slow server), and passes everything else, ``Host`` and
    ``Origin`` included, as sent. One request per connection (``Connection: close``); plain
    HTTP only (a TLS hello is answered by closing the connection, as a plain server would fail it)."""
    host, port = target.rsplit(":", 1)
    added = [f"{name}: {value}".encode() for name, value in (headers or {}).items()]
    added.append(b"Connection: close")
    replaced = {name.lower().encode() for name in headers or {}} | {b"connection", b"keep-alive"}

    async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            start = await reader.readexactly(1)
            if not start.isalpha():
                return  # not HTTP (a TLS hello: an HTTPS client is told at once this is no TLS)
            head = start + await reader.readuntil(b"\r\n\r\n")
            first, *fields = head[:-4].split(b"\r\n")
            if delay is not None:
                await asyncio.sleep(delay(first))
            kept = [f for f in fields if f.split(b":", 1)[0].strip().lower() not in replaced]
            up_reader, up_writer = await asyncio.open_connection(host, int(port))
            up_writer.write(b"\r\n".join([first, *kept, *added]) + b"\r\n\r\n")
            upload = asyncio.ensure_future(pump(reader, up_writer))
            try:
                await pump(up_reader, writer)  # the answer, until the server closes
            finally:
                upload.cancel()
                up_writer.close()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        await server.wait_closed()

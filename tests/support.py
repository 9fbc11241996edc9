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
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import nats
from nats.aio.client import Client

from sbx import natsd
from shared.contract import codec, commands, ids, subjects
from shared.infrastructure import bus, service, settings

ROOT = Path(__file__).resolve().parent.parent
API_KEY = "test-key-0123456789abcdef"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def service_settings(
    server_url: str, namespace: str, name: str, **overrides: Any
) -> settings.ServiceSettings:
    base = settings.ServiceSettings(
        service=name,
        instance=f"{name}-{ids.new_id()[:8]}",
        bus=settings.BusSettings(nats_url=server_url, namespace=namespace, request_timeout=5.0),
        health_interval=0.2,
        drain_timeout=2.0,
    )
    return replace(base, **overrides)


@dataclass
class Running:
    """A service running in this process's event loop."""

    settings: settings.ServiceSettings
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
    nc = await bus.connect(settings.BusSettings(nats_url=server_url, namespace=namespace), "test")
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

"""The local proxy fleet: ``sbx-proxy`` processes on the sandbox network's proxy address.

Each proxy listens on ``10.213.255.254:<port>`` (ports 3129-3191), shares the state
directory's CA and config, and runs detached in its own session: like sandboxes, it
outlives the service that started it and is found again through
``<state>/proxies/<port>.json`` (pid and start time, so a reused pid is not mistaken
for it). Which proxy a sandbox uses is an entry in the host's nftables map (see
``network.py``): routing is per sandbox address, so moving a sandbox to another proxy
changes nothing inside it. Each proxy serves its Prometheus metrics on the unix socket
``<state>/proxies/<port>.metrics.sock`` only (never on a port: ``sbx_proxy/metrics.py``
says why); the proxy-scaler re-exports them.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import signal
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from sbx_api import errors
from shared.infrastructure import processenv, processes
from shared.runtime.local import network
from shared.runtime.local.runtime import LocalRuntime

START_TIMEOUT = 30.0
PORTS_LOCK = Path("/run/sbx-proxy-ports.lock")
"""Held from choosing a free port until the proxy listens on it, by every stack on the
host (proxies of all stacks share the proxy address): without it two stacks starting
proxies at once could pick the same port, and one would take the other's proxy,
answering on that port, for its own (it then exits: its port is taken)."""


@dataclass(frozen=True)
class Record:
    proxy_id: str
    port: int
    pid: int
    starttime: int

    @property
    def endpoint(self) -> str:
        return f"{network.PROXY_ADDRESS}:{self.port}"


async def ensure_ca(confdir: Path, binary: str) -> None:
    """Create the proxies' CA in ``confdir`` once (``sbx-proxy --init-ca``)."""
    if (confdir / "mitmproxy-ca-cert.pem").exists():
        return
    if not Path(binary).exists():
        raise errors.ConfigError(f"{binary} is missing: run scripts/setup (it installs proxy/.venv)")
    proc = await asyncio.create_subprocess_exec(
        binary, "--init-ca", "--confdir", str(confdir),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=processenv.system(os.environ),
    )  # fmt: skip
    out, _ = await proc.communicate()
    if proc.returncode != 0:
        raise errors.InfrastructureError(f"cannot create the proxy CA: {out.decode(errors='replace')[-500:]}")


class LocalProxies:
    pinned = True
    """Each sandbox is routed to one proxy (the nftables map); the scaler assigns it."""

    def __init__(self, state_dir: Path, runtime: LocalRuntime, *, binary: str, config: str = "") -> None:
        self.state_dir = state_dir
        self.runtime = runtime
        self.binary = binary
        self.config = config
        self.dir = state_dir / "proxies"
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.confdir = state_dir / "proxy" / "ca"
        self._env: dict[str, str] | None = None

    async def _proxy_env(self) -> dict[str, str]:
        """A proxy's whole environment: the system variables and the ones its config takes
        secrets from (``sbx-proxy --check --env-names``), from this process's."""
        if self._env is None:
            names: list[str] = []
            if self.config:
                proc = await asyncio.create_subprocess_exec(
                    self.binary, "--check", "--env-names", "--config", self.config,
                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                )  # fmt: skip
                out, err = await proc.communicate()
                if proc.returncode != 0:
                    raise errors.ConfigError(err.decode(errors="replace").strip()[-800:])
                names = json.loads(out.decode().strip().splitlines()[-1])
            self._env = processenv.system(os.environ) | {n: os.environ[n] for n in names if n in os.environ}
        return self._env

    # ---- records -----------------------------------------------------------------

    def records(self) -> list[Record]:
        found = []
        for path in sorted(self.dir.glob("*.json")):
            with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
                found.append(Record(**json.loads(path.read_text())))
        return found

    def metrics_socket(self, record: Record) -> Path:
        """Where the proxy serves ``GET /metrics`` (a unix socket, mode 0600)."""
        return self.dir / f"{record.port}.metrics.sock"

    def alive(self, record: Record) -> bool:
        return processes.start_time(record.pid) == record.starttime

    def _free_port(self) -> int:
        taken = {r.port for r in self.records()}
        for port in range(network.PROXY_PORTS[0], network.PROXY_PORTS[1] + 1):
            if port in taken:
                continue
            with socket.socket() as probe:
                try:
                    probe.bind((network.PROXY_ADDRESS, port))
                except OSError:
                    continue  # another stack's proxy on this host
            return port
        raise errors.LimitExceeded(f"no free proxy port in {network.PROXY_PORTS}")

    # ---- lifecycle ---------------------------------------------------------------

    async def ensure_ca(self) -> None:
        """The fleet's CA exists before any proxy runs: sandboxes trust it from their start."""
        await ensure_ca(self.confdir, self.binary)

    async def start(self, proxy_id: str) -> Record:
        """A new proxy, listening when this returns."""
        if not Path(self.binary).exists():
            raise errors.ConfigError(f"{self.binary} is missing: run scripts/setup (it installs proxy/.venv)")
        await self.runtime.network.ensure_host()  # the proxy address must exist before binding it
        env = await self._proxy_env()
        async with _ports_locked(self.dir):
            return await self._start(proxy_id, env)

    async def _start(self, proxy_id: str, env: dict[str, str]) -> Record:
        port = self._free_port()
        log = os.open(self.dir / f"{port}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            proc = await asyncio.create_subprocess_exec(
                self.binary,
                "--listen-host", network.PROXY_ADDRESS,
                "--listen-port", str(port),
                "--confdir", str(self.confdir),
                "--config", self.config,
                "--metrics-socket", str(self.dir / f"{port}.metrics.sock"),
                stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                start_new_session=True,  # its own session: it outlives the scaler
            )  # fmt: skip
        finally:
            os.close(log)
        # Recorded at once, so a crash or cancellation from here on never leaves an
        # unknown process (the next round stops records that have no proxy.started).
        starttime = processes.start_time(proc.pid)
        record = Record(proxy_id=proxy_id, port=port, pid=proc.pid, starttime=starttime or 0)
        (self.dir / f"{port}.json").write_text(json.dumps(record.__dict__))
        try:
            await self._until_listening(proc, port)
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            self.forget(record)
            raise
        return record

    async def _until_listening(self, proc: asyncio.subprocess.Process, port: int) -> None:
        """Until something answers on the port (ours: the ports lock is held, so no other
        proxy took it since it was found free), or the process ended."""
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if proc.returncode is not None:
                tail = (self.dir / f"{port}.log").read_text(errors="replace")[-800:]
                raise errors.InfrastructureError(f"the proxy on port {port} exited at start: {tail.strip()}")
            try:
                _, writer = await asyncio.open_connection(network.PROXY_ADDRESS, port)
                writer.close()
                return
            except OSError:
                await asyncio.sleep(0.05)
        raise errors.InfrastructureError(f"the proxy on port {port} did not listen within {START_TIMEOUT:g}s")

    async def stop(self, record: Record) -> None:
        if self.alive(record):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(record.pid, signal.SIGTERM)
            for _ in range(100):
                if not self.alive(record):
                    break
                await asyncio.sleep(0.05)
            if self.alive(record):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(record.pid, signal.SIGKILL)
        self.forget(record)

    def forget(self, record: Record) -> None:
        (self.dir / f"{record.port}.json").unlink(missing_ok=True)
        self.metrics_socket(record).unlink(missing_ok=True)

    async def stop_all(self) -> None:
        for record in self.records():
            await self.stop(record)

    # ---- routing -------------------------------------------------------------------

    async def ensure_network(self) -> None:
        """Re-install the host's firewall and routing table if something removed them."""
        await self.runtime.network.ensure_host()

    async def route_many(
        self, wanted: dict[str, Record], current: dict[int, int] | None = None
    ) -> tuple[set[str], bool]:
        """Route several sandboxes at once (one nftables transaction): the ids routed (a
        sandbox without a proxy link, e.g. stopped meanwhile, is left out), and whether
        the map had to be listed again. ``current``: the routing map as last listed, if
        the caller has it (updated with what was routed, or replaced by a new listing)."""
        links = {sid: self.runtime.egress_link(sid) for sid in wanted}
        routable = {sid: link for sid, link in links.items() if link is not None}
        relisted = await self.runtime.network.route_many(
            {link: wanted[sid].port for sid, link in routable.items()}, current
        )
        return set(routable), relisted

    def peer_address(self, sandbox_id: str) -> str | None:
        """The address the sandbox's connections come from, as its proxy sees them."""
        return self.runtime.egress_address(sandbox_id)

    def routed_port(self, sandbox_id: str, routes: dict[int, int]) -> int | None:
        link = self.runtime.egress_link(sandbox_id)
        return None if link is None else routes.get(link)

    async def routes(self) -> dict[int, int]:
        return await self.runtime.network.routes()

    def routes_generation(self) -> int | None:
        """A number that changes whenever the host's nftables ruleset does (None: unknown)."""
        return self.runtime.network.generation()

    async def prune_routes(self, routes: dict[int, int] | None = None) -> int:
        return await self.runtime.network.prune(routes)


@contextlib.asynccontextmanager
async def _ports_locked(fallback_dir: Path) -> AsyncIterator[None]:
    """:data:`PORTS_LOCK` held (an exclusive ``flock``, polled so that a cancelled start
    never leaves it taken); in ``fallback_dir`` where /run is not writable."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(PORTS_LOCK, flags, 0o600)
    except OSError:
        fd = os.open(fallback_dir / "ports.lock", flags, 0o600)
    try:
        deadline = time.monotonic() + START_TIMEOUT * 2
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise errors.InfrastructureError(
                        f"another proxy start held {PORTS_LOCK} for {START_TIMEOUT * 2:g}s"
                    ) from None
                await asyncio.sleep(0.02)
        yield
    finally:
        os.close(fd)  # (releases the lock)

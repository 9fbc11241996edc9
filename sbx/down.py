"""Stopping what a stack runs on this machine: the last step of ``sbx up``'s stop, the
first step of its start after a crash, and ``sbx down``.

Sessions' sandboxes are stopped with their files kept (a session's next call, after the
next ``sbx up``, resumes its sandbox); every other sandbox (idle pool ones, ones no live
record claims) is deleted; the proxies are stopped; the host keeps none of the stack's
processes, mounts, cgroups, veths or routes. It runs while no service does, so nothing
races it. Each change is recorded with the rules the services use (``shared.domain``)
when the stack's NATS answers; without NATS, sandboxes are only stopped, none deleted,
and the next ``sbx up`` records what it finds.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
import subprocess
from collections.abc import AsyncIterator, Mapping
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

import structlog
from nats.aio.client import Client
from nats.js.errors import NotFoundError

from sbx import natsd, observe, stack, supervisor
from sbx_api import errors
from sbx_client import terminal
from shared.contract import commands, events, ids, states, subjects
from shared.domain import projections
from shared.domain import proxy as proxy_rules
from shared.domain import sandbox as sandbox_rules
from shared.domain import session as session_rules
from shared.infrastructure import aggregates, eventstore, projector
from shared.infrastructure.settings import bus
from shared.infrastructure.settings import runtime as runtime_settings
from shared.runtime import api, backends

log = structlog.get_logger(__name__)

SERVICE = "sbx"
REASON = "shutdown"
"""The reason recorded on everything a stack's stop stops."""
CONCURRENCY = 8
"""Sandboxes stopped at once (each is a cgroup kill and two unmounts)."""


@dataclass
class Released:
    stopped: int = 0
    """Sessions' sandboxes stopped, files kept."""
    deleted: int = 0
    proxies: int = 0
    recorded: bool = True
    """False when NATS did not answer: nothing was recorded, nothing deleted (unless purged)."""
    purged: bool = False

    def summary(self) -> str:
        text = (
            f"{self.stopped} session sandbox(es) stopped (files kept), {self.deleted} deleted, "
            f"{self.proxies} proxy(ies) stopped"
        )
        if not self.recorded and not self.purged:
            text += " (NATS did not answer: nothing recorded; the next `sbx up` does)"
        return text


class _Records:
    """The stack's sandboxes, sessions and proxies, changed as the services would."""

    def __init__(
        self,
        sandboxes: projector.ProjectionStore[states.SandboxState],
        sessions: projector.ProjectionStore[states.SessionState],
        proxies: projector.ProjectionStore[states.ProxyState],
    ) -> None:
        self.sandboxes = sandboxes
        self.sessions = sessions
        self.proxies = proxies
        self.instance = f"sbx-{os.getpid()}"

    @classmethod
    async def open(cls, nc: Client, namespace: str) -> _Records:
        js = nc.jetstream()
        store = eventstore.EventStore(js, subjects.Topology(namespace))
        return cls(
            await projector.ProjectionStore.open(js, projections.SANDBOXES, store),
            await projector.ProjectionStore.open(js, projections.SESSIONS, store),
            await projector.ProjectionStore.open(js, projections.PROXIES, store),
        )

    def meta(self, session_id: str | None = None) -> events.Meta:
        return events.Meta(
            event_id=ids.new_id(),
            time=datetime.now(UTC),
            service=SERVICE,
            instance=self.instance,
            session_id=session_id,
        )

    async def stopped(self, sandbox_id: str) -> None:
        """The sandbox stopped, and its session with it (if the session still has it)."""
        outcome = await aggregates.transact(
            self.sandboxes,
            sandbox_id,
            lambda s: sandbox_rules.decide_stopped(s, sandbox_id, self.meta, reason=REASON),
        )
        state = outcome.state
        if state is None or state.session_id is None:
            return
        session_id = state.session_id
        session = await self.sessions.get(session_id)
        if session is None or session.sandbox_id != sandbox_id or session.status != "active":
            return
        command = commands.StopSession(
            session_id=session_id, reason=REASON, command_id=ids.new_id(), actor=commands.Actor(via="cli")
        )
        await aggregates.transact(
            self.sessions, session_id, lambda s: session_rules.decide(s, command, self.meta(session_id))
        )

    async def deleted(self, sandbox_id: str) -> None:
        """Stopped (for the audit: why), then deleted."""
        for decide in (
            lambda s: sandbox_rules.decide_stopped(s, sandbox_id, self.meta, reason=REASON),
            lambda s: sandbox_rules.decide_deleted(s, sandbox_id, self.meta),
        ):
            await aggregates.transact(self.sandboxes, sandbox_id, decide)

    async def proxies_stopped(self, backend: str) -> None:
        for proxy in (await self.proxies.all()).values():
            if proxy.backend != backend:
                continue
            event = events.ProxyStopped(meta=self.meta(), proxy_id=proxy.proxy_id, reason=REASON)
            await aggregates.transact(
                self.proxies, proxy.proxy_id, functools.partial(_decide_proxy, event=event)
            )


def _decide_proxy(state: states.ProxyState | None, event: events.Event) -> list[events.Event]:
    return proxy_rules.decide(state, event)


async def release(
    state_dir: Path, nc: Client | None, namespace: str, backend: str = "local", *, purge: bool = False
) -> Released:
    """Stop the sandboxes and proxies of ``state_dir`` (see the module's docstring).
    ``nc``: the stack's NATS, or None when it does not answer. ``purge``: delete every
    sandbox, sessions' too (their sessions get fresh ones on their next call)."""
    runtime = backends.local_runtime(backend, state_dir)
    if runtime is None or not await asyncio.to_thread(state_dir.exists):
        return Released()
    listed = await runtime.list()
    records = None
    if nc is not None:
        try:
            records = await _Records.open(nc, namespace)
        except NotFoundError:  # no service ever made the buckets: nothing to record against
            nc = None
    released = Released(recorded=nc is not None, purged=purge)
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(info: api.SandboxInfo) -> None:
        async with gate:
            sandbox_id = info.sandbox_id
            record = await records.sandboxes.get(sandbox_id) if records else None
            keep = not purge and (records is None or sandbox_rules.at_stack_stop(record) == "stop")
            if keep:
                if info.status in ("running", "paused"):
                    await runtime.stop(sandbox_id)
                if records is not None:
                    await records.stopped(sandbox_id)
                released.stopped += 1
            else:
                await runtime.delete(sandbox_id)
                if records is not None:
                    await records.deleted(sandbox_id)
                released.deleted += 1

    try:
        await asyncio.gather(*(one(info) for info in listed))
        released.proxies = await backends.release_host(backend, state_dir)
        if records is not None:
            await records.proxies_stopped(backend)
    finally:
        await runtime.close()
    return released


# ---- `sbx down` --------------------------------------------------------------------

STOP_WAIT = 180.0
"""How long ``sbx down`` waits for a running ``sbx up`` to finish its stop."""


async def _wait_for_release_of(state_dir: Path, pid: int) -> None:
    deadline = asyncio.get_running_loop().time() + STOP_WAIT
    while stack.lock_holder(state_dir) is not None:
        if asyncio.get_running_loop().time() > deadline:
            raise errors.Unavailable(f"`sbx up` (pid {pid}) did not stop within {STOP_WAIT:.0f}s")
        await asyncio.sleep(0.1)


@contextlib.asynccontextmanager
async def _stack_nats(state_dir: Path, env: Mapping[str, str]) -> AsyncIterator[tuple[Client | None, str]]:
    """The stack's NATS while ``sbx down`` works: ``NATS_URL``'s, else the embedded
    server's store started on a free loopback port for the while (None if neither
    answers or there is none)."""
    info = stack.StackInfo.read(state_dir)
    base = bus.BusSettings.from_env(env)
    namespace = info.namespace if info else base.namespace
    server: subprocess.Popen[bytes] | None = None
    nc: Client | None = None
    try:
        if env.get("NATS_URL"):
            nc = await _connect(base, None)
        elif await asyncio.to_thread((state_dir / "nats").is_dir):
            token = stack.nats_token(state_dir)
            server, port = await asyncio.to_thread(_spawn_nats, state_dir, token)
            url = f"nats://127.0.0.1:{port}"
            nc = await _connect(bus.BusSettings(nats_url=url, namespace=namespace, nats_token=token), server)
        yield nc, namespace
    finally:
        if nc is not None:
            await nc.close()
        if server is not None:
            server.terminate()
            await asyncio.to_thread(server.wait)


async def release_via(state: Path, bus_settings: bus.BusSettings, backend: str, *, who: str) -> Released:
    """:func:`release`, recorded through the NATS of ``bus_settings`` if it answers."""
    nc = await _connect(bus_settings, None, who)
    try:
        return await release(state, nc, bus_settings.namespace, backend)
    finally:
        if nc is not None:
            await nc.close()


async def _connect(
    bus_settings: bus.BusSettings, server: subprocess.Popen[bytes] | None, who: str = "sbx-down"
) -> Client | None:
    """Connected, or None if it does not answer (within 10 s of ``server`` starting)."""
    for _ in range(100 if server is not None else 1):
        try:
            return await observe.connect_bus(bus_settings, who, wait=3 if server is None else 1)
        except errors.Unavailable:
            if server is not None and server.poll() is not None:
                return None
            await asyncio.sleep(0.1)
    return None


def _spawn_nats(state_dir: Path, token: str) -> tuple[subprocess.Popen[bytes], int]:
    """The embedded server on its store, on a free loopback port (its log appended to)."""
    port = stack.free_port()
    config = natsd.write_config(state_dir, "127.0.0.1", port, token)
    with open(state_dir / "nats.log", "ab") as log:
        server = subprocess.Popen(
            natsd.command_with_config(config),
            stdout=log,
            stderr=log,
            stdin=subprocess.DEVNULL,
            preexec_fn=supervisor.die_with_parent,  # not left running if `sbx down` is killed
        )
    return server, port


async def run(state_dir: Path, env: Mapping[str, str], *, purge: bool = False, as_json: bool = False) -> int:
    """``sbx down``: stop the stack of ``state_dir`` — the running ``sbx up`` (told to stop,
    as Ctrl-C does), or what a stack that crashed left behind; ``purge``: then delete every
    sandbox and remove the state dir. Notes go to stderr; ``as_json``: the report to stdout."""
    report = {"state_dir": str(state_dir), "up_pid": None, **asdict(Released()), "removed": False}
    if not await asyncio.to_thread(state_dir.is_dir):
        supervisor.say(f"nothing to stop: {state_dir}/ does not exist")
        return _report(report, as_json)
    if purge:
        await asyncio.to_thread(_check_removable, state_dir)
    backend = runtime_settings.RuntimeSettings.from_env(env).backend
    holder = stack.lock_holder(state_dir)
    if holder:
        report["up_pid"] = holder
        supervisor.say(f"stopping `sbx up` (pid {holder})...")
        with contextlib.suppress(ProcessLookupError):
            os.kill(holder, signal.SIGTERM)
        await _wait_for_release_of(state_dir, holder)
    lock = stack.lock(state_dir, role="down")  # no `sbx up` starts while this runs
    doomed: Path | None = None
    try:
        async with _stack_nats(state_dir, env) as (nc, namespace):
            released = await release(state_dir, nc, namespace, backend, purge=purge)
        report.update(asdict(released))
        if not holder or released.stopped or released.deleted or released.proxies:
            supervisor.say(released.summary())
        stack.StackInfo.path(state_dir).unlink(missing_ok=True)
        # Still under the lock: moved aside, so an `sbx up` starting now makes a new one.
        if purge:
            doomed = state_dir.parent / f".{state_dir.name}.removing.{os.getpid()}"
            await asyncio.to_thread(state_dir.rename, doomed)
    finally:
        lock.close()
    if doomed is not None:
        await backends.remove_state(backend, doomed)
        supervisor.say(f"removed {state_dir}/")
        report["removed"] = True
    return _report(report, as_json)


def _report(report: dict[str, object], as_json: bool) -> int:
    if as_json:
        print(terminal.json_text(report, indent=2))
    return 0


STATE_FILES = ("api-key", "nats-token", "nats", "sandboxes", "stack.json")


def _check_removable(state_dir: Path) -> None:
    """``--purge`` removes only what is a state dir of sbx: not a symlink, not a mount
    point, holding some of sbx's own files."""
    if state_dir.is_symlink():
        raise errors.ConfigError(f"{state_dir} is a symlink: not removed (pass the directory itself)")
    if os.path.ismount(state_dir):
        raise errors.ConfigError(f"{state_dir} is a mount point: not removed (remove its contents yourself)")
    if not any((state_dir / name).exists() for name in STATE_FILES):
        raise errors.ConfigError(
            f"{state_dir} does not look like a state dir of sbx "
            f"(none of {', '.join(STATE_FILES)}): not removed"
        )

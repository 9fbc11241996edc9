"""Shell helpers (relays): how the executor reaches each session's bash.

Starting a command from the host costs a fork of the executor, an entry into seven
namespaces and two shells (~5-8 ms). Instead, an executor keeps one long-lived
helper per sandbox it serves (the relay of :mod:`services.executor.bashsession`, started
through the runtime's ordinary exec with stdin kept open), which passes each call to
the session's bash in the sandbox. Nothing about the session lives in the helper: the
state is in that bash, which the sandbox owns, calls of one session are serialized by a
lock in the sandbox, so any executor can serve any call, and a helper that dies loses
nothing.

The helper's answers come from inside the sandbox and are treated as untrusted: a
malformed answer retires the helper, and everything it can say affects only the
session that owns the sandbox. Its output is held here only up to :data:`BUFFER_MAX`:
during a call the helper then waits for the call to take it; output nobody asked for
(outside a call, or after the helper is retired) retires and ends it, and is dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

import structlog

from sbx_api import errors
from services.executor import bashsession, output, scripts
from shared.contract import ids
from shared.infrastructure import bounded
from shared.runtime import api

log = structlog.get_logger(__name__)

IDLE_CLOSE = 60.0
"""A helper not used for this long is closed (the sandbox keeps no extra process)."""
MAX_SERVERS = 256
"""Most helpers one executor holds; the least recently used is closed beyond that."""
PINNED_FOR = 1800.0
"""A pool sandbox's helper is kept this long at most without a call (then the idle rule
applies): with several executors, the session's calls may all go to another one."""
KILL_GRACE = 10.0
"""How long to wait for a killed command's answer before retiring the helper."""
_LINE_MAX = 200
BUFFER_MAX = 1024 * 1024
"""Most of a helper's output held here before it waits for a call to take it."""
_STARTED = re.compile(rb"([0-9a-f]{32}) started ([0-9]{1,9} [0-9]{1,9} [0-9]{1,15})")
_EXITED = re.compile(rb"([0-9a-f]{32}) exited ([0-9]{1,3})\n")


class ServerGone(Exception):
    """The helper stopped answering; ``started`` says whether the command may have run."""

    def __init__(self, started: bool) -> None:
        super().__init__("the shell server is gone")
        self.started = started


@dataclass(frozen=True)
class Result:
    exit_code: int
    timed_out: bool
    duration: float


class ShellServer:
    """One helper process in one sandbox, used by one call at a time."""

    def __init__(self, runtime: api.Runtime, sandbox_id: str, process: api.Exec) -> None:
        self.runtime = runtime
        self.sandbox_id = sandbox_id
        self.process = process
        self.lock = asyncio.Lock()
        self.used = time.monotonic()
        self.broken = False
        self.pinned = False
        """Started for a pool sandbox before any session has it: kept, however long idle,
        until its first call."""
        self._buffer = bytearray()
        self._more = asyncio.Event()
        self._taken = asyncio.Event()
        self._dropping = False
        self._eof = False
        self._pump_task = asyncio.create_task(self._pump())
        self._tasks: set[asyncio.Task[None]] = set()
        self._ended = False

    @property
    def alive(self) -> bool:
        return not (self.broken or self._eof)

    async def _pump(self) -> None:
        try:
            async for stream, data in self.process.chunks():
                if stream != "stdout" or self._dropping:
                    continue  # a retired helper's output is dropped until it ends
                self._buffer += data
                self._more.set()
                while len(self._buffer) > BUFFER_MAX and not self._dropping:
                    if not self.lock.locked():
                        self.retire("it wrote output nobody asked for")
                        break
                    self._taken.clear()
                    await self._taken.wait()  # until the call takes some (or retires it)
        finally:
            self._eof = True
            self._more.set()

    def _took(self, count: int) -> None:
        """A call consumed ``count`` bytes of the buffer's start: room for the pump."""
        del self._buffer[:count]
        self._taken.set()

    async def _wait_for_data(self, deadline: float) -> None:
        self._more.clear()
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        async with asyncio.timeout(remaining):
            await self._more.wait()

    async def _line(self, deadline: float) -> bytes | None:
        """The next line of the helper's answer (None at end of output)."""
        while True:
            end = self._buffer.find(b"\n")
            if end >= 0:
                line = bytes(self._buffer[:end])
                self._took(end + 1)
                return line
            if self._eof or self._dropping:
                return None
            if len(self._buffer) > _LINE_MAX:
                self.retire("answer line too long")
                return None
            await self._wait_for_data(deadline)

    async def hello(self) -> bool:
        """True once the helper says it runs; False if this sandbox cannot run one."""
        try:
            line = await self._line(time.monotonic() + scripts.QUICK)
        except TimeoutError:
            line = None
        if line is None or line + b"\n" != bashsession.HELLO:
            self.retire("no greeting")
            return False
        return True

    async def _output(self, nonce: bytes, capture: output.Capture, deadline: float) -> int | None:
        """Feed the command's output to ``capture`` up to the end marker; its exit status."""
        marker = nonce + b" exited "
        while True:
            found = self._buffer.find(marker)
            if found >= 0:
                match = _EXITED.match(self._buffer, found)
                if match is None:
                    if len(self._buffer) - found > len(marker) + 5:
                        self.retire("malformed end marker")
                        return None
                else:
                    status, rest = int(match.group(2)), len(self._buffer) > match.end()
                    capture.add(bytes(self._buffer[:found]))
                    self._took(len(self._buffer))  # (invalidates ``match``, which views the buffer)
                    if rest:
                        self.retire("data after the end marker")
                    return status
            else:
                keep = len(marker) + 4  # a marker may be split across reads
                if len(self._buffer) > keep:
                    capture.add(bytes(self._buffer[:-keep]))
                    self._took(len(self._buffer) - keep)
            if self._eof or self._dropping:
                return None
            await self._wait_for_data(deadline)

    async def run(self, command: str, capture: output.Capture, timeout: float) -> Result:
        async with self.lock:
            self.pinned = False
            self.used = started_at = time.monotonic()
            deadline = started_at + timeout
            nonce = ids.new_id().encode()
            try:
                await self.process.send(nonce + b"\n" + command.encode() + b"\0")
            except errors.Unavailable as exc:
                self.retire("stdin closed")
                raise ServerGone(started=False) from exc
            call: list[str] | None = None
            try:
                try:
                    line = await self._line(time.monotonic() + scripts.QUICK)
                except TimeoutError:
                    self.retire("no start report in time")
                    raise ServerGone(started=True) from None  # it may still run: never run it twice
                match = _STARTED.fullmatch(line or b"")
                if match is None or match.group(1) != nonce:
                    self.retire("no start report")
                    raise ServerGone(started=line is not None)
                call = match.group(2).decode().split()
                timed_out = False
                try:
                    status = await self._output(nonce, capture, deadline)
                except TimeoutError:
                    timed_out = True
                    await self._kill(call)
                    try:
                        status = await self._output(nonce, capture, time.monotonic() + KILL_GRACE)
                    except TimeoutError:
                        self.retire("a killed command did not end")
                        status = None
                if status is None and not timed_out:
                    self.retire("ended mid-command")
                    self._spawn(self._kill(call))  # nobody is left to wait for it
                    raise ServerGone(started=True)
            except asyncio.CancelledError:
                self.retire("call cancelled")
                if call is not None:
                    self._spawn(self._kill(call))
                raise
            finally:
                if self.broken:  # closed or retired meanwhile: end the helper now
                    self._spawn(self._end())
            self.used = time.monotonic()
            return Result(
                exit_code=-1 if timed_out else status or 0,
                timed_out=timed_out,
                duration=self.used - started_at,
            )

    async def _kill(self, call: list[str]) -> None:
        """Kills what the running call started (``call``: what its start report said)."""
        try:
            await self.runtime.run(
                self.sandbox_id, scripts.argv(bashsession.KILL, *call), timeout=scripts.QUICK
            )
        except errors.SandboxError as exc:
            log.warning("executor.shell_kill_failed", sandbox_id=self.sandbox_id, error=exc.message)

    def retire(self, why: str) -> None:
        """Stop using this helper and end its process (not the commands it started)."""
        if not self.broken:
            log.info("executor.shell_server_retired", sandbox_id=self.sandbox_id, reason=why)
        self.broken = True
        self._dropping = True  # nothing reads its answers any more
        self._buffer.clear()
        self._taken.set()
        self._more.set()
        self._spawn(self._end())

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)  # keep a reference until it is done
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        """End the helper: now if idle; if busy, its call finishes and the helper ends with
        this process (its input closes)."""
        self.broken = True
        if not self.lock.locked():
            await self._end()

    async def _end(self) -> None:
        if self._ended:
            return
        self._ended = True
        # No call reads any more: what it still writes is drained and dropped, so it never
        # waits on a full pipe and its reader ends with it.
        self._dropping = True
        self._buffer.clear()
        self._taken.set()
        with contextlib.suppress(Exception):
            await self.process.close_stdin()
        try:
            async with asyncio.timeout(5):
                await self.process.wait()
        except (TimeoutError, Exception):
            with contextlib.suppress(Exception):
                await self.process.kill()
        await asyncio.wait({self._pump_task}, timeout=5)
        self._pump_task.cancel()


async def start(runtime: api.Runtime, sandbox_id: str) -> ShellServer | None:
    """A new helper in this sandbox; None where none can run (no bash: use ``scripts.SHELL``)."""
    process = await runtime.exec(sandbox_id, scripts.argv(bashsession.BOOT), keep_stdin_open=True)
    server = ShellServer(runtime, sandbox_id, process)
    try:
        await process.send(bashsession.BOOT_INPUT)
    except errors.SandboxError:
        server.retire("its program could not be sent")
        return None
    return server if await server.hello() else None


class ShellServers:
    """The helpers of one executor, by sandbox: started on first use, closed when idle."""

    def __init__(
        self, runtime: api.Runtime, *, idle_close: float = IDLE_CLOSE, limit: int = MAX_SERVERS
    ) -> None:
        self.runtime = runtime
        self.idle_close = idle_close
        self.limit = limit
        self._servers: dict[str, ShellServer] = {}
        self._starting: dict[str, asyncio.Lock] = {}
        self._unsupported: bounded.Bounded[str, float] = bounded.Bounded(self.limit * 4)
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._preparing = 0

    def __len__(self) -> int:
        return sum(1 for s in self._servers.values() if s.alive)

    def ready(self, sandbox_id: str) -> ShellServer | None:
        """This sandbox's helper if it is up; otherwise None, and one is started in the
        background."""
        server = self._servers.get(sandbox_id)
        if server is not None and server.alive:
            return server
        if sandbox_id not in self._unsupported and sandbox_id not in self._tasks:
            task = asyncio.get_running_loop().create_task(self._start_quietly(sandbox_id))
            self._tasks[sandbox_id] = task
            task.add_done_callback(lambda _: self._tasks.pop(sandbox_id, None))
        return None

    async def _start_quietly(self, sandbox_id: str) -> None:
        try:
            await self.get(sandbox_id)
        except errors.SandboxError as exc:
            log.info("executor.shell_server_not_started", sandbox_id=sandbox_id, error=exc.message)
        except Exception:
            log.exception("executor.shell_server_start_crashed", sandbox_id=sandbox_id)

    async def get(self, sandbox_id: str) -> ShellServer | None:
        """This sandbox's helper, started if needed; None where one cannot run (no bash)."""
        server = self._servers.get(sandbox_id)
        if server is not None and server.alive:
            return server
        if sandbox_id in self._unsupported:
            return None
        lock = self._starting.setdefault(sandbox_id, asyncio.Lock())
        try:
            async with lock:
                server = self._servers.get(sandbox_id)
                if server is not None and server.alive:
                    return server
                server = await start(self.runtime, sandbox_id)
                if server is None:
                    self._unsupported[sandbox_id] = time.monotonic()
                    return None
                self._servers[sandbox_id] = server
        finally:
            self._starting.pop(sandbox_id, None)  # also when starting failed
        await self._evict_beyond_limit()
        return server

    async def prepare(self, sandbox_id: str) -> bool:
        """Start the helper of a pool sandbox before it is claimed and keep it until its
        first call (the idle rule does not close it). False where none can run, or when
        half the helpers this executor may hold are already kept for pool sandboxes (the
        rest are for the sessions it serves)."""
        if sum(1 for s in self._servers.values() if s.pinned) + self._preparing >= self.limit // 2:
            return False
        self._preparing += 1
        try:
            server = await self.get(sandbox_id)
        finally:
            self._preparing -= 1
        if server is None:
            return False
        # One call now: it starts the session's bash (with its backup) and creates the
        # lock and state files, which the session's first call then finds ready. The bash
        # answers it without running anything, so it is not taken for a user's call.
        await server.run(bashsession.PREPARE, output.Capture(1024), scripts.QUICK)
        server.pinned = True
        server.used = time.monotonic()
        return True

    async def _evict_beyond_limit(self) -> None:
        while len(self._servers) > self.limit:
            # Sessions' helpers first, least recently used; pool sandboxes' helpers last.
            oldest = min(self._servers, key=lambda sid: (self._servers[sid].pinned, self._servers[sid].used))
            await self._drop(oldest)

    async def _drop(self, sandbox_id: str) -> None:
        server = self._servers.pop(sandbox_id, None)
        if server is not None:
            await server.close()

    async def sweep(self) -> None:
        """Close helpers that died or sat idle; forget 'cannot run here' after a while."""
        now = time.monotonic()
        for sandbox_id, server in list(self._servers.items()):
            if server.pinned and now - server.used > PINNED_FOR:
                server.pinned = False  # its first call went to another executor, or never came
            idle = now - server.used > self.idle_close and not server.pinned and not server.lock.locked()
            if not server.alive or idle:
                await self._drop(sandbox_id)
        for sandbox_id, since in list(self._unsupported.items()):
            if now - since > self.idle_close:
                del self._unsupported[sandbox_id]

    async def run_sweeps(self, every: float = 10.0) -> None:
        while True:
            await asyncio.sleep(every)
            await self.sweep()

    async def close(self) -> None:
        for task in list(self._tasks.values()):
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        await asyncio.gather(*(self._drop(sid) for sid in list(self._servers)), return_exceptions=True)

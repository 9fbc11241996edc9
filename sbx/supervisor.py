"""Running child processes: start, restart with back-off, stop in order.

The restart rule is a pure function (:func:`restart_delay`); the rest is thin
process handling. Children get SIGTERM if the supervisor itself dies
(``PR_SET_PDEATHSIG``), so a killed ``sbx up`` never leaves orphans behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import IO

from sbx_client import terminal

#: A service that exits with this code found its configuration wrong: restarting it
#: cannot help, so it is not restarted and the stack stops (``shared.infrastructure.service.main``).
CONFIG_EXIT = 2
#: A child that ran at least this long before exiting restarts without back-off.
HEALTHY_RUN_SECONDS = 30.0
MAX_DELAY_SECONDS = 30.0
PR_SET_PDEATHSIG = 1


def restart_delay(consecutive_failures: int) -> float:
    """Seconds to wait before restart number ``consecutive_failures`` (1, 2, ...)."""
    if consecutive_failures <= 0:
        return 0.0
    return min(0.25 * 2 ** min(consecutive_failures - 1, 16), MAX_DELAY_SECONDS)


def die_with_parent() -> None:  # runs in the child between fork and exec
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def say(message: str) -> None:
    print(f"sbx: {terminal.escape(message)}", file=sys.stderr, flush=True)


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str]
    output: IO[bytes] | None = None
    """Where stdout/stderr go (``None``: inherit the supervisor's)."""
    proc: asyncio.subprocess.Process | None = None
    started_at: float = 0.0
    failures: int = 0
    restarts: int = 0
    exited: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc and self.proc.returncode is None else None


class Supervisor:
    def __init__(self, *, stop_timeout: float = 15.0) -> None:
        self.children: list[Child] = []
        self.stopping = False
        self.stop_timeout = stop_timeout
        self._watchers: list[asyncio.Task[None]] = []
        self.refused = asyncio.Event()
        """Set when a child exits with ``CONFIG_EXIT`` (``refused_by`` says which)."""
        self.refused_by: str | None = None

    async def _spawn(self, child: Child) -> None:
        child.exited.clear()
        child.proc = await asyncio.create_subprocess_exec(
            *child.argv,
            env=child.env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=child.output,
            stderr=child.output,
            start_new_session=True,  # a terminal's Ctrl-C reaches only us; we stop children in order
            preexec_fn=die_with_parent,
        )
        child.started_at = time.monotonic()

    async def start(self, child: Child) -> Child:
        await self._spawn(child)
        self.children.append(child)
        self._watchers.append(asyncio.create_task(self._watch(child), name=f"watch:{child.name}"))
        return child

    async def _watch(self, child: Child) -> None:
        while True:
            assert child.proc is not None
            code = await child.proc.wait()
            child.exited.set()
            if self.stopping:
                return
            if code == CONFIG_EXIT:
                say(f"{child.name} refused its configuration (see its message above); not restarting it")
                self.refused_by = child.name
                self.refused.set()
                return
            ran = time.monotonic() - child.started_at
            child.failures = 1 if ran >= HEALTHY_RUN_SECONDS else child.failures + 1
            delay = restart_delay(child.failures)
            say(f"{child.name} exited with {code} after {ran:.1f}s; restarting in {delay:.2f}s")
            await asyncio.sleep(delay)
            if self.stopping:
                return
            await self._spawn(child)
            child.restarts += 1

    async def stop(self, child: Child) -> None:
        proc = child.proc
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            async with asyncio.timeout(self.stop_timeout):
                await proc.wait()
        except TimeoutError:
            say(f"{child.name} did not stop within {self.stop_timeout:.0f}s; killing it")
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()

    async def stop_all(
        self, last: Child | None = None, before_last: Callable[[], Awaitable[None]] | None = None
    ) -> None:
        """Stop every child (in parallel), run ``before_last``, then stop ``last`` (the bus
        they drain into, which ``before_last`` may still use)."""
        self.stopping = True
        await asyncio.gather(*(self.stop(c) for c in self.children if c is not last))
        if before_last is not None:
            await before_last()
        if last is not None:
            await self.stop(last)
        for watcher in self._watchers:
            watcher.cancel()
        await asyncio.gather(*self._watchers, return_exceptions=True)


def child_env(base: dict[str, str], **overrides: str | None) -> dict[str, str]:
    """``base`` (already narrowed by ``shared.infrastructure.processenv``) with ``overrides`` set, or
    removed where ``None``."""
    env = {**base, "PYTHONUNBUFFERED": "1"}
    for key, value in overrides.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def python_module(module: str) -> list[str]:
    return [sys.executable, "-m", module]

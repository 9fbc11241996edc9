"""Pausing local sandboxes: every process of one frozen in its cgroup's freezer (memory and
open files kept, no CPU time), and thawed again.

Each sandbox's freezer is taken by one at a time (a lock file in its directory, held
across threads and processes): a pause, a resume and a snapshot's frozen instant never
interleave, so a snapshot never thaws a sandbox a pause just froze.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path

import msgspec

from sbx_api import errors
from shared.runtime import api
from shared.runtime.local import cgroups, sandboxdirs


class Freezer:
    """Pause and resume of the sandboxes in ``dirs``, through this host's cgroups."""

    def __init__(self, dirs: sandboxdirs.SandboxDirs, host_cgroups: cgroups.HostCgroups) -> None:
        self.dirs = dirs
        self.host_cgroups = host_cgroups

    @staticmethod
    @contextlib.contextmanager
    def lock(d: Path, *, wait: bool = True) -> Iterator[bool]:
        """The sandbox's freezer to oneself (a lock file in its directory, held across threads
        and processes). Yields whether it is held (False only without ``wait``, when another
        holds it)."""
        try:
            lock = open(d / "freeze.lock", "a")  # (held for the block below)
        except FileNotFoundError:
            raise errors.NotFound(f"sandbox directory {d.name} is gone") from None
        with lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                yield False
                return
            try:
                yield True
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def freeze(self, sandbox_id: str) -> None:
        with self.lock(self.dirs.dir(sandbox_id)):
            self.host_cgroups.get().freeze(sandboxdirs.cgroup_name(sandbox_id))

    def thaw(self, sandbox_id: str, *, wait: bool = True) -> bool:
        """Thaw it with its freezer held; False (nothing done) if ``wait`` is off and the
        freezer is held by another."""
        with self.lock(self.dirs.dir(sandbox_id), wait=wait) as held:
            if held:
                self.host_cgroups.get().thaw(sandboxdirs.cgroup_name(sandbox_id))
            return held

    async def thaw_soon(self, sandbox_id: str) -> None:
        """Thaw now (one small write, not worth a thread) unless the freezer is held (a
        snapshot's instant, a few ms): then wait for it in a thread."""
        if not self.thaw(sandbox_id, wait=False):
            await asyncio.to_thread(self.thaw, sandbox_id)

    async def pause(self, sandbox_id: str) -> api.SandboxInfo:
        """Freeze every process of the running sandbox. Its network link and mounts stay; a
        command cannot enter it meanwhile (NotRunning)."""
        info = self.dirs.require(sandbox_id)
        if info.status == "paused":
            return info
        if info.status != "running":
            raise api.SandboxNotRunning(f"sandbox {sandbox_id!r} is {info.status}: nothing to pause")
        await asyncio.to_thread(self.freeze, sandbox_id)
        if self.dirs.running(self.dirs.dir(sandbox_id)) is None:  # it stopped meanwhile: nothing paused
            await asyncio.to_thread(self.thaw, sandbox_id)
            raise api.SandboxNotRunning(f"sandbox {sandbox_id!r} stopped while it was being paused")
        return msgspec.structs.replace(info, status="paused")

    async def resume(self, sandbox_id: str) -> api.SandboxInfo:
        """Thaw a paused sandbox: its processes go on where they were."""
        if self.paused(sandbox_id):  # the common case, first: one small write
            await self.thaw_soon(sandbox_id)
            return self.dirs.require(sandbox_id)
        info = self.dirs.require(sandbox_id)
        if info.status == "paused":
            await self.thaw_soon(sandbox_id)
            return msgspec.structs.replace(info, status="running")
        if info.status != "running":
            raise api.SandboxNotRunning(f"sandbox {sandbox_id!r} is {info.status}, not paused")
        return info

    def paused(self, sandbox_id: str) -> bool:
        return self.dirs.frozen(self.dirs.dir(sandbox_id))

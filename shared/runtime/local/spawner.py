"""The executor's side of the spawner (``spawnd.py``): starts it on first use, sends it
the commands of ``runtime.exec`` with their pipes, and gives back each command as a
process with streams, an exit status and a kill.

The spawner is the executor's child (started with ``vfork``: no fork of this large
process) and shares with it only a socketpair. If it ends (a crash, a kill: seen on its
pidfd, not only when its socket ends), what it started ends with it (``enter.py``): the
commands waiting for a start fail, the running ones end as killed, and the next command
starts a new spawner. A caller that stops waiting for a start has it killed.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import errno
import functools
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any

import structlog

from shared.runtime.local import enter, spawnd

log = structlog.get_logger(__name__)

INTERPRETER = os.path.realpath(sys.executable)
"""The base interpreter (``-I -S``: the spawner needs the standard library only)."""
LOST = "the spawner stopped; the next command starts a new one"


class Process:
    """A command the spawner started: its pipes as asyncio streams, its exit status."""

    def __init__(self, link: _Link, ident: int, pid: int) -> None:
        self.link, self.ident, self.pid = link, ident, pid
        self.returncode: int | None = None
        self.stdin: asyncio.StreamWriter | None = None
        self.stdout: asyncio.StreamReader | None = None
        self.stderr: asyncio.StreamReader | None = None
        self._ended = link.loop.create_future()
        self._readers: list[asyncio.ReadTransport] = []

    async def connect(self, fds: list[int]) -> None:
        """Streams over our ends of its pipes (stdin, stdout, stderr); each descriptor is
        owned by a transport, or closed, by the time this returns or raises."""
        loop = asyncio.get_running_loop()
        try:
            # (open() of a descriptor: no filesystem call, nothing that blocks)
            pipe = open(fds[0], "wb", 0)  # noqa: ASYNC230
            fds[0] = -1
            writer, protocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin, pipe)
            self.stdin = asyncio.StreamWriter(writer, protocol, None, loop)
            self.stdout, self.stderr = asyncio.StreamReader(), asyncio.StreamReader()
            for i, reader in ((1, self.stdout), (2, self.stderr)):
                pipe = open(fds[i], "rb", 0)  # noqa: ASYNC230
                fds[i] = -1
                transport, _ = await loop.connect_read_pipe(
                    functools.partial(asyncio.StreamReaderProtocol, reader), pipe
                )
                self._readers.append(transport)
        finally:
            for fd in fds:
                if fd >= 0:
                    os.close(fd)

    def ended(self, status: int) -> None:
        """The spawner reaped it (a wait status) or is gone (``-SIGKILL``)."""
        if self.returncode is None:
            self.returncode = os.waitstatus_to_exitcode(status) if status >= 0 else status
            self._ended.set_result(None)  # (never cancelled: waiters are shielded)

    async def wait(self) -> int:
        """Its exit status, once it ended (its pipes may stay open: see ``LocalExec``)."""
        await asyncio.shield(self._ended)  # a waiter that gives up does not cancel the end
        assert self.returncode is not None
        return self.returncode

    async def kill(self) -> None:
        """SIGKILL to its process group (through the spawner, which still holds its leader)."""
        if self.returncode is None:
            await self.link.kill(self.ident, signal.SIGKILL)

    def close_output(self) -> None:
        for transport in self._readers:
            transport.close()


class _Link:
    """One spawner process and the socket to it."""

    def __init__(self, cgroup_root: Path, keep_caps: frozenset[int], deadline: float) -> None:
        self.loop = asyncio.get_running_loop()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with theirs:
            settings = spawnd.settings(os.getpid(), theirs.fileno(), str(cgroup_root), keep_caps, deadline)
            # From this (the loop's) thread: the spawner's PR_SET_PDEATHSIG follows the
            # thread that started it.
            try:
                self.proc = subprocess.Popen(
                    [INTERPRETER, "-I", "-S", "-c", spawnd.BOOT],
                    pass_fds=(theirs.fileno(),), env={spawnd.SETTINGS: settings}, cwd="/",
                    start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                )  # fmt: skip
            except BaseException:
                ours.close()
                raise
        ours.setblocking(False)
        self.sock = ours
        self.pidfd = os.pidfd_open(self.proc.pid)
        self.loop.add_reader(self.pidfd, self._ended)
        self.alive = True
        self.buffer = bytearray()
        self.next_id = 0
        self.starting: dict[int, asyncio.Future[Process]] = {}
        self.running: dict[int, Process] = {}
        self._sending = asyncio.Lock()
        self._kills: set[asyncio.Task[None]] = set()
        self.loop.add_reader(ours.fileno(), self._readable)

    async def spawn(self, request: dict[str, Any], stdio: list[int]) -> Process:
        """The started command; OSError if it could not start. ``stdio`` (the command's
        ends of its pipes) is closed here once sent, or on failure. A caller that stops
        waiting leaves nothing running: a start answered after that is killed."""
        self.next_id += 1
        ident = self.next_id
        frame = spawnd.encode({"op": "spawn", "id": ident, **request})
        if len(frame) > spawnd.HEADER.size + spawnd.MAX_FRAME:
            _close(stdio)
            raise OSError(errno.E2BIG, f"the command line and environment are over {spawnd.MAX_FRAME} bytes")
        started: asyncio.Future[Process] = self.loop.create_future()
        self.starting[ident] = started
        # Shielded: a frame cut short would end the spawner (and every command it runs),
        # and the descriptors must stay open until they are sent.
        sending = self.loop.create_task(self._send(frame, stdio))
        sending.add_done_callback(lambda _: _close(stdio))
        try:
            await asyncio.shield(sending)
            return await started
        except asyncio.CancelledError:
            if not started.done() or started.cancelled():  # not answered: killed where it is
                self._later(self.kill(ident, signal.SIGKILL))
            elif started.exception() is None:
                self.kill_soon(started.result())
            raise
        finally:
            self.starting.pop(ident, None)

    async def kill(self, ident: int, sig: int) -> None:
        if self.alive:
            with contextlib.suppress(OSError):
                await self._send(spawnd.encode({"op": "kill", "id": ident, "signal": int(sig)}), ())

    def kill_soon(self, process: Process) -> None:
        """Kill a command nobody will read (its caller went away while it started)."""
        self._later(process.kill())

    def _later(self, kill: Coroutine[Any, Any, None]) -> None:
        task = self.loop.create_task(kill)
        self._kills.add(task)
        task.add_done_callback(self._kills.discard)

    async def _send(self, frame: bytes, fds: Sequence[int]) -> None:
        async with self._sending:
            if not self.alive:
                raise OSError(errno.EPIPE, LOST)
            ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
            while True:  # the descriptors go with the frame's first byte
                try:
                    sent = self.sock.sendmsg([frame], ancillary)
                    break
                except BlockingIOError:
                    await self._writable()
            if sent < len(frame):
                await self.loop.sock_sendall(self.sock, frame[sent:])

    async def _writable(self) -> None:
        ready: asyncio.Future[None] = self.loop.create_future()
        self.loop.add_writer(self.sock.fileno(), _settle, ready)
        try:
            await ready
        finally:
            self.loop.remove_writer(self.sock.fileno())

    def _readable(self) -> bool:
        """Read and dispatch what the spawner said; whether there was anything."""
        try:
            data = self.sock.recv(1 << 16)
        except BlockingIOError:
            return False
        except OSError:
            data = b""
        if not data:
            self.lost("its socket ended")
            return False
        self.buffer += data
        try:
            messages = spawnd.decode_frames(self.buffer)
        except ValueError as exc:
            self.lost(str(exc))
            return False
        for message in messages:
            self._dispatch(message)
        return True

    def _ended(self) -> None:
        """Its pidfd: the spawner ended (what it said before that still counts)."""
        while self.alive and self._readable():
            pass
        self.lost("it ended")

    def _dispatch(self, message: dict[str, Any]) -> None:
        ident = message.get("id")
        if not isinstance(ident, int):
            return
        if "status" in message:
            process = self.running.pop(ident, None)
            if process is not None:
                process.ended(int(message["status"]))
            return
        started = self.starting.get(ident)
        if "pid" in message:
            process = Process(self, ident, int(message["pid"]))
            self.running[ident] = process
            if started is None or started.done():  # nobody waits for it any more
                self.kill_soon(process)
            else:
                started.set_result(process)
        elif started is not None and not started.done():
            started.set_exception(OSError(int(message.get("errno", errno.EIO)), str(message.get("error"))))

    def lost(self, why: str | None) -> None:
        """The spawner ended or is let go (``why`` None): nothing it started runs any more."""
        if not self.alive:
            return
        self.alive = False
        with contextlib.suppress(ValueError, OSError):
            self.loop.remove_reader(self.sock.fileno())
        with contextlib.suppress(ValueError, OSError):
            self.loop.remove_reader(self.pidfd)
        self.sock.close()
        os.close(self.pidfd)
        for started in self.starting.values():
            if not started.done():
                started.set_exception(OSError(errno.EPIPE, LOST))
        ended = len(self.running)
        for process in self.running.values():
            process.ended(-signal.SIGKILL)
        self.running.clear()
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        try:
            self.loop.run_in_executor(None, self.proc.wait)  # reaped off the loop
        except RuntimeError:  # (the loop is closed)
            self.proc.wait()
        if why is not None:
            log.warning("spawner.lost", pid=self.proc.pid, why=why, commands_ended=ended)


def _close(fds: Sequence[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class Spawner:
    """The spawner of one runtime: started on first use, started again after it ended."""

    def __init__(
        self, cgroup_root: Path, keep_caps: frozenset[int], start_deadline: float = spawnd.START_DEADLINE
    ) -> None:
        self.cgroup_root = cgroup_root
        self.keep_caps = keep_caps
        self.start_deadline = start_deadline
        self._link: _Link | None = None
        self.started = 0
        """How many spawners this runtime started (more than 1: one ended and was replaced)."""

    def _current(self) -> _Link:
        link, loop = self._link, asyncio.get_running_loop()
        if link is not None and link.alive and link.loop is loop:
            return link
        if link is not None:
            link.lost(None)  # (still alive: a runtime used from a new event loop)
        self._link = _Link(self.cgroup_root, self.keep_caps, self.start_deadline)
        self.started += 1
        return self._link

    @property
    def pid(self) -> int | None:
        """The running spawner's pid, if one runs."""
        return self._link.proc.pid if self._link is not None and self._link.alive else None

    async def spawn(
        self, argv: Sequence[str], env: Mapping[str, str], entry: enter.Entry, cgroup_files: Sequence[Path]
    ) -> Process:
        """Start ``argv`` in ``entry``'s sandbox, with pipes for its stdin, stdout and stderr;
        OSError if it could not start (its message says what failed)."""
        link = self._current()
        request = {
            "argv": list(argv),
            "env": [f"{k}={v}" for k, v in env.items()],
            "path": env.get("PATH", os.defpath).split(os.pathsep),
            "cgroups": [str(p) for p in cgroup_files],
            "pid": entry.pid,
            "starttime": entry.starttime,
            "uid": entry.uid,
            "caps": sorted(entry.keep_caps),
            "nofile": entry.nofile,
            "bpf": entry.bpf,
        }
        pipes = [os.pipe2(os.O_CLOEXEC) for _ in range(3)]
        ours = [pipes[0][1], pipes[1][0], pipes[2][0]]
        try:
            process = await link.spawn(request, [pipes[0][0], pipes[1][1], pipes[2][1]])
        except BaseException:
            _close(ours)
            raise
        try:
            await process.connect(ours)
        except BaseException:
            link.kill_soon(process)
            raise
        return process

    def close(self) -> None:
        """Stop the spawner (what it started ends with it)."""
        if self._link is not None:
            self._link.lost(None)
            self._link = None

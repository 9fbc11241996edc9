"""A command running in a local sandbox (``LocalRuntime.exec``): its output read ahead a
bounded amount, its input fed, its deadline kept, its kill."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from sbx_api import errors
from shared.runtime import api
from shared.runtime.local import spawner

READ_CHUNK = 64 * 1024
QUEUE_CHUNKS = 64
"""Output read ahead of its consumer, at most (64 reads of up to 64 KiB: 4 MiB)."""


class LocalExec(api.Exec):
    def __init__(
        self,
        proc: spawner.Process,
        timeout: float | None,
        stdin: bytes | None,
        keep_stdin_open: bool = False,
    ) -> None:
        self.proc = proc
        self.keep_stdin_open = keep_stdin_open
        self.started = time.monotonic()
        self.timed_out = False
        # Bounded read-ahead: a reader that nobody keeps up with stops reading, the pipe
        # fills and the command waits, instead of its output filling this process's
        # memory. The end markers never wait for room.
        self._queue: asyncio.Queue[tuple[api.Stream, bytes] | None] = asyncio.Queue()
        self._room = asyncio.Semaphore(QUEUE_CHUNKS)
        self._readers = [
            asyncio.create_task(self._read("stdout", proc.stdout)),
            asyncio.create_task(self._read("stderr", proc.stderr)),
        ]
        self._feeder = asyncio.create_task(self._feed(stdin))
        self._deadline = asyncio.create_task(self._expire(timeout)) if timeout else None

    async def _feed(self, data: bytes | None) -> None:
        assert self.proc.stdin is not None
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            if data:
                self.proc.stdin.write(data)
                await self.proc.stdin.drain()
        if not self.keep_stdin_open:
            self.proc.stdin.close()

    async def send(self, data: bytes) -> None:
        if not self.keep_stdin_open:
            raise errors.InvalidInput("this command was not started with keep_stdin_open")
        await self._feeder
        assert self.proc.stdin is not None
        if self.proc.stdin.is_closing() or self.proc.returncode is not None:
            raise errors.Unavailable("the command's input is closed")
        try:
            self.proc.stdin.write(data)
            await self.proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError, RuntimeError) as exc:
            raise errors.Unavailable(f"the command no longer reads its input: {exc}") from exc

    async def close_stdin(self) -> None:
        await self._feeder
        assert self.proc.stdin is not None
        self.proc.stdin.close()

    async def _read(self, stream: api.Stream, reader: asyncio.StreamReader | None) -> None:
        assert reader is not None
        try:
            while chunk := await reader.read(READ_CHUNK):
                await self._room.acquire()
                self._queue.put_nowait((stream, chunk))
        finally:
            self._queue.put_nowait(None)

    async def _expire(self, timeout: float) -> None:
        await asyncio.sleep(timeout)
        if self.proc.returncode is None:
            self.timed_out = True
            await self.kill()

    async def chunks(self) -> AsyncIterator[tuple[api.Stream, bytes]]:
        open_streams = 2
        while open_streams:
            item = await self._queue.get()
            if item is None:
                open_streams -= 1
            else:
                self._room.release()
                yield item

    async def wait(self) -> api.ExecResult:
        await self.proc.wait()
        await asyncio.gather(*self._readers, self._feeder, return_exceptions=True)
        return await self.exited()  # returncode is set by now: no polling

    async def exited(self) -> api.ExecResult:
        # The exit alone (the spawner reaped it): processes left behind may keep the pipes open.
        code = await self.proc.wait()
        if self._deadline:
            self._deadline.cancel()
        if code < 0:
            code = 128 - code
        return api.ExecResult(
            exit_code=-1 if self.timed_out else code,
            timed_out=self.timed_out,
            duration=time.monotonic() - self.started,
        )

    def detach(self) -> None:
        for reader in self._readers:
            reader.cancel()
        self.proc.close_output()

    async def kill(self) -> None:
        await self.proc.kill()

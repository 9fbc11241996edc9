"""Exec over the pods/exec websocket: the channel protocol (``v5.channel.k8s.io``, with
``v4.channel.k8s.io`` as the fallback) and the shell wrapper every command runs in.

Every binary frame starts with a channel byte: 0 stdin, 1 stdout, 2 stderr, 3 the
exit status (a ``Status`` object as JSON), 4 resize (unused). v5 adds frame
``255, 0``: "stdin is closed". A v4 server cannot be told that, so one-shot stdin goes
through the wrapper instead (it reads exactly that many bytes, then runs the command
with them as its input).

The pods/exec API has no environment, working directory or kill: the wrapper changes
directory, exports the environment and a random ``SBX_EXEC_ID``, then ``exec``s the
command, so the exit status is the command's own (128+N when a signal killed it).
Killing a command is a second exec that SIGKILLs every process whose environment holds
that id, until none is left: the command and whatever it started, daemons included,
unless they cleared their environment.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence

import aiohttp
import structlog

from sbx_api import errors
from shared.runtime import api

log = structlog.get_logger(__name__)

STDIN, STDOUT, STDERR, STATUS = 0, 1, 2, 3
CLOSE = 255
V5 = "v5.channel.k8s.io"
V4 = "v4.channel.k8s.io"
PROTOCOLS = (V5, V4)
FRAME = 32 * 1024
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

WRAPPER = r"""
cd -- "$1" || exit 126
shift
while [ "$1" != -- ]; do export "$1"; shift; done
export SBX_EXEC_ID="$2"
if [ "$3" != - ]; then
  head -c "$3" > "/tmp/.sbx-in-$2" && exec 3< "/tmp/.sbx-in-$2"; rm -f "/tmp/.sbx-in-$2"; exec 0<&3 3<&-
fi
shift 3
exec "$@"
"""
"""Arguments: cwd, NAME=value..., ``--``, exec id, stdin byte count or ``-``, the command.
It uses no shell variable of its own, so no caller variable can change what it does,
and the exec id is exported last, so the caller cannot replace it."""

KILLER = r"""
for round in 1 2 3 4 5 6 7 8; do
  found=$(grep -l -a -s -F "SBX_EXEC_ID=$1" /proc/[0-9]*/environ 2>/dev/null)
  [ -n "$found" ] || exit 0
  for f in $found; do p=${f#/proc/}; kill -KILL "${p%/environ}" 2>/dev/null; done
done
"""
"""grep's exit status is not used: it is 2 whenever one ``environ`` could not be read (a
process of another user, a non-dumpable one, one that just exited), matches or not."""
KILL_TIMEOUT = 30.0
GRACE = 3.0
"""After a kill, how long the stream may stay open (a process that cleared its
environment can survive and hold stdout); then it is closed and the call returns."""


def new_exec_id() -> str:
    return secrets.token_hex(16)


def wrap(
    argv: Sequence[str],
    *,
    exec_id: str,
    cwd: str,
    env: Mapping[str, str],
    stdin_bytes: int | None,
) -> list[str]:
    """The argv actually sent: the wrapper, its arguments, then the command."""
    if not argv:
        raise errors.InvalidInput("the command is empty")
    for name in env:
        if not ENV_NAME.fullmatch(name) or name == "SBX_EXEC_ID":
            raise errors.InvalidInput(f"environment variable name {name!r:.60} is not allowed")
    pairs = [f"{k}={v}" for k, v in env.items()]
    count = "-" if stdin_bytes is None else str(stdin_bytes)
    return ["/bin/sh", "-c", WRAPPER, "sbx-exec", cwd, *pairs, "--", exec_id, count, *argv]


def killer(exec_id: str) -> list[str]:
    return ["/bin/sh", "-c", KILLER, "sbx-kill", exec_id]


def exit_code(status: Mapping[str, object]) -> int:
    """The exit code in a channel-3 Status; raises for a failure that is not one."""
    if status.get("status") == "Success":
        return 0
    details = status.get("details") or {}
    for cause in details.get("causes", []) if isinstance(details, dict) else []:
        if cause.get("reason") == "ExitCode":
            return int(cause["message"])
    raise errors.InfrastructureError(f"exec failed: {status.get('message') or status}")


class ChannelExec(api.Exec):
    """A command running over one exec websocket."""

    def __init__(
        self,
        ws: aiohttp.ClientWebSocketResponse,
        *,
        timeout: float | None,
        stdin: bytes | None,
        keep_stdin_open: bool,
        kill: Callable[[], Awaitable[None]],
        stdin_requested: bool = True,
    ) -> None:
        self.ws = ws
        self.stdin_requested = stdin_requested
        self.killed = False
        self.protocol = ws.protocol or V4
        self.keep_stdin_open = keep_stdin_open
        self.started = time.monotonic()
        self.timed_out = False
        self._kill = kill
        self._code: int | None = None
        self._failure: errors.SandboxError | None = None
        self._queue: asyncio.Queue[tuple[api.Stream, bytes] | None] = asyncio.Queue()
        self._reader = asyncio.create_task(self._read())
        self._feeder = asyncio.create_task(self._feed(stdin))
        self._deadline = asyncio.create_task(self._expire(timeout)) if timeout else None

    @property
    def finished(self) -> bool:
        return self._reader.done()

    async def _feed(self, data: bytes | None) -> None:
        if data:
            await self._send(data)
        if not self.keep_stdin_open and self.protocol == V5 and self.stdin_requested:
            await self._close_stdin()

    async def _send(self, data: bytes) -> None:
        try:
            for at in range(0, len(data), FRAME):
                await self.ws.send_bytes(bytes([STDIN]) + data[at : at + FRAME])
        except (ConnectionError, aiohttp.ClientError, RuntimeError) as exc:
            raise errors.Unavailable(f"the command's input is closed: {exc}") from exc

    async def _close_stdin(self) -> None:
        with contextlib.suppress(ConnectionError, aiohttp.ClientError, RuntimeError):
            await self.ws.send_bytes(bytes([CLOSE, STDIN]))

    async def send(self, data: bytes) -> None:
        if not self.keep_stdin_open:
            raise errors.InvalidInput("this command was not started with keep_stdin_open")
        await self._feeder
        if self.finished or self.ws.closed:
            raise errors.Unavailable("the command's input is closed")
        await self._send(data)

    async def close_stdin(self) -> None:
        await self._feeder
        if self.protocol != V5:
            raise errors.Unavailable(
                "this API server speaks the v4 exec protocol, which cannot close stdin "
                "(v5 needs Kubernetes 1.30 or newer)"
            )
        await self._close_stdin()

    async def _read(self) -> None:
        try:
            async for message in self.ws:
                if message.type != aiohttp.WSMsgType.BINARY or not message.data:
                    continue
                channel, payload = message.data[0], message.data[1:]
                if not payload:
                    continue  # the server opens every channel with an empty frame
                if channel == STDOUT:
                    await self._queue.put(("stdout", payload))
                elif channel == STDERR:
                    await self._queue.put(("stderr", payload))
                elif channel == STATUS:
                    try:
                        self._code = exit_code(json.loads(payload))
                    except (ValueError, TypeError, KeyError) as exc:
                        self._failure = errors.InfrastructureError(f"unreadable exec status: {exc}")
                    except errors.SandboxError as exc:
                        self._failure = exc
        except (TimeoutError, aiohttp.ClientError, ConnectionError) as exc:
            self._failure = errors.Unavailable(f"the exec stream broke: {exc}")
        finally:
            await self._queue.put(None)
            with contextlib.suppress(Exception):
                await self.ws.close()

    async def _expire(self, timeout: float) -> None:
        await asyncio.sleep(timeout)
        if not self.finished:
            self.timed_out = True
            await self.kill()

    async def chunks(self) -> AsyncIterator[tuple[api.Stream, bytes]]:
        while (item := await self._queue.get()) is not None:
            yield item
        await self._queue.put(None)  # a later chunks() call ends at once too

    async def wait(self) -> api.ExecResult:
        await asyncio.shield(self._reader)
        if self._deadline is not None:
            self._deadline.cancel()
        self._feeder.cancel()
        duration = time.monotonic() - self.started
        if self.timed_out:
            return api.ExecResult(exit_code=-1, timed_out=True, duration=duration)
        if self._code is None and self.killed:
            return api.ExecResult(exit_code=128 + 9, duration=duration)
        if self._code is None:
            raise self._failure or errors.Unavailable("the exec stream ended without an exit status")
        return api.ExecResult(exit_code=self._code, duration=duration)

    async def kill(self) -> None:
        """SIGKILL the command and what it started (a second exec), then give the stream
        GRACE to end; a stream something still holds open is closed."""
        if self.finished:
            return
        self.killed = True
        try:
            async with asyncio.timeout(KILL_TIMEOUT):
                await self._kill()
        except (errors.SandboxError, TimeoutError) as exc:
            log.warning("exec.kill_failed", error=str(exc))
        await asyncio.wait({self._reader}, timeout=GRACE)
        if not self.finished:
            await self.ws.close()

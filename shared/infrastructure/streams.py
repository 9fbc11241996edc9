"""Byte streams between two services over core NATS, with flow control.

The streamed operations of the host API (a command's live output, file transfer, tree
listings) move more than one NATS message may hold (1 MiB by default) and must not
outrun a slow reader. A stream is a sequence of *frames* published to the receiver's
subject, each a request the receiver acknowledges once its consumer has taken the
frame: at most :data:`WINDOW` frames are unacknowledged, so a slow HTTP client slows
the command's output down instead of filling memory anywhere.

* A frame carries a channel (one byte, see :mod:`shared.frames`) and up to
  :data:`CHUNK` bytes; headers ``Sbx-Ch`` and ``Sbx-Seq`` (gaps are detected).
* The last frame has channel :data:`END` (its data is the operation's result, JSON) or
  :data:`ERROR` (an :class:`ErrorBody`).
* A receiver that no longer wants the stream answers an ack with ``stop``; the sender
  raises :class:`Aborted`. A receiver that is gone (its subscription closed, its
  service crashed) makes the sender's next frame fail the same way, so the sender
  never works for nobody.
* A sender sends :data:`HEARTBEAT` frames while idle; a receiver that hears nothing for
  :data:`SILENCE` seconds gives up, so a crashed sender never leaves a reader hanging.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from sbx_api import errors

CHUNK = 256 * 1024
"""Largest payload of one frame (well under NATS's default 1 MiB message limit)."""
WINDOW = 8
"""Frames in flight before the sender waits for acknowledgements."""
ACK_TIMEOUT = 60.0
"""How long a sender waits for the oldest acknowledgement before giving up."""
HEARTBEAT = 5.0
SILENCE = 30.0
"""A receiver that hears nothing (not even a heartbeat) for this long gives up."""
END = b"x"
ERROR = b"!"
PING = b"h"
STOP = b"stop"


class Aborted(Exception):
    """The receiver said stop, went away, or stopped acknowledging."""


class ErrorBody(msgspec.Struct, frozen=True, kw_only=True):
    """An error frame's payload (the same fields as the REST API's problem body)."""

    error: str
    message: str
    status: int
    retriable: bool = False

    @classmethod
    def of(cls, exc: errors.SandboxError) -> ErrorBody:
        return cls(
            error=exc.code,
            message=exc.message,
            status=exc.status if exc.status >= 400 else 500,
            retriable=exc.retriable,
        )


@dataclass(frozen=True, slots=True)
class Frame:
    channel: bytes
    data: bytes


class Sender:
    """Publishes frames to ``subject`` in order, at most ``window`` unacknowledged."""

    def __init__(self, nc: Client, subject: str, *, window: int = WINDOW, ack_timeout: float = ACK_TIMEOUT):
        self.nc = nc
        self.subject = subject
        self.window = window
        self.ack_timeout = ack_timeout
        self._seq = 0
        self._acked = 0
        self._changed = asyncio.Condition()
        self._failure: str | None = None
        self._sub: Subscription | None = None
        self._ack_subject = ""
        self._lock = asyncio.Lock()

    async def __aenter__(self) -> Sender:
        self._ack_subject = self.nc.new_inbox()
        self._sub = await self.nc.subscribe(self._ack_subject, cb=self._on_ack)
        return self

    async def __aexit__(self, *_: object) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()

    async def _on_ack(self, msg: Msg) -> None:
        async with self._changed:
            if msg.headers and msg.headers.get("Status") == "503":
                self._failure = "the receiver is gone"
            elif msg.data == STOP:
                self._failure = "the receiver stopped the stream"
            self._acked += 1
            self._changed.notify_all()

    async def send(self, channel: bytes, data: bytes = b"") -> None:
        """Send ``data`` on ``channel`` (split into frames of at most :data:`CHUNK` bytes)."""
        view = memoryview(data)
        for start in range(0, max(len(view), 1), CHUNK):
            await self._frame(channel, bytes(view[start : start + CHUNK]))

    async def _frame(self, channel: bytes, data: bytes) -> None:
        async with self._lock:  # frames leave in order, whoever sends them (output, heartbeats)
            await self._room(self.window - 1)
            self._seq += 1
            headers = {"Sbx-Ch": channel.decode(), "Sbx-Seq": str(self._seq)}
            try:
                await self.nc.publish(self.subject, data, reply=self._ack_subject, headers=headers)
            except Exception as exc:
                raise Aborted(f"could not send: {type(exc).__name__}") from exc

    async def _room(self, outstanding: int) -> None:
        """Wait until at most ``outstanding`` frames are unacknowledged."""
        async with self._changed:
            try:
                async with asyncio.timeout(self.ack_timeout):
                    await self._changed.wait_for(
                        lambda: self._failure is not None or self._seq - self._acked <= outstanding
                    )
            except TimeoutError:
                raise Aborted("the receiver stopped acknowledging") from None
            if self._failure is not None:
                raise Aborted(self._failure)

    async def end(self, result: bytes) -> None:
        """Send the final frame and wait until every frame is acknowledged."""
        await self._frame(END, result)
        await self._room(0)

    async def error(self, exc: errors.SandboxError) -> None:
        """Send the final frame of a failed operation: :data:`ERROR` with the error."""
        await self._frame(ERROR, msgspec.json.encode(ErrorBody.of(exc)))
        await self._room(0)

    async def heartbeats(self) -> None:
        """Run while the sender may be idle: a heartbeat every :data:`HEARTBEAT` seconds."""
        while True:
            await asyncio.sleep(HEARTBEAT)
            await self._frame(PING, b"")


class Receiver:
    """The receiving end: a subject of its own, frames yielded in order until the end."""

    def __init__(self, nc: Client, *, silence: float = SILENCE) -> None:
        self.nc = nc
        self.silence = silence
        self.subject = nc.new_inbox()
        self._sub: Subscription | None = None
        self._seq = 0
        self._stopped = False

    async def __aenter__(self) -> Receiver:
        self._sub = await self.nc.subscribe(self.subject)
        return self

    async def __aexit__(self, *_: object) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()

    async def frames(self) -> AsyncIterator[Frame]:
        """Frames up to and including the :data:`END` frame; heartbeats are not yielded.
        Each frame is acknowledged when the consumer asks for the next one."""
        assert self._sub is not None, "use the receiver as an async context manager"
        pending: Msg | None = None
        try:
            while True:
                if pending is not None:
                    await self._ack(pending)
                    pending = None
                try:
                    msg = await self._sub.next_msg(timeout=self.silence)
                except TimeoutError:
                    raise errors.Unavailable(
                        f"the executor stopped answering (nothing for {self.silence:g} s); "
                        "the operation's outcome is unknown"
                    ) from None
                headers = msg.headers or {}
                seq = int(headers.get("Sbx-Seq", "0"))
                if seq != self._seq + 1:
                    raise errors.Unavailable("a stream frame was lost; the operation's outcome is unknown")
                self._seq = seq
                channel = headers.get("Sbx-Ch", "").encode()
                if channel == PING:
                    await self._ack(msg)
                    continue
                frame = Frame(channel, msg.data)
                if channel in (END, ERROR):
                    await self._ack(msg)
                    yield frame
                    return
                pending = msg
                yield frame
        finally:
            if pending is not None and not self._stopped:
                self._stopped = True
                with contextlib.suppress(Exception):
                    await pending.respond(STOP)

    async def _ack(self, msg: Msg) -> None:
        with contextlib.suppress(Exception):
            await msg.respond(b"")

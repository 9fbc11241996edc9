"""The server side of requests: one subscription per request subject and instance, in the
responder's queue group, answering at most ``workers`` requests at once.

Every request is beaten (:mod:`shared.infrastructure.beats`) from the moment it arrives,
waiting ones too, until its reply leaves. So a caller hears from a live instance within a
beat's time, whether its request is being worked on or waits for a free worker. A caller
that heard nothing for :data:`beats.SILENCE` asks the instance (or all of them) whether it
holds the request: a request lost with its instance (SIGKILLed between delivery and reply)
is noticed then, not after its budget, and one whose instance is only starved is waited
for. Past ``workers + backlog`` requests in hand,
a new one is refused at once with a retriable "busy" error: memory stays bounded, and the
caller's retry may reach another instance.

Stopping takes no new requests, lets those in hand finish within the drain timeout, then
cancels the rest (their callers hear that it is not held).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import Awaitable, Callable

import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from sbx_api import errors
from shared.contract import commands
from shared.infrastructure import aio, beats, tracing

log = structlog.get_logger(__name__)

Handle = Callable[[bytes], Awaitable[bytes]]
"""A request's payload -> its reply's payload (errors already encoded as error replies)."""
BACKLOG_PER_WORKER = 4
"""Requests that may wait for a worker, per worker."""


_progress: contextvars.ContextVar[Callable[[Callable[[], str | None]], None] | None] = contextvars.ContextVar(
    "responder_progress", default=None
)


def report_progress(provider: Callable[[], str | None]) -> None:
    """Have the beats of the request being handled (in this task or one it started) say how
    far its work got: ``provider()``, asked at each beat (a no-op outside a beaten request)."""
    register = _progress.get()
    if register is not None:
        register(provider)


class Responder:
    def __init__(
        self,
        nc: Client,
        subject: str,
        handle: Handle,
        *,
        queue: str,
        workers: int,
        busy: Callable[[commands.ErrorInfo], bytes],
    ) -> None:
        """``busy``: the error reply for a request refused because too many are in hand."""
        self.nc, self.subject, self.handle, self.queue = nc, subject, handle, queue
        self.limit = workers * (1 + BACKLOG_PER_WORKER)
        self._slots = asyncio.Semaphore(workers)
        self._busy = busy
        self._tasks: set[asyncio.Task[None]] = set()
        self._beating: set[str] = set()
        self._progress: dict[str, Callable[[], str | None]] = {}
        self._sub: Subscription | None = None
        self._asked: list[Subscription] = []
        self._beater: asyncio.Task[None] | None = None
        self.holder = beats.instance_subject()
        """Where this instance says whether it holds a request (named in its beats)."""

    async def start(self) -> None:
        for subject in (self.holder, beats.held_subject(self.subject)):
            self._asked.append(await self.nc.subscribe(subject, cb=self._is_held))
        self._sub = await self.nc.subscribe(self.subject, queue=self.queue, cb=self._arrived)
        self._beater = asyncio.create_task(self._beat(), name=f"beats:{self.subject}")

    async def _arrived(self, msg: Msg) -> None:
        """nats-py's callback (called for one message at a time): never waits for work."""
        if len(self._tasks) >= self.limit:
            if msg.reply:
                info = commands.ErrorInfo(
                    errors.Unavailable.code,
                    f"this {self.queue} instance has {len(self._tasks)} requests in hand; retry shortly",
                )
                with contextlib.suppress(Exception):
                    await self.nc.publish(msg.reply, self._busy(info))
            return
        beating = bool(msg.reply) and beats.HEADER in (msg.headers or {})
        if beating:
            self._beating.add(msg.reply)
            await beats.beat(self.nc, msg.reply, holder=self.holder)
        task = asyncio.create_task(self._serve(msg, beating))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _is_held(self, msg: Msg) -> None:
        """A caller that heard nothing for a while asks whether its request (its reply
        subject) is in hand here, worked on or waiting."""
        if msg.reply:
            held = msg.data.decode(errors="replace") in self._beating
            with contextlib.suppress(Exception):
                await self.nc.publish(msg.reply, beats.HELD if held else beats.NOT_HELD)

    async def _serve(self, msg: Msg, beating: bool) -> None:
        reply = msg.reply
        if beating:
            _progress.set(lambda provider: self._progress.__setitem__(reply, provider))
        try:
            # (the span covers the wait for a worker too: a saturated instance shows)
            with tracing.serving(msg.headers, self.queue, self.subject):
                async with self._slots:
                    data = await self.handle(msg.data)
                if msg.reply:
                    await self.nc.publish(msg.reply, data)
        except Exception:  # the handle encodes every error: this is a bug, or NATS went away
            log.exception("responder.failed", subject=self.subject)
        finally:
            if beating:
                self._beating.discard(msg.reply)
                self._progress.pop(msg.reply, None)

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(beats.INTERVAL)
            for reply in list(self._beating):
                provider = self._progress.get(reply)
                progress = None
                if provider is not None:
                    with contextlib.suppress(Exception):
                        progress = provider()
                await beats.beat(self.nc, reply, progress, holder=self.holder)

    async def stop(self, timeout: float) -> None:
        """Take no more requests; wait up to ``timeout`` for those in hand, cancel the rest."""
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None
        if self._tasks:
            _, late = await asyncio.wait(list(self._tasks), timeout=timeout)
            if late:
                log.warning("responder.cancelled", subject=self.subject, requests=len(late))
                await aio.cancel_and_wait(list(late))
        if self._beater is not None:
            await aio.cancel_and_wait([self._beater])
            self._beater = None
        for sub in self._asked:  # (last: a caller of a cancelled request hears "not held")
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._asked.clear()

"""Requests whose responder says it is alive while it works, so that a caller learns within
seconds, not after its whole budget, that the instance handling its request died.

The caller sends the request with the header ``Sbx-Beat`` to an inbox of its own
(:class:`Replies`: one wildcard subscription per connection, as nats-py's own requests).
The responder (:class:`shared.infrastructure.responders.Responder`) publishes an empty
message with ``Sbx-Beat: beat`` (:func:`beat`) to that inbox the moment the request
arrives and every :data:`INTERVAL` until its reply leaves, while the request waits for a
worker too; the reply ends the exchange. Each beat names the responder instance's own
subject (``Sbx-Beat-From``).

Silence is not taken for a death on its own: a loaded machine can starve a live
responder for seconds. After :data:`SILENCE` without news the caller asks whether its
request is still held (:func:`held_subject`: the instance that beat, or every instance
of the subject when none has yet): no subscriber at all (the instance's connection is
gone: SIGKILL, a crash) or "not held" from the instance that beat (it lost the request)
is a death, a retriable ``Unavailable`` at once; "held" is life, and the wait goes on; no
answer within :data:`ASK_WAIT` (the instance is starved too) waits on, up to
:data:`GIVE_UP` seconds of silence in all. A request without the header (``nats req``,
a test) gets the reply only.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import weakref
from collections.abc import Awaitable, Callable

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg

from sbx_api import errors
from shared.infrastructure import tracing

HEADER = "Sbx-Beat"
FROM = "Sbx-Beat-From"
"""A beat's header naming the subject its responder instance answers "held?" on."""
PROGRESS = "Sbx-Progress"
"""A beat's header saying how far the work got, when the handler says (e.g. bytes of output)."""
INTERVAL = 0.5
"""Seconds between a responder's beats."""
SILENCE = 3.0
"""Seconds without a beat (the first included) after which the caller asks if its request is held."""
ASK_WAIT = 1.0
"""Seconds an "is it held?" question waits for its answers."""
GIVE_UP = 30.0
"""Seconds of silence after which the responder is taken for dead though nothing said so
(its instance or NATS unreachable, or starved that long)."""
HELD = b"1"
NOT_HELD = b"0"
_ANY = "_SBX.HELD.ANY."
_ONE = "_SBX.HELD.ONE."
BEAT = "beat"
"""The header's value on a beat (a reply may carry the request's headers back)."""
_NO_RESPONDERS = "503"


class Replies:
    """One connection's inbox for beating requests (``for_connection`` shares it)."""

    def __init__(self, nc: Client) -> None:
        self.nc = nc
        self._prefix: str | None = None
        self._waiting: dict[str, asyncio.Queue[Msg]] = {}
        self._ready = asyncio.Lock()

    async def _inbox(self) -> str:
        async with self._ready:
            if self._prefix is None:
                prefix = self.nc.new_inbox() + "."
                await self.nc.subscribe(prefix + "*", cb=self._heard)
                self._prefix = prefix
        return self._prefix

    async def _heard(self, msg: Msg) -> None:
        assert self._prefix is not None
        waiting = self._waiting.get(msg.subject[len(self._prefix) :])
        if waiting is not None:
            waiting.put_nowait(msg)

    async def request(
        self,
        subject: str,
        payload: bytes,
        *,
        timeout: float,
        who: str,
        on_progress: Callable[[str], Awaitable[None]] | None = None,
    ) -> bytes:
        """The reply's payload; ``Timeout`` after ``timeout`` in all, ``Unavailable`` when
        no ``who`` is running or the one handling it stops beating. ``on_progress`` gets
        what beats say of the work's progress."""
        token = secrets.token_hex(8)
        heard: asyncio.Queue[Msg] = asyncio.Queue()
        self._waiting[token] = heard
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        try:
            inbox = await self._inbox()
            headers = tracing.inject({HEADER: str(INTERVAL)})  # (and the caller's trace, if traced)
            await self.nc.publish(subject, payload, reply=inbox + token, headers=headers)
            holder: str | None = None  # the instance that beat: asked first
            news = loop.time()  # the last time anything was heard (or a holder said "held")
            while True:
                left = deadline - loop.time()
                if left <= 0:
                    raise _timed_out(who)
                try:
                    async with asyncio.timeout(min(left, SILENCE)):
                        msg = await heard.get()
                except TimeoutError:
                    if left <= SILENCE:  # the budget ran out (not the silence)
                        raise _timed_out(who) from None
                    verdict = await self._held(subject, inbox + token, holder, min(ASK_WAIT, left))
                    silent = loop.time() - news
                    if verdict == "held":
                        news = loop.time()
                    elif not heard.empty():  # (the reply came in meanwhile)
                        continue
                    elif verdict == "dead" or silent >= GIVE_UP:
                        raise errors.Unavailable(
                            f"the {who} handling this request stopped answering (nothing heard for "
                            f"{silent:.0f} s; it may have been restarted): the outcome is unknown; retry"
                        ) from None
                    continue
                news = loop.time()
                headers = msg.headers or {}
                if headers.get("Status") == _NO_RESPONDERS:
                    raise errors.Unavailable(f"no {who} is running; retry shortly")
                if headers.get(HEADER) == BEAT and not msg.data:
                    holder = headers.get(FROM) or holder
                    progress = headers.get(PROGRESS)
                    if progress and on_progress is not None:
                        await on_progress(progress)
                    continue
                return msg.data
        except (
            nats.errors.ConnectionClosedError,
            nats.errors.ConnectionReconnectingError,
            nats.errors.ConnectionDrainingError,
        ):
            raise errors.Unavailable("not connected to NATS; retry shortly") from None
        finally:
            self._waiting.pop(token, None)

    async def _held(self, subject: str, reply: str, holder: str | None, wait: float) -> str:
        """Whether the request answered on ``reply`` is held: "dead" (no instance there, or
        the one that beat no longer holds it), "held", or "unknown" (nobody answered)."""
        token = secrets.token_hex(8)
        answers: asyncio.Queue[Msg] = asyncio.Queue()
        self._waiting[token] = answers
        try:
            target = holder if holder is not None else held_subject(subject)
            await self.nc.publish(target, reply.encode(), reply=(await self._inbox()) + token)
            async with asyncio.timeout(wait):
                while True:
                    msg = await answers.get()
                    if (msg.headers or {}).get("Status") == _NO_RESPONDERS:
                        return "dead"
                    if msg.data == HELD:
                        return "held"
                    if holder is not None:  # the instance that had it has it no more
                        return "dead"
                    # (one instance of several without it: another may hold it, starved)
        except TimeoutError:
            return "unknown"
        finally:
            self._waiting.pop(token, None)


def _timed_out(who: str) -> errors.Timeout:
    return errors.Timeout(
        f"the {who} did not answer in time; the outcome is unknown, retrying with the same "
        "Idempotency-Key is safe"
    )


_replies: weakref.WeakKeyDictionary[Client, Replies] = weakref.WeakKeyDictionary()


def for_connection(nc: Client) -> Replies:
    replies = _replies.get(nc)
    if replies is None:
        replies = _replies[nc] = Replies(nc)
    return replies


def held_subject(subject: str) -> str:
    """Where every instance answering ``subject`` says whether it holds a request."""
    return _ANY + subject


def instance_subject() -> str:
    """A new subject for one responder instance to answer "held?" on."""
    return _ONE + secrets.token_hex(8)


async def beat(nc: Client, reply: str, progress: str | None = None, *, holder: str | None = None) -> None:
    """Tell the caller waiting on ``reply`` that its request is in hand (by the instance
    answering on ``holder``), and how far it got if ``progress`` says (a lost beat only
    makes it wait)."""
    headers = {HEADER: BEAT}
    if holder is not None:
        headers[FROM] = holder
    if progress is not None:
        headers[PROGRESS] = progress
    with contextlib.suppress(Exception):
        await nc.publish(reply, b"", headers=headers)

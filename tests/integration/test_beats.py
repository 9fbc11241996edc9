"""Beating requests over a real nats-server: a working responder keeps its caller waiting as
long as the budget allows, a dead one is noticed within seconds, a queued request is not
taken for dead, and a caller that did not ask for beats hears only the reply."""

from __future__ import annotations

import asyncio
import time

import nats
import pytest

from shared.contract import errors
from shared.infrastructure import beats


async def reachable(nc, subject: str) -> None:
    """Until the server routes ``subject`` to its new subscriber: right after a subscribe
    (even flushed) nats-server may still answer "no responders" for a moment."""
    for _ in range(100):
        try:
            await nc.request(subject + ".ping", b"", timeout=1)
            return
        except nats.errors.NoRespondersError:
            await asyncio.sleep(0.02)
    raise AssertionError(f"{subject} never became reachable")


async def responder(url: str, subject: str, work_for: float, *, reply: bytes = b"done"):
    """A separate connection answering ``subject`` after ``work_for`` seconds, beating
    (and ``<subject>.ping`` at once, to know it is reachable)."""
    nc = await nats.connect(url)

    async def on_request(msg) -> None:
        async def work() -> bytes:
            await asyncio.sleep(work_for)
            return reply

        answer = await beats.beating(nc, msg, work())
        await msg.respond(answer)

    async def on_ping(msg) -> None:
        await msg.respond(b"")

    await nc.subscribe(subject, cb=on_request)
    await nc.subscribe(subject + ".ping", cb=on_ping)  # after: reachable once this is
    await nc.flush()
    return nc


async def test_a_working_responder_is_waited_for_past_the_silence(bus, nats_server):
    nc, _ = bus
    them = await responder(nats_server.url, "beats.slow", beats.SILENCE + 2)
    await reachable(nc, "beats.slow")
    try:
        got = await beats.for_connection(nc).request("beats.slow", b"", timeout=30, who="worker")
        assert got == b"done"
    finally:
        await them.close()


async def test_a_dead_responder_is_noticed_within_the_silence(bus, nats_server):
    nc, _ = bus
    them = await responder(nats_server.url, "beats.dying", 60)
    await reachable(nc, "beats.dying")
    call = asyncio.create_task(beats.for_connection(nc).request("beats.dying", b"", timeout=60, who="worker"))
    await asyncio.sleep(1)  # it took the request and beats
    assert not call.done()
    died = time.monotonic()
    await them.close()  # its beats stop, as when the process is killed
    with pytest.raises(errors.Unavailable, match="stopped answering") as caught:
        await call
    assert caught.value.retriable
    assert time.monotonic() - died < 30  # long before the 60 s budget


async def test_a_request_without_the_header_gets_the_reply_only(bus, nats_server):
    nc, _ = bus
    them = await responder(nats_server.url, "beats.plain", 1.2)  # at least two beats' time
    await reachable(nc, "beats.plain")
    try:
        msg = await nc.request("beats.plain", b"", timeout=10)
        assert msg.data == b"done" and not msg.headers
    finally:
        await them.close()


async def test_no_responder_and_the_budget(bus, nats_server):
    nc, _ = bus
    replies = beats.for_connection(nc)
    with pytest.raises(errors.Unavailable, match="no worker is running"):
        await replies.request("beats.nobody", b"", timeout=10, who="worker")
    them = await responder(nats_server.url, "beats.long", 30)
    await reachable(nc, "beats.long")
    try:
        with pytest.raises(errors.Timeout, match="did not answer in time"):
            await replies.request("beats.long", b"", timeout=1.5, who="worker")
    finally:
        await them.close()


async def test_a_queued_request_is_not_taken_for_dead(bus, nats_server):
    """A responder that takes requests one at a time: the second waits longer than the
    silence before its first beat, and still gets its answer."""
    nc, _ = bus
    them = await nats.connect(nats_server.url)
    turn = asyncio.Lock()

    async def on_request(msg) -> None:
        async with turn:
            await asyncio.sleep(0.2)  # not beating yet: queued in this process
            await asyncio.sleep(beats.SILENCE + 0.5)

            async def work() -> bytes:
                return msg.data

            await msg.respond(await beats.beating(them, msg, work()))

    async def on_ping(msg) -> None:
        await msg.respond(b"")

    await them.subscribe("beats.queue", cb=on_request)
    await them.subscribe("beats.queue.ping", cb=on_ping)
    await them.flush()
    await reachable(nc, "beats.queue")
    try:
        replies = beats.for_connection(nc)
        got = await asyncio.gather(
            replies.request("beats.queue", b"1", timeout=30, who="worker"),
            replies.request("beats.queue", b"2", timeout=30, who="worker"),
        )
        assert sorted(got) == [b"1", b"2"]
    finally:
        await them.close()

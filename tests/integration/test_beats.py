"""Beating requests over a real nats-server, answered by the services' own Responder: a
working responder keeps its caller waiting as long as the budget allows, a dead one is
noticed within seconds (also when it died before working on the request, or was
SIGKILLed in another process), one starved past the silence (its whole process stopped,
as on a loaded machine) is waited for, a request waiting for a worker is not taken for
dead, too many in hand are refused at once, and a caller that did not ask for beats hears
only the reply."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import nats
import pytest

from sbx_api import errors
from shared.contract import codec, commands
from shared.infrastructure import beats, responders


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


def _busy(info: commands.ErrorInfo) -> bytes:
    return codec.encode(commands.CommandReply(ok=False, error=info))


async def responder(url: str, subject: str, work_for: float, *, reply: bytes = b"done", workers: int = 8):
    """A separate connection answering ``subject`` (a Responder) after ``work_for``
    seconds (and ``<subject>.ping`` at once, to know it is reachable)."""
    nc = await nats.connect(url)

    async def work(_: bytes) -> bytes:
        await asyncio.sleep(work_for)
        return reply

    async def on_ping(msg) -> None:
        await msg.respond(b"")

    await responders.Responder(nc, subject, work, queue="workers", workers=workers, busy=_busy).start()
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


async def test_a_request_waiting_for_a_worker_is_not_taken_for_dead(bus, nats_server):
    """One worker: the second request waits longer than the silence for it, beaten all the
    while, and gets its answer."""
    nc, _ = bus
    them = await responder(nats_server.url, "beats.queue", beats.SILENCE + 0.5, workers=1)
    await reachable(nc, "beats.queue")
    try:
        replies = beats.for_connection(nc)
        got = await asyncio.gather(
            replies.request("beats.queue", b"1", timeout=30, who="worker"),
            replies.request("beats.queue", b"2", timeout=30, who="worker"),
        )
        assert got == [b"done", b"done"]
    finally:
        await them.close()


async def test_a_request_lost_before_any_work_is_noticed_within_the_silence(bus, nats_server):
    """A responder process that took the request off the wire and died before working on
    it (no beat ever sent): the caller hears the silence, not its whole budget."""
    nc, _ = bus
    them = await nats.connect(nats_server.url)

    async def take(msg) -> None:  # takes it, never answers
        pass

    async def on_ping(msg) -> None:
        await msg.respond(b"")

    await them.subscribe("beats.lost", cb=take)
    await them.subscribe("beats.lost.ping", cb=on_ping)
    await them.flush()
    await reachable(nc, "beats.lost")
    try:  # heard as a death ("stopped answering"), not as the budget running out ("in time")
        with pytest.raises(errors.Unavailable, match="stopped answering"):
            await beats.for_connection(nc).request("beats.lost", b"", timeout=12, who="worker")
    finally:
        await them.close()


async def test_too_many_requests_in_hand_are_refused_at_once(bus, nats_server):
    nc, _ = bus
    them = await responder(nats_server.url, "beats.full", 30, workers=1)  # holds 1 + 4 waiting
    await reachable(nc, "beats.full")
    replies = beats.for_connection(nc)
    held = [asyncio.create_task(replies.request("beats.full", b"", timeout=60, who="w")) for _ in range(5)]
    try:
        await asyncio.sleep(0.5)
        refused = codec.decode_reply(await replies.request("beats.full", b"", timeout=10, who="w"))
        assert not refused.ok and refused.error.code == "unavailable", refused
        assert "requests in hand; retry shortly" in refused.error.message
        assert not any(t.done() for t in held)
    finally:
        for t in held:
            t.cancel()
        await asyncio.gather(*held, return_exceptions=True)
        await them.close()


# A responder in a process of its own: it prints "ready" once subscribed and answers
# "done" after ``work`` seconds of asyncio sleep.
_RESPONDER = """
import asyncio, sys
import nats
from shared.contract import codec, commands
from shared.infrastructure import responders

async def main(url, subject, work):
    nc = await nats.connect(url)
    async def handle(_):
        await asyncio.sleep(work)
        return b"done"
    async def on_ping(msg):
        await msg.respond(b"")
    busy = lambda info: codec.encode(commands.CommandReply(ok=False, error=info))
    await responders.Responder(nc, subject, handle, queue="workers", workers=1, busy=busy).start()
    await nc.subscribe(subject + ".ping", cb=on_ping)
    await nc.flush()
    print("ready", flush=True)
    await asyncio.Event().wait()

asyncio.run(main(sys.argv[1], sys.argv[2], float(sys.argv[3])))
"""


def _process(url: str, subject: str, work: float) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _RESPONDER, url, subject, str(work)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


async def test_a_responder_starved_past_the_silence_is_waited_for(bus, nats_server):
    """Its process stopped (SIGSTOP) for longer than the silence while it holds the
    request, as a loaded machine starves it: no beat, no answer to "held?", and the caller
    still waits and gets the reply (it would have given up after the silence before)."""
    nc, _ = bus
    proc = _process(nats_server.url, "beats.starved", 1.0)
    try:
        await reachable(nc, "beats.starved")
        call = asyncio.create_task(
            beats.for_connection(nc).request("beats.starved", b"", timeout=60, who="w")
        )
        await asyncio.sleep(0.3)  # it took the request and beat
        os.kill(proc.pid, signal.SIGSTOP)
        await asyncio.sleep(beats.SILENCE + beats.ASK_WAIT + 2)
        assert not call.done()
        os.kill(proc.pid, signal.SIGCONT)
        assert await call == b"done"
    finally:
        proc.kill()
        proc.wait()


async def test_a_responder_sigkilled_in_its_own_process_is_noticed_within_seconds(bus, nats_server):
    nc, _ = bus
    proc = _process(nats_server.url, "beats.killed", 60)
    try:
        await reachable(nc, "beats.killed")
        call = asyncio.create_task(beats.for_connection(nc).request("beats.killed", b"", timeout=60, who="w"))
        await asyncio.sleep(1)  # it took the request and beats
        assert not call.done()
        died = time.monotonic()
        proc.kill()
        with pytest.raises(errors.Unavailable, match="stopped answering"):
            await call
        assert time.monotonic() - died < beats.GIVE_UP  # its connection went: not the long wait
    finally:
        proc.kill()
        proc.wait()

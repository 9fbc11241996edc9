"""Flow-controlled byte streams over a real nats-server (shared.infrastructure.streams)."""

from __future__ import annotations

import asyncio

import pytest

from sbx_api import errors
from shared.infrastructure import streams


async def test_frames_arrive_in_order_split_at_the_chunk_size_and_end(bus):
    nc, _ = bus
    payload = bytes(range(256)) * (streams.CHUNK // 64)  # four chunks
    async with streams.Receiver(nc) as receiver:
        async with streams.Sender(nc, receiver.subject) as sender:

            async def send() -> None:
                await sender.send(b"o", payload)
                await sender.send(b"e", b"tail")
                await sender.end(b'{"exit_code": 0}')

            sending = asyncio.create_task(send())
            got = [frame async for frame in receiver.frames()]
            await sending
    assert b"".join(f.data for f in got if f.channel == b"o") == payload
    assert [f.channel for f in got][-2:] == [b"e", b"x"]
    assert max(len(f.data) for f in got) == streams.CHUNK


async def test_a_slow_reader_holds_the_sender_back(bus):
    """At most WINDOW frames are unacknowledged: the sender waits for the reader."""
    nc, _ = bus
    async with streams.Receiver(nc) as receiver:
        async with streams.Sender(nc, receiver.subject, window=2) as sender:
            sent = 0

            async def send() -> None:
                nonlocal sent
                for _ in range(10):
                    await sender.send(b"o", b"x")
                    sent += 1
                await sender.end(b"{}")

            sending = asyncio.create_task(send())
            frames = receiver.frames()
            first = await anext(frames)
            await asyncio.sleep(0.3)  # the reader dawdles: the sender must not run ahead
            assert first.data == b"x"
            assert sent <= 3
            rest = [frame async for frame in frames]
            await sending
    assert len(rest) == 10  # nine more "x" and the end
    assert sent == 10


async def test_a_reader_that_stops_aborts_the_sender(bus):
    nc, _ = bus
    async with streams.Receiver(nc) as receiver:
        async with streams.Sender(nc, receiver.subject, window=2) as sender:

            async def send() -> None:
                for _ in range(100):
                    await sender.send(b"o", b"x")

            sending = asyncio.create_task(send())
            frames = receiver.frames()
            await anext(frames)
            await frames.aclose()  # the reader stops: its pending frame is answered "stop"
            with pytest.raises(streams.Aborted, match="stopped"):
                await asyncio.wait_for(sending, 10)


async def test_a_reader_that_is_gone_aborts_the_sender(bus):
    nc, _ = bus
    async with streams.Sender(nc, nc.new_inbox(), ack_timeout=5) as sender:
        with pytest.raises(streams.Aborted):
            await sender.send(b"o", b"nobody listens")
            await sender.end(b"{}")


async def test_a_silent_sender_makes_the_reader_give_up(bus):
    nc, _ = bus
    async with streams.Receiver(nc, silence=0.3) as receiver:
        with pytest.raises(errors.Unavailable, match="stopped answering"):
            async for _ in receiver.frames():
                pass


async def test_an_error_frame_ends_the_stream(bus):
    nc, _ = bus
    async with streams.Receiver(nc) as receiver:
        async with streams.Sender(nc, receiver.subject) as sender:
            sending = asyncio.create_task(sender.error(errors.NotRunning("the sandbox is stopped")))
            got = [frame async for frame in receiver.frames()]
            await sending
    assert [f.channel for f in got] == [b"!"]
    assert b"not_running" in got[0].data

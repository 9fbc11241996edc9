"""A run's output in standard media types and content negotiation (issue 20, item 2)."""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sbx_api import errors, hostapi
from services.gateway import hostapi as gateway_hostapi
from services.gateway import media
from shared.infrastructure import streams

OFFERS = media.RUN_MEDIA_TYPES


@pytest.mark.parametrize(
    ("accept", "chosen"),
    [
        (None, hostapi.NDJSON),
        ("", hostapi.NDJSON),
        ("*/*", hostapi.NDJSON),
        ("text/event-stream", hostapi.EVENT_STREAM),
        ("application/vnd.sbx.frames, application/json", hostapi.MEDIA_TYPE),
        ("text/*;q=0.5, */*;q=0.1", hostapi.EVENT_STREAM),
        ("application/x-ndjson;q=0.2, text/event-stream;q=0.9", hostapi.EVENT_STREAM),
        ("*/*, application/x-ndjson;q=0", hostapi.EVENT_STREAM),  # the exact range decides
        ("APPLICATION/X-NDJSON", hostapi.NDJSON),
    ],
)
def test_negotiation_follows_the_accept_header(accept, chosen):
    assert media.negotiate(accept, OFFERS) == chosen


@pytest.mark.parametrize("accept", ["text/html", "application/json", "*/*;q=0", "garbage", "x/y;q=abc"])
def test_an_accept_that_admits_nothing_is_refused(accept):
    with pytest.raises(errors.NotAcceptable):
        media.negotiate(accept, OFFERS)


def lines(encoded: bytes) -> list[dict]:
    return [json.loads(line) for line in encoded.splitlines() if line]


@given(st.text(), st.integers(min_value=1, max_value=7))
def test_text_is_whole_however_the_bytes_are_cut(text, cut):
    encoder = media.RunEncoder(hostapi.NDJSON)
    raw = text.encode()
    out = b"".join(encoder.encode(hostapi.STDOUT, raw[i : i + cut]) for i in range(0, len(raw), cut))
    out += encoder.encode(hostapi.END, b'{"exit_code": 0}')
    events = lines(out)
    assert "".join(e["data"] for e in events if e["type"] == "stdout") == text
    assert events[-1]["type"] == "exit" and events[-1]["exit_code"] == 0


def test_events_and_their_server_sent_form():
    ndjson = media.RunEncoder(hostapi.NDJSON)
    assert lines(ndjson.encode(hostapi.STDERR, b"\xffok")) == [{"type": "stderr", "data": "\ufffdok"}]
    assert lines(ndjson.encode(hostapi.KEEPALIVE, b"")) == [{"type": "keepalive"}]
    assert lines(ndjson.encode(hostapi.LISTING, b"f 644 1\0")) == [
        {"type": "listing", "data": "ZiA2NDQgMQA="}
    ]
    # A character cut at the end is flushed (replaced) before the last event.
    ndjson.encode(hostapi.STDOUT, "é".encode()[:1])
    failed = lines(ndjson.encode(hostapi.ERROR, b'{"error":"not_running","message":"gone","status":409}'))
    assert failed == [
        {"type": "stdout", "data": "\ufffd"},
        {"type": "error", "error": "not_running", "message": "gone", "status": 409, "retriable": False},
    ]
    sse = media.RunEncoder(hostapi.EVENT_STREAM)
    assert sse.encode(hostapi.STDOUT, b"a\n") == b'event: stdout\ndata: {"type":"stdout","data":"a\\n"}\n\n'
    assert sse.encode(hostapi.KEEPALIVE, b"") == b": keepalive\n\n"
    assert sse.error(errors.Unavailable("down")).startswith(b"event: error\ndata: ")
    frames = media.RunEncoder(hostapi.MEDIA_TYPE)
    assert frames.encode(hostapi.STDOUT, b"x") == hostapi.frame(hostapi.STDOUT, b"x")
    assert (
        lines(media.RunEncoder(hostapi.NDJSON).encode(hostapi.END, b"{broken"))[0]["error"] == "unavailable"
    )


async def test_keepalives_fill_silence_and_frames_pass_in_order():
    """The source waits until the consumer has seen a keepalive, so one must come."""
    seen_keepalive = asyncio.Event()

    async def source():
        yield streams.Frame(hostapi.STDOUT, b"1")
        await seen_keepalive.wait()
        yield streams.Frame(hostapi.END, b"{}")

    got = []
    async for frame in gateway_hostapi.with_keepalives(source(), gateway_hostapi.KEEPALIVE_FRAME, every=0.01):
        got.append(frame.channel)
        if frame.channel == hostapi.KEEPALIVE:
            seen_keepalive.set()
    assert got[0] == hostapi.STDOUT and got[-1] == hostapi.END
    assert set(got[1:-1]) == {hostapi.KEEPALIVE}


async def test_a_consumer_that_leaves_closes_the_source():
    closed = asyncio.Event()

    async def source():
        try:
            yield streams.Frame(hostapi.STDOUT, b"1")
            await asyncio.sleep(3600)
        finally:
            closed.set()

    relay = gateway_hostapi.with_keepalives(source(), gateway_hostapi.KEEPALIVE_FRAME, every=0.01)
    assert (await anext(relay)).channel == hostapi.STDOUT
    assert (await anext(relay)).channel == hostapi.KEEPALIVE
    await relay.aclose()
    assert closed.is_set()

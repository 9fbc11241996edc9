"""Content negotiation and a run's output in standard media types (pure: no I/O).

The executor's answer is frames (:mod:`sbx_api.hostapi`); the agent-host client
takes them as they are. Everyone else gets one :data:`~sbx_api.hostapi.RunEvent`
per NDJSON line or per server-sent event, readable with curl and a browser's ``fetch``.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

import msgspec

from sbx_api import errors, hostapi

RUN_MEDIA_TYPES = (hostapi.NDJSON, hostapi.EVENT_STREAM, hostapi.MEDIA_TYPE)
"""What a run answers with, the default first."""
_encoder = msgspec.json.Encoder()


def negotiate(accept: str | None, offers: Sequence[str]) -> str:
    """The offer an ``Accept`` header prefers (RFC 9110: the most specific range decides an
    offer's weight; ties go to the earlier offer); the first offer when there is no header.
    :class:`~sbx_api.errors.NotAcceptable` when it admits none."""
    if not accept or not accept.strip():
        return offers[0]
    ranges: list[tuple[str, str, float]] = []
    for item in accept.split(","):
        media, *params = (part.strip() for part in item.split(";"))
        kind, _, sub = media.lower().partition("/")
        if not kind or not sub:
            continue
        weight = 1.0
        for param in params:
            name, _, value = param.partition("=")
            if name.strip().lower() == "q":
                try:
                    weight = min(max(float(value), 0.0), 1.0)
                except ValueError:
                    weight = 0.0
        ranges.append((kind, sub, weight))
    best, best_weight = None, 0.0
    for offer in offers:
        kind, _, sub = offer.partition("/")
        matches = [
            (specificity, weight)
            for k, s, weight in ranges
            if (specificity := _specificity(k, s, kind, sub)) >= 0
        ]
        if not matches:
            continue
        weight = max(matches)[1]
        if weight > best_weight:
            best, best_weight = offer, weight
    if best is None:
        raise errors.NotAcceptable(
            f"this route answers with {', '.join(offers)}; Accept: {accept[:200]!r} admits none"
        )
    return best


def _specificity(range_kind: str, range_sub: str, kind: str, sub: str) -> int:
    """2 for an exact match, 1 for ``type/*``, 0 for ``*/*``, -1 for no match."""
    if range_kind == kind and range_sub == sub:
        return 2
    if range_kind == kind and range_sub == "*":
        return 1
    if range_kind == "*" and range_sub == "*":
        return 0
    return -1


class RunEncoder:
    """A run's frames in one media type. Output is decoded as UTF-8 per channel, so a
    character split between two frames is kept whole."""

    def __init__(self, media_type: str) -> None:
        self.media_type = media_type
        self._text = {
            hostapi.STDOUT: codecs.getincrementaldecoder("utf-8")("replace"),
            hostapi.STDERR: codecs.getincrementaldecoder("utf-8")("replace"),
        }

    def encode(self, channel: bytes, data: bytes) -> bytes:
        """The bytes to send for one frame (``b""`` for nothing)."""
        if self.media_type == hostapi.MEDIA_TYPE:
            return hostapi.frame(channel, data)
        if channel == hostapi.KEEPALIVE:
            return (
                b": keepalive\n\n"
                if self.media_type == hostapi.EVENT_STREAM
                else self._event(hostapi.Keepalive())
            )
        if channel in self._text:
            text = self._text[channel].decode(data)
            return self._output(channel, text) if text else b""
        if channel == hostapi.END:
            rest = self._flush()
            try:
                end = msgspec.json.decode(data, type=hostapi.End)
            except msgspec.DecodeError:
                return rest + self._failed(errors.Unavailable("the executor's answer was malformed"))
            return rest + self._event(hostapi.Exit(**msgspec.structs.asdict(end)))
        if channel == hostapi.ERROR:
            rest = self._flush()
            try:
                return rest + self._event(msgspec.json.decode(data, type=hostapi.Failed))
            except msgspec.DecodeError:
                return rest + self._failed(errors.Unavailable("the executor's error was malformed"))
        if channel == hostapi.LISTING:
            return self._event(hostapi.Listing(data=data))
        return b""  # (a tar: never asked for in these media types)

    def error(self, exc: errors.SandboxError) -> bytes:
        """The last event when the stream fails on the gateway's side."""
        return self._flush() + self._failed(exc)

    def _failed(self, exc: errors.SandboxError) -> bytes:
        return self._event(
            hostapi.Failed(error=exc.code, message=exc.message, status=exc.status, retriable=exc.retriable)
        )

    def _flush(self) -> bytes:
        out = b""
        for channel, decoder in self._text.items():
            if text := decoder.decode(b"", final=True):
                out += self._output(channel, text)
        return out

    def _output(self, channel: bytes, text: str) -> bytes:
        return self._event(
            hostapi.Stdout(data=text) if channel == hostapi.STDOUT else hostapi.Stderr(data=text)
        )

    def _event(self, event: hostapi.RunEvent) -> bytes:
        line = _encoder.encode(event)
        if self.media_type == hostapi.EVENT_STREAM:
            return b"event: " + _NAMES[type(event)] + b"\ndata: " + line + b"\n\n"
        return line + b"\n"


_NAMES: dict[type, bytes] = {
    kind: str(kind.__struct_config__.tag).encode()
    for kind in (
        hostapi.Stdout,
        hostapi.Stderr,
        hostapi.Listing,
        hostapi.Exit,
        hostapi.Failed,
        hostapi.Keepalive,
    )
}
"""Each event's ``type``, the name of its server-sent event."""

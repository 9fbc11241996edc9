"""Wire encoding (JSON via msgspec) and schema evolution for stored events.

Decoders are built once at import. Stored events are decoded on a fast path
when they carry their type's current version; older payloads go through the
registered upcasters (``UPCASTERS[(type, v)]`` turns a ``v`` dict into ``v + 1``)
before being converted.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import msgspec

from sbx_api import errors
from shared.contract import commands, events

T = TypeVar("T")

_encoder = msgspec.json.Encoder()
_event_decoder = msgspec.json.Decoder(events.AnyEvent)
_command_decoder = msgspec.json.Decoder(commands.SessionCommand)
_reply_decoder = msgspec.json.Decoder(commands.CommandReply)

CURRENT_VERSION: dict[str, int] = {
    events.tag_of(cls): events.current_version(cls) for cls in events.EVENT_TYPES
}

Upcaster = Callable[[dict[str, Any]], dict[str, Any]]
#: ``(type tag, from version) -> function`` returning the payload at ``from version + 1``.
#: Empty while every event type is at v1; the mechanism is exercised by tests.
UPCASTERS: dict[tuple[str, int], Upcaster] = {}


def encode(obj: msgspec.Struct) -> bytes:
    return _encoder.encode(obj)


def decode_event(data: bytes | memoryview) -> events.AnyEvent:
    """Decode a stored event of any known type and version, or raise CorruptEvent."""
    try:
        event = _event_decoder.decode(data)
    except msgspec.ValidationError:
        event = None
    except msgspec.DecodeError as exc:
        raise errors.CorruptEvent(f"stored event is not JSON: {exc}") from exc
    if event is not None and event.v == CURRENT_VERSION[events.tag_of(type(event))]:
        return event
    return _upcast(msgspec.json.decode(data))


def _upcast(raw: Any) -> events.AnyEvent:
    if not isinstance(raw, dict) or not isinstance(raw.get("type"), str):
        raise errors.CorruptEvent("stored event has no type tag")
    tag = raw["type"]
    if tag not in CURRENT_VERSION:
        raise errors.CorruptEvent(f"unknown event type {tag!r} (written by a newer version?)")
    version = raw.get("v", 1)
    if not isinstance(version, int) or version < 1:
        raise errors.CorruptEvent(f"event {tag!r} has an invalid schema version {version!r}")
    if version > CURRENT_VERSION[tag]:
        raise errors.CorruptEvent(
            f"event {tag!r} v{version} is newer than this build understands (v{CURRENT_VERSION[tag]})"
        )
    while version < CURRENT_VERSION[tag]:
        upcaster = UPCASTERS.get((tag, version))
        if upcaster is None:
            raise errors.CorruptEvent(f"no upcaster for {tag!r} v{version}")
        raw = upcaster(dict(raw))
        version += 1
        raw["v"] = version
    try:
        event: events.AnyEvent = msgspec.convert(raw, events.AnyEvent)
        return event
    except msgspec.ValidationError as exc:
        raise errors.CorruptEvent(f"event {tag!r} v{version} does not match its schema: {exc}") from exc


def decode_command(data: bytes | memoryview) -> commands.SessionCommand:
    try:
        return _command_decoder.decode(data)
    except msgspec.DecodeError as exc:  # ValidationError is a subclass
        raise errors.InvalidInput(f"malformed command: {exc}") from exc


def decode_reply(data: bytes | memoryview) -> commands.CommandReply:
    return _reply_decoder.decode(data)


def decode_state(data: bytes | memoryview, state_type: type[T]) -> T:
    return msgspec.json.decode(data, type=state_type)


def to_builtins(obj: Any) -> Any:
    """JSON-ready builtins (for ``--json`` output and REST bodies)."""
    return msgspec.to_builtins(obj)


__all__ = [
    "CURRENT_VERSION",
    "UPCASTERS",
    "decode_command",
    "decode_event",
    "decode_reply",
    "decode_state",
    "encode",
    "to_builtins",
]

"""Connect RPC's wire, as envd speaks it with the JSON codec over HTTP/1.1: unary calls
(a JSON body, a JSON answer, errors as ``{"code", "message"}`` with the code's HTTP
status) and server streams (enveloped messages: a flag byte, a 4-byte length, JSON; the
last envelope, flagged end of stream, carries the error if there is one)."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator
from typing import Any, TypeVar

import msgspec
from starlette.types import Receive, Send

from sbx_api import errors

BODY_MAX = 1024 * 1024
"""Largest request body of an envd call, and message of a client stream (a stdin chunk is
the largest there is)."""
SILENCE = 60.0
"""A client stream that sends nothing for this long is given up on."""
_ENVELOPE = struct.Struct(">BI")
END_STREAM = 0x02
STREAM_JSON = "application/connect+json"
UNARY_JSON = "application/json"
STATUS_OF = {
    "invalid_argument": 400,
    "failed_precondition": 400,
    "unauthenticated": 401,
    "permission_denied": 403,
    "not_found": 404,
    "already_exists": 409,
    "resource_exhausted": 429,
    "unimplemented": 501,
    "unavailable": 503,
    "deadline_exceeded": 504,
    "internal": 500,
}
_encoder = msgspec.json.Encoder()
M = TypeVar("M", bound=msgspec.Struct)


class ConnectError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def envelope(payload: bytes, flags: int = 0) -> bytes:
    return _ENVELOPE.pack(flags, len(payload)) + payload


def message(body: Any) -> bytes:
    """One streamed message, enveloped."""
    return envelope(_encoder.encode(body))


def end_stream(error: ConnectError | None = None) -> bytes:
    body = {} if error is None else {"error": {"code": error.code, "message": error.message}}
    return envelope(_encoder.encode(body), END_STREAM)


async def body(receive: Receive, limit: int = BODY_MAX) -> bytes:
    raw = bytearray()
    while True:
        part = await receive()
        raw += part.get("body", b"")
        if len(raw) > limit:
            raise ConnectError("resource_exhausted", f"request larger than {limit} bytes")
        if not part.get("more_body"):
            return bytes(raw)


def decode(raw: bytes, kind: type[M]) -> M:
    try:
        return msgspec.json.decode(raw, type=kind)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ConnectError("invalid_argument", f"invalid {kind.__name__}: {exc}") from None


async def envelopes(receive: Receive, limit: int = BODY_MAX) -> AsyncIterator[bytes]:
    """A client stream's messages as they arrive, each at most ``limit`` bytes."""
    buffer = bytearray()
    more = True
    while True:
        while len(buffer) >= _ENVELOPE.size:
            flags, size = _ENVELOPE.unpack_from(buffer)
            if flags != 0 or size > limit:
                raise ConnectError(
                    "invalid_argument", f"expected uncompressed messages of at most {limit} bytes"
                )
            if len(buffer) < _ENVELOPE.size + size:
                break
            yield bytes(buffer[_ENVELOPE.size : _ENVELOPE.size + size])
            del buffer[: _ENVELOPE.size + size]
        if not more:
            if buffer:
                raise ConnectError("invalid_argument", "the stream ended in the middle of a message")
            return
        try:
            async with asyncio.timeout(SILENCE):
                part = await receive()
        except TimeoutError:
            raise ConnectError("deadline_exceeded", f"the stream sent nothing for {SILENCE:g} s") from None
        buffer += part.get("body", b"")
        more = bool(part.get("more_body"))


def unenvelope(raw: bytes) -> bytes:
    """The one message of a server-streaming call's request."""
    if len(raw) < _ENVELOPE.size:
        raise ConnectError("invalid_argument", "expected one Connect envelope")
    flags, size = _ENVELOPE.unpack_from(raw)
    if flags != 0 or size != len(raw) - _ENVELOPE.size:
        raise ConnectError("invalid_argument", "expected one uncompressed Connect envelope")
    return raw[_ENVELOPE.size :]


async def respond(send: Send, status: int, body: bytes, content_type: str | None = None) -> None:
    headers = [(b"content-length", str(len(body)).encode())]
    if content_type is not None:
        headers.append((b"content-type", content_type.encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def unary(send: Send, answer: Any) -> None:
    await respond(send, 200, _encoder.encode(answer), UNARY_JSON)


async def error(send: Send, exc: ConnectError) -> None:
    payload = _encoder.encode({"code": exc.code, "message": exc.message})
    await respond(send, STATUS_OF.get(exc.code, 500), payload, UNARY_JSON)


def from_error(exc: errors.SandboxError) -> ConnectError:
    """The stack's error as Connect's (its message kept)."""
    match exc:
        case errors.NotFound():
            code = "not_found"
        case errors.InvalidInput():
            code = "invalid_argument"
        case errors.LimitExceeded():
            code = "resource_exhausted"
        case errors.Timeout():
            code = "deadline_exceeded"
        case errors.NotRunning():
            code = "unavailable"
        case errors.Conflict():
            code = "failed_precondition"
        case _:
            code = "unavailable" if exc.retriable else "internal"
    return ConnectError(code, exc.message)

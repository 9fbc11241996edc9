"""Bearer-key authentication, checked before any handler runs.

``Authorization: Bearer <key>``; the scheme is case-insensitive (RFC 9110 §11.1),
exactly one space separates it from the key, and the key is compared in
constant time (digests of equal length, so not even its length leaks).
"""

from __future__ import annotations

import hashlib
import hmac
import json

from starlette.types import ASGIApp, Receive, Scope, Send


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


class KeyCheck:
    def __init__(self, api_key: str) -> None:
        self._expected = _digest(api_key.encode())

    def accepts(self, header_values: list[bytes]) -> bool:
        """True iff exactly one well-formed ``Authorization: Bearer`` header carries the key."""
        if len(header_values) != 1:
            return False
        try:
            value = header_values[0].decode("ascii")
        except UnicodeDecodeError:
            return False
        scheme, sep, token = value.partition(" ")
        if not sep or scheme.lower() != "bearer" or not token or not token.isprintable() or " " in token:
            return False
        return hmac.compare_digest(_digest(token.encode()), self._expected)


UNAUTHORIZED_BODY = json.dumps(
    {
        "error": "unauthorized",
        "message": "missing or invalid API key: send 'Authorization: Bearer <SANDBOX_API_KEY>'",
        "status": 401,
    }
).encode()


class BearerAuth:
    """ASGI middleware: 401 with ``WWW-Authenticate: Bearer`` unless the key matches.

    Paths in ``public`` (exact matches) pass without a key.
    """

    def __init__(self, app: ASGIApp, check: KeyCheck, *, public: frozenset[str]) -> None:
        self.app = app
        self.check = check
        self.public = public

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.public:
            await self.app(scope, receive, send)
            return
        values = [v for k, v in scope["headers"] if k == b"authorization"]
        if self.check.accepts(values):
            await self.app(scope, receive, send)
            return
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"www-authenticate", b'Bearer realm="sandbox"'),
                    (b"content-length", str(len(UNAUTHORIZED_BODY)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": UNAUTHORIZED_BODY})

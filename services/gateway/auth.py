"""Bearer-key authentication, checked before any handler runs.

``Authorization: Bearer <key>``; the scheme is case-insensitive (RFC 9110 §11.1),
exactly one space separates it from the key, and the key is compared in
constant time (digests of equal length, so not even its length leaks).

Two kinds of key: the operator's (``SANDBOX_API_KEY``), whose calls say which
organisation they act for in ``X-Org-Id`` (or none), and keys bound to one organisation
(``SBX_ORG_KEYS``): their calls act for that organisation only. The middleware sets
``X-Org-Id`` from the key (a different one in the request is refused with 403), so every
handler, REST, MCP or host API, sees the organisation the key allows, and the scheduler
keeps it out of other organisations' sessions.
"""

from __future__ import annotations

import hashlib
import hmac
import json

from starlette.types import ASGIApp, Receive, Scope, Send


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


OPERATOR = ""
"""What :meth:`KeyCheck.identify` returns for the operator's key."""


class KeyCheck:
    def __init__(self, api_key: str, org_keys: tuple[tuple[str, str], ...] = ()) -> None:
        self._expected = _digest(api_key.encode())
        self._orgs = [(_digest(key.encode()), org) for org, key in org_keys]

    def accepts(self, header_values: list[bytes]) -> bool:
        """True iff exactly one well-formed ``Authorization: Bearer`` header carries a key."""
        return self.identify(header_values) is not None

    def identify(self, header_values: list[bytes]) -> str | None:
        """None: no valid key; :data:`OPERATOR` for the operator's key; else the
        organisation the key is bound to. Every key is compared, in constant time each."""
        if len(header_values) != 1:
            return None
        try:
            value = header_values[0].decode("ascii")
        except UnicodeDecodeError:
            return None
        scheme, sep, token = value.partition(" ")
        if not sep or scheme.lower() != "bearer" or not token or not token.isprintable() or " " in token:
            return None
        given = _digest(token.encode())
        found: str | None = OPERATOR if hmac.compare_digest(given, self._expected) else None
        for digest, org in self._orgs:
            if hmac.compare_digest(given, digest):
                found = org
        return found


FORBIDDEN_BODY = json.dumps(
    {
        "error": "forbidden",
        "message": "this key acts for one organisation: X-Org-Id must be absent or that organisation",
        "status": 403,
        "retriable": False,
    }
).encode()


async def _deny(send: Send, status: int, body: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


UNAUTHORIZED_BODY = json.dumps(
    {
        "error": "unauthorized",
        "message": "missing or invalid API key: send 'Authorization: Bearer <SANDBOX_API_KEY>'",
        "status": 401,
        "retriable": False,
    }
).encode()


PREFLIGHT_REFUSED_BODY = json.dumps(
    {
        "error": "forbidden",
        "message": (
            "cross-origin requests from this origin are not enabled on this gateway (SBX_CORS_ORIGINS)"
        ),
        "status": 403,
        "retriable": False,
    }
).encode()


def is_preflight(scope: Scope) -> bool:
    """A browser's CORS preflight: it never carries credentials, so it is not asked for a key."""
    asks = any(k == b"access-control-request-method" for k, _ in scope["headers"])
    return scope["method"] == "OPTIONS" and asks


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
        if is_preflight(scope):  # (an allowed origin's is answered before this: CrossOrigin)
            await _deny(send, 403, PREFLIGHT_REFUSED_BODY)
            return
        values = [v for k, v in scope["headers"] if k == b"authorization"]
        who = self.check.identify(values)
        if who == OPERATOR:
            await self.app(scope, receive, send)
            return
        if who is not None:
            claimed = {v for k, v in scope["headers"] if k == b"x-org-id"}
            if claimed - {who.encode()}:
                await _deny(send, 403, FORBIDDEN_BODY)
                return
            headers = [(k, v) for k, v in scope["headers"] if k != b"x-org-id"] + [
                (b"x-org-id", who.encode())
            ]
            await self.app({**scope, "headers": headers, "sbx.org": who}, receive, send)
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


class CrossOrigin:
    """ASGI middleware for browsers (``SBX_CORS_ORIGINS``): an allowed origin's preflights and
    responses get Starlette's CORS headers; any other origin's preflight a JSON 403."""

    def __init__(self, app: ASGIApp, cors: ASGIApp, origins: frozenset[str]) -> None:
        self.app = app
        self.cors = cors
        self.origins = origins

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            origin = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"origin"), None)
            if origin in self.origins:
                await self.cors(scope, receive, send)
                return
            if is_preflight(scope):
                await _deny(send, 403, PREFLIGHT_REFUSED_BODY)
                return
        await self.app(scope, receive, send)

"""The console's session cookie and CSRF tokens (pure: no I/O, the time is given).

Logging in with an API key gives a cookie that never holds the key: a token with who
logged in (the key's organisation, or none for the operator's key), the name they gave,
when it expires and a random nonce, signed with HMAC-SHA256. The signing key is derived
from a server secret *and the key that logged in*, so rotating a key (``SANDBOX_API_KEY``
or a line of ``SBX_ORG_KEYS``) ends the console sessions it opened, and a token names an
organisation only if it was signed with that organisation's key.

CSRF tokens are derived from the cookie's token (synchronizer tokens without server
state): a form needs the token of the session that rendered it. Before logging in, the
login form's token is derived from a random pre-session cookie (double submit, signed).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import secrets
from collections.abc import Iterable
from dataclasses import dataclass

TTL_SECONDS = 8 * 3600
"""How long a console login lasts."""
VERSION = "v1"


@dataclass(frozen=True)
class Identity:
    """Who a console session acts as: recorded on the events of what they do."""

    org: str | None
    """The organisation the key is bound to; None for the operator's key (every org)."""
    user: str
    """The name given at login (free text, like ``X-User-Id`` on REST: attribution only)."""
    expires: int
    """Unix time after which the token is refused."""
    nonce: str

    @property
    def operator(self) -> bool:
        return self.org is None


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def key_digest(key: str) -> bytes:
    """What the signer keeps of a key: its SHA-256 (the key itself is not needed after start)."""
    return hashlib.sha256(key.encode()).digest()


class Signer:
    """Signs and checks console tokens.

    ``secret``: the server secret (every gateway instance must have the same); ``keys``:
    each configured key as ``(organisation or None for the operator's key, its digest)``.
    A token names the key that logged in by an id derived from the secret (never the key
    or its plain digest)."""

    def __init__(self, secret: bytes, keys: Iterable[tuple[str | None, bytes]]) -> None:
        self._secret = secret
        self._keys: dict[str, tuple[str | None, bytes]] = {}
        for org, digest in keys:
            self._keys[self._key_id(digest)] = (
                org,
                hmac.new(secret, b"console-session\0" + digest, hashlib.sha256).digest(),
            )

    def _key_id(self, digest: bytes) -> str:
        return _b64(hmac.new(self._secret, b"console-key-id\0" + digest, hashlib.sha256).digest()[:12])

    def issue(self, digest: bytes, user: str, now: float, ttl: int = TTL_SECONDS) -> str:
        """A token for whoever logged in with the key whose digest this is."""
        kid = self._key_id(digest)
        org, key = self._keys[kid]
        claims = {
            "v": VERSION,
            "k": kid,
            "o": org,
            "u": user,
            "e": int(now) + ttl,
            "n": secrets.token_urlsafe(16),
        }
        payload = _b64(json.dumps(claims, separators=(",", ":"), sort_keys=True).encode())
        return f"{payload}.{_b64(hmac.new(key, payload.encode(), hashlib.sha256).digest())}"

    def check(self, token: str | None, now: float) -> Identity | None:
        """The identity a token proves, or None (malformed, forged, expired, or signed with
        a key that is no longer configured)."""
        if not token or len(token) > 4096 or token.count(".") != 1:
            return None
        payload, mac = token.split(".")
        try:
            claims = json.loads(_unb64(payload))
            given = _unb64(mac)
        except (ValueError, binascii.Error):
            return None
        if not isinstance(claims, dict) or claims.get("v") != VERSION:
            return None
        kid = claims.get("k")
        found = self._keys.get(kid) if isinstance(kid, str) else None
        if found is None:
            return None
        org, key = found
        if not hmac.compare_digest(hmac.new(key, payload.encode(), hashlib.sha256).digest(), given):
            return None
        user, expires, nonce = claims.get("u"), claims.get("e"), claims.get("n")
        if claims.get("o") != org or not isinstance(user, str) or not isinstance(nonce, str):
            return None
        if not isinstance(expires, int) or expires <= now:
            return None
        return Identity(org=org, user=user, expires=expires, nonce=nonce)

    def csrf(self, binding: str) -> str:
        """The CSRF token of a form rendered for ``binding`` (a session's nonce, or the
        pre-session cookie of the login form)."""
        return _b64(hmac.new(self._secret, b"console-csrf\0" + binding.encode(), hashlib.sha256).digest())

    def csrf_ok(self, binding: str | None, given: str | None) -> bool:
        if not binding or not given:
            return False
        return hmac.compare_digest(self.csrf(binding).encode(), given.encode("utf-8", "replace"))


def new_binding() -> str:
    """A random value for the login form's pre-session cookie."""
    return secrets.token_urlsafe(24)


def server_secret(operator_key: str) -> bytes:
    """The server secret, derived from the operator's key: every gateway instance has it (a
    cookie issued by one is honoured by the others), and rotating it ends every console
    session."""
    return hmac.new(
        key_digest(operator_key), b"sbx-console-secret\0" + VERSION.encode(), hashlib.sha256
    ).digest()

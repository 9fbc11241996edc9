"""Pure: envd's signed file URLs and host-name routing.

The SDK's ``files.upload_url()`` / ``download_url()`` (npm: ``uploadUrl`` /
``downloadUrl``) are ``{envd}/files?path=P[&username=U]&signature=S[&signature_expiration=E]``
with ``S = "v1_" + base64(sha256("P:OP:U:TOKEN[:E]"))`` without padding, ``OP`` ``read``
(GET) or ``write`` (POST), ``TOKEN`` the sandbox's ``envdAccessToken``. Such a URL carries
no sandbox id: only its host can say whose it is, so it is served where the SDK makes it
without ``E2B_SANDBOX_URL``, at ``{port}-{sandboxId}.{domain}`` (:func:`route`). It is
checked as envd checks it (:func:`check`): the signature over exactly the path, operation,
user and expiry the request names, the expiry not past. A user name with ``:`` is refused
(envd's format could then read one signed string as another path and operation)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import urllib.parse

from services.gateway.e2b import connect

QUERY_MAX = 16 * 1024
"""Longest query string of a ``/files`` request (a path is at most 4 KiB, 3 escaped)."""
FIELDS = ("path", "username", "signature", "signature_expiration")
_SIGNATURE = re.compile(r"v1_[A-Za-z0-9+/]{43}")
_EXPIRATION = re.compile(r"[0-9]{1,12}")
_LABEL = re.compile(r"([0-9]{1,5})-([a-z0-9_-]{1,64})")
OPERATIONS = {"GET": "read", "HEAD": "read", "POST": "write"}


def signature(path: str, operation: str, user: str, token: str, expiration: int | None) -> str:
    """What the SDK's ``get_signature`` makes (and envd's ``generateSignature``)."""
    fields = [path, operation, user, token] + ([] if expiration is None else [str(expiration)])
    digest = hashlib.sha256(":".join(fields).encode()).digest()
    return "v1_" + base64.b64encode(digest).decode().rstrip("=")


def query(raw: bytes) -> dict[str, str]:
    """A ``/files`` query string: bounded, UTF-8, each field at most once (a field given
    twice could be signed as one value and served as the other)."""
    if len(raw) > QUERY_MAX:
        raise connect.ConnectError("invalid_argument", f"query string longer than {QUERY_MAX} bytes")
    try:
        pairs = urllib.parse.parse_qsl(
            raw.decode("ascii"), keep_blank_values=True, errors="strict", max_num_fields=16
        )
    except (UnicodeDecodeError, ValueError):
        raise connect.ConnectError("invalid_argument", "malformed query string") from None
    found: dict[str, str] = {}
    for name, value in pairs:
        if name in found:
            raise connect.ConnectError("invalid_argument", f"query field {name[:40]!r} given twice")
        found[name] = value
    return found


def check(fields: dict[str, str], method: str, token: str, now: float) -> None:
    """Whether a ``/files`` request without ``X-Access-Token`` is signed for this sandbox
    (whose token is ``token``): envd's rule, compared in constant time."""
    given = fields.get("signature")
    if given is None:
        raise connect.ConnectError("unauthenticated", "missing X-Access-Token or signature")
    operation = OPERATIONS.get(method)
    user = fields.get("username", "")
    raw_expiration = fields.get("signature_expiration")
    if operation is None or ":" in user or not _SIGNATURE.fullmatch(given):
        raise connect.ConnectError("unauthenticated", "invalid signature")
    if raw_expiration is not None and not _EXPIRATION.fullmatch(raw_expiration):
        raise connect.ConnectError("unauthenticated", "invalid signature_expiration")
    expiration = None if raw_expiration is None else int(raw_expiration)
    expected = signature(fields.get("path", ""), operation, user, token, expiration)
    if not hmac.compare_digest(given.encode(), expected.encode()):
        raise connect.ConnectError("unauthenticated", "invalid signature")
    if expiration is not None and expiration < now:
        raise connect.ConnectError("unauthenticated", "signature expired")


def route(host: str, domain: str) -> tuple[str, str] | None:
    """``Host`` ``{port}-{sandboxId}.{domain}`` (name only, lower case, no port) as
    (port, sandbox id); None for any other host."""
    label, dot, rest = host.partition(".")
    if not dot or not domain or rest != domain:
        return None
    matched = _LABEL.fullmatch(label)
    return None if matched is None else (matched.group(1), matched.group(2))

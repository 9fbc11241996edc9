"""Identifier rules: what a session id may be (the client's rules, :mod:`sbx_api.ids`, under
the server's name), and the safe tokens derived from ids.

User-supplied ids are validated, then *never* used raw in a NATS subject, a KV
key, a file path or a Kubernetes name: those use :func:`token`, a fixed-length
hex digest that cannot contain separators or wildcards whatever the input.
"""

from __future__ import annotations

import hashlib
import secrets

from sbx_api import errors
from sbx_api.ids import (
    ATTRIBUTION_HEADER_PATTERN,
    ATTRIBUTION_MAX,
    ATTRIBUTION_PATTERN,
    IDEMPOTENCY_KEY_PATTERN,
    REQUEST_ID_PATTERN,
    SESSION_ID_MAX,
    SESSION_ID_PATTERN,
    validate_attribution,
    validate_idempotency_key,
    validate_request_id,
    validate_session_id,
)

__all__ = [
    "ATTRIBUTION_HEADER_PATTERN",
    "ATTRIBUTION_MAX",
    "ATTRIBUTION_PATTERN",
    "IDEMPOTENCY_KEY_PATTERN",
    "REQUEST_ID_PATTERN",
    "SESSION_ID_MAX",
    "SESSION_ID_PATTERN",
    "new_id",
    "token",
    "validate_attribution",
    "validate_idempotency_key",
    "validate_image",
    "validate_request_id",
    "validate_session_id",
]


def token(value: str) -> str:
    """A 32-hex-character token for ``value``, safe in subjects, keys, paths and names."""
    return hashlib.blake2b(value.encode(), digest_size=16).hexdigest()


def new_id() -> str:
    """A random 32-hex-character id (events, commands, instances)."""
    return secrets.token_hex(16)


def validate_image(value: object) -> str | None:
    """An image reference (``python:3.12``, ``ghcr.io/org/img@sha256:...``), a registered
    name, or ``default``; kept as given (the runtime normalises and resolves it)."""
    from shared.contract import references

    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise errors.InvalidInput("image must be a non-empty string when given")
    references.parse(value)
    return value

"""Identifier rules: what a session id may be, and the safe tokens derived from ids.

User-supplied ids are validated, then *never* used raw in a NATS subject, a KV
key, a file path or a Kubernetes name: those use :func:`token`, a fixed-length
hex digest that cannot contain separators or wildcards whatever the input.
"""

from __future__ import annotations

import hashlib
import re
import secrets

from shared.contract import errors

SESSION_ID_MAX = 128
_SESSION_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")
SESSION_ID_PATTERN = f"^[A-Za-z0-9][A-Za-z0-9_-]{{0,{SESSION_ID_MAX - 1}}}$"
"""The same rule as a JSON-schema pattern (the OpenAPI document's)."""
_SESSION_ID_RULE = (
    f"1 to {SESSION_ID_MAX} characters: letters, digits, '-' and '_', starting with a letter or digit"
)
ATTRIBUTION_MAX = 256
_IDEMPOTENCY_KEY = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
IDEMPOTENCY_KEY_PATTERN = f"^{_IDEMPOTENCY_KEY.pattern}$"
"""The same rule as a JSON-schema pattern (the OpenAPI document's)."""


def validate_session_id(value: object, *, what: str = "session id") -> str:
    """Return ``value`` if it is a well-formed session id, else raise InvalidInput."""
    if not isinstance(value, str) or not value:
        raise errors.InvalidInput(f"{what} is missing; it must be {_SESSION_ID_RULE}")
    if len(value) > SESSION_ID_MAX:
        raise errors.InvalidInput(f"{what} is {len(value)} characters long; it must be {_SESSION_ID_RULE}")
    if not _SESSION_ID.fullmatch(value):
        raise errors.InvalidInput(f"{what} {value!r:.60} is not allowed; it must be {_SESSION_ID_RULE}")
    return value


_NOT_IN_ATTRIBUTION = "\\x00-\\x1f\\x7f-\\x9f\\u200b-\\u200f\\u2028-\\u202e\\u2066-\\u2069\\ufeff"
ATTRIBUTION_PATTERN = f"^[^{_NOT_IN_ATTRIBUTION}]{{0,{ATTRIBUTION_MAX}}}$"
"""Org and user ids in a body: any text but control characters (C0, DEL, C1), line
separators and the invisible format characters that reorder or hide text (bidi overrides,
zero widths, BOM). The JSON-schema pattern of the OpenAPI document, and the check."""
ATTRIBUTION_HEADER_PATTERN = f"^[\\x20-\\x7e]{{0,{ATTRIBUTION_MAX}}}$"
"""In a header (``X-Org-Id``, ``X-User-Id``): printable ASCII, what a header carries as text."""
_ATTRIBUTION = re.compile(ATTRIBUTION_PATTERN)
_ATTRIBUTION_HEADER = re.compile(ATTRIBUTION_HEADER_PATTERN)


def validate_attribution(value: object, *, what: str, header: bool = False) -> str | None:
    """Org and user ids are free text for attribution, but bounded and printable."""
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise errors.InvalidInput(f"{what} must be a string")
    if len(value) > ATTRIBUTION_MAX:
        raise errors.InvalidInput(f"{what} is longer than {ATTRIBUTION_MAX} characters")
    if header and not _ATTRIBUTION_HEADER.fullmatch(value):
        raise errors.InvalidInput(f"{what} must be printable ASCII")
    if not _ATTRIBUTION.fullmatch(value):
        raise errors.InvalidInput(f"{what} contains control or invisible formatting characters")
    return value


def validate_idempotency_key(value: str) -> str:
    if not _IDEMPOTENCY_KEY.fullmatch(value):
        raise errors.InvalidInput(
            "Idempotency-Key must be 1 to 128 characters of letters, digits, '_', '.', ':' or '-'"
        )
    return value


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

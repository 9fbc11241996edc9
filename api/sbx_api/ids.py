"""The identifier rules a client applies before it sends a request, and the server applies
when it receives one: session ids, request and idempotency keys, org and user attribution.

One definition for both sides (the server's :mod:`shared.contract.ids` adds only what the
server derives from ids: tokens and new ids). Each rule is also a JSON-schema pattern for
the OpenAPI document.
"""

from __future__ import annotations

import re

from sbx_api import errors

SESSION_ID_MAX = 128
_SESSION_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")
SESSION_ID_PATTERN = f"^[A-Za-z0-9][A-Za-z0-9_-]{{0,{SESSION_ID_MAX - 1}}}$"
"""The same rule as a JSON-schema pattern (the OpenAPI document's)."""
SESSION_ID_RULE = (
    f"1 to {SESSION_ID_MAX} characters: letters, digits, '-' and '_', starting with a letter or digit"
)
ATTRIBUTION_MAX = 256
_KEY = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
IDEMPOTENCY_KEY_PATTERN = f"^{_KEY.pattern}$"
"""``Idempotency-Key`` as a JSON-schema pattern (the OpenAPI document's)."""
REQUEST_ID_PATTERN = IDEMPOTENCY_KEY_PATTERN
"""``X-Request-Id``: the same rule."""
_KEY_RULE = "1 to 128 characters of letters, digits, '_', '.', ':' or '-'"


def session_id_problem(value: object, *, what: str = "session id") -> str | None:
    """Why ``value`` is not a well-formed session id, or None if it is."""
    if not isinstance(value, str) or not value:
        return f"{what} is missing; it must be {SESSION_ID_RULE}"
    if len(value) > SESSION_ID_MAX:
        return f"{what} is {len(value)} characters long; it must be {SESSION_ID_RULE}"
    if not _SESSION_ID.fullmatch(value):
        return f"{what} {value!r:.60} is not allowed; it must be {SESSION_ID_RULE}"
    return None


def validate_session_id(value: object, *, what: str = "session id") -> str:
    """Return ``value`` if it is a well-formed session id, else raise InvalidInput."""
    problem = session_id_problem(value, what=what)
    if problem is not None:
        raise errors.InvalidInput(problem)
    assert isinstance(value, str)
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
    if not _KEY.fullmatch(value):
        raise errors.InvalidInput(f"Idempotency-Key must be {_KEY_RULE}")
    return value


def validate_request_id(value: str | None) -> str | None:
    """``X-Request-Id`` if given and well formed (None if not given); else InvalidInput."""
    if value is not None and not _KEY.fullmatch(value):
        raise errors.InvalidInput(f"X-Request-Id must be {_KEY_RULE}")
    return value

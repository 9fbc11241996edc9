"""List cursors: where the next page starts, opaque to clients and bound to one query.

A cursor is ``<payload>.<tag>`` in URL-safe base64: the payload is the position of the last
item shown (its creation time in µs and its id, both things the client was shown), the tag
an HMAC over the payload and the query it belongs to (which list, its filters and the
organisation the key acts for), keyed by a secret derived from ``SANDBOX_API_KEY`` (every
gateway of a stack derives the same one). So a cursor cannot be forged, altered, or
replayed against other filters or for another organisation: any of those is a 400, and the
page is filtered by the caller's organisation whatever the cursor says.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac

import msgspec

from sbx_api import errors
from shared.domain import listing

TAG_BYTES = 16
MAX_LENGTH = 512
INVALID = "cursor is not one this API returned for this query (altered, or the filters changed)"


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class Cursors:
    def __init__(self, api_key: str) -> None:
        self._key = hashlib.sha256(b"sbx list cursor\0" + api_key.encode()).digest()

    def _tag(self, list_name: str, selector: listing.Selector, payload: bytes) -> bytes:
        query = msgspec.json.encode([list_name, list(selector)])
        return hmac.new(self._key, query + b"\0" + payload, hashlib.sha256).digest()[:TAG_BYTES]

    def encode(self, list_name: str, selector: listing.Selector, position: listing.Position) -> str:
        payload = msgspec.json.encode([position[0], position[1]])
        return f"{_b64(payload)}.{_b64(self._tag(list_name, selector, payload))}"

    def decode(self, list_name: str, selector: listing.Selector, cursor: str) -> listing.Position:
        """The position ``cursor`` names, or ``InvalidInput`` (400) if it is not one
        :meth:`encode` gave for this very query."""
        if len(cursor) > MAX_LENGTH or cursor.count(".") != 1:
            raise errors.InvalidInput(INVALID)
        head, tail = cursor.split(".")
        try:
            payload, tag = _unb64(head), _unb64(tail)
        except (binascii.Error, ValueError):
            raise errors.InvalidInput(INVALID) from None
        if not hmac.compare_digest(tag, self._tag(list_name, selector, payload)):
            raise errors.InvalidInput(INVALID)
        try:
            micros, item_id = msgspec.json.decode(payload, type=tuple[int, str])
        except msgspec.DecodeError:  # (signed by us: only if the format changed)
            raise errors.InvalidInput(INVALID) from None
        return (micros, item_id)

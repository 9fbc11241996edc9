"""The REST API's answers (``/v1/sessions``, ``/healthz``, every error's body): what the
gateway writes and the clients read. The gateway's OpenAPI document is generated from
these (with its request bodies, which stay with the server's checks)."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

import msgspec

SessionStatus = Literal["active", "stopped", "deleted"]


class Session(msgspec.Struct, kw_only=True):
    session_id: str
    status: SessionStatus
    image: str | None
    org_id: str | None
    user_id: str | None
    created_at: datetime
    updated_at: datetime
    incarnation: int
    """1 for the first life of this id, +1 each time it is created again after deletion."""
    version: int
    """Number of events recorded for this id."""


class SessionList(msgspec.Struct, kw_only=True):
    sessions: list[Session]
    count: int
    """How many sessions matched (``sessions`` holds at most ``limit`` of them)."""


class Problem(msgspec.Struct, kw_only=True):
    """Every error response."""

    error: str
    """Stable machine-readable code (``invalid_input``, ``not_found``, ``conflict``...)."""
    message: str
    status: int
    retriable: bool = False


class Health(msgspec.Struct, kw_only=True):
    status: Literal["ok", "starting", "draining"]
    instance: str
    version: str

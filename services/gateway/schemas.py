"""REST request and response bodies. The OpenAPI document is generated from these."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

import msgspec

from shared.contract import ids, references, states

SessionId = Annotated[
    str,
    msgspec.Meta(
        min_length=1,
        max_length=128,
        pattern="^[A-Za-z0-9][A-Za-z0-9_-]*$",
        description="Letters, digits, '-' and '_'; starts with a letter or digit.",
        examples=["task-42"],
    ),
]

Attribution = Annotated[
    str,
    msgspec.Meta(
        max_length=ids.ATTRIBUTION_MAX,
        extra_json_schema={"pattern": ids.ATTRIBUTION_PATTERN},  # (checked in our words: ids)
        description="Free text for attribution, without control or invisible formatting characters.",
    ),
]


class CreateSessionRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Register a session id. Org and user default to the X-Org-Id / X-User-Id headers."""

    session_id: SessionId
    image: (
        Annotated[
            str,
            msgspec.Meta(
                max_length=references.MAX_LENGTH,
                examples=["python:3.12-slim"],
                extra_json_schema={"pattern": references.PATTERN},
            ),
        ]
        | None
    ) = None
    org_id: Attribution | None = None
    user_id: Attribution | None = None


class Session(msgspec.Struct, kw_only=True):
    session_id: str
    status: Literal["active", "stopped", "deleted"]
    image: str | None
    org_id: str | None
    user_id: str | None
    created_at: datetime
    updated_at: datetime
    incarnation: int
    """1 for the first life of this id, +1 each time it is created again after deletion."""
    version: int
    """Number of events recorded for this id."""

    @classmethod
    def of(cls, state: states.SessionState) -> Session:
        return cls(
            session_id=state.session_id,
            status=state.status,
            image=state.image,
            org_id=state.org_id,
            user_id=state.user_id,
            created_at=state.created_at,
            updated_at=state.updated_at,
            incarnation=state.incarnation,
            version=state.version,
        )


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

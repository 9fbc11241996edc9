"""REST request and response bodies. The OpenAPI document is generated from these.

The answers (Session, SessionList, Problem, Health) are the client distribution's
(:mod:`sbx_api.wire`): one definition for the gateway and its clients; the requests
stay here, with the checks that give their patterns."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

import msgspec

from sbx_api.wire import Health, Problem, Session, SessionList
from shared.contract import ids, references, states

__all__ = [
    "CreateSessionRequest",
    "Health",
    "Problem",
    "Session",
    "SessionList",
    "SessionSandbox",
    "sandbox_of",
    "session_of",
]

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


def session_of(state: states.SessionState) -> Session:
    return Session(
        session_id=state.session_id,
        status=state.status,
        image=state.image,
        org_id=state.org_id,
        user_id=state.user_id,
        created_at=state.created_at,
        updated_at=state.updated_at,
        incarnation=state.incarnation,
        version=state.version,
        forked_from=state.forked_from,
    )


class SessionSandbox(msgspec.Struct, kw_only=True):
    """A session's sandbox after a pause or resume. (The gateway's own answer for now;
    the client distribution may adopt it.)"""

    session_id: str
    sandbox_id: str
    status: Literal["running", "paused"]
    """``paused``: every process frozen, memory kept; the session's next call (MCP or host
    API) resumes it."""
    paused_at: datetime | None
    """When it was paused (null while running)."""
    changed: bool
    """Whether this request paused or resumed it (false: it already was, or the same
    Idempotency-Key did it before)."""


def sandbox_of(session_id: str, state: states.SandboxState, changed: bool) -> SessionSandbox:
    status: Literal["running", "paused"] = "paused" if state.status == "paused" else "running"
    return SessionSandbox(
        session_id=session_id,
        sandbox_id=state.sandbox_id,
        status=status,
        paused_at=state.paused_at,
        changed=changed,
    )

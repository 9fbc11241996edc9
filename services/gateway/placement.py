"""Where a session runs, read from the projections and remembered for a moment.

The fast path of every tool call: when the projections say a session is active on a
running sandbox, the gateway sends the call straight to the executor, skipping the
scheduler. A remembered answer may be stale (the session was stopped, cleared or
re-provisioned since); that is safe because the executor checks ownership and state
on every call and refuses, and the gateway then forgets the answer and asks the
scheduler (``mcp.build_mcp``).
"""

from __future__ import annotations

import time

from shared.contract import states
from shared.infrastructure import projector

TTL = 2.0
LIMIT = 10_000


class Placement:
    def __init__(
        self,
        sessions: projector.ProjectionStore[states.SessionState],
        sandboxes: projector.ProjectionStore[states.SandboxState],
        *,
        ttl: float = TTL,
        limit: int = LIMIT,
    ) -> None:
        self.sessions, self.sandboxes = sessions, sandboxes
        self.ttl, self.limit = ttl, limit
        self._known: dict[str, tuple[str, float, str | None]] = {}

    async def running_sandbox(self, session_id: str, org_id: str | None = None) -> str | None:
        """The session's running sandbox, if the caller may use it without asking the
        scheduler: a caller acting for an organisation only reaches that organisation's
        sessions (or sessions of none); otherwise the scheduler decides (and refuses)."""
        known = self._known.get(session_id)
        if known is not None and time.monotonic() - known[1] < self.ttl:
            return known[0] if org_id is None or known[2] in (None, org_id) else None
        session = await self.sessions.get(session_id)
        if session is None or session.status != "active" or session.sandbox_id is None:
            self.forget(session_id)
            return None
        sandbox = await self.sandboxes.get(session.sandbox_id)
        if sandbox is None or sandbox.status != "running":
            self.forget(session_id)
            return None
        self.remember(session_id, session.sandbox_id, session.org_id)
        if org_id is not None and session.org_id not in (None, org_id):
            return None
        return session.sandbox_id

    def remember(self, session_id: str, sandbox_id: str, org_id: str | None) -> None:
        """What the scheduler just answered (a session's first request: its next call,
        usually the agent's first tool call right after connecting, needs no lookup)."""
        if len(self._known) >= self.limit:
            self._known.clear()
        self._known[session_id] = (sandbox_id, time.monotonic(), org_id)

    def forget(self, session_id: str) -> None:
        self._known.pop(session_id, None)

"""Who is calling, and which sandbox serves their session: shared by the MCP tools and
the host API.

A call first asks the placement cache (the projections, remembered for a moment); when
that has no answer it sends ``EnsureSession`` to the scheduler (get-or-create of the
session's sandbox). A remembered answer may be stale: the executor checks ownership and
state on every call and refuses, and then the call is retried once through the scheduler.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Literal, TypeVar

from sbx_api import errors
from shared.contract import ids
from shared.contract.commands import Actor, EnsureSession
from shared.infrastructure import rpc

T = TypeVar("T")
PREFETCH_MAX = 1024
ENSURE_BUDGET = 60.0
"""How long a call waits for its session's sandbox when the scheduler has to start one (a
cold start on a busy machine takes seconds, not the bus's request timeout; a scheduler
that died is noticed within seconds by its missing beats). ``create_sandbox`` waits
longer, for image pulls."""
"""Sessions whose sandbox is being got ahead of their first call, at most, per gateway."""


@dataclass(frozen=True, slots=True)
class Identity:
    """Who is calling and for which session, read from the request's headers."""

    session_id: str
    correlation_id: str
    org_id: str | None = None
    user_id: str | None = None
    via: Literal["mcp", "rest"] = "mcp"

    @property
    def actor(self) -> Actor:
        return Actor(via=self.via, org_id=self.org_id, user_id=self.user_id)


def identity_from_headers(
    headers: Mapping[str, str], *, session_id: str | None = None, via: Literal["mcp", "rest"] = "mcp"
) -> Identity:
    """Validate the identity headers (names in lower case); raise InvalidInput if wrong.
    The session comes from ``X-Session-Id`` unless the caller names it (a REST path)."""
    if session_id is None:
        session = ids.validate_session_id(headers.get("x-session-id"), what="X-Session-Id header")
    else:
        session = ids.validate_session_id(session_id)
    request_id = ids.validate_request_id(headers.get("x-request-id") or None)
    return Identity(
        session_id=session,
        correlation_id=request_id or ids.new_id(),
        org_id=ids.validate_attribution(headers.get("x-org-id"), what="X-Org-Id header", header=True),
        user_id=ids.validate_attribution(headers.get("x-user-id"), what="X-User-Id header", header=True),
        via=via,
    )


class Resolver:
    def __init__(
        self,
        commands: rpc.SessionClient,
        running_sandbox: Callable[[str, str | None], Awaitable[str | None]] | None = None,
        forget: Callable[[str], None] | None = None,
        remember: Callable[[str, str, str | None], None] | None = None,
    ) -> None:
        self.commands = commands
        self.running_sandbox = running_sandbox
        self.forget = forget
        self.remember = remember
        self._early: dict[tuple[str, str | None], asyncio.Task[str]] = {}

    def prefetch(self, who: Identity) -> None:
        """Start getting the session's sandbox now (an agent connected: its first tool
        call comes soon); that call then waits for this instead of asking again. At most
        ``PREFETCH_MAX`` at once; failures are the first call's to report (it asks again)."""
        key = (who.session_id, who.org_id)
        if key in self._early or len(self._early) >= PREFETCH_MAX:
            return
        task = asyncio.get_running_loop().create_task(self._sandbox_for(who))
        self._early[key] = task

        def done(t: asyncio.Task[str]) -> None:
            self._early.pop(key, None)
            if not t.cancelled():
                t.exception()  # (retrieved: the first call reports its own)

        task.add_done_callback(done)

    async def close(self) -> None:
        for task in list(self._early.values()):
            task.cancel()
        await asyncio.gather(*self._early.values(), return_exceptions=True)

    async def sandbox_for(self, who: Identity, *, fast: bool = True) -> str:
        early = self._early.get((who.session_id, who.org_id)) if fast else None
        if early is not None:
            with contextlib.suppress(errors.SandboxError):
                return await asyncio.shield(early)
        return await self._sandbox_for(who, fast=fast)

    async def _sandbox_for(self, who: Identity, *, fast: bool = True) -> str:
        if fast and self.running_sandbox is not None:
            known = await self.running_sandbox(who.session_id, who.org_id)
            if known is not None:
                return known
        state = await self.commands.session(
            EnsureSession(
                session_id=who.session_id,
                command_id=ids.new_id(),
                correlation_id=who.correlation_id,
                actor=who.actor,
            ),
            timeout=ENSURE_BUDGET,
        )
        if state is None or state.sandbox_id is None:
            raise errors.Unavailable("the scheduler did not assign a sandbox to this session; retry shortly")
        if self.remember is not None:
            self.remember(state.session_id, state.sandbox_id, state.org_id)
        return state.sandbox_id

    async def with_sandbox(self, who: Identity, call: Callable[[str], Awaitable[T]]) -> T:
        """``call(sandbox_id)``; when a remembered sandbox was refused, once more through
        the scheduler."""
        sandbox_id = await self.sandbox_for(who)
        try:
            return await call(sandbox_id)
        except (errors.NotFound, errors.Conflict):
            if self.running_sandbox is None:
                raise
        # The projection was behind (the sandbox just stopped or was replaced): ask the scheduler.
        if self.forget is not None:
            self.forget(who.session_id)
        return await call(await self.sandbox_for(who, fast=False))

    @staticmethod
    def request_fields(who: Identity, sandbox_id: str) -> dict[str, object]:
        return {
            "session_id": who.session_id,
            "sandbox_id": sandbox_id,
            "actor": who.actor,
            "correlation_id": who.correlation_id,
        }

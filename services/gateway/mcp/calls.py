"""What every tool does around its work: who is calling (from the HTTP headers only), the
product's errors as MCP tool errors, and one execution request sent to the session's
sandbox (got or claimed first)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TypeVar

from fastmcp.exceptions import ToolError
from fastmcp.server.dependencies import get_context, get_http_headers

from sbx_api import errors
from services.gateway import sessions
from services.gateway.sessions import Identity, identity_from_headers
from shared.contract import execution, ids
from shared.infrastructure import rpc, tracing

REQUEST_BUDGET = 30.0
"""The executor's time for a request that does not say (polls, edits, starting a job)."""

T = TypeVar("T")
HeaderSource = Callable[[], Mapping[str, str]]
"""Returns the current request's headers, names in lower case."""


def request_headers() -> Mapping[str, str]:
    """The current HTTP request's headers (empty outside an HTTP request)."""
    return get_http_headers()


@contextlib.contextmanager
def tool_errors() -> Iterator[None]:
    """Turn the product's errors into MCP tool errors carrying only their message."""
    try:
        yield
    except errors.SandboxError as exc:
        tracing.failed(exc.code)  # (the tool error carries the message only)
        # fastmcp logs a ToolError at its level: the caller's mistakes are not the gateway's errors.
        level = logging.WARNING if exc.status >= 500 else logging.INFO
        raise ToolError(exc.message, log_level=level) from None


def current_request_id() -> str | None:
    """The JSON-RPC id of the MCP request being served (None outside one)."""
    try:
        return get_context().request_id
    except RuntimeError:
        return None


def mcp_call_id(session_id: str, request_id: str | None) -> str:
    """The executor's name for a tool call, derived from the session and the MCP request id
    so that a ``notifications/cancelled`` for that id, arriving as a request of its own at
    any gateway instance, names the same call."""
    if request_id is None:
        return ids.new_id()
    return hashlib.sha256(f"{session_id}\0{request_id}".encode()).hexdigest()[:32]


class Progress:
    """MCP progress notifications for a long call, from what the executor's beats say: the
    seconds it has run (the progress value) and the bytes of output so far, at most every
    ``EVERY`` seconds; nothing for a client that sent no progress token."""

    EVERY = 2.0

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.last = self.started

    async def report(self, said: str) -> None:
        now = time.monotonic()
        if now - self.last < self.EVERY:
            return
        self.last = now
        fields = dict(part.partition("=")[::2] for part in said.split())
        elapsed = now - self.started
        output = fields.get("output", "")
        message = f"running for {elapsed:.0f} s" + (
            f", {output} bytes of output so far" if output.isdigit() else ""
        )
        with contextlib.suppress(Exception):  # progress is a courtesy: never fails the call
            await get_context().report_progress(progress=round(elapsed, 1), message=message)


async def waiting(work: Awaitable[T], say: Callable[[float], str]) -> T:
    """``work``'s result; while it runs, an MCP progress notification every
    ``Progress.EVERY`` seconds saying ``say(seconds waited)`` (the seconds are the
    progress value), for a client that sent a progress token."""
    task = asyncio.ensure_future(work)
    started = time.monotonic()
    try:
        while not (await asyncio.wait({task}, timeout=Progress.EVERY))[0]:
            elapsed = time.monotonic() - started
            with contextlib.suppress(Exception):  # progress is a courtesy: never fails the call
                await get_context().report_progress(progress=round(elapsed, 1), message=say(elapsed))
        return task.result()
    finally:
        task.cancel()  # (the call was cancelled: so is its work; done: nothing)


def required(value: object, name: str, command: str) -> None:
    if value is None:
        raise errors.InvalidInput(f"Parameter `{name}` is required for command: {command}")


@dataclass(frozen=True)
class Calls:
    """What the tools share: the scheduler and executor clients, where identity comes
    from, the session resolver and what the sandboxes can reach."""

    commands: rpc.SessionClient
    executor: rpc.ExecClient
    headers: HeaderSource
    resolver: sessions.Resolver
    egress: str

    def identity(self) -> Identity:
        return identity_from_headers(self.headers())

    async def run(
        self,
        who: Identity,
        build: Callable[..., execution.AnyRequest],
        budget: float,
        *,
        progress: bool = False,
    ) -> execution.Reply:
        """Send the request ``build`` makes (given the session's fields) to the session's
        sandbox, getting or claiming the sandbox first. ``progress``: a client that asked
        for progress notifications gets them while the call runs (see ``Progress``)."""

        call_id = mcp_call_id(who.session_id, current_request_id())
        on_progress = Progress().report if progress else None

        async def call(sandbox_id: str) -> execution.Reply:
            tracing.annotate({"sbx.sandbox_id": sandbox_id})
            request = build(**self.resolver.request_fields(who, sandbox_id), call_id=call_id)
            return await self.executor.run(request, budget=budget, on_progress=on_progress)

        return await self.resolver.with_sandbox(who, call)

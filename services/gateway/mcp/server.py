"""The MCP server: the eight tools, claim-on-connect, and its streamable-HTTP app."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import fastmcp
import key_value.aio.adapters.pydantic  # noqa: F401  (see build_mcp: imported at start, not on a call)
from fastmcp.server.http import StarletteWithLifespan
from fastmcp.server.middleware import CallNext, Middleware, MiddlewareContext
from key_value.aio.stores.memory import MemoryStore
from mcp import types as mt

from services.gateway import sessions
from services.gateway.mcp import calls, edit, sandbox, shell, texts
from services.gateway.sessions import Identity
from shared.contract import errors
from shared.infrastructure import rpc, service

TOOL_NAMES: tuple[str, ...] = (
    "shell",
    "shell_async",
    "shell_poll",
    "shell_wait",
    "shell_stop",
    "str_replace_based_edit_tool",
    "create_sandbox",
    "clear_session",
)

MCP_PATH = "/mcp"


class ClaimOnConnect(Middleware):
    """When an agent connects (``initialize`` with its ``X-Session-Id``), start getting its
    session's sandbox: claiming one takes the scheduler tens of milliseconds, which the
    agent's first tool call then does not wait for (it waits for this instead of asking
    again). A connection with bad identity headers starts nothing: its first call says why."""

    def __init__(self, resolver: sessions.Resolver, identity: Callable[[], Identity]) -> None:
        self.resolver, self.identity = resolver, identity

    async def on_initialize(
        self,
        context: MiddlewareContext[mt.InitializeRequest],
        call_next: CallNext[mt.InitializeRequest, mt.InitializeResult | None],
    ) -> mt.InitializeResult | None:
        result = await call_next(context)
        try:
            who = self.identity()
        except errors.SandboxError:
            return result
        self.resolver.prefetch(who)
        return result


def build_mcp(
    commands: rpc.SessionClient,
    executor: rpc.ExecClient,
    *,
    headers: calls.HeaderSource = calls.request_headers,
    running_sandbox: Callable[[str, str | None], Awaitable[str | None]] | None = None,
    forget: Callable[[str], None] | None = None,
    resolver: sessions.Resolver | None = None,
    claim_on_connect: bool = False,
    egress: str = "none",
) -> fastmcp.FastMCP:
    """The MCP server with the eight tools. ``headers`` is where identity is read from
    (the HTTP request by default; tests pass their own). ``running_sandbox`` is an
    optional fast path: the session's sandbox id if the projections say it is active and
    running (then no scheduler round trip is needed; if the projection was stale, the
    executor refuses, ``forget`` is told, and the call falls back to the scheduler).
    ``claim_on_connect``: an ``initialize`` starts getting the session's sandbox (see
    ``ClaimOnConnect``). ``egress``: what the sandboxes can reach, said in the texts."""
    mcp = fastmcp.FastMCP(
        "agent-sandbox",
        instructions=texts.instructions(egress),
        version=service.VERSION,
        mask_error_details=True,
        # fastmcp's per-session state (visibility rules, which these tools do not use)
        # stays in this process. Made here, not on the first tool call: creating it
        # imports its store and pydantic adapter, ~0.6 s the first agent would wait.
        session_state_store=MemoryStore(),
    )
    resolver = resolver or sessions.Resolver(commands, running_sandbox, forget)
    tools = calls.Calls(commands, executor, headers, resolver, egress)
    if claim_on_connect:
        mcp.add_middleware(ClaimOnConnect(resolver, tools.identity))
    shell.register(mcp, tools)
    edit.register(mcp, tools)
    sandbox.register(mcp, tools)
    return mcp


def mcp_http_app(mcp: fastmcp.FastMCP) -> StarletteWithLifespan:
    """Streamable HTTP at ``/mcp``, stateless. Run its ``lifespan`` (see the package docstring)."""
    return mcp.http_app(path=MCP_PATH, stateless_http=True, json_response=True)

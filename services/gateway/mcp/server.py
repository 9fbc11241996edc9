"""The MCP server: the eight tools, what connecting does, and its streamable-HTTP app."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import fastmcp
import key_value.aio.adapters.pydantic  # noqa: F401  (see build_mcp: imported at start, not on a call)
import pydantic
from fastmcp.exceptions import ToolError
from fastmcp.exceptions import ValidationError as FastMCPValidationError
from fastmcp.server.http import StarletteWithLifespan
from fastmcp.server.middleware import CallNext, Middleware, MiddlewareContext
from fastmcp.tools.base import Tool, ToolResult
from key_value.aio.stores.memory import MemoryStore
from mcp import types as mt
from mcp.shared.exceptions import MCPError

from sbx_api import errors
from services.gateway import sessions
from services.gateway.mcp import calls, checkpoints, edit, jobinput, sandbox, shell, texts
from services.gateway.sessions import Identity
from shared.infrastructure import metrics, rpc, service, tracing

INVALID_PARAMS = -32602
"""JSON-RPC's code for a request whose parameters (here: headers) are wrong."""
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
_LABELS = frozenset((*TOOL_NAMES, *checkpoints.TOOL_NAMES, *jobinput.TOOL_NAMES))
"""Tool names a metric or span may carry (any other is ``unknown``)."""


class Connect(Middleware):
    """What happens when an agent connects. Its identity headers are checked on
    ``initialize`` and ``tools/list`` (a client of the newer protocol revision may start
    with either): a missing or malformed ``X-Session-Id`` is refused there, with the
    reason, not at the first tool call. With ``claim``, the session's sandbox is then
    fetched in the background: claiming one takes the scheduler tens of milliseconds,
    which the agent's first tool call then does not wait for (it waits for this instead
    of asking again)."""

    def __init__(self, resolver: sessions.Resolver, identity: Callable[[], Identity], *, claim: bool) -> None:
        self.resolver, self.identity, self.claim = resolver, identity, claim

    def _connected(self) -> None:
        try:
            who = self.identity()
        except errors.SandboxError as exc:
            raise MCPError(INVALID_PARAMS, exc.message) from None
        if self.claim:
            self.resolver.prefetch(who)

    async def on_initialize(
        self,
        context: MiddlewareContext[mt.InitializeRequest],
        call_next: CallNext[mt.InitializeRequest, mt.InitializeResult | None],
    ) -> mt.InitializeResult | None:
        self._connected()
        return await call_next(context)

    async def on_list_tools(
        self,
        context: MiddlewareContext[mt.ListToolsRequest],
        call_next: CallNext[mt.ListToolsRequest, Sequence[Tool]],
    ) -> Sequence[Tool]:
        self._connected()
        return await call_next(context)


class ArgumentErrors(Middleware):
    """A tool call whose arguments do not fit the tool's schema is answered in our words
    (which parameter, what is wrong with it), not with the validator's text and links."""

    async def on_call_tool(
        self,
        context: MiddlewareContext[mt.CallToolRequestParams],
        call_next: CallNext[mt.CallToolRequestParams, ToolResult],
    ) -> ToolResult:
        try:
            return await call_next(context)
        except FastMCPValidationError as exc:
            cause = exc.__cause__
            problems = cause.errors() if isinstance(cause, pydantic.ValidationError) else []
            raise ToolError(texts.invalid_arguments(context.message.name, problems)) from None


class ToolMetrics(Middleware):
    """RED metrics per tool: calls by outcome (``ok``; ``error``: the tool answered an error,
    bad arguments included; ``cancelled``) and their time. Unknown tool names count as
    ``unknown`` (a client cannot grow the label set)."""

    async def on_call_tool(
        self,
        context: MiddlewareContext[mt.CallToolRequestParams],
        call_next: CallNext[mt.CallToolRequestParams, ToolResult],
    ) -> ToolResult:
        tool = context.message.name if context.message.name in _LABELS else "unknown"
        started = time.monotonic()
        outcome = "error"
        try:
            result = await call_next(context)
            outcome = "ok"
            return result
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            metrics.mcp_tool_calls.labels(tool, outcome).inc()
            metrics.mcp_tool_seconds.labels(tool).observe(time.monotonic() - started)


class ToolSpans(Middleware):
    """A span per tool call (``gateway/<tool>``, inside fastmcp's ``tools/call`` span when
    that one is recorded): the tool and the caller's session; the sandbox and any error
    code are added as the call learns them. Its context goes with every request the call
    sends, so the scheduler's, the pool-manager's and the executor's spans join its trace."""

    def __init__(self, identity: Callable[[], Identity]) -> None:
        self.identity = identity

    async def on_call_tool(
        self,
        context: MiddlewareContext[mt.CallToolRequestParams],
        call_next: CallNext[mt.CallToolRequestParams, ToolResult],
    ) -> ToolResult:
        if not tracing.enabled():
            return await call_next(context)
        tool = context.message.name if context.message.name in _LABELS else "unknown"
        attributes: tracing.Attributes = {"sbx.tool": tool}
        with contextlib.suppress(errors.SandboxError):  # (refused with its reason by the tool)
            who = self.identity()
            attributes["sbx.session_id"] = who.session_id
            if who.org_id is not None:
                attributes["sbx.org_id"] = who.org_id
        with tracing.span(f"gateway/{tool}", attributes=attributes):
            return await call_next(context)


class Cancellations(Middleware):
    """``notifications/cancelled`` (clients of the older protocol revision cancel that way;
    in stateless mode it arrives as a request of its own, at any gateway instance): the
    executors are told to stop the named call of this session. (Clients of the newer
    revision close the request's stream instead, which cancels the call's handler.)"""

    def __init__(self, tools: calls.Calls) -> None:
        self.tools = tools

    async def on_notification(
        self,
        context: MiddlewareContext[mt.Notification[Any, Any]],
        call_next: CallNext[mt.Notification[Any, Any], Any],
    ) -> Any:
        if context.method == "notifications/cancelled":
            params = context.message  # the raw params at this hook
            request_id = params.get("requestId") if isinstance(params, dict) else None
            if isinstance(request_id, str | int):
                with contextlib.suppress(errors.SandboxError):  # no valid session: nothing of its to stop
                    who = self.tools.identity()
                    self.tools.executor.cancel(
                        who.session_id, calls.mcp_call_id(who.session_id, str(request_id))
                    )
        return await call_next(context)


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
    checkpoint_tools: bool = False,
    job_input: bool = False,
) -> fastmcp.FastMCP:
    """The MCP server with the eight tools. ``headers`` is where identity is read from
    (the HTTP request by default; tests pass their own). ``running_sandbox`` is an
    optional fast path: the session's sandbox id if the projections say it is active and
    running (then no scheduler round trip is needed; if the projection was stale, the
    executor refuses, ``forget`` is told, and the call falls back to the scheduler).
    ``claim_on_connect``: connecting starts getting the session's sandbox (see ``Connect``).
    ``egress``: what the sandboxes can reach, said in the texts. ``checkpoint_tools``: the
    two optional tools of ``checkpoints`` too. ``job_input``: the optional ``shell_input`` tool
    (and ``shell_async``'s ``stdin``)."""
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
    mcp.add_middleware(Connect(resolver, tools.identity, claim=claim_on_connect))
    mcp.add_middleware(ToolMetrics())
    if tracing.enabled():  # (configured before the server is built; off, not even a layer)
        mcp.add_middleware(ToolSpans(tools.identity))
    mcp.add_middleware(ArgumentErrors())
    mcp.add_middleware(Cancellations(tools))
    shell.register(mcp, tools, job_input=job_input)
    edit.register(mcp, tools)
    sandbox.register(mcp, tools)
    if checkpoint_tools:
        checkpoints.register(mcp, tools)
    if job_input:
        jobinput.register(mcp, tools)
    return mcp


def mcp_http_app(mcp: fastmcp.FastMCP) -> StarletteWithLifespan:
    """Streamable HTTP at ``/mcp``, stateless. Run its ``lifespan`` (see the package docstring)."""
    return mcp.http_app(path=MCP_PATH, stateless_http=True, json_response=False)

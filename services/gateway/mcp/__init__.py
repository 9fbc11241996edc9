"""The MCP surface of the gateway: eight tools that turn calls into commands and exec
requests, in modules by tool group (``shell``: the shell and background jobs; ``edit``:
the edit tool; ``sandbox``: re-provision and clear), with what every tool does around its
work in ``calls`` and what an agent reads in ``texts``; ``server`` builds the server.

Identity comes only from HTTP headers, never from tool arguments: ``X-Session-Id``
(required), ``X-Org-Id`` / ``X-User-Id`` (optional, attribution) and ``X-Request-Id``
(optional, becomes the correlation id). The shell, job and edit tools first send
``EnsureSession`` to the scheduler (get-or-create of the session's sandbox), then send
the execution request to the executor with the sandbox id from that answer. Every
:class:`sbx_api.errors.SandboxError` comes back as an MCP tool error carrying its message;
other exceptions are masked (``mask_error_details``) and logged by fastmcp.

Transport: :func:`mcp_http_app` returns fastmcp's streamable-HTTP Starlette app serving
``/mcp`` in **stateless** mode (``stateless_http=True``), answering on the stream path
(``json_response=False``): a call that ends soon is still answered with plain JSON, and the
transport watches each request's connection, so a client that cancels (newer revision:
it closes the request's stream) or goes away cancels the tool's handler, which stops
the executor's call (``rpc.ExecClient.run``). Every POST gets a fresh transport
and no ``Mcp-Session-Id`` is issued, so any gateway instance can serve any request (the
MCP session lives nowhere; our own session is the ``X-Session-Id`` header). Stateful mode
would pin each client to the instance holding its in-memory transport (others answer 404
"Session not found"), cap sessions per instance (10 000) and expire them when idle.
What stateless gives up (server-initiated requests such as sampling/elicitation, the GET
notification stream, resumability) is not used by these tools.

Mounting (what ``services/gateway/app.py`` must do). The returned app has its own
lifespan, which starts the streamable-HTTP session manager (a task group every request
runs in); without it each ``/mcp`` request fails with "task group was not initialized"::

    mcp_app = mcp.mcp_http_app(mcp.build_mcp(commands, executor))
    routes += [Mount("/", app=mcp_app)]          # last: REST routes keep precedence
    inner = Starlette(routes=routes, lifespan=mcp_app.lifespan)
    app = auth.BearerAuth(inner, auth.KeyCheck(gateway.api_key), public=PUBLIC_PATHS)

and the uvicorn config must run lifespans: ``lifespan="on"`` instead of ``"off"``
(``BearerAuth`` passes non-HTTP scopes through, so the ``lifespan`` scope reaches the
inner Starlette app). Mount the whole app, not ``mcp_app.routes``: its
``RequestContextMiddleware`` is what makes the request's headers visible to the tools.
``BearerAuth`` already answers 401 before any MCP traffic, so no fastmcp ``auth=`` is set.
"""

from services.gateway.mcp.server import MCP_PATH, TOOL_NAMES, build_mcp, mcp_http_app
from services.gateway.mcp.texts import NETWORK, instructions

__all__ = ["MCP_PATH", "NETWORK", "TOOL_NAMES", "build_mcp", "instructions", "mcp_http_app"]

"""The MCP tool surface of the gateway: eight tools that turn calls into commands and exec requests.

Identity comes only from HTTP headers, never from tool arguments: ``X-Session-Id``
(required), ``X-Org-Id`` / ``X-User-Id`` (optional, attribution) and ``X-Request-Id``
(optional, becomes the correlation id). The shell, job and edit tools first send
``EnsureSession`` to the scheduler (get-or-create of the session's sandbox), then send
the execution request to the executor with the sandbox id from that answer. Every
:class:`shared.contract.errors.SandboxError` comes back as an MCP tool error carrying its message;
other exceptions are masked (``mask_error_details``) and logged by fastmcp.

Transport: :func:`mcp_http_app` returns fastmcp's streamable-HTTP Starlette app serving
``/mcp`` in **stateless** mode (``stateless_http=True``) with plain JSON responses
(``json_response=True``: each tool answers once, so an SSE stream only costs time;
measured about 4 ms less per call here): every POST gets a fresh transport
and no ``Mcp-Session-Id`` is issued, so any gateway instance can serve any request (the
MCP session lives nowhere; our own session is the ``X-Session-Id`` header). Stateful mode
would pin each client to the instance holding its in-memory transport (others answer 404
"Session not found"), cap sessions per instance (10 000) and expire them when idle.
What stateless gives up (server-initiated requests such as sampling/elicitation, the GET
notification stream, resumability) is not used by these tools.

Mounting (what ``services/gateway/app.py`` must do). The returned app has its own
lifespan, which starts the streamable-HTTP session manager (a task group every request
runs in); without it each ``/mcp`` request fails with "task group was not initialized"::

    mcp_app = mcp_tools.mcp_http_app(mcp_tools.build_mcp(commands, executor))
    routes += [Mount("/", app=mcp_app)]          # last: REST routes keep precedence
    inner = Starlette(routes=routes, lifespan=mcp_app.lifespan)
    app = auth.BearerAuth(inner, auth.KeyCheck(gateway.api_key), public=PUBLIC_PATHS)

and the uvicorn config must run lifespans: ``lifespan="on"`` instead of ``"off"``
(``BearerAuth`` passes non-HTTP scopes through, so the ``lifespan`` scope reaches the
inner Starlette app). Mount the whole app, not ``mcp_app.routes``: its
``RequestContextMiddleware`` is what makes the request's headers visible to the tools.
``BearerAuth`` already answers 401 before any MCP traffic, so no fastmcp ``auth=`` is set.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Annotated, Literal

import fastmcp
import key_value.aio.adapters.pydantic  # noqa: F401  (see build_mcp: imported at start, not on a call)
from fastmcp.exceptions import ToolError
from fastmcp.server.dependencies import get_http_headers
from fastmcp.server.http import StarletteWithLifespan
from fastmcp.server.middleware import CallNext, Middleware, MiddlewareContext
from key_value.aio.stores.memory import MemoryStore
from mcp import types as mt
from pydantic import Field

from services.gateway import sessions
from services.gateway.sessions import Identity, identity_from_headers
from shared.contract import checks, errors, execution, ids, states
from shared.contract.commands import ClearSession, ProvisionSandbox
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
SHELL_TIMEOUT = execution.DEFAULT_TIMEOUT
WAIT_TIMEOUT = 30.0
REQUEST_BUDGET = 30.0
MAX_TIMEOUT = execution.MAX_TIMEOUT
_REQUEST_ID = re.compile(r"[A-Za-z0-9_.:-]{1,128}")

_JOB_ID_ARG = Field(description="The job id shell_async returned (32 lower-case hex characters).")

HeaderSource = Callable[[], Mapping[str, str]]
"""Returns the current request's headers, names in lower case."""

NETWORK = {
    "proxy": (
        "Outbound HTTP(S) goes through a proxy (HTTP_PROXY and HTTPS_PROXY are set), so pip, "
        "npm, apt and git over HTTPS work; credentials the operator configured are added by the "
        "proxy and are never visible in the sandbox. Private and internal addresses are refused."
    ),
    "none": "The sandbox has no network access (loopback only).",
}
"""What the sandboxes can reach, by ``SBX_SANDBOX_EGRESS``: the tool texts say it."""


def instructions(egress: str) -> str:
    """The server instructions for a deployment whose sandboxes have ``egress``."""
    return (
        "Tools to work in a disposable Linux sandbox that belongs to this MCP session (the "
        "X-Session-Id header). The sandbox is created automatically on first use; /workspace is "
        "the working directory and persists between calls until the sandbox is re-provisioned "
        f"(create_sandbox) or cleared (clear_session). {NETWORK[egress]} Use `shell` for quick "
        "commands, `shell_async` + `shell_poll`/`shell_wait`/`shell_stop` for long-running ones, "
        "and `str_replace_based_edit_tool` to view and edit files."
    )


_SANDBOX_NOTE = "The sandbox is created automatically on first use; /workspace is the working directory."


def request_headers() -> Mapping[str, str]:
    """The current HTTP request's headers (empty outside an HTTP request)."""
    return get_http_headers()


@contextlib.contextmanager
def _tool_errors() -> Iterator[None]:
    """Turn the product's errors into MCP tool errors carrying only their message."""
    try:
        yield
    except errors.SandboxError as exc:
        # fastmcp logs a ToolError at its level: the caller's mistakes are not the gateway's errors.
        level = logging.WARNING if exc.status >= 500 else logging.INFO
        raise ToolError(exc.message, log_level=level) from None


# ---- argument checks (before anything is sent) ---------------------------------------------------


def _required(value: object, name: str, command: str) -> None:
    if value is None:
        raise errors.InvalidInput(f"Parameter `{name}` is required for command: {command}")


# ---- formatting of results -----------------------------------------------------------------------


def _with_newline(text: str) -> str:
    return text if not text or text.endswith("\n") else text + "\n"


def format_shell(reply: execution.Reply, timeout: float) -> str:
    text = _with_newline(reply.output)
    if reply.timed_out:
        text += f"[timed out after {timeout:g} s]\n"
    exit_code = "unknown" if reply.exit_code is None else str(reply.exit_code)
    return text + f"[exit code: {exit_code}]"


def format_job(job_id: str, reply: execution.Reply, *, waited: float | None = None) -> str:
    status = reply.status or "unknown"
    lines = [f"job {job_id}"]
    if status == "running" and waited is not None:
        lines.append(f"status: running (still running after {waited:g} s; wait again, poll, or stop it)")
    else:
        lines.append(f"status: {status}")
    if reply.exit_code is not None:
        lines.append(f"exit code: {reply.exit_code}")
    if reply.output:
        lines.append("output so far:" if status == "running" else "output:")
        return "\n".join(lines) + "\n" + reply.output
    lines.append("output: (none)")
    return "\n".join(lines)


# ---- the server ----------------------------------------------------------------------------------


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
    headers: HeaderSource = request_headers,
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
    ``ClaimOnConnect``)."""
    mcp = fastmcp.FastMCP(
        "agent-sandbox",
        instructions=instructions(egress),
        version=service.VERSION,
        mask_error_details=True,
        # fastmcp's per-session state (visibility rules, which these tools do not use)
        # stays in this process. Made here, not on the first tool call: creating it
        # imports its store and pydantic adapter, ~0.6 s the first agent would wait.
        session_state_store=MemoryStore(),
    )

    def identity() -> Identity:
        return identity_from_headers(headers())

    resolver = resolver or sessions.Resolver(commands, running_sandbox, forget)
    if claim_on_connect:
        mcp.add_middleware(ClaimOnConnect(resolver, identity))

    async def run(
        who: Identity, build: Callable[..., execution.AnyRequest], budget: float
    ) -> execution.Reply:
        async def call(sandbox_id: str) -> execution.Reply:
            return await executor.run(build(**resolver.request_fields(who, sandbox_id)), budget=budget)

        return await resolver.with_sandbox(who, call)

    # ---- shell -----------------------------------------------------------------------------------

    @mcp.tool(
        name="shell",
        output_schema=None,
        annotations={"title": "Run a shell command", "openWorldHint": egress == "proxy"},
        description=(
            "Run a bash command synchronously in this session's persistent shell and return its combined "
            "stdout and stderr followed by a final line `[exit code: N]`. The shell persists between "
            "calls: the current directory, exported variables carry over (e.g. `cd src` "
            "then `ls` lists src); shell functions and unexported variables do not. "
            + _SANDBOX_NOTE
            + f" {NETWORK[egress]} The command is stopped after `timeout` seconds "
            f"(default {SHELL_TIMEOUT:g}, at most {MAX_TIMEOUT:g}); then `[timed out after T s]` is "
            "shown. Very long output is truncated and the text says where it was cut. For commands that "
            "take longer or run forever (servers, watchers), use shell_async instead. Examples: "
            "`ls -la`, `python -m pytest -q`, `git status`."
        ),
    )
    async def shell(
        command: Annotated[str, Field(description="The bash command to run, e.g. 'ls -la /workspace'.")],
        timeout: Annotated[
            float | None,
            Field(
                description=f"Seconds before the command is stopped (default {SHELL_TIMEOUT:g}, max 3600)."
            ),
        ] = None,
    ) -> str:
        with _tool_errors():
            who = identity()
            checks.command(command)
            checks.timeout(timeout)
            budget = timeout or SHELL_TIMEOUT
            reply = await run(who, lambda **f: execution.Shell(command=command, timeout=timeout, **f), budget)
            return format_shell(reply, budget)

    @mcp.tool(
        name="shell_async",
        output_schema=None,
        annotations={"title": "Start a background command", "openWorldHint": egress == "proxy"},
        description=(
            "Start a long-running bash command in the background and return at once with its job id "
            "(32 hex characters). Follow it with shell_poll (status and output so far), shell_wait "
            "(block until it finishes or a timeout) and shell_stop (terminate it). "
            "Example: `cd /workspace/app && npm test`. " + _SANDBOX_NOTE + " " + NETWORK[egress]
        ),
    )
    async def shell_async(
        command: Annotated[str, Field(description="The bash command to start, e.g. 'make -j4 all'.")],
    ) -> str:
        with _tool_errors():
            who = identity()
            checks.command(command)
            reply = await run(who, lambda **f: execution.ShellAsync(command=command, **f), REQUEST_BUDGET)
            if reply.job_id is None:
                raise errors.SandboxError("the executor started the command but returned no job id")
            job = reply.job_id
            return (
                f"started job {job}\n"
                f'Check it with shell_poll(job_id="{job}"), block until it ends with '
                f'shell_wait(job_id="{job}", timeout=60), or terminate it with shell_stop(job_id="{job}").'
            )

    @mcp.tool(
        name="shell_poll",
        output_schema=None,
        annotations={"title": "Check a background job", "readOnlyHint": True, "openWorldHint": False},
        description=(
            "Return a background job's current status (running, exited, stopped or lost), its exit code "
            "once it has exited, and its output so far (long output is truncated). Does not wait. "
            + _SANDBOX_NOTE
        ),
    )
    async def shell_poll(job_id: Annotated[str, _JOB_ID_ARG]) -> str:
        with _tool_errors():
            who = identity()
            checks.job_id(job_id)
            reply = await run(who, lambda **f: execution.ShellPoll(job_id=job_id, **f), REQUEST_BUDGET)
            return format_job(job_id, reply)

    @mcp.tool(
        name="shell_wait",
        output_schema=None,
        annotations={"title": "Wait for a background job", "readOnlyHint": True, "openWorldHint": False},
        description=(
            "Block until a background job finishes or `timeout` seconds pass (default "
            f"{WAIT_TIMEOUT:g}, at most {MAX_TIMEOUT:g}), then return its status, exit code if it exited, "
            "and output so far. A job still running after the timeout keeps running; call shell_wait "
            "again, shell_poll, or shell_stop. " + _SANDBOX_NOTE
        ),
    )
    async def shell_wait(
        job_id: Annotated[str, _JOB_ID_ARG],
        timeout: Annotated[
            float | None,
            Field(description=f"Seconds to wait at most (default {WAIT_TIMEOUT:g}, max 3600)."),
        ] = None,
    ) -> str:
        with _tool_errors():
            who = identity()
            checks.job_id(job_id)
            checks.timeout(timeout)
            budget = timeout or WAIT_TIMEOUT
            reply = await run(
                who, lambda **f: execution.ShellWait(job_id=job_id, timeout=timeout, **f), budget
            )
            return format_job(job_id, reply, waited=budget)

    @mcp.tool(
        name="shell_stop",
        output_schema=None,
        annotations={"title": "Stop a background job", "destructiveHint": True, "openWorldHint": False},
        description=(
            "Terminate a background job and return its final status, its exit code if it has one, and "
            "its output. " + _SANDBOX_NOTE
        ),
    )
    async def shell_stop(job_id: Annotated[str, _JOB_ID_ARG]) -> str:
        with _tool_errors():
            who = identity()
            checks.job_id(job_id)
            reply = await run(who, lambda **f: execution.ShellStop(job_id=job_id, **f), REQUEST_BUDGET)
            return format_job(job_id, reply)

    # ---- file editing ----------------------------------------------------------------------------

    @mcp.tool(
        name="str_replace_based_edit_tool",
        output_schema=None,
        annotations={"title": "View and edit files", "openWorldHint": False},
        description=(
            "View, create and edit text files in the sandbox (Anthropic's text editor tool). Paths are "
            "absolute, e.g. /workspace/app.py. Commands:\n"
            "* `view`: a file with line numbers (`view_range` [start, end] is 1-indexed and inclusive, "
            "end -1 means to the end of the file), or a directory listing two levels deep.\n"
            "* `create`: write `file_text` to `path`, replacing any existing file.\n"
            "* `str_replace`: replace `old_str`, which must occur exactly once in the file (whitespace "
            "included), with `new_str` (omit `new_str` to delete `old_str`).\n"
            "* `insert`: insert `insert_text` after line `insert_line` (0 inserts at the top).\n"
            "Files over 10 MiB and binary files are refused; use the shell for them. " + _SANDBOX_NOTE
        ),
    )
    async def str_replace_based_edit_tool(
        command: Annotated[
            Literal["view", "create", "str_replace", "insert"], Field(description="The operation to perform.")
        ],
        path: Annotated[
            str, Field(description="Absolute path of the file or directory, e.g. /workspace/a.py.")
        ],
        view_range: Annotated[
            list[int] | None,
            Field(description="For view: [start_line, end_line], e.g. [10, 40] or [10, -1]."),
        ] = None,
        file_text: Annotated[
            str | None, Field(description="For create: the whole content of the file.")
        ] = None,
        old_str: Annotated[
            str | None, Field(description="For str_replace: the exact text to replace (must be unique).")
        ] = None,
        new_str: Annotated[str | None, Field(description="For str_replace: the replacement text.")] = None,
        insert_line: Annotated[
            int | None, Field(description="For insert: the line after which to insert (0 = top of file).")
        ] = None,
        insert_text: Annotated[str | None, Field(description="For insert: the text to insert.")] = None,
    ) -> str:
        with _tool_errors():
            who = identity()
            checks.path(path)
            if command == "create":
                _required(file_text, "file_text", command)
            elif command == "str_replace":
                _required(old_str, "old_str", command)
            elif command == "insert":
                _required(insert_line, "insert_line", command)
                if insert_text is None:  # older versions of the tool sent the text as new_str
                    insert_text, new_str = new_str, None
                _required(insert_text, "insert_text", command)
            reply = await run(
                who,
                lambda **f: execution.Edit(
                    command=command,
                    path=path,
                    view_range=view_range,
                    file_text=file_text,
                    old_str=old_str,
                    new_str=new_str,
                    insert_line=insert_line,
                    insert_text=insert_text,
                    **f,
                ),
                REQUEST_BUDGET,
            )
            return reply.output

    # ---- the sandbox itself ----------------------------------------------------------------------

    @mcp.tool(
        name="create_sandbox",
        output_schema=None,
        annotations={"title": "(Re-)create the sandbox", "destructiveHint": True, "openWorldHint": False},
        description=(
            "Provision a new sandbox for this session with the given options. Optional: a sandbox is "
            "created automatically on first use with the default image. If the session already has a "
            "sandbox, the new one replaces it and the old one is deleted with its /workspace (all files "
            "are lost) and any running jobs. Options this deployment cannot provide are refused with an "
            f"explanation. {NETWORK[egress]} Example: create_sandbox(run_as_root=false)."
        ),
    )
    async def create_sandbox(
        image: Annotated[
            str | None,
            Field(
                description="The name of an image this deployment offers; omit for the default image."
            ),
        ] = None,
        use_kata: Annotated[
            bool, Field(description="Run in a Kata Containers VM for stronger isolation.")
        ] = False,
        run_as_root: Annotated[bool, Field(description="Run commands as root inside the sandbox.")] = True,
        writable_root: Annotated[
            bool, Field(description="Allow writes outside /workspace (the root filesystem).")
        ] = True,
    ) -> str:
        with _tool_errors():
            who = identity()
            ids.validate_image(image)
            state = await commands.session(
                ProvisionSandbox(
                    session_id=who.session_id,
                    image=image,
                    use_kata=use_kata,
                    run_as_root=run_as_root,
                    writable_root=writable_root,
                    command_id=ids.new_id(),
                    correlation_id=who.correlation_id,
                    actor=who.actor,
                )
            )
            return _provisioned(state, image)

    @mcp.tool(
        name="clear_session",
        output_schema=None,
        annotations={"title": "Delete the sandbox", "destructiveHint": True, "openWorldHint": False},
        description=(
            "Delete this session's sandbox and its /workspace (all files and running jobs are lost). The "
            "next tool call with the same session starts a fresh sandbox. Clearing a session that has "
            "no sandbox is fine."
        ),
    )
    async def clear_session() -> str:
        with _tool_errors():
            who = identity()
            await commands.session(
                ClearSession(
                    session_id=who.session_id,
                    command_id=ids.new_id(),
                    correlation_id=who.correlation_id,
                    actor=who.actor,
                )
            )
            return (
                f"cleared session {who.session_id}: its sandbox and /workspace were deleted; "
                "the next call starts a fresh sandbox"
            )

    return mcp


def _provisioned(state: states.SessionState | None, image: str | None) -> str:
    sandbox = state.sandbox_id if state is not None else None
    shown_image = (state.image if state is not None else None) or image or "the default image"
    what = f"sandbox {sandbox}" if sandbox else "a new sandbox"
    return (
        f"provisioned {what} from {shown_image} for this session; any previous sandbox and its "
        "/workspace were deleted"
    )


def mcp_http_app(mcp: fastmcp.FastMCP) -> StarletteWithLifespan:
    """Streamable HTTP at ``/mcp``, stateless. Run its ``lifespan`` (see the module docstring)."""
    return mcp.http_app(path=MCP_PATH, stateless_http=True, json_response=True)

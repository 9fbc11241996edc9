"""The shell tools: a command in the session's persistent shell, and background jobs
(start, poll, wait, stop)."""

from __future__ import annotations

from typing import Annotated

import fastmcp
from pydantic import Field

from sbx_api import errors
from services.gateway.mcp import calls, texts
from services.gateway.mcp.calls import REQUEST_BUDGET
from services.gateway.mcp.texts import MAX_TIMEOUT, SHELL_TIMEOUT, WAIT_TIMEOUT
from shared.contract import checks, execution

_JOB_ID_ARG = Field(description="The job id shell_async returned (32 lower-case hex characters).")
_COMMAND_ARG = Field(description="The bash command to start, e.g. 'make -j4 all'.")
_STDIN_ARG = Field(description=texts.STDIN_ARG)


def register(mcp: fastmcp.FastMCP, tools: calls.Calls, *, job_input: bool = False) -> None:
    """The five shell tools; with ``job_input``, ``shell_async`` takes ``stdin`` too (see
    :mod:`.jobinput`)."""
    _shell(mcp, tools)
    _shell_async(mcp, tools, job_input)
    _shell_poll(mcp, tools)
    _shell_wait(mcp, tools)
    _shell_stop(mcp, tools)


def _shell(mcp: fastmcp.FastMCP, tools: calls.Calls) -> None:
    @mcp.tool(
        name="shell",
        output_schema=None,
        annotations={"title": "Run a shell command", "openWorldHint": tools.egress == "proxy"},
        description=(
            "Run a bash command synchronously in this session's persistent shell and return its combined "
            "stdout and stderr followed by a final line `[exit code: N]`. The shell persists between "
            "calls as one bash session: the directory, all variables and arrays, functions, aliases, "
            "`set -o`/`shopt` options, umask, traps, ulimits and jobs carry over (e.g. `cd src` then `ls` "
            "lists src; `source venv/bin/activate` stays active). The command runs as a script sourced "
            "by that shell: an error stops only its own command, and line numbers count from the "
            "command's first line. Commands have no stdin (a program that reads input gets end of "
            "file at once): give input with a here-document or a pipe, e.g. `python3 - <<'EOF'` "
            "or `printf 'y\\n' | cmd`. `exit N` ends only this call; a call that ends the shell "
            "(`exit`, `set -e`) or times out leaves the shell as it was before that call. "
            + texts.SANDBOX_NOTE
            + f" {texts.NETWORK[tools.egress]} The command is stopped after `timeout` seconds "
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
        with calls.tool_errors():
            who = tools.identity()
            checks.command(command)
            checks.timeout(timeout)
            budget = timeout or SHELL_TIMEOUT
            reply = await tools.run(
                who, lambda **f: execution.Shell(command=command, timeout=timeout, **f), budget, progress=True
            )
            return texts.format_shell(reply, budget)


def _shell_async(mcp: fastmcp.FastMCP, tools: calls.Calls, job_input: bool) -> None:
    async def start(command: str, stdin: bool) -> str:
        with calls.tool_errors():
            who = tools.identity()
            checks.command(command)
            reply = await tools.run(
                who, lambda **f: execution.ShellAsync(command=command, stdin=stdin, **f), REQUEST_BUDGET
            )
            if reply.job_id is None:
                raise errors.SandboxError("the executor started the command but returned no job id")
            job = reply.job_id
            given = f'Give it input with shell_input(job_id="{job}", input="..."). ' if stdin else ""
            return (
                f"started job {job}\n{given}"
                f'Check it with shell_poll(job_id="{job}"), block until it ends with '
                f'shell_wait(job_id="{job}", timeout=60), or terminate it with shell_stop(job_id="{job}").'
            )

    tool = mcp.tool(
        name="shell_async",
        output_schema=None,
        annotations={"title": "Start a background command", "openWorldHint": tools.egress == "proxy"},
        description=(
            "Start a long-running bash command in the background and return at once with its job id "
            "(32 hex characters). Follow it with shell_poll (status and output so far), shell_wait "
            "(block until it finishes or a timeout) and shell_stop (terminate it). "
            + (texts.STDIN_NOTE if job_input else "")
            + "Example: `cd /workspace/app && npm test`. "
            + texts.SANDBOX_NOTE
            + " "
            + texts.NETWORK[tools.egress]
        ),
    )
    if not job_input:

        @tool
        async def shell_async(command: Annotated[str, _COMMAND_ARG]) -> str:
            return await start(command, False)

        return

    @tool
    async def shell_async_with_input(
        command: Annotated[str, _COMMAND_ARG],
        stdin: Annotated[bool, _STDIN_ARG] = False,
    ) -> str:
        return await start(command, stdin)


def _shell_poll(mcp: fastmcp.FastMCP, tools: calls.Calls) -> None:
    @mcp.tool(
        name="shell_poll",
        output_schema=None,
        annotations={"title": "Check a background job", "readOnlyHint": True, "openWorldHint": False},
        description=(
            "Return a background job's current status (running, exited, stopped or lost), its exit code "
            "once it has exited, and its output so far (long output is truncated). Does not wait. "
            + texts.SANDBOX_NOTE
        ),
    )
    async def shell_poll(job_id: Annotated[str, _JOB_ID_ARG]) -> str:
        with calls.tool_errors():
            who = tools.identity()
            checks.job_id(job_id)
            reply = await tools.run(who, lambda **f: execution.ShellPoll(job_id=job_id, **f), REQUEST_BUDGET)
            return texts.format_job(job_id, reply)


def _shell_wait(mcp: fastmcp.FastMCP, tools: calls.Calls) -> None:
    @mcp.tool(
        name="shell_wait",
        output_schema=None,
        annotations={"title": "Wait for a background job", "readOnlyHint": True, "openWorldHint": False},
        description=(
            "Block until a background job finishes or `timeout` seconds pass (default "
            f"{WAIT_TIMEOUT:g}, at most {MAX_TIMEOUT:g}), then return its status, exit code if it exited, "
            "and output so far. A job still running after the timeout keeps running; call shell_wait "
            "again, shell_poll, or shell_stop. " + texts.SANDBOX_NOTE
        ),
    )
    async def shell_wait(
        job_id: Annotated[str, _JOB_ID_ARG],
        timeout: Annotated[
            float | None,
            Field(description=f"Seconds to wait at most (default {WAIT_TIMEOUT:g}, max 3600)."),
        ] = None,
    ) -> str:
        with calls.tool_errors():
            who = tools.identity()
            checks.job_id(job_id)
            checks.timeout(timeout)
            budget = timeout or WAIT_TIMEOUT
            reply = await tools.run(
                who, lambda **f: execution.ShellWait(job_id=job_id, timeout=timeout, **f), budget
            )
            return texts.format_job(job_id, reply, waited=budget)


def _shell_stop(mcp: fastmcp.FastMCP, tools: calls.Calls) -> None:
    @mcp.tool(
        name="shell_stop",
        output_schema=None,
        annotations={"title": "Stop a background job", "destructiveHint": True, "openWorldHint": False},
        description=(
            "Terminate a background job and return its final status, its exit code if it has one, and "
            "its output. " + texts.SANDBOX_NOTE
        ),
    )
    async def shell_stop(job_id: Annotated[str, _JOB_ID_ARG]) -> str:
        with calls.tool_errors():
            who = tools.identity()
            checks.job_id(job_id)
            reply = await tools.run(who, lambda **f: execution.ShellStop(job_id=job_id, **f), REQUEST_BUDGET)
            return texts.format_job(job_id, reply)

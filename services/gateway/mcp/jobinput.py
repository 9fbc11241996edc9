"""One optional tool (``SBX_MCP_JOB_INPUT=on``; off by default, and the eight tools stay as
they are): ``shell_input`` writes to the standard input of a background job that
``shell_async`` started with ``stdin=true`` (an argument it has only then), or closes it.
The executor's ``shell_input`` operation, which the E2B processes API uses too."""

from __future__ import annotations

import asyncio
from typing import Annotated

import fastmcp
from pydantic import Field

from services.gateway.mcp import calls, texts
from services.gateway.mcp.calls import REQUEST_BUDGET
from shared.contract import checks, execution

TOOL_NAMES = ("shell_input",)
SETTLE = 0.2
"""Seconds given to the job to answer its input before its output is read back."""


def register(mcp: fastmcp.FastMCP, tools: calls.Calls) -> None:
    @mcp.tool(
        name="shell_input",
        output_schema=None,
        annotations={"title": "Give a background job input", "readOnlyHint": False, "openWorldHint": False},
        description=(
            "Write `input` to the standard input of a background job started with "
            "shell_async(stdin=true), exactly as given (end a line with \\n), and/or close its input "
            "with close=true (the job then reads end of file). Returns the job's status and output "
            "so far, as shell_poll does. " + texts.SANDBOX_NOTE
        ),
    )
    async def shell_input(
        job_id: Annotated[str, Field(description="The job id shell_async returned.")],
        input: Annotated[str, Field(description="Text for the job's stdin, e.g. 'yes\\n'.")] = "",
        close: Annotated[bool, Field(description="Then close the job's stdin (end of file).")] = False,
    ) -> str:
        with calls.tool_errors():
            who = tools.identity()
            checks.job_id(job_id)
            if input:
                data = input.encode()
                await tools.run(
                    who, lambda **f: execution.ShellInput(job_id=job_id, data=data, **f), REQUEST_BUDGET
                )
            if close:
                await tools.run(
                    who, lambda **f: execution.ShellInput(job_id=job_id, close=True, **f), REQUEST_BUDGET
                )
            await asyncio.sleep(SETTLE)
            reply = await tools.run(who, lambda **f: execution.ShellPoll(job_id=job_id, **f), REQUEST_BUDGET)
            return texts.format_job(job_id, reply)

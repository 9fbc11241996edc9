"""The sandbox itself: re-provision it with options, or clear the session."""

from __future__ import annotations

from typing import Annotated

import fastmcp
from pydantic import Field

from sbx_api import errors
from services.gateway.mcp import calls, texts
from shared.contract import ids
from shared.contract.commands import ClearSession, ProvisionSandbox
from shared.infrastructure import rpc

CREATE_BUDGET = rpc.PROVISION_TIMEOUT
"""How long ``create_sandbox`` waits for its new sandbox: its image's first pull included
(the scheduler beats meanwhile: one that dies is noticed within seconds)."""


def register(mcp: fastmcp.FastMCP, tools: calls.Calls) -> None:
    _create_sandbox(mcp, tools)
    _clear_session(mcp, tools)


def _create_sandbox(mcp: fastmcp.FastMCP, tools: calls.Calls) -> None:
    @mcp.tool(
        name="create_sandbox",
        output_schema=None,
        annotations={"title": "(Re-)create the sandbox", "destructiveHint": True, "openWorldHint": False},
        description=(
            "Provision a new sandbox for this session with the given options. Optional: a sandbox is "
            "created automatically on first use with the default image. If the session already has a "
            "sandbox, the new one replaces it and the old one is deleted with its /workspace (all files "
            "are lost) and any running jobs. Options this deployment cannot provide are refused with an "
            f"explanation. {texts.creating(CREATE_BUDGET)} {texts.NETWORK[tools.egress]} "
            'Example: create_sandbox(image="python:3.12-slim").'
        ),
    )
    async def create_sandbox(
        image: Annotated[
            str | None,
            Field(
                description=(
                    "Any container image reference, e.g. python:3.12-slim, node:22, "
                    "ghcr.io/org/img:tag; pulled from its registry on first use (the first sandbox of "
                    "an image waits for the pull). It needs /bin/sh. Omit for the default image."
                )
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
        with calls.tool_errors():
            who = tools.identity()
            ids.validate_image(image)
            command = ProvisionSandbox(
                session_id=who.session_id,
                image=image,
                use_kata=use_kata,
                run_as_root=run_as_root,
                writable_root=writable_root,
                command_id=ids.new_id(),
                correlation_id=who.correlation_id,
                actor=who.actor,
            )
            try:
                state = await calls.waiting(
                    tools.commands.session(command, timeout=CREATE_BUDGET), texts.still_creating
                )
            except errors.Timeout:
                raise errors.Timeout(texts.create_timed_out(CREATE_BUDGET)) from None
            return texts.provisioned(state, image)


def _clear_session(mcp: fastmcp.FastMCP, tools: calls.Calls) -> None:
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
        with calls.tool_errors():
            who = tools.identity()
            await tools.commands.session(
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

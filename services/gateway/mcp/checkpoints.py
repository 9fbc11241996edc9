"""Two optional tools (``SBX_MCP_CHECKPOINTS=on``; off by default, and the eight tools stay
as they are): an agent checkpoints its own session's files and goes back to one of its
own checkpoints (a snapshot of this session: ``session.snapshot`` and a restore limited to
the session's own snapshots)."""

from __future__ import annotations

from typing import Annotated

import fastmcp
from pydantic import Field

from services.gateway.mcp import calls
from shared.contract import ids
from shared.contract.commands import RestoreSession, SnapshotSession

TOOL_NAMES = ("checkpoint", "restore_checkpoint")
BUDGET = 900.0
"""A checkpoint copies files and a restore starts a sandbox: the provisioning budget."""


def register(mcp: fastmcp.FastMCP, tools: calls.Calls) -> None:
    _checkpoint(mcp, tools)
    _restore(mcp, tools)


def _checkpoint(mcp: fastmcp.FastMCP, tools: calls.Calls) -> None:
    @mcp.tool(
        name="checkpoint",
        output_schema=None,
        annotations={"title": "Checkpoint the session", "readOnlyHint": False, "openWorldHint": False},
        description=(
            "Save this session's files as a checkpoint: /workspace, what was installed outside it, "
            "and the shell's directory and exported variables (not running processes). Go back to it "
            "later with restore_checkpoint, e.g. before trying a risky change. Returns the checkpoint id."
        ),
    )
    async def checkpoint() -> str:
        with calls.tool_errors():
            who = tools.identity()
            reply = await tools.commands.call(
                SnapshotSession(
                    session_id=who.session_id,
                    snapshot_id=f"cp-{ids.new_id()[:20]}",
                    command_id=ids.new_id(),
                    correlation_id=who.correlation_id,
                    actor=who.actor,
                ),
                timeout=BUDGET,
            )
            assert reply.snapshot is not None
            saved = reply.snapshot.snapshot_id
            return (
                f"checkpoint {saved} saved ({reply.snapshot.files} files and directories); "
                f'restore_checkpoint(checkpoint_id="{saved}") goes back to it'
            )


def _restore(mcp: fastmcp.FastMCP, tools: calls.Calls) -> None:
    @mcp.tool(
        name="restore_checkpoint",
        output_schema=None,
        annotations={"title": "Go back to a checkpoint", "destructiveHint": True, "openWorldHint": False},
        description=(
            "Put this session's files back to one of its checkpoints: everything written since is "
            "lost, running processes and jobs end, and the shell starts again in the checkpoint's "
            'directory with its exported variables. Example: restore_checkpoint(checkpoint_id="cp-…").'
        ),
    )
    async def restore_checkpoint(
        checkpoint_id: Annotated[str, Field(description="The id the checkpoint tool returned.")],
    ) -> str:
        with calls.tool_errors():
            who = tools.identity()
            ids.validate_session_id(checkpoint_id, what="checkpoint id")
            await tools.commands.call(
                RestoreSession(
                    session_id=who.session_id,
                    snapshot_id=checkpoint_id,
                    own=True,
                    command_id=ids.new_id(),
                    correlation_id=who.correlation_id,
                    actor=who.actor,
                ),
                timeout=BUDGET,
            )
            if tools.resolver.forget is not None:  # (the old sandbox is gone: ask next time)
                tools.resolver.forget(who.session_id)
            return f"this session is back at checkpoint {checkpoint_id}: a new sandbox with its files"

"""The agent-host client: run an agent's commands in a sandbox while the host's working
tree stays the source of truth (see ../shared/seeds/self-hosted-agent-sandbox.md).

``route`` decides, from the command text alone, what must run on the host (git network
commands, which need the host's credentials) and what runs in the sandbox.
"""

from sbx_client.sandbox import AsyncSandbox, Result, Sandbox, SyncError

__all__ = ["AsyncSandbox", "Result", "Sandbox", "SyncError"]

"""The Cloud Agent Sandbox client, without the server (``pip install ./api ./clients/python``:
the wire contract, :mod:`sbx_api`, and msgspec).

- :class:`Client`: the REST API (sessions, a command's output as it comes, files as tar).
- :class:`Sandbox`: an agent host's code dir synced with a session's sandbox around each
  command (see ../shared/seeds/self-hosted-agent-sandbox.md); ``route`` decides, from the
  command text alone, what must run on the host (git network commands, which need the
  host's credentials) and what runs in the sandbox.
- The wire contract is :mod:`sbx_api` (its own distribution, ``api/``): the gateway and
  this client import the same definitions.
"""

from sbx_api.wire import Session, SessionList
from sbx_client.connection import ApiError
from sbx_client.rest import Client, Completed
from sbx_client.sandbox import AsyncSandbox, Result, Sandbox, SyncError

__all__ = [
    "ApiError",
    "AsyncSandbox",
    "Client",
    "Completed",
    "Result",
    "Sandbox",
    "Session",
    "SessionList",
    "SyncError",
]

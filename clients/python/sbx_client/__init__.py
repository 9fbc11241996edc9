"""The Cloud Agent Sandbox client, without the server (``pip install ./clients/python``:
one dependency, msgspec).

- :class:`Client`: the REST API (sessions, a command's output as it comes, files as tar).
- :class:`Sandbox`: an agent host's code dir synced with a session's sandbox around each
  command (see ../shared/seeds/self-hosted-agent-sandbox.md); ``route`` decides, from the
  command text alone, what must run on the host (git network commands, which need the
  host's credentials) and what runs in the sandbox.
- :mod:`sbx_client.hostapi`, :mod:`sbx_client.api`, :mod:`sbx_client.errors`: the wire
  contract the gateway itself uses.
"""

from sbx_client.api import Session, SessionList
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

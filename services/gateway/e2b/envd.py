"""The in-sandbox API (envd) the SDK reaches at ``E2B_SANDBOX_URL``: Connect RPC with the
JSON codec over HTTP/1.1, routed by ``E2b-Sandbox-Id`` and checked by ``X-Access-Token``.
This module holds the tokens and the routing; the methods are in :mod:`.processes` and
:mod:`.filesystem`. A method not listed here is Connect's ``unimplemented``."""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

import msgspec
import structlog
from starlette.types import Receive, Scope, Send

from sbx_api import errors
from services.gateway import hostapi as host_api
from services.gateway.e2b import connect, filesystem, processes, signing
from shared.contract import ids, states
from shared.infrastructure import projector

log = structlog.get_logger(__name__)

ENVD_PORT = "49983"
HEALTH = "/health"
STREAM_INPUT = "/process.Process/StreamInput"
ROUTE = "sbx.e2b.route"
"""Scope key: (port, sandbox id) of a request routed by its host (:func:`signing.route`)."""
NOT_BUILT = (
    "this envd method is not served by this stack: see docs/e2b.md for what is (process "
    "Start/Connect/List/SendInput/StreamInput/CloseStdin/SendSignal, filesystem Stat/ListDir/MakeDir/Move/"
    "Remove/WatchDir/CreateWatcher/GetWatcherEvents/RemoveWatcher, /files, /health)"
)
Unary = Callable[[states.SessionState, bytes], Awaitable[Any]]
Streaming = Callable[[states.SessionState, bytes], Awaitable[AsyncGenerator[bytes, None]]]


def access_token(secret: bytes, session: states.SessionState) -> str:
    """The sandbox's ``envdAccessToken``: bound to the session id, its organisation and this
    incarnation (a sandbox id created again gets another), verifiable by every gateway."""
    material = msgspec.json.encode(["e2b-envd", session.session_id, session.org_id, session.incarnation])
    return hmac.new(secret, material, hashlib.sha256).hexdigest()


def secret_of(operator_key: str) -> bytes:
    """The access tokens' secret, derived from the operator's key (every gateway has it;
    rotating the key ends every token)."""
    return hmac.new(
        hashlib.sha256(operator_key.encode()).digest(), b"sbx-e2b-envd\0", hashlib.sha256
    ).digest()


class Envd:
    def __init__(
        self,
        sessions_store: projector.ProjectionStore[states.SessionState],
        host: host_api.HostAPI,
        secret: bytes,
        visible: Callable[[states.SessionState | None], bool],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.clock = clock
        self.sessions = sessions_store
        self.host = host
        self.secret = secret
        self.visible = visible
        self.processes = processes.Processes(host)
        self.filesystem = filesystem.Filesystem(host)
        fs = "/filesystem.Filesystem/"
        self.unary: dict[str, Unary] = {
            fs + "Stat": self.filesystem.stat,
            fs + "ListDir": self.filesystem.list_dir,
            fs + "MakeDir": self.filesystem.make_dir,
            fs + "Move": self.filesystem.move,
            fs + "Remove": self.filesystem.remove,
            fs + "CreateWatcher": self.filesystem.create_watcher,
            fs + "GetWatcherEvents": self.filesystem.get_watcher_events,
            fs + "RemoveWatcher": self.filesystem.remove_watcher,
        }
        pr = "/process.Process/"
        self.unary.update(
            {
                pr + "List": self.processes.list_processes,
                pr + "SendInput": self.processes.send_input,
                pr + "CloseStdin": self.processes.close_stdin,
                pr + "SendSignal": self.processes.send_signal,
                pr + "Update": self.processes.update,
            }
        )
        self.streaming: dict[str, Streaming] = {
            pr + "Start": self.processes.start,
            pr + "Connect": self.processes.connect,
            fs + "WatchDir": self.filesystem.watch_dir,
        }

    async def session(self, scope: Scope, fields: dict[str, str] | None) -> states.SessionState:
        """The sandbox a call is for (its host's ``{port}-{id}`` label, else ``E2b-Sandbox-Id``
        and ``E2b-Sandbox-Port``) when the call proves it may: ``X-Access-Token``, or for
        ``/files`` (``fields``: its query) a signed URL's signature."""
        headers = {k.decode("latin-1"): v for k, v in scope["headers"]}
        named = headers.get("e2b-sandbox-id", b"").decode("latin-1")
        port, raw_sid = scope.get(ROUTE) or (headers.get("e2b-sandbox-port", b"").decode("latin-1"), named)
        if port != ENVD_PORT:
            raise connect.ConnectError(
                "unimplemented", f"only envd (port {ENVD_PORT}) is reachable here, not port {port[:8]}"
            )
        if ROUTE in scope and named and named != raw_sid:
            raise connect.ConnectError(
                "invalid_argument", "E2b-Sandbox-Id names another sandbox than the host"
            )
        try:
            sid = ids.validate_session_id(raw_sid)
        except errors.InvalidInput:
            raise connect.ConnectError("not_found", "no such sandbox") from None
        state = await self.sessions.get(sid)
        token = access_token(self.secret, state) if state is not None else "\0"
        given = headers.get("x-access-token")
        if given is None and fields is not None:  # (a signed URL: envd's rule)
            signing.check(fields, scope["method"], token, self.clock())
        elif not hmac.compare_digest(given or b"", token.encode()):
            # (compared even for a missing sandbox: the answer takes as long either way)
            raise connect.ConnectError("unauthenticated", "missing or wrong X-Access-Token for this sandbox")
        if state is None or not self.visible(state):
            raise connect.ConnectError("unauthenticated", "missing or wrong X-Access-Token for this sandbox")
        return state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path, method = scope["path"], scope["method"]
        try:
            fields = signing.query(scope.get("query_string", b"")) if path == filesystem.FILES else None
            session = await self.session(scope, fields)
            if path == HEALTH and method in ("GET", "HEAD"):
                await connect.respond(send, 204, b"")
            elif fields is not None:
                await self.filesystem.serve(session, fields, scope, receive, send)
            elif method == "POST" and path in self.unary:
                await connect.unary(send, await self.unary[path](session, await connect.body(receive)))
            elif method == "POST" and path == STREAM_INPUT:
                await self.stream(send, await self.processes.stream_input(session, receive))
            elif method == "POST" and path in self.streaming:
                raw = connect.unenvelope(await connect.body(receive))
                await self.stream(send, await self.streaming[path](session, raw))
            else:
                raise connect.ConnectError("unimplemented", NOT_BUILT)
        except connect.ConnectError as exc:
            await connect.error(send, exc)
        except errors.SandboxError as exc:
            await connect.error(send, connect.from_error(exc))

    @staticmethod
    async def stream(send: Send, messages: AsyncGenerator[bytes, None]) -> None:
        """A server stream's answer: its messages, then the end of the stream (an error
        message of the generator's own ends it instead)."""
        headers = [(b"content-type", connect.STREAM_JSON.encode()), (b"cache-control", b"no-store")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        try:
            ended = False
            async for chunk in messages:
                if chunk:
                    ended = chunk[0] == connect.END_STREAM
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send(
                {
                    "type": "http.response.body",
                    "body": b"" if ended else connect.end_stream(),
                    "more_body": False,
                }
            )
        finally:
            await messages.aclose()

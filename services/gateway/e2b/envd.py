"""The in-sandbox API (envd) the SDK reaches at ``E2B_SANDBOX_URL``, as far as it is built:
Connect RPC with the JSON codec over HTTP/1.1, routed by ``E2b-Sandbox-Id`` and checked by
``X-Access-Token``. ``process.Process/Start`` runs the command through the executor's
``Run`` (the host API's streamed run) and streams its output and exit code; ``GET /health``
answers for a live sandbox. Every other method is Connect's ``unimplemented``."""

from __future__ import annotations

import base64
import hashlib
import hmac
import struct
from collections.abc import AsyncGenerator, Callable

import msgspec
import structlog
from starlette.types import Receive, Scope, Send

from sbx_api import errors, hostapi
from services.gateway import hostapi as host_api
from services.gateway import sessions
from shared.contract import execution, ids, states
from shared.infrastructure import projector

log = structlog.get_logger(__name__)

ENVD_PORT = "49983"
START = "/process.Process/Start"
HEALTH = "/health"
BODY_MAX = 1024 * 1024
DEFAULT_CWD = hostapi.WORKSPACE
_ENVELOPE = struct.Struct(">BI")
END_STREAM = 0x02
CONNECT_JSON = "application/connect+json"
NOT_BUILT = (
    "this envd method is not served by this stack yet: only process.Process/Start (foreground "
    "commands) and /health are (docs/e2b.md)"
)
STATUS_OF = {
    "invalid_argument": 400,
    "unauthenticated": 401,
    "permission_denied": 403,
    "not_found": 404,
    "unimplemented": 501,
    "unavailable": 503,
    "internal": 500,
}


def access_token(secret: bytes, session: states.SessionState) -> str:
    """The sandbox's ``envdAccessToken``: bound to the session id, its organisation and this
    incarnation (a sandbox id created again gets another), verifiable by every gateway."""
    material = msgspec.json.encode(["e2b-envd", session.session_id, session.org_id, session.incarnation])
    return hmac.new(secret, material, hashlib.sha256).hexdigest()


class ConnectError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class ProcessConfig(msgspec.Struct, frozen=True):
    cmd: str = ""
    args: list[str] = []
    envs: dict[str, str] = {}
    cwd: str | None = None


class StartRequest(msgspec.Struct, frozen=True):
    process: ProcessConfig = ProcessConfig()
    stdin: bool = False
    tag: str | None = None


class Failure(msgspec.Struct, frozen=True):
    """An executor's error frame, as far as it is shown."""

    message: str = "the command failed"
    retriable: bool = False


def secret_of(operator_key: str) -> bytes:
    """The access tokens' secret, derived from the operator's key (every gateway has it;
    rotating the key ends every token)."""
    return hmac.new(
        hashlib.sha256(operator_key.encode()).digest(), b"sbx-e2b-envd\0", hashlib.sha256
    ).digest()


def command_of(request: StartRequest) -> str:
    """The shell command the SDK's ``commands.run`` sends (``/bin/bash -l -c CMD``)."""
    config = request.process
    if config.cmd != "/bin/bash" or len(config.args) != 3 or config.args[:2] != ["-l", "-c"]:
        raise ConnectError("unimplemented", "only '/bin/bash -l -c COMMAND' processes are started here")
    return config.args[2]


def envelope(payload: bytes, flags: int = 0) -> bytes:
    return _ENVELOPE.pack(flags, len(payload)) + payload


def event(kind: str, body: dict[str, object]) -> bytes:
    return envelope(msgspec.json.encode({"event": {kind: body}}))


def end_stream(error: ConnectError | None = None) -> bytes:
    body = {} if error is None else {"error": {"code": error.code, "message": error.message}}
    return envelope(msgspec.json.encode(body), END_STREAM)


def translate(channel: bytes, data: bytes) -> bytes:
    """One executor frame as a ``StartResponse`` envelope (or end of stream)."""
    if channel in (hostapi.STDOUT, hostapi.STDERR):
        name = "stdout" if channel == hostapi.STDOUT else "stderr"
        return event("data", {name: base64.b64encode(data).decode()})
    if channel == hostapi.END:
        end = msgspec.json.decode(data, type=hostapi.End)
        if end.exit_code is None:
            status = "timed out" if end.timed_out else "killed"
            return event("end", {"exitCode": -1, "exited": False, "status": status, "error": status})
        return event(
            "end", {"exitCode": end.exit_code, "exited": True, "status": f"exit status {end.exit_code}"}
        )
    if channel == hostapi.ERROR:
        failed = msgspec.json.decode(data, type=Failure)
        return end_stream(ConnectError("unavailable" if failed.retriable else "internal", failed.message))
    if channel == hostapi.KEEPALIVE:
        return event("keepalive", {})
    return b""


class Envd:
    def __init__(
        self,
        sessions_store: projector.ProjectionStore[states.SessionState],
        host: host_api.HostAPI,
        secret: bytes,
        visible: Callable[[states.SessionState | None], bool],
    ) -> None:
        self.sessions = sessions_store
        self.host = host
        self.secret = secret
        self.visible = visible

    async def session(self, scope: Scope) -> states.SessionState:
        headers = {k.decode("latin-1"): v for k, v in scope["headers"]}
        port = headers.get("e2b-sandbox-port", b"").decode("latin-1")
        if port != ENVD_PORT:
            raise ConnectError(
                "unimplemented", f"only envd (port {ENVD_PORT}) is reachable here, not port {port[:8]}"
            )
        try:
            sid = ids.validate_session_id(headers.get("e2b-sandbox-id", b"").decode("ascii"))
        except (errors.InvalidInput, UnicodeDecodeError):
            raise ConnectError("not_found", "no such sandbox") from None
        state = await self.sessions.get(sid)
        given = headers.get("x-access-token", b"")
        expected = access_token(self.secret, state).encode() if state is not None else b"\0"
        # (compared even for a missing sandbox: the answer takes as long either way)
        if not hmac.compare_digest(given, expected) or not self.visible(state):
            raise ConnectError("unauthenticated", "missing or wrong X-Access-Token for this sandbox")
        assert state is not None
        return state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"]
        try:
            session = await self.session(scope)
            if path == HEALTH and scope["method"] in ("GET", "HEAD"):
                await self.plain(send, 204, b"")
                return
            if path != START or scope["method"] != "POST":
                raise ConnectError("unimplemented", NOT_BUILT)
            request = await self.start_request(receive)
            frames = await self.start(session, request)
        except ConnectError as exc:
            await self.error(send, exc)
            return
        except errors.SandboxError as exc:
            await self.error(send, ConnectError("unavailable" if exc.retriable else "internal", exc.message))
            return
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", CONNECT_JSON.encode()), (b"cache-control", b"no-store")],
            }
        )
        try:
            await send({"type": "http.response.body", "body": event("start", {"pid": 0}), "more_body": True})
            async for chunk in frames:
                if chunk:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": end_stream(), "more_body": False})
        finally:
            await frames.aclose()

    @staticmethod
    async def start_request(receive: Receive) -> StartRequest:
        raw = bytearray()
        while True:
            message = await receive()
            raw += message.get("body", b"")
            if len(raw) > BODY_MAX:
                raise ConnectError("invalid_argument", f"request larger than {BODY_MAX} bytes")
            if not message.get("more_body"):
                break
        if len(raw) < _ENVELOPE.size:
            raise ConnectError("invalid_argument", "expected one Connect envelope")
        flags, size = _ENVELOPE.unpack_from(raw)
        if flags != 0 or size != len(raw) - _ENVELOPE.size:
            raise ConnectError("invalid_argument", "expected one uncompressed Connect envelope")
        try:
            return msgspec.json.decode(bytes(raw[_ENVELOPE.size :]), type=StartRequest)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise ConnectError("invalid_argument", f"invalid StartRequest: {exc}") from None

    async def start(self, session: states.SessionState, request: StartRequest) -> AsyncGenerator[bytes, None]:
        command = command_of(request)
        env = {**session.env, **request.process.envs}
        who = sessions.Identity(
            session_id=session.session_id, correlation_id=ids.new_id(), org_id=session.org_id, via="rest"
        )
        receiver, run_id, _, _ = await self.host.open(
            who,
            lambda **fields: execution.Run(
                command=command, cwd=request.process.cwd or DEFAULT_CWD, env=env, **fields
            ),
        )
        stop = self.host.topology.exec_stop(session.session_id, run_id)
        events = self.host.events(receiver, stop)

        async def frames() -> AsyncGenerator[bytes, None]:
            try:
                async for channel, data in events:
                    yield translate(channel, data)
            finally:
                await events.aclose()

        return frames()

    @staticmethod
    async def plain(send: Send, status: int, body: bytes) -> None:
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": body})

    @staticmethod
    async def error(send: Send, exc: ConnectError) -> None:
        body = msgspec.json.encode({"code": exc.code, "message": exc.message})
        await send(
            {
                "type": "http.response.start",
                "status": STATUS_OF.get(exc.code, 500),
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

"""The session registry's REST endpoints, declared once for routing and OpenAPI."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
import structlog
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from sbx_api import errors
from services.gateway import cursors, schemas
from shared.contract import commands, ids, states
from shared.domain import listing
from shared.infrastructure import listings, projector, rpc

log = structlog.get_logger(__name__)

MAX_BODY = 64 * 1024
LIST_LIMIT_MAX = 1000
CURSOR_HELP = (
    "Continue after the previous page: its `next_cursor`, unchanged, with the same filters. "
    "An opaque, signed token naming the last item shown; a page costs the same however deep. "
    "Items created meanwhile appear on later pages; none that existed throughout is skipped "
    "or repeated. A cursor altered, or sent with other filters, is a 400."
)
CURSOR_SCHEMA: dict[str, Any] = {"type": "string", "minLength": 1, "maxLength": cursors.MAX_LENGTH}
_encoder = msgspec.json.Encoder()

Handler = Callable[[Request], Awaitable[Response]]


class API(Protocol):
    """One of the gateway's HTTP APIs: its operations (a table of :class:`Operation`, also
    what OpenAPI is generated from), each answered by the method the operation names."""

    def routes(self) -> list[BaseRoute]: ...


def routes(api: object, operations: Sequence[Operation], *, failed: str = "rest.failed") -> list[BaseRoute]:
    """A route per operation of ``api``'s table, to its handler (``handler_name``) with its
    errors answered as problem documents (5xx also logged as ``failed``)."""
    return [
        Route(
            op.path,
            guarded(getattr(api, op.handler_name), op.operation_id, failed=failed),
            methods=[op.method],
            name=op.operation_id,
        )
        for op in operations
    ]


def list_limit(raw: str | None) -> int:
    """A list's ``limit`` parameter (default 100), or a 400."""
    raw = "100" if raw is None else raw
    if not raw.isdigit() or not 1 <= int(raw) <= LIST_LIMIT_MAX:
        raise errors.InvalidInput(f"limit must be an integer from 1 to {LIST_LIMIT_MAX}")
    return int(raw)


def json_response(body: msgspec.Struct | None, status: int = 200, **headers: str) -> Response:
    content = _encoder.encode(body) if body is not None else b""
    return Response(
        content, status, media_type="application/json" if body is not None else None, headers=headers
    )


def problem(exc: errors.SandboxError) -> Response:
    status = exc.status if exc.status >= 400 else 500
    return json_response(
        schemas.Problem(error=exc.code, message=exc.message, status=status, retriable=exc.retriable),
        status,
        **({"retry-after": "1"} if exc.retriable else {}),
    )


@dataclass(frozen=True)
class Param:
    name: str
    where: str  # "path" | "query" | "header"
    description: str
    schema: dict[str, Any] = field(default_factory=lambda: {"type": "string"})
    required: bool = False


@dataclass(frozen=True)
class Operation:
    method: str
    path: str
    operation_id: str
    summary: str
    handler_name: str
    responses: dict[int, tuple[type | None, str]]
    body: type | None = None
    body_optional: bool = False
    """The JSON body may be left out (every field of ``body`` has a default)."""
    params: tuple[Param, ...] = ()
    tag: str = "sessions"
    body_media_type: str | None = None
    """A body that is not JSON (the upload's frame stream), by its media type."""
    answer_media: tuple[tuple[str, Any], ...] = ()
    """The success answer's media types (the preferred first), each with the msgspec type
    of its items (NDJSON lines, events) or None for bytes; none: JSON, by ``responses``."""
    answer_headers: tuple[str, ...] = ()
    """Headers the success answer always carries (names of :data:`HEADERS`)."""


HEADERS: dict[str, tuple[str, dict[str, Any]]] = {
    "Location": ("Where the new session is (/v1/sessions/{id}).", {"type": "string"}),
    "X-Sandbox-Id": ("The sandbox that did it.", {"type": "string"}),
    "X-Run-Id": (
        "Names the run (POST .../runs/{run_id}/stop stops it).",
        {"type": "string", "pattern": "^[0-9a-f]{32}$"},
    ),
    "Retry-After": (
        "Seconds to wait before retrying; sent when the error is retriable.",
        {"type": "integer"},
    ),
}
"""Response headers the document declares: name -> (description, schema)."""


SESSION_ID_SCHEMA = {"type": "string", "pattern": ids.SESSION_ID_PATTERN}
SESSION_ID_PARAM = Param("session_id", "path", "The session id.", SESSION_ID_SCHEMA, required=True)
_ATTRIBUTION_SCHEMA = {"type": "string", "pattern": ids.ATTRIBUTION_HEADER_PATTERN}
"""(Printable ASCII: what an HTTP header carries as text; bodies may carry any printable text.)"""
ATTRIBUTION = (
    Param(
        "X-Org-Id",
        "header",
        "Organisation to attribute the session to (recorded on events).",
        _ATTRIBUTION_SCHEMA,
    ),
    Param(
        "X-User-Id", "header", "User to attribute the session to (recorded on events).", _ATTRIBUTION_SCHEMA
    ),
)
IDEMPOTENCY = Param(
    "Idempotency-Key",
    "header",
    "Makes retries of a write safe: the same key never causes a second transition.",
    {"type": "string", "pattern": ids.IDEMPOTENCY_KEY_PATTERN},
)
COMMON_ERRORS: dict[int, tuple[type | None, str]] = {
    400: (schemas.Problem, "Invalid input; nothing was changed."),
    401: (schemas.Problem, "Missing or wrong API key."),
    503: (schemas.Problem, "The scheduler or NATS is unavailable; retry."),
    504: (
        schemas.Problem,
        "The scheduler did not answer in time; the outcome is unknown: retry with the same Idempotency-Key.",
    ),
}
CONCURRENCY: dict[int, tuple[type | None, str]] = {
    409: (schemas.Problem, "Another write to this session won the race (concurrency); retry."),
}

PAUSE_ERRORS: dict[int, tuple[type | None, str]] = {
    404: (schemas.Problem, "No such session."),
    409: (
        schemas.Problem,
        "The session has no sandbox to pause or resume (never used, stopped, or its sandbox is "
        "gone or still starting); or another write won the race (code concurrency): retry.",
    ),
    501: (schemas.Problem, "The runtime cannot pause sandboxes."),
    **COMMON_ERRORS,
}

OPERATIONS: tuple[Operation, ...] = (
    Operation(
        "POST",
        "/v1/sessions",
        "createSession",
        "Register a session id",
        "create_session",
        {201: (schemas.Session, "Created."), 409: (schemas.Problem, "The session exists."), **COMMON_ERRORS},
        body=schemas.CreateSessionRequest,
        params=(*ATTRIBUTION, IDEMPOTENCY),
        answer_headers=("Location",),
    ),
    Operation(
        "GET",
        "/v1/sessions",
        "listSessions",
        "List sessions, one page at a time (deleted ones only when asked for)",
        "list_sessions",
        {200: (schemas.SessionList, "A page of matching sessions, oldest first."), **COMMON_ERRORS},
        params=(
            Param(
                "status",
                "query",
                "Only sessions in this status.",
                {"type": "string", "enum": list(listing.SESSION_STATUSES)},
            ),
            Param("org_id", "query", "Only sessions of this organisation."),
            Param("user_id", "query", "Only sessions of this user."),
            Param("image", "query", "Only sessions created with this image."),
            Param(
                "limit",
                "query",
                "At most this many (default 100).",
                {"type": "integer", "minimum": 1, "maximum": LIST_LIMIT_MAX},
            ),
            Param("cursor", "query", CURSOR_HELP, CURSOR_SCHEMA),
        ),
    ),
    Operation(
        "GET",
        "/v1/sessions/{session_id}",
        "getSession",
        "Get one session",
        "get_session",
        {200: (schemas.Session, "The session."), 404: (schemas.Problem, "No such session."), **COMMON_ERRORS},
        params=(SESSION_ID_PARAM,),
    ),
    Operation(
        "POST",
        "/v1/sessions/{session_id}/stop",
        "stopSession",
        "Stop a session (idempotent)",
        "stop_session",
        {
            200: (schemas.Session, "Stopped (or already stopped)."),
            404: (schemas.Problem, "No such session."),
            **CONCURRENCY,
            **COMMON_ERRORS,
        },
        params=(SESSION_ID_PARAM, IDEMPOTENCY),
    ),
    Operation(
        "POST",
        "/v1/sessions/{session_id}/pause",
        "pauseSession",
        "Pause a session's sandbox: every process frozen, memory kept (idempotent)",
        "pause_session",
        {
            200: (schemas.SessionSandbox, "Paused (or already paused); the session's next call resumes it."),
            **PAUSE_ERRORS,
        },
        params=(SESSION_ID_PARAM, IDEMPOTENCY),
    ),
    Operation(
        "POST",
        "/v1/sessions/{session_id}/resume",
        "resumeSession",
        "Resume a session's paused sandbox (idempotent)",
        "resume_session",
        {200: (schemas.SessionSandbox, "Running (resumed now, or it was running)."), **PAUSE_ERRORS},
        params=(SESSION_ID_PARAM, IDEMPOTENCY),
    ),
    Operation(
        "DELETE",
        "/v1/sessions/{session_id}",
        "deleteSession",
        "Delete a session",
        "delete_session",
        {204: (None, "Deleted."), 404: (schemas.Problem, "No such session."), **CONCURRENCY, **COMMON_ERRORS},
        params=(SESSION_ID_PARAM, IDEMPOTENCY),
    ),
)


class SessionsAPI:
    def __init__(
        self,
        client: rpc.SessionClient,
        sessions: projector.ProjectionStore[states.SessionState],
        forget: Callable[[str], None] | None = None,
        *,
        listed: listings.Listing[states.SessionState],
        tokens: cursors.Cursors,
    ) -> None:
        self.client = client
        self.sessions = sessions
        self.listed = listed
        """Sessions in list indexes (a projection store of its own, followed)."""
        self.cursors = tokens
        self.forget = forget
        """Drops what this gateway remembers of a session's sandbox (``Placement.forget``):
        after a pause, its next call asks instead of finding the sandbox frozen."""

    # ---- request helpers -------------------------------------------------------

    @staticmethod
    def command_fields(
        request: Request, operation: str, *, org_id: str | None = None, user_id: str | None = None
    ) -> dict[str, Any]:
        """The fields every session command carries. An ``Idempotency-Key`` names one request
        to one operation: the command id is the key scoped by ``operation`` (a key reused on a
        stop, then on a delete, is two requests; the same delete again is a retry)."""
        key = request.headers.get("idempotency-key")
        request_id = ids.validate_request_id(request.headers.get("x-request-id"))
        bound = request.scope.get("sbx.org")
        if bound is not None and org_id not in (None, bound):
            raise errors.Forbidden(
                "this key acts for one organisation: org_id must be absent or that organisation"
            )
        header_org, header_user = request.headers.get("x-org-id"), request.headers.get("x-user-id")
        actor = commands.Actor(
            via="rest",
            org_id=ids.validate_attribution(org_id, what="org_id")
            or ids.validate_attribution(header_org, what="X-Org-Id header", header=True),
            user_id=ids.validate_attribution(user_id, what="user_id")
            or ids.validate_attribution(header_user, what="X-User-Id header", header=True),
        )
        command_id = ids.new_id() if key is None else f"{operation}:{ids.validate_idempotency_key(key)}"
        return {
            "command_id": command_id,
            "correlation_id": request_id or ids.new_id(),
            "actor": actor,
        }

    @staticmethod
    def path_session_id(request: Request) -> str:
        return ids.validate_session_id(request.path_params["session_id"])

    @staticmethod
    async def read_body(request: Request, body_type: type[Any]) -> Any:
        raw = await request.body()
        if len(raw) > MAX_BODY:
            raise errors.InvalidInput(f"request body is larger than {MAX_BODY} bytes")
        if not raw:
            raise errors.InvalidInput("request body is empty; send a JSON object")
        try:
            return msgspec.json.decode(raw, type=body_type)
        except msgspec.ValidationError as exc:
            raise errors.InvalidInput(f"invalid request body: {exc}") from None
        except msgspec.DecodeError as exc:
            raise errors.InvalidInput(f"request body is not valid JSON: {exc}") from None

    # ---- operations ------------------------------------------------------------

    async def create_session(self, request: Request) -> Response:
        body: schemas.CreateSessionRequest = await self.read_body(request, schemas.CreateSessionRequest)
        command = commands.CreateSession(
            session_id=ids.validate_session_id(body.session_id),
            image=ids.validate_image(body.image),
            **self.command_fields(request, "create", org_id=body.org_id, user_id=body.user_id),
        )
        state = await self.client.session(command)
        assert state is not None
        return json_response(schemas.session_of(state), 201, location=f"/v1/sessions/{state.session_id}")

    async def list_sessions(self, request: Request) -> Response:
        query = request.query_params
        status = query.get("status")
        if status is not None and status not in listing.SESSION_STATUSES:
            raise errors.InvalidInput(f"status must be one of: {', '.join(listing.SESSION_STATUSES)}")
        limit = list_limit(query.get("limit"))
        org_id, user_id, image = query.get("org_id"), query.get("user_id"), query.get("image")
        bound = request.scope.get("sbx.org")
        if bound is not None:
            if org_id not in (None, bound):
                raise errors.Forbidden(
                    "this key acts for one organisation: it lists only that organisation's"
                )
            org_id = bound
        selector = listing.session_selector(status, org_id, user_id, image)
        raw_cursor = query.get("cursor")
        after = self.cursors.decode("sessions", selector, raw_cursor) if raw_cursor is not None else None
        page = await self.listed.page(selector, after=after, limit=limit)
        return json_response(
            schemas.SessionList(
                sessions=[schemas.session_of(s) for s in page.items],
                count=page.total,
                next_cursor=self.cursors.encode("sessions", selector, page.last) if page.last else None,
            )
        )

    async def get_session(self, request: Request) -> Response:
        session_id = self.path_session_id(request)
        state = await self.sessions.get(session_id)
        bound = request.scope.get("sbx.org")
        foreign = bound is not None and state is not None and state.org_id not in (None, bound)
        if state is None or state.status == "deleted" or foreign:
            raise errors.NotFound(f"session {session_id!r} does not exist")
        return json_response(schemas.session_of(state))

    async def stop_session(self, request: Request) -> Response:
        command = commands.StopSession(
            session_id=self.path_session_id(request), **self.command_fields(request, "stop")
        )
        state = await self.client.session(command)
        self.forget_placement(command.session_id)
        assert state is not None
        return json_response(schemas.session_of(state))

    def forget_placement(self, session_id: str) -> None:
        """This gateway's remembered placement of the session is stale now: a download right
        after a stop or delete must not reach the sandbox being stopped through it."""
        if self.forget is not None:
            self.forget(session_id)

    async def pause_session(self, request: Request) -> Response:
        command = commands.PauseSession(
            session_id=self.path_session_id(request), **self.command_fields(request, "pause")
        )
        return await self._sandbox_answer(command)

    async def resume_session(self, request: Request) -> Response:
        command = commands.ResumeSession(
            session_id=self.path_session_id(request), **self.command_fields(request, "resume")
        )
        return await self._sandbox_answer(command)

    async def _sandbox_answer(self, command: commands.PauseSession | commands.ResumeSession) -> Response:
        reply = await self.client.call(command)
        self.forget_placement(command.session_id)
        if reply.sandbox is None:
            raise errors.Conflict(f"session {command.session_id!r} has no sandbox to pause or resume")
        return json_response(schemas.sandbox_of(command.session_id, reply.sandbox, reply.appended > 0))

    async def delete_session(self, request: Request) -> Response:
        command = commands.DeleteSession(
            session_id=self.path_session_id(request), **self.command_fields(request, "delete")
        )
        await self.client.session(command)
        self.forget_placement(command.session_id)
        return json_response(None, 204)

    def routes(self) -> list[BaseRoute]:
        return routes(self, OPERATIONS)


def guarded(handler: Handler, name: str, *, failed: str = "rest.failed") -> Handler:
    """The handler, its errors answered as problem documents (5xx also logged as ``failed``)."""

    async def endpoint(request: Request) -> Response:
        try:
            return await handler(request)
        except errors.SandboxError as exc:
            if exc.status >= 500:
                log.warning(failed, operation=name, code=exc.code, error=exc.message)
            return problem(exc)

    return endpoint

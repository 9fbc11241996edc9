"""The E2B control plane over HTTP, under ``/e2b``: ``X-API-KEY`` auth (the gateway's own
keys, org-bound ones kept to their organisation), each route one or more session commands,
errors as E2B's ``{"code", "message"}``. A sandbox's id is its session id."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

import msgspec
import structlog
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from sbx_api import errors
from services.gateway import auth, origins
from services.gateway.e2b import envd, rules, signing, wire
from shared.contract import commands, execution, ids, states
from shared.infrastructure import projector, rpc

log = structlog.get_logger(__name__)

PREFIX = "/e2b"
MAX_BODY = 64 * 1024
BUDGET = rpc.PROVISION_TIMEOUT
METRICS_BUDGET = 10.0
_encoder = msgspec.json.Encoder()
T = TypeVar("T")
Handler = Callable[[Request], Awaitable[Response]]


def answer(body: Any, status: int = 200, **headers: str) -> Response:
    content = _encoder.encode(body) if body is not None else b""
    return Response(
        content, status, media_type="application/json" if body is not None else None, headers=headers
    )


def failure(status: int, message: str) -> Response:
    return answer(wire.Error(code=status, message=message), status)


def _status(exc: errors.SandboxError) -> int:
    return exc.status if exc.status >= 400 else 500


@dataclass(frozen=True)
class Stores:
    sessions: projector.ProjectionStore[states.SessionState]
    sandboxes: projector.ProjectionStore[states.SandboxState]
    snapshots: projector.ProjectionStore[states.SnapshotState]


class ControlPlane:
    def __init__(
        self,
        client: rpc.SessionClient,
        stores: Stores,
        *,
        max_lifetime: float,
        forget: Callable[[str], None] | None = None,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        secret: bytes = b"",
        executor: rpc.ExecClient | None = None,
        sandbox_domain: str = "",
    ) -> None:
        self.sandbox_domain = sandbox_domain
        """``SBX_E2B_DOMAIN``: the ``domain`` every answer names (empty: the request's host)."""
        self.executor = executor
        """Reads a sandbox's resource use (``metrics``); None: metrics are not served."""
        self.secret = secret
        """Signs each sandbox's envd access token (``envd.access_token``)."""
        self.client = client
        self.stores = stores
        self.max_lifetime = max_lifetime
        self.forget = forget
        self.clock = clock

    # ---- request helpers -------------------------------------------------------

    @staticmethod
    def org(request: Request) -> str | None:
        org: str | None = request.scope.get("sbx.org")
        return org

    def domain(self, request: Request) -> str:
        """Where the SDK's sandbox traffic goes when it has no E2B_SANDBOX_URL, never E2B's
        cloud: ``SBX_E2B_DOMAIN`` (``{port}-{id}.{domain}`` reaches this gateway), else our own
        host name (the Host the guard let through)."""
        return self.sandbox_domain or (request.url.hostname or "localhost").lower()

    @staticmethod
    def fields(request: Request, operation: str) -> dict[str, Any]:
        key = request.headers.get("idempotency-key")
        command_id = ids.new_id() if key is None else f"e2b-{operation}:{ids.validate_idempotency_key(key)}"
        return {
            "command_id": command_id,
            "correlation_id": ids.validate_request_id(request.headers.get("x-request-id")) or ids.new_id(),
            "actor": commands.Actor(via="e2b", org_id=request.scope.get("sbx.org")),
        }

    @staticmethod
    async def body(request: Request, kind: type[T], *, optional: bool = False) -> T:
        raw = await request.body()
        if len(raw) > MAX_BODY:
            raise errors.InvalidInput(f"request body is larger than {MAX_BODY} bytes")
        if not raw.strip():
            if optional:
                return msgspec.json.decode(b"{}", type=kind)
            raise errors.InvalidInput("request body is empty; send a JSON object")
        try:
            return msgspec.json.decode(raw, type=kind)
        except msgspec.ValidationError as exc:
            raise errors.InvalidInput(f"invalid request body: {exc}") from None
        except msgspec.DecodeError as exc:
            raise errors.InvalidInput(f"request body is not valid JSON: {exc}") from None

    async def session(self, request: Request) -> states.SessionState:
        """The path's sandbox, if the caller may see it: else 404, as a missing one."""
        raw = request.path_params["sandbox_id"]
        try:
            sid = ids.validate_session_id(raw)
        except errors.InvalidInput:
            raise errors.NotFound("sandbox not found") from None
        state = await self.stores.sessions.get(sid)
        if not rules.visible(self.org(request), state):
            raise errors.NotFound(f"sandbox {sid} not found")
        assert state is not None
        return state

    async def sandbox_of(self, session: states.SessionState) -> states.SandboxState | None:
        return await self.stores.sandboxes.get(session.sandbox_id) if session.sandbox_id else None

    def created(self, request: Request, session: states.SessionState) -> wire.Sandbox:
        return wire.Sandbox(
            templateID=session.forked_from or session.image or "base",
            sandboxID=session.session_id,
            clientID=wire.CLIENT_ID,
            envdVersion=wire.ENVD_VERSION,
            envdAccessToken=envd.access_token(self.secret, session),
            domain=self.domain(request),
        )

    async def snapshot(self, request: Request, snapshot_id: str) -> states.SnapshotState | None:
        try:
            ids.validate_session_id(snapshot_id, what="snapshot id")
        except errors.InvalidInput:
            return None
        state = await self.stores.snapshots.get(snapshot_id)
        org = self.org(request)
        if state is None or state.status != "ready" or (org is not None and state.org_id != org):
            return None
        return state

    # ---- sandboxes -------------------------------------------------------------

    async def create(self, request: Request) -> Response:
        body = await self.body(request, wire.NewSandbox)
        org = self.org(request)
        labels = dict(body.metadata)
        end_at = rules.deadline(self.clock(), body.timeout)
        fields = self.fields(request, "create")
        sid = rules.sandbox_id(org, request.headers.get("idempotency-key"), ids.new_id())
        snap = await self.snapshot(request, body.template_id)
        if snap is not None:
            state = (
                await self.client.call(
                    commands.ForkSession(
                        session_id=sid, snapshot_id=snap.snapshot_id, metadata=labels, env=body.env_vars,
                        end_at=end_at, **fields,
                    ),
                    timeout=BUDGET,
                )
            ).session  # fmt: skip
        else:
            image = (
                None if body.template_id in rules.DEFAULT_TEMPLATES else ids.validate_image(body.template_id)
            )
            existing = await self.stores.sessions.get(sid)
            if existing is not None and existing.status == "active":  # a retried create (same key)
                if not rules.visible(org, existing):
                    raise errors.Conflict("this Idempotency-Key named another sandbox")
            state = await self.client.session(
                commands.EnsureSession(
                    session_id=sid, image=image, metadata=labels, env=body.env_vars, end_at=end_at, **fields
                ),
                timeout=BUDGET,
            )
        assert state is not None
        return answer(self.created(request, state), 201)

    async def connect(self, request: Request) -> Response:
        session = await self.session(request)
        body = await self.body(request, wire.Connect, optional=True)
        before = rules.state_of(await self.sandbox_of(session))
        fields = self.fields(request, "connect")
        state = await self.client.session(
            commands.EnsureSession(session_id=session.session_id, **fields), timeout=BUDGET
        )
        assert state is not None
        if body.timeout is not None:
            end_at = rules.deadline(self.clock(), body.timeout)
            if state.end_at is None or end_at > state.end_at:  # connecting only ever extends
                state = await self.client.session(
                    commands.SetDeadline(
                        session_id=state.session_id, end_at=end_at, **self.fields(request, "extend")
                    )
                )
                assert state is not None
        return answer(self.created(request, state), 201 if before == "paused" else 200)

    async def listed(self, request: Request, session: states.SessionState) -> wire.ListedSandbox | None:
        state = rules.state_of(await self.sandbox_of(session))
        if state is None:
            return None
        return wire.ListedSandbox(
            templateID=session.forked_from or session.image or "base",
            sandboxID=session.session_id,
            clientID=wire.CLIENT_ID,
            startedAt=session.created_at,
            endAt=rules.end_of(session, self.max_lifetime),
            cpuCount=0,
            memoryMB=0,
            diskSizeMB=0,
            state=state,
            envdVersion=wire.ENVD_VERSION,
            metadata=session.metadata,
        )

    async def list_v2(self, request: Request) -> Response:
        query = request.query_params
        wanted = rules.parse_states(query.get("state"))
        labels = rules.parse_metadata_filter(query.get("metadata"))
        limit = rules.parse_limit(query.get("limit"))
        cursor = rules.decode_cursor(query.get("nextToken"))
        order = query.get("order", "asc")
        if order not in ("asc", "desc"):
            raise errors.InvalidInput("order must be asc or desc")
        template = query.get("template")
        org = self.org(request)
        candidates = [
            s for s in (await self.stores.sessions.all()).values()
            if rules.visible(org, s) and rules.matches(s, labels)
            and (template is None or template in (s.image or "base", s.forked_from))
        ]  # fmt: skip
        shown: list[wire.ListedSandbox] = []
        next_token: str | None = None
        while True:  # (pages of sessions until one has ``limit`` sandboxes in the states asked for)
            batch, token = rules.page(candidates, cursor, limit - len(shown), descending=order == "desc")
            for s in batch:
                item = await self.listed(request, s)
                if item is not None and item.state in wanted:
                    shown.append(item)
            if token is None or len(shown) >= limit:
                next_token = token
                break
            cursor = rules.decode_cursor(token)
        headers = {"x-next-token": next_token} if next_token else {}
        return answer(shown, 200, **headers)

    async def list_v1(self, request: Request) -> Response:
        labels = rules.parse_metadata_filter(request.query_params.get("metadata"))
        org = self.org(request)
        items = [
            await self.listed(request, s)
            for s in (await self.stores.sessions.all()).values()
            if rules.visible(org, s) and rules.matches(s, labels)
        ]
        return answer([i for i in items if i is not None and i.state == "running"])

    async def get(self, request: Request) -> Response:
        session = await self.session(request)
        item = await self.listed(request, session)
        if item is None:
            raise errors.NotFound(f"sandbox {session.session_id} not found")
        detail = wire.SandboxDetail(**msgspec.structs.asdict(item), domain=self.domain(request))
        return answer(detail)

    async def kill(self, request: Request) -> Response:
        session = await self.session(request)
        await self.client.session(
            commands.DeleteSession(session_id=session.session_id, **self.fields(request, "kill"))
        )
        if self.forget is not None:
            self.forget(session.session_id)
        return answer(None, 204)

    async def timeout(self, request: Request) -> Response:
        session = await self.session(request)
        body = await self.body(request, wire.Timeout)
        await self.client.session(
            commands.SetDeadline(
                session_id=session.session_id,
                end_at=rules.deadline(self.clock(), body.timeout),
                **self.fields(request, "timeout"),
            )
        )
        return answer(None, 204)

    async def pause(self, request: Request) -> Response:
        session = await self.session(request)
        if rules.state_of(await self.sandbox_of(session)) == "paused":
            return failure(409, f"sandbox {session.session_id} is already paused")
        await self.client.call(
            commands.PauseSession(session_id=session.session_id, **self.fields(request, "pause"))
        )
        if self.forget is not None:
            self.forget(session.session_id)
        return answer(None, 204)

    async def metrics(self, request: Request) -> Response:
        """One reading taken now (no history is kept): CPU over a short window, memory and
        disk as the runtime reads them from the kernel. An empty list when the range asked
        for ends before now or the sandbox does not run (stopped: no processes to measure)."""
        session = await self.session(request)
        if self.executor is None:
            raise errors.NotBuiltYet("sandbox metrics are not served by this gateway (docs/e2b.md)")
        now = self.clock()
        start, end = (rules.parse_unix(request.query_params.get(k), k) for k in ("start", "end"))
        sandbox = await self.sandbox_of(session)
        running = sandbox is not None and sandbox.status in ("running", "paused")
        if sandbox is None or not running or not rules.now_in(now, start, end):
            return answer([])
        reply = await self.executor.run(
            execution.SandboxUsage(
                session_id=session.session_id,
                sandbox_id=sandbox.sandbox_id,
                actor=commands.Actor(via="e2b", org_id=self.org(request)),
                correlation_id=ids.new_id(),
            ),
            budget=METRICS_BUDGET,
        )
        assert reply.usage is not None
        return answer([rules.metric(reply.usage)])

    # ---- snapshots and forks ---------------------------------------------------

    def _snapshot_id(self, request: Request, session: states.SessionState, operation: str) -> str:
        key = request.headers.get("idempotency-key") or ids.new_id()
        raw = msgspec.json.encode([operation, self.org(request), session.session_id, key])
        return f"snap-{hashlib.sha256(raw).hexdigest()[:20]}"

    async def take_snapshot(self, request: Request) -> Response:
        session = await self.session(request)
        body = await self.body(request, wire.SnapshotRequest, optional=True)
        if body.name is not None:
            raise errors.NotBuiltYet("named snapshots are not implemented: leave out name (docs/e2b.md)")
        snapshot_id = self._snapshot_id(request, session, "snapshot")
        reply = await self.client.call(
            commands.SnapshotSession(
                session_id=session.session_id, snapshot_id=snapshot_id, **self.fields(request, "snapshot")
            ),
            timeout=BUDGET,
        )
        assert reply.snapshot is not None
        return answer(wire.SnapshotInfo(snapshotID=reply.snapshot.snapshot_id, names=[]), 201)

    async def list_snapshots(self, request: Request) -> Response:
        query = request.query_params
        of = query.get("sandboxID")
        if query.get("name"):
            raise errors.NotBuiltYet("snapshots have no names here: filter by sandboxID (docs/e2b.md)")
        limit = rules.parse_limit(query.get("limit"))
        cursor = rules.decode_cursor(query.get("nextToken"))
        org = self.org(request)
        mine = sorted(
            (
                s for s in (await self.stores.snapshots.all()).values()
                if s.status == "ready" and (org is None or s.org_id == org)
                and (of is None or s.session_id == of)
            ),
            key=lambda s: (s.created_at.isoformat(), s.snapshot_id),
        )  # fmt: skip
        if cursor is not None:
            mine = [s for s in mine if (s.created_at.isoformat(), s.snapshot_id) > cursor]
        shown = mine[:limit]
        headers: dict[str, str] = {}
        if len(mine) > limit:
            last = shown[-1]
            raw = msgspec.json.encode([last.created_at.isoformat(), last.snapshot_id])
            headers["x-next-token"] = rules.base64.urlsafe_b64encode(raw).decode().rstrip("=")
        return answer([wire.SnapshotInfo(snapshotID=s.snapshot_id, names=[]) for s in shown], 200, **headers)

    async def delete_template(self, request: Request) -> Response:
        template_id = request.path_params["template_id"]
        snap = await self.snapshot(request, template_id)
        if snap is None:
            raise errors.NotFound(
                f"template {template_id[:128]} not found (only snapshots can be deleted here: docs/e2b.md)"
            )
        await self.client.call(
            commands.DeleteSnapshot(
                session_id=snap.session_id, snapshot_id=snap.snapshot_id, **self.fields(request, "unsnap")
            )
        )
        return answer(None, 204)

    async def fork(self, request: Request) -> Response:
        session = await self.session(request)
        body = await self.body(request, wire.ForkRequest, optional=True)
        if not 1 <= body.count <= 100:
            raise errors.InvalidInput("count must be from 1 to 100")
        end_at = rules.deadline(self.clock(), body.timeout) if body.timeout is not None else session.end_at
        fields = self.fields(request, "fork")
        snapshot_id = self._snapshot_id(request, session, "fork")
        reply = await self.client.call(
            commands.SnapshotSession(session_id=session.session_id, snapshot_id=snapshot_id, **fields),
            timeout=BUDGET,
        )
        assert reply.snapshot is not None
        org = self.org(request)
        key = request.headers.get("idempotency-key")
        wanted = [
            rules.sandbox_id(org, f"{key}:{n}" if key else None, ids.new_id()) for n in range(body.count)
        ]
        forks = [
            commands.ForkSession(
                session_id=sid, snapshot_id=snapshot_id, metadata=session.metadata, env=session.env,
                end_at=end_at, **{**fields, "command_id": f"{fields['command_id']}:{sid}"},
            )
            for sid in wanted
        ]  # fmt: skip
        results = await asyncio.gather(
            *(self.client.call(f, timeout=BUDGET) for f in forks), return_exceptions=True
        )
        out: list[wire.ForkResult] = []
        for result in results:
            if isinstance(result, errors.SandboxError):
                out.append(wire.ForkResult(error=wire.Error(code=_status(result), message=result.message)))
            elif isinstance(result, BaseException):
                raise result
            else:
                assert result.session is not None
                out.append(wire.ForkResult(sandbox=self.created(request, result.session)))
        return answer(out, 201)

    # ---- routing -----------------------------------------------------------------

    def routes(self) -> list[Route]:
        table: list[tuple[str, str, Handler]] = [
            ("POST", "/v2/sandboxes", self.create),
            ("POST", "/sandboxes", self.create),
            ("GET", "/v2/sandboxes", self.list_v2),
            ("GET", "/sandboxes", self.list_v1),
            ("POST", "/v2/sandboxes/{sandbox_id}/connect", self.connect),
            ("POST", "/sandboxes/{sandbox_id}/connect", self.connect),
            ("GET", "/sandboxes/{sandbox_id}", self.get),
            ("DELETE", "/sandboxes/{sandbox_id}", self.kill),
            ("POST", "/sandboxes/{sandbox_id}/timeout", self.timeout),
            ("POST", "/sandboxes/{sandbox_id}/pause", self.pause),
            ("POST", "/sandboxes/{sandbox_id}/snapshots", self.take_snapshot),
            ("POST", "/sandboxes/{sandbox_id}/fork", self.fork),
            ("GET", "/sandboxes/{sandbox_id}/metrics", self.metrics),
            ("GET", "/snapshots", self.list_snapshots),
            ("DELETE", "/templates/{template_id}", self.delete_template),
        ]
        return [Route(PREFIX + path, guarded(handler), methods=[method]) for method, path, handler in table]

    def app(self, keys: auth.KeyCheck) -> ASGIApp:
        async def not_found(request: Request, _: Exception) -> Response:
            return failure(
                404, f"not implemented by this server: {request.method} {request.url.path} (docs/e2b.md)"
            )

        async def not_allowed(request: Request, _: Exception) -> Response:
            return failure(405, f"{request.method} is not allowed on {request.url.path}")

        inner = Starlette(routes=self.routes(), exception_handlers={404: not_found, 405: not_allowed})
        return ApiKeyAuth(inner, keys)


def guarded(handler: Handler) -> Handler:
    async def endpoint(request: Request) -> Response:
        try:
            return await handler(request)
        except errors.SandboxError as exc:
            status = _status(exc)
            if status >= 500:
                log.warning("e2b.failed", path=request.url.path, code=exc.code, error=exc.message)
            response = failure(status, exc.message)
            if exc.retriable:
                response.headers["retry-after"] = "1"
            return response

    return endpoint


class ApiKeyAuth:
    """``X-API-KEY: <key>``, checked as the gateway checks a bearer key (the same keys, in
    constant time); an org-bound key acts for its organisation only (``sbx.org``)."""

    def __init__(self, app: ASGIApp, keys: auth.KeyCheck) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = [v for k, v in scope["headers"] if k == b"x-api-key"]
        who = self.keys.identify([b"Bearer " + given[0]]) if len(given) == 1 else None
        if who is None:
            await failure(
                401, "missing or invalid API key: send X-API-KEY (E2B_API_KEY) with a key of this stack"
            )(scope, receive, send)
            return
        headers = [(k, v) for k, v in scope["headers"] if k != b"x-org-id"]
        org = None if who == auth.OPERATOR else who
        await self.app({**scope, "headers": headers, "sbx.org": org}, receive, send)


ENVD_PREFIX = PREFIX + "/envd"
"""Where ``E2B_SANDBOX_URL`` points: the in-sandbox API (envd), not served yet."""
ENVD_NOT_BUILT = msgspec.json.encode(
    {
        "code": "unimplemented",
        "message": "the in-sandbox API (envd: commands, files) is not served by this stack yet; "
        "only the control plane is (docs/e2b.md)",
    }
)


async def envd_not_built(scope: Scope, receive: Receive, send: Send) -> None:
    """Every envd call, before any key check (it reveals nothing): Connect's ``unimplemented``
    (HTTP 501), which the SDK shows with its message."""
    await send(
        {
            "type": "http.response.start",
            "status": 501,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(ENVD_NOT_BUILT)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": ENVD_NOT_BUILT})


class Mount:
    """The API app with the E2B control plane beside it under ``/e2b`` and envd (when built
    in) under ``/e2b/envd``, and at every path of a host ``{port}-{sandboxId}.{domain}``
    when ``domain`` (``SBX_E2B_DOMAIN``) is set: the sandbox named by the host."""

    def __init__(
        self, api_app: ASGIApp, e2b_app: ASGIApp, envd_app: ASGIApp | None = None, domain: str = ""
    ) -> None:
        self.api_app = api_app
        self.e2b_app = e2b_app
        self.envd_app = envd_app
        named = origins.split_host(domain) if domain else None
        self.domain = named[0] if named is not None else ""  # (the name: any port may front it)

    def routed(self, scope: Scope) -> tuple[str, str] | None:
        if not self.domain:
            return None
        hosts = [v.decode("latin-1") for k, v in scope["headers"] if k == b"host"]
        host = origins.split_host(hosts[0]) if len(hosts) == 1 else None
        return None if host is None else signing.route(host[0], self.domain)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        route = self.routed(scope) if scope["type"] == "http" else None
        if route is not None or path == ENVD_PREFIX or path.startswith(ENVD_PREFIX + "/"):
            if self.envd_app is None:
                await envd_not_built(scope, receive, send)
            elif route is not None:
                await self.envd_app({**scope, envd.ROUTE: route}, receive, send)
            else:
                await self.envd_app({**scope, "path": path[len(ENVD_PREFIX) :] or "/"}, receive, send)
            return
        if path == PREFIX or path.startswith(PREFIX + "/"):
            await self.e2b_app(scope, receive, send)
            return
        await self.api_app(scope, receive, send)

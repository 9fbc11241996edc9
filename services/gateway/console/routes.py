"""The console's routes under ``/console``: login, pages, live streams and actions.

The console is its own ASGI app beside the API (:func:`mount`): the API takes bearer
keys, the console a session cookie it issues for one of the same keys. Every answer
carries a strict Content-Security-Policy and refuses framing; every action is a POST with
the CSRF token of the session that rendered its form. Its live streams (a session's
timeline, the audit stream) are server-sent events under ``/console/``, for the
console's own pages only: they are not part of the API (the API's timeline route is
``GET /v1/sessions/{id}/timeline``), so they are left out of the OpenAPI document.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import urllib.parse
from collections.abc import AsyncGenerator, Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec
import nats.js.errors
import structlog
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Scope

from sbx_api import errors
from sbx_api.wire import Timeline
from services.gateway import auth, hostapi, timeline
from services.gateway.console import asgi, templating, tokens, views
from shared.contract import commands, ids, states
from shared.domain import incarnations, projections
from shared.infrastructure import eventstore, health, projector, replay, rpc, service

log = structlog.get_logger(__name__)

PREFIX = asgi.PREFIX
COOKIE = "sbx_console"
LOGIN_COOKIE = "sbx_console_login"
TIMELINE_SHOWN = 1000
"""Entries a session page renders; the rest are a link away (``?after=``)."""
AUDIT_SHOWN = 200
"""Events of the stream's end the audit page renders before it goes live."""
STREAMS_MAX = 64
"""Live streams (timelines and audit) the console serves at once, per gateway instance."""
STATIC = Path(__file__).parent / "static"
STATIC_TYPES = {
    "console.js": "text/javascript; charset=utf-8",
    "console.css": "text/css; charset=utf-8",
    "favicon.svg": "image/svg+xml",
}
DONE = {"stopped": "Session stopped.", "deleted": "Session deleted."}
"""What a redirect after an action says (by a fixed name: no text is taken from the URL)."""

Page = Callable[[Request, tokens.Identity], Awaitable[Response]]


class Console:
    def __init__(
        self,
        *,
        keys: auth.KeyCheck,
        signer: tokens.Signer,
        ctx: service.Context,
        sessions: projector.ProjectionStore[states.SessionState],
        client: rpc.SessionClient,
        history: timeline.TimelineAPI,
        clock: Callable[[], float] = time.time,
        forget: Callable[[str], None] | None = None,
    ) -> None:
        self.keys = keys
        self.forget = forget
        """Drops this gateway's remembered placement of a session it stopped or deleted."""
        self.signer = signer
        self.ctx = ctx
        self.sessions = sessions
        self.client = client
        self.history = history
        self.clock = clock
        self.static = {name: (STATIC / name).read_bytes() for name in STATIC_TYPES}
        self._stores: dict[str, projector.ProjectionStore[Any]] = {}
        self._replaying = asyncio.Lock()
        self._streams = 0

    # ---- the app ------------------------------------------------------------------

    def app(self) -> ASGIApp:
        p = PREFIX
        routes = [
            Route(p, self.home, methods=["GET"]),
            Route(p + "/", self.home, methods=["GET"]),
            Route(p + "/login", self.login_form, methods=["GET"]),
            Route(p + "/login", self.login, methods=["POST"]),
            Route(p + "/logout", self.action(self.logout), methods=["POST"]),
            Route(p + "/static/{name}", self.static_file, methods=["GET"]),
            Route(p + "/sessions", self.page(self.session_list), methods=["GET"]),
            Route(p + "/sessions/{session_id}", self.page(self.session_page), methods=["GET"]),
            Route(p + "/sandboxes", self.page(self.sandbox_list), methods=["GET"]),
            Route(p + "/snapshots", self.page(self.snapshot_list), methods=["GET"]),
            Route(p + "/sessions/{session_id}/stop", self.action(self.stop), methods=["POST"]),
            Route(p + "/sessions/{session_id}/delete", self.action(self.delete), methods=["POST"]),
            Route(
                p + "/sessions/{session_id}/timeline/stream",
                self.page(self.timeline_stream, stream=True),
                methods=["GET"],
            ),
            Route(p + "/audit", self.page(self.audit), methods=["GET"]),
            Route(p + "/audit/stream", self.page(self.audit_stream, stream=True), methods=["GET"]),
            Route(p + "/system", self.page(self.system, operator=True), methods=["GET"]),
            Route(p + "/replay", self.action(self.replay, operator=True), methods=["POST"]),
        ]

        async def not_found(request: Request, _: Exception) -> Response:
            return self.error(request, None, 404, "There is no such page in the console.")

        async def not_allowed(request: Request, _: Exception) -> Response:
            return self.error(request, None, 405, f"{request.method} is not allowed here.")

        inner = Starlette(routes=routes, exception_handlers={404: not_found, 405: not_allowed})
        return asgi.SecurityHeaders(inner)

    # ---- who is asking ------------------------------------------------------------

    def identity(self, request: Request) -> tokens.Identity | None:
        return self.signer.check(request.cookies.get(COOKIE), self.clock())

    def page(self, handler: Page, *, operator: bool = False, stream: bool = False) -> Callable[..., Any]:
        """A GET for people logged in (else to the login page; a stream: 401)."""

        async def endpoint(request: Request) -> Response:
            who = self.identity(request)
            if who is None:
                if stream:
                    return Response("log in first", 401, media_type="text/plain")
                return RedirectResponse(PREFIX + "/login", 303)
            if operator and not who.operator:
                return self.error(request, who, 403, "Only the operator's key sees this page.")
            try:
                return await handler(request, who)
            except errors.SandboxError as exc:
                return self.failed(request, who, exc)

        return endpoint

    def action(self, handler: Page, *, operator: bool = False) -> Callable[..., Any]:
        """A POST from a console form: logged in, with the CSRF token of this login."""

        async def endpoint(request: Request) -> Response:
            who = self.identity(request)
            if who is None:
                return self.error(request, None, 401, "Log in first.")
            form = await asgi.read_form(request)
            if form is None or not self.signer.csrf_ok(who.nonce, form.get("csrf")):
                return self.error(request, who, 403, "This form is stale or was not sent by the console.")
            if operator and not who.operator:
                return self.error(request, who, 403, "Only the operator's key may do this.")
            request.state.form = form
            try:
                return await handler(request, who)
            except errors.SandboxError as exc:
                return self.failed(request, who, exc)

        return endpoint

    # ---- logging in and out ---------------------------------------------------------

    async def home(self, request: Request) -> Response:
        return RedirectResponse(PREFIX + ("/sessions" if self.identity(request) else "/login"), 303)

    async def login_form(self, request: Request) -> Response:
        if self.identity(request) is not None:
            return RedirectResponse(PREFIX + "/sessions", 303)
        return self._login(request, 200, "")

    def _login(self, request: Request, status: int, message: str) -> Response:
        binding = tokens.new_binding()
        response = self.html(
            None, "login.html", "Log in", status, csrf=self.signer.csrf("login:" + binding), error=message
        )
        response.set_cookie(
            LOGIN_COOKIE,
            binding,
            max_age=3600,
            path=PREFIX + "/login",
            secure=request.url.scheme == "https",
            httponly=True,
            samesite="strict",
        )
        return response

    async def login(self, request: Request) -> Response:
        form = await asgi.read_form(request)
        binding = request.cookies.get(LOGIN_COOKIE)
        if (
            form is None
            or not self.signer.csrf_ok("login:" + (binding or ""), form.get("csrf"))
            or not binding
        ):
            return self._login(request, 403, "This form is stale or was not sent by the console: try again.")
        key = form.get("key", "")
        org = self.keys.identify([b"Bearer " + key.encode()]) if key else None
        if org is None:
            log.info("console.login_refused")
            return self._login(request, 401, "That key is not valid.")
        try:
            user = views.user_name(form.get("user"))
        except errors.InvalidInput as exc:
            return self._login(request, 400, exc.message)
        token = self.signer.issue(tokens.key_digest(key), user, self.clock())
        log.info("console.login", org=org or None, user=user)
        response = RedirectResponse(PREFIX + "/sessions", 303)
        response.set_cookie(
            COOKIE,
            token,
            max_age=tokens.TTL_SECONDS,
            path=PREFIX,
            secure=request.url.scheme == "https",
            httponly=True,
            samesite="strict",
        )
        response.delete_cookie(LOGIN_COOKIE, path=PREFIX + "/login", httponly=True, samesite="strict")
        return response

    async def logout(self, request: Request, who: tokens.Identity) -> Response:
        response = RedirectResponse(PREFIX + "/login", 303)
        response.delete_cookie(COOKIE, path=PREFIX, httponly=True, samesite="strict")
        return response

    # ---- sessions -------------------------------------------------------------------

    async def session_list(self, request: Request, who: tokens.Identity) -> Response:
        chosen = views.filters(request.query_params, who.org)
        sandboxes = await self.all(projections.SANDBOXES)
        rows = views.session_rows((await self.sessions.all()).values(), sandboxes, chosen, who.org)
        return self.html(
            who,
            "sessions.html",
            "Sessions",
            done=_done(request),
            form=views.filter_form("sessions", chosen, views.STATUSES, "active and stopped", who.org),
            rows=rows,
        )

    async def sandbox_list(self, request: Request, who: tokens.Identity) -> Response:
        chosen = views.filters(request.query_params, who.org, views.SANDBOX_STATUSES)
        sessions = await self.sessions.all()
        by_id = {s.session_id: s for s in sessions.values()}
        rows = views.sandbox_rows((await self.all(projections.SANDBOXES)).values(), by_id, chosen, who.org)
        return self.html(
            who,
            "sandboxes.html",
            "Sandboxes",
            form=views.filter_form("sandboxes", chosen, views.SANDBOX_STATUSES, "all but deleted", who.org),
            rows=rows,
        )

    async def snapshot_list(self, request: Request, who: tokens.Identity) -> Response:
        chosen = views.filters(request.query_params, who.org, views.SNAPSHOT_STATUSES)
        rows = views.snapshot_rows((await self.all(projections.SNAPSHOTS)).values(), chosen, who.org)
        return self.html(
            who,
            "snapshots.html",
            "Snapshots",
            form=views.filter_form("snapshots", chosen, views.SNAPSHOT_STATUSES, "ready", who.org),
            rows=rows,
        )

    async def visible_state(self, session_id: str, who: tokens.Identity) -> states.SessionState:
        ids.validate_session_id(session_id)
        state = await self.sessions.get(session_id)
        if state is None or not views.visible_session(state, who.org):
            raise errors.NotFound(f"session {session_id!r} does not exist")
        return state

    async def session_page(self, request: Request, who: tokens.Identity) -> Response:
        state = await self.visible_state(request.path_params["session_id"], who)
        after = _after(request.query_params.get("after"))
        page = await self.timeline_page(state.session_id, who, after)
        box = await self.one(projections.SANDBOXES, state.sandbox_id) if state.sandbox_id else None
        sid = state.session_id
        taken = views.snapshot_rows(
            (await self.all(projections.SNAPSHOTS)).values(), views.Filters(), who.org, session_id=sid
        )
        return self.html(
            who,
            "session.html",
            f"Session {sid}",
            done=_done(request),
            details=views.session_details(state),
            sandbox=views.sandbox_details(box) if box else None,
            actions=views.session_actions(state, self.signer.csrf(who.nonce)),
            snapshots=taken,
            stream=views.href("sessions", sid, "timeline", "stream") + f"?after={page.next_after}",
            entries=[views.timeline_row(e) for e in page.entries],
            more=views.href("sessions", sid) + f"?after={page.next_after}" if page.more else None,
        )

    async def timeline_page(self, session_id: str, who: tokens.Identity, after: int) -> Timeline:
        """A page of the timeline, read through the API's own route (same rules, same entries)."""
        request = _internal(
            f"/v1/sessions/{session_id}/timeline",
            {"session_id": session_id},
            {"after": str(after), "limit": str(TIMELINE_SHOWN)},
            "application/json",
            who.org,
        )
        response = await self.history.timeline(request)
        return msgspec.json.decode(bytes(response.body), type=Timeline)

    async def timeline_stream(self, request: Request, who: tokens.Identity) -> Response:
        state = await self.visible_state(request.path_params["session_id"], who)
        after = max(_after(request.query_params.get("after")), _after(request.headers.get("last-event-id")))
        internal = _internal(
            f"/v1/sessions/{state.session_id}/timeline",
            {"session_id": state.session_id},
            {"after": str(after), "follow": "true"},
            "text/event-stream",
            who.org,
        )
        return self.counted(await self.history.timeline(internal))

    async def stop(self, request: Request, who: tokens.Identity) -> Response:
        state = await self.visible_state(request.path_params["session_id"], who)
        await self.client.session(
            commands.StopSession(session_id=state.session_id, **self.command_fields(who))
        )
        if self.forget is not None:
            self.forget(state.session_id)
        return RedirectResponse(views.href("sessions", state.session_id) + "?done=stopped", 303)

    async def delete(self, request: Request, who: tokens.Identity) -> Response:
        state = await self.visible_state(request.path_params["session_id"], who)
        if request.state.form.get("confirm") != "yes":
            raise errors.InvalidInput("tick the box to confirm the deletion")
        await self.client.session(
            commands.DeleteSession(session_id=state.session_id, **self.command_fields(who))
        )
        if self.forget is not None:
            self.forget(state.session_id)
        return RedirectResponse(PREFIX + "/sessions?done=deleted", 303)

    @staticmethod
    def command_fields(who: tokens.Identity) -> dict[str, Any]:
        """Who did it, on the events it causes: the key's organisation and the name given
        at login; the request id says it came from the console."""
        return {
            "command_id": ids.new_id(),
            "correlation_id": "console:" + ids.new_id(),
            "actor": commands.Actor(via="console", org_id=who.org, user_id=who.user),
        }

    # ---- the audit stream -----------------------------------------------------------

    async def audit(self, request: Request, who: tokens.Identity) -> Response:
        last = await self.ctx.store.last_seq()
        lives: dict[str, incarnations.Incarnations] = {}
        records = []
        if last:
            reader = self.ctx.store.read(None, start_seq=max(1, last - AUDIT_SHOWN + 1))
            async with contextlib.aclosing(reader) as stream:
                async for stored in stream:
                    if stored.seq > last:
                        break
                    if await self.sees(stored, who, lives):
                        records.append(views.audit_record(stored.seq, stored.event))
        return self.html(
            who,
            "audit.html",
            "Audit stream",
            scope="every organisation" if who.operator else f"organisation {who.org}",
            shown=AUDIT_SHOWN,
            stream=PREFIX + f"/audit/stream?after={last}",
            records=records,
        )

    async def audit_stream(self, request: Request, who: tokens.Identity) -> Response:
        after = max(_after(request.query_params.get("after")), _after(request.headers.get("last-event-id")))
        return self.counted(
            hostapi.LiveStream(
                _sse(hostapi.with_keepalives(self._audit_records(who, after), None)),
                {"cache-control": "no-store"},
                "text/event-stream",
            )
        )

    async def _audit_records(
        self, who: tokens.Identity, after: int
    ) -> AsyncGenerator[views.AuditRecord, None]:
        lives: dict[str, incarnations.Incarnations] = {}
        async with contextlib.aclosing(self.ctx.store.read(None, start_seq=after + 1, follow=True)) as stream:
            async for stored in stream:
                if await self.sees(stored, who, lives):
                    yield views.audit_record(stored.seq, stored.event)

    async def sees(
        self, stored: eventstore.Stored, who: tokens.Identity, lives: dict[str, incarnations.Incarnations]
    ) -> bool:
        """Whether a login sees an event of the audit stream; ``lives``: the incarnations
        of the session ids met so far (read whole the first time one is met, then learnt
        from the stream), so that an event of a session id is its incarnation's, not the
        id's current owner's."""
        if who.operator:
            return True
        event = stored.event
        sid = views.session_of(event)
        owner = None
        if sid is not None:
            if sid not in lives:
                lives[sid] = (await self.history.reader.members(sid)).lives
            lives[sid].learn(stored.seq, event)
            await self.history.reader.place_snapshot(lives[sid], event)  # (its creation may be off the page)
            life = lives[sid].of(stored.seq, event)
            owner = life.org_id if life is not None else None
        return views.visible_event(event, who.org, owner)

    def counted(self, response: Response) -> Response:
        """A live stream, if fewer than :data:`STREAMS_MAX` are open (else 503: the page's
        script retries)."""
        if self._streams >= STREAMS_MAX:
            return Response(
                "too many live streams; retry", 503, media_type="text/plain", headers={"retry-after": "5"}
            )
        if not isinstance(response, hostapi.LiveStream):
            return response
        chunks = response.chunks

        async def counting() -> AsyncGenerator[bytes, None]:
            self._streams += 1
            try:
                async for chunk in chunks:
                    yield chunk
            finally:
                self._streams -= 1
                await chunks.aclose()

        response.chunks = counting()
        return response

    # ---- the system -----------------------------------------------------------------

    async def system(
        self, request: Request, who: tokens.Identity, result: views.ReplayView | None = None
    ) -> Response:
        reports = await self.health()
        now = datetime.now(UTC)
        rows = views.instance_rows(reports, (await self.all(projections.INSTANCES)).values(), now)
        gauges = views.gauges(
            (await self.all(projections.SANDBOXES)).values(),
            (await self.all(projections.PROXIES)).values(),
            reports,
        )
        return self.html(
            who,
            "system.html",
            "System",
            instances=rows,
            gauges=gauges,
            csrf=self.signer.csrf(who.nonce),
            replay=result,
        )

    async def replay(self, request: Request, who: tokens.Identity) -> Response:
        async with self._replaying:  # one at a time: it reads the whole stream
            report = await replay.verify(self.ctx.js, self.ctx.topology)
        view = views.replay_view(report.events, report.seconds, report.aggregates, report.differences)
        log.info(
            "console.replay_verified",
            user=who.user,
            events=report.events,
            differences=len(report.differences),
        )
        return await self.system(request, who, view)

    async def health(self) -> list[health.HealthReport]:
        try:
            return await health.read_all(self.ctx.js, self.ctx.topology.health_bucket)
        except nats.js.errors.NotFoundError:
            return []

    async def _open(self, projection: projections.Projection[Any]) -> projector.ProjectionStore[Any] | None:
        """A projection's store; None while its bucket was never made (nothing ran yet)."""
        if projection.kind not in self._stores:
            try:
                self._stores[projection.kind] = await projector.ProjectionStore.open(
                    self.ctx.js, projection, self.ctx.store
                )
            except nats.js.errors.NotFoundError:
                return None
        return self._stores[projection.kind]

    async def all(self, projection: projections.Projection[Any]) -> dict[str, Any]:
        store = await self._open(projection)
        return await store.all() if store is not None else {}

    async def one(self, projection: projections.Projection[Any], aggregate_id: str) -> Any:
        store = await self._open(projection)
        return await store.get(aggregate_id) if store is not None else None

    # ---- rendering ------------------------------------------------------------------

    def html(
        self, who: tokens.Identity | None, template: str, title: str, status: int = 200, **values: object
    ) -> Response:
        """A page: ``template`` (which extends ``base.html``) with its values, the
        navigation of the login ``who`` (none before logging in), never cached."""
        nav = None
        if who is not None:
            nav = views.Nav(
                user=who.user,
                scope="operator" if who.operator else f"organisation {who.org}",
                operator=who.operator,
                csrf=self.signer.csrf(who.nonce),
            )
        page = templating.render(template, title=title, nav=nav, **values)
        return Response(
            page, status, media_type="text/html; charset=utf-8", headers={"cache-control": "no-store"}
        )

    def error(self, request: Request, who: tokens.Identity | None, status: int, message: str) -> Response:
        return self.html(who, "error.html", "Error", status, code=status, message=message)

    def failed(self, request: Request, who: tokens.Identity, exc: errors.SandboxError) -> Response:
        status = exc.status if exc.status >= 400 else 500
        if status >= 500:
            log.warning("console.failed", path=request.url.path, code=exc.code, error=exc.message)
        return self.error(request, who, status, exc.message)

    async def static_file(self, request: Request) -> Response:
        name = request.path_params["name"]
        if name not in self.static:
            return Response("not found", 404, media_type="text/plain")
        return Response(
            self.static[name], media_type=STATIC_TYPES[name], headers={"cache-control": "no-cache"}
        )


# ---- helpers ----------------------------------------------------------------------


def _done(request: Request) -> str:
    """What a redirect after an action says ("" for nothing)."""
    return DONE.get(request.query_params.get("done", ""), "")


def _after(text: str | None) -> int:
    return int(text) if text and text.isdigit() and len(text) < 19 else 0


def _internal(
    path: str, path_params: dict[str, str], query: dict[str, str], accept: str, org: str | None
) -> Request:
    """A request to one of the API's handlers made by the console for its login (the
    organisation the key acts for, as the API's auth would set it)."""
    scope: Scope = {
        "type": "http",
        "method": "GET",
        "path": path,
        "path_params": path_params,
        "query_string": urllib.parse.urlencode(query).encode(),
        "headers": [(b"accept", accept.encode())],
    }
    if org is not None:
        scope["sbx.org"] = org
    return Request(scope)


async def _sse(records: AsyncGenerator[views.AuditRecord | None, None]) -> AsyncGenerator[bytes, None]:
    encoder = msgspec.json.Encoder()
    async with contextlib.aclosing(records) as stream:
        async for record in stream:
            if record is None:
                yield b": keepalive\n\n"
            else:
                yield b"event: record\nid: %d\ndata: %s\n\n" % (record.seq, encoder.encode(record))

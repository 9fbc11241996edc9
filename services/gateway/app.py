"""Wiring of the gateway: one HTTP app (REST, MCP, the host API, OpenAPI, health and
metrics) served by uvicorn."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator, Mapping

import msgspec
import structlog
import uvicorn
from fastmcp.server.http import StarletteWithLifespan
from starlette.applications import Starlette
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Match, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sbx_api import errors
from services.gateway import (
    archive,
    auth,
    cursors,
    hostapi,
    mcp,
    openapi,
    origins,
    placement,
    rest,
    schemas,
    sessions,
    snapshots,
    timeline,
)
from services.gateway import console as web_console
from services.gateway.e2b import control as e2b_control
from services.gateway.e2b import envd as e2b_envd
from shared.domain import listing, projections
from shared.infrastructure import listings, metrics, projector, rpc, service
from shared.infrastructure.settings import gateway as gateway_settings
from shared.infrastructure.settings import lifecycle
from shared.infrastructure.settings import service as service_settings

log = structlog.get_logger(__name__)

PUBLIC_PATHS = frozenset({"/healthz", "/openapi.json", "/metrics"})
CORS_HEADERS = (
    "Idempotency-Key", "X-Request-Id", "X-Org-Id", "X-User-Id", "X-Session-Id",
    "Mcp-Session-Id", "Mcp-Protocol-Version", "Last-Event-ID",
)  # fmt: skip
"""Request headers a browser page of an allowed origin may send (SBX_CORS_ORIGINS)."""


def build_app(
    gateway: gateway_settings.GatewaySettings,
    ctx: service.Context,
    api: rest.SessionsAPI,
    mcp_app: StarletteWithLifespan,
    host: hostapi.HostAPI | None = None,
    copies: snapshots.SnapshotsAPI | None = None,
    e2b: tuple[ASGIApp, ASGIApp | None] | None = None,
) -> ASGIApp:
    spec = msgspec.json.encode(openapi.document(service.VERSION))

    async def openapi_json(_: Request) -> Response:
        return Response(spec, media_type="application/json")

    async def healthz(_: Request) -> Response:
        body = schemas.Health(status=ctx.status, instance=ctx.settings.instance, version=service.VERSION)
        return rest.json_response(body, 200 if ctx.status == "ok" else 503)

    history = timeline.TimelineAPI(ctx.store, ctx.topology)
    files = archive.ArchiveAPI(host) if host is not None else None
    apis: list[rest.API | None] = [api, copies, history, host, files]  # (in the order they match)
    routes: list[BaseRoute] = [route for each in apis if each is not None for route in each.routes()]

    async def metrics_endpoint(_: Request) -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    routes += [
        Route("/openapi.json", openapi_json),
        Route("/healthz", healthz),
        Route("/metrics", metrics_endpoint),
    ]
    routes += [Route(mcp.MCP_PATH, endpoint=mcp_app)]  # (its own app: every method is its own)

    async def not_found(request: Request, _: Exception) -> Response:
        return rest.problem(errors.NotFound(f"no such route: {request.url.path} (see /openapi.json)"))

    async def not_allowed(request: Request, _: Exception) -> Response:
        here = [r for r in routes if isinstance(r, Route) and r.matches(request.scope)[0] != Match.NONE]
        allowed = sorted({method for route in here for method in route.methods or ()})
        response = rest.json_response(
            schemas.Problem(
                error="method_not_allowed",
                message=f"{request.method} is not allowed on {request.url.path} (allowed: {', '.join(allowed)})",  # noqa: E501
                status=405,
            ),
            405,
        )
        if allowed:
            response.headers["allow"] = ", ".join(allowed)
        return response

    inner = Starlette(
        routes=routes, lifespan=mcp_app.lifespan, exception_handlers={404: not_found, 405: not_allowed}
    )
    app: ASGIApp = auth.BearerAuth(
        inner, auth.KeyCheck(gateway.api_key, gateway.org_keys), public=PUBLIC_PATHS
    )
    app = web_console.mount(app, gateway, ctx, api, history)  # /console: its own (cookie) auth
    if e2b is not None:
        # /e2b: E2B's control plane (X-API-KEY) and envd (its tokens), envd at {port}-{id}.{domain}
        app = e2b_control.Mount(app, *e2b, domain=gateway.e2b_domain)
    under = (gateway.e2b_domain.partition(":")[0],) if gateway.e2b_domain and e2b is not None else ()
    allowed = origins.Allowed.build(
        gateway.host, gateway.allowed_hosts, (*gateway.allowed_origins, *gateway.cors_origins), under
    )
    app = origins.Guard(app, allowed)  # Host and Origin before anything else (DNS rebinding)
    app = RequestMetrics(app)
    if gateway.cors_origins:
        cors = CORSMiddleware(
            app,
            allow_origins=list(gateway.cors_origins),
            allow_methods=["GET", "POST", "PUT", "DELETE"],
            allow_headers=["Authorization", "Content-Type", *CORS_HEADERS],
            expose_headers=["X-Sandbox-Id", "X-Run-Id", "Mcp-Session-Id", "Location", "Retry-After"],
            max_age=600,
        )
        app = auth.CrossOrigin(app, cors, frozenset(gateway.cors_origins))
    return app


METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


class RequestMetrics:
    """RED metrics per route: requests by route template (never the raw path: ids would
    grow the label set), method and status, and the time to the response's start.
    Requests no route took (refused before routing, unknown paths) count as ``other``."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        status = 500

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                route = scope.get("route")
                template = getattr(route, "path", None) or "other"
                method = scope["method"] if scope["method"] in METHODS else "OTHER"
                metrics.http_seconds.labels(template, method).observe(time.monotonic() - started)
                metrics.http_requests.labels(template, method, str(status)).inc()
            await send(message)

        await self.app(scope, receive, sending)


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: the service runner owns SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def make_setup(gateway: gateway_settings.GatewaySettings, *, max_lifetime: float = 3600.0) -> service.Setup:
    async def setup(ctx: service.Context) -> service.Workload:
        session_states = await projector.ProjectionStore.open(ctx.js, projections.SESSIONS, ctx.store)
        client = rpc.SessionClient(ctx.nc, ctx.topology, ctx.settings.bus.request_timeout)
        executor = rpc.ExecClient(ctx.nc, ctx.topology)
        sandboxes = await projector.ProjectionStore.open(ctx.js, projections.SANDBOXES, ctx.store)

        where = placement.Placement(session_states, sandboxes)
        resolver = sessions.Resolver(client, where.running_sandbox, where.forget, where.remember)
        mcp_app = mcp.mcp_http_app(
            mcp.build_mcp(
                client,
                executor,
                resolver=resolver,
                claim_on_connect=gateway.claim_on_connect,
                egress=gateway.sandbox_egress,
                checkpoint_tools=gateway.mcp_checkpoints,
                job_input=gateway.mcp_job_input,
            )
        )
        host = hostapi.HostAPI(ctx.nc, ctx.topology, resolver, executor)
        tokens = cursors.Cursors(gateway.api_key)
        listed = listings.Listing(
            await projector.ProjectionStore.open(ctx.js, projections.SESSIONS, ctx.store),
            listing.session_index,
        )
        rest_api = rest.SessionsAPI(client, session_states, where.forget, listed=listed, tokens=tokens)
        snapshot_states = await projector.ProjectionStore.open(ctx.js, projections.SNAPSHOTS, ctx.store)
        idle = await projector.ProjectionStore.open(ctx.js, projections.SANDBOXES, ctx.store)
        listed_snapshots = listings.Listing(
            await projector.ProjectionStore.open(ctx.js, projections.SNAPSHOTS, ctx.store),
            listing.snapshot_index,
        )
        copies = snapshots.SnapshotsAPI(rest_api, snapshot_states, idle, listed_snapshots)
        plane = e2b_control.ControlPlane(
            client,
            e2b_control.Stores(session_states, sandboxes, snapshot_states),
            max_lifetime=max_lifetime,
            forget=where.forget,
            secret=e2b_envd.secret_of(gateway.api_key),
            executor=executor,
            sandbox_domain=gateway.e2b_domain,
        )
        in_sandbox = e2b_envd.Envd(
            session_states, host, plane.secret, lambda s: s is not None and s.status == "active"
        )
        e2b_apps = (plane.app(auth.KeyCheck(gateway.api_key, gateway.org_keys)), in_sandbox)
        app = build_app(gateway, ctx, rest_api, mcp_app, host, copies, e2b_apps)
        server = _Server(
            uvicorn.Config(
                app,
                host=gateway.host,
                port=gateway.port,
                log_config=None,
                access_log=False,
                lifespan="on",  # the MCP session manager runs in the app's lifespan
                timeout_graceful_shutdown=int(ctx.settings.drain_timeout),
            )
        )
        served = asyncio.Event()

        async def serve() -> None:
            try:
                await server.serve()
            finally:
                served.set()
            if not server.should_exit:
                raise RuntimeError("HTTP server stopped unexpectedly")
            await asyncio.Event().wait()  # stopped on purpose: wait to be cancelled

        async def announce() -> None:
            while not server.started:
                if served.is_set():
                    raise RuntimeError(f"could not listen on {gateway.host}:{gateway.port}")
                await asyncio.sleep(0.01)
            host, port = server.servers[0].sockets[0].getsockname()[:2]
            url = f"http://{host}:{port}"
            ctx.details["url"] = url
            log.info("gateway.listening", url=url)
            await asyncio.Event().wait()

        async def stop_listening() -> None:
            server.should_exit = True
            await served.wait()

        return service.Workload(
            tasks=[serve(), announce()],
            on_drain=[stop_listening, resolver.close],
            on_stop=[copies.close, listed.stop],
        )

    return setup


def build(env: Mapping[str, str]) -> tuple[service_settings.ServiceSettings, service.Setup]:
    gateway = gateway_settings.GatewaySettings.from_env(env)
    lifetime = lifecycle.LifecycleSettings.from_env(env).max_lifetime
    return gateway.base, make_setup(gateway, max_lifetime=lifetime)

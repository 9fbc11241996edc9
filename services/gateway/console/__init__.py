"""The web console under ``/console`` (issue 21, item 4): sessions and sandboxes with
filters, a session's timeline and the audit stream live, service instances and health,
pool and proxy-fleet gauges, ``replay --verify``; stop and delete recorded with the
operator's identity.

Pages are rendered on the server (:mod:`.templating`: Jinja2, autoescape on) from pure view
functions (:mod:`.views`); :mod:`.routes` does the I/O and the security (:mod:`.tokens`:
the session cookie and CSRF tokens). One script (``static/console.js``) makes the
timeline and the audit stream live; there is no build step.
"""

from __future__ import annotations

from starlette.types import ASGIApp

from services.gateway import auth, rest, timeline
from services.gateway.console import asgi, routes, tokens
from shared.infrastructure import service
from shared.infrastructure.settings import gateway as gateway_settings


def mount(
    api_app: ASGIApp,
    gateway: gateway_settings.GatewaySettings,
    ctx: service.Context,
    api: rest.SessionsAPI,
    history: timeline.TimelineAPI,
) -> ASGIApp:
    """``api_app`` with the console beside it under ``/console`` (its own auth: a cookie
    issued for one of the gateway's keys)."""
    keys: list[tuple[str | None, bytes]] = [(None, tokens.key_digest(gateway.api_key))]
    keys += [(org, tokens.key_digest(key)) for org, key in gateway.org_keys]
    console = routes.Console(
        keys=auth.KeyCheck(gateway.api_key, gateway.org_keys),
        signer=tokens.Signer(tokens.server_secret(gateway.api_key), keys),
        ctx=ctx,
        sessions=api.sessions,
        client=api.client,
        history=history,
        forget=api.forget,
    )
    return asgi.Mount(api_app, console.app())

"""The console's HTTP plumbing: its place beside the API (:class:`Mount`), the security
headers on every answer (:class:`SecurityHeaders`) and bounded form parsing."""

from __future__ import annotations

import urllib.parse

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

PREFIX = "/console"
FORM_MAX = 16 * 1024
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
    "form-action 'self'; frame-ancestors 'none'; base-uri 'none'; object-src 'none'"
)
SECURITY_HEADERS = [
    (b"content-security-policy", CSP.encode()),
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"same-origin"),
    (b"cross-origin-opener-policy", b"same-origin"),
    (b"cross-origin-resource-policy", b"same-origin"),
]


async def read_form(request: Request) -> dict[str, str] | None:
    """A url-encoded form's fields (the first of each), or None if it is not one or too big."""
    if request.headers.get("content-type", "").split(";")[0].strip() != "application/x-www-form-urlencoded":
        return None
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > FORM_MAX:
            return None
    try:
        pairs = urllib.parse.parse_qsl(body.decode("utf-8"), keep_blank_values=True, max_num_fields=20)
    except (UnicodeDecodeError, ValueError):
        return None
    form: dict[str, str] = {}
    for name, value in pairs:
        form.setdefault(name, value)
    return form


class SecurityHeaders:
    """Every console answer: a strict CSP, no framing, no sniffing, no cross-origin use."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *SECURITY_HEADERS]}
            await send(message)

        await self.app(scope, receive, sending)


class Mount:
    """``/console`` and below to the console; everything else to the API as it was."""

    def __init__(self, api: ASGIApp, console: ASGIApp) -> None:
        self.api = api
        self.console = console

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and (path == PREFIX or path.startswith(PREFIX + "/")):
            await self.console(scope, receive, send)
        else:
            await self.api(scope, receive, send)

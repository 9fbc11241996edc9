"""Which requests the gateway serves at all, by the ``Host`` they name and the ``Origin`` a
browser put on them: the MCP spec's transport security (servers MUST validate ``Origin``
and answer 403 to an invalid one) and the defence against DNS rebinding, for every
surface (MCP, REST, the host API, the console).

DNS rebinding: a web page at ``http://evil.example:8080`` makes its own name resolve to
127.0.0.1, and the victim's browser then sends the page's requests to the gateway as
same-origin requests. Such a request always names the page's host in ``Host`` (and, on a
POST, its origin in ``Origin``), so a ``Host`` that is not one of the gateway's names is
refused, and so is a cross-origin request from a page of an origin not allowed. A request
without ``Origin`` (every non-browser client: agents, the CLI, SDKs) is not a browser's
cross-origin request and passes the ``Origin`` check.

The rule (:meth:`Allowed.refusal`) is pure; :class:`Guard` applies it before anything else
(authentication included) and answers a refusal with a JSON 403 naming the setting.
"""

from __future__ import annotations

import ipaddress
import json
import re
from dataclasses import dataclass

from starlette.types import ASGIApp, Receive, Scope, Send

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
"""The loopback names a ``Host`` or an ``Origin`` may carry, with any port, always."""
ANY = "*"
_DEFAULT_PORTS = {"http": "80", "https": "443"}
_NAME = re.compile(r"[a-z0-9_-]+(\.[a-z0-9_-]+)*")
_PORT = re.compile(r"[0-9]{1,5}")
_SHOWN = 100
"""Characters of a refused value an error repeats."""


def split_host(value: str) -> tuple[str, str] | None:
    """``Host`` (or an origin's authority) as (name, port): the name in lower case without
    a final dot, IPv6 without brackets; ``port`` empty when none was given. None when it
    is not a host name or an address with an optional port."""
    value = value.strip().lower()
    if value.startswith("["):
        address, bracket, port = value[1:].partition("]")
        if not bracket or (port and not port.startswith(":")):
            return None
        name, port = address, port[1:]
        if not _is_ip(name) or ":" not in name:
            return None
    else:
        name, _, port = value.partition(":")
        name = name.removesuffix(".")
        if not _NAME.fullmatch(name):
            return None
    if port and not _PORT.fullmatch(port):
        return None
    return name, port


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def split_origin(value: str) -> tuple[str, str, str] | None:
    """An ``Origin`` (``scheme://host[:port]``) as (scheme, name, port), the port said
    even when it is the scheme's default; None for ``null`` or anything not an origin."""
    scheme, sep, authority = value.strip().lower().partition("://")
    if not sep or scheme not in _DEFAULT_PORTS:
        return None
    host = split_host(authority)
    if host is None:
        return None
    name, port = host
    return scheme, name, port or _DEFAULT_PORTS[scheme]


def listens_beyond_loopback(listen: str) -> bool:
    """Whether a gateway listening on ``listen`` (``SBX_GATEWAY_HOST``) is reachable
    other than through loopback (``0.0.0.0``, ``::``, an address or a name of the host)."""
    name = listen.strip().lower().strip("[]")
    if name == "localhost":
        return False
    try:
        return not ipaddress.ip_address(name).is_loopback
    except ValueError:
        return True


@dataclass(frozen=True)
class Allowed:
    """What the gateway accepts.

    ``hosts``: names (lower case, no port) a ``Host`` may carry besides loopback's; ``*``
    for any. ``addresses``: any IP address in ``Host`` too (a gateway listening beyond
    loopback, reached by its address: DNS rebinding needs a name, never an address).
    ``origins``: origins (``scheme://host:port``) a browser page may call from besides
    loopback's and the gateway's own; ``*`` for any. ``under``: names any subdomain of which
    a ``Host`` may carry (``SBX_E2B_DOMAIN``: ``{port}-{sandboxId}.{domain}``)."""

    hosts: frozenset[str] = frozenset()
    addresses: bool = False
    origins: frozenset[str] = frozenset()
    under: frozenset[str] = frozenset()

    @classmethod
    def build(
        cls,
        listen: str,
        hosts: tuple[str, ...] = (),
        origins: tuple[str, ...] = (),
        under: tuple[str, ...] = (),
    ) -> Allowed:
        """For a gateway listening on ``listen`` with the operator's names and origins
        (``SBX_ALLOWED_HOSTS``, and ``SBX_ALLOWED_ORIGINS`` with ``SBX_CORS_ORIGINS``)."""
        beyond = listens_beyond_loopback(listen)
        names = set(hosts)
        own = split_host(listen)
        if beyond and own is not None and not _is_ip(own[0]):
            names.add(own[0])  # (listening on a name: that name is the gateway's)
        normal = {ANY if o == ANY else _joined(split_origin(o)) for o in origins}
        return cls(frozenset(names), beyond, frozenset(normal - {""}), frozenset(under))

    def refusal(self, hosts: list[str], origins: list[str]) -> str | None:
        """Why a request with these ``Host`` and ``Origin`` header values is refused, or
        None when it is served."""
        if len(hosts) > 1 or len(origins) > 1:
            return "a request carries one Host header and at most one Origin header"
        host = split_host(hosts[0]) if hosts else None
        if hosts and not self._host_ok(host):
            return (
                f"Host {_shown(hosts[0])} is not a name of this gateway (DNS-rebinding protection); "
                "an operator can add it to SBX_ALLOWED_HOSTS"
            )
        if origins and not self._origin_ok(origins[0], hosts[0] if hosts else None):
            return (
                f"requests from web pages of origin {_shown(origins[0])} are not allowed here; "
                "an operator can allow that origin with SBX_ALLOWED_ORIGINS"
            )
        return None

    def _host_ok(self, host: tuple[str, str] | None) -> bool:
        if host is None:
            return False
        name = host[0]
        if ANY in self.hosts or name in LOOPBACK_NAMES or name in self.hosts:
            return True
        if any(name.endswith("." + parent) for parent in self.under):
            return True
        return self.addresses and _is_ip(name)

    def _origin_ok(self, origin: str, host: str | None) -> bool:
        if ANY in self.origins:
            return True
        parts = split_origin(origin)
        if parts is None:
            return False  # ``null`` (a sandboxed frame, a file) or not an origin
        scheme, name, port = parts
        if name in LOOPBACK_NAMES or _joined(parts) in self.origins:
            return True
        # The gateway's own pages (the console) reached by an allowed name: same origin.
        # (The scheme is not compared: TLS may end at an ingress in front.)
        own = split_host(host) if host is not None else None
        return own is not None and own[0] == name and (own[1] or _DEFAULT_PORTS[scheme]) == port


def _joined(parts: tuple[str, str, str] | None) -> str:
    if parts is None:
        return ""
    scheme, name, port = parts
    return f"{scheme}://[{name}]:{port}" if ":" in name else f"{scheme}://{name}:{port}"


def _shown(value: str) -> str:
    """A refused header value as an error repeats it: quoted, escaped, cut short."""
    return ascii(value[:_SHOWN]) + ("..." if len(value) > _SHOWN else "")


def _body(message: str) -> bytes:
    return json.dumps({"error": "forbidden", "message": message, "status": 403, "retriable": False}).encode()


class Guard:
    """ASGI middleware: every HTTP request whose ``Host`` or ``Origin`` :class:`Allowed`
    refuses is answered 403 (JSON, the reason and the setting) before anything else runs."""

    def __init__(self, app: ASGIApp, allowed: Allowed) -> None:
        self.app = app
        self.allowed = allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        hosts = [v.decode("latin-1") for k, v in scope["headers"] if k == b"host"]
        origins = [v.decode("latin-1") for k, v in scope["headers"] if k == b"origin"]
        why = self.allowed.refusal(hosts, origins)
        if why is None:
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":  # (none today; a page opening one is refused alike)
            await send({"type": "websocket.close", "code": 1008, "reason": why[:120]})
            return
        body = _body(why)
        await send(
            {
                "type": "http.response.start",
                "status": 403,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

"""Which rule a request may use, decided from where its connection really goes (pure).

A credential is injected only when the CONNECT target, the TLS SNI and the request's
``Host``/``:authority`` all name the same configured host and port, over TLS that the
proxy itself verified upstream. The ``Host`` header alone never decides anything: it is
whatever the client wrote.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

_LABEL = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")


def normalize(host: str | None) -> str | None:
    """The host name in lower case, or None for names that never match a rule.

    Deliberate choices: case is folded (DNS is case-insensitive, so ``GitHub.com`` *is*
    github.com); a trailing dot, non-ASCII (IDN look-alikes), punycode labels that are
    not in the rule verbatim, empty labels or any other character make the name match
    nothing rather than being rewritten into something that might.
    """
    if not host or len(host) > 253:
        return None
    lowered = host.lower()
    if not lowered.isascii():
        return None
    labels = lowered.split(".")
    if any(not _LABEL.fullmatch(label) for label in labels):
        return None
    return lowered


def split_authority(value: str | None, default_port: int) -> tuple[str, int] | None:
    """``host[:port]`` → (host, port); None when malformed. IPv6 literals stay bracketed."""
    if not value:
        return None
    host, port = value, default_port
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            return None
        host, rest = value[: end + 1], value[end + 1 :]
        if rest:
            if not rest.startswith(":") or not rest[1:].isdigit():
                return None
            port = int(rest[1:])
    elif ":" in value:
        host, _, raw = value.rpartition(":")
        if not raw.isdigit() or ":" in host:
            return None
        port = int(raw)
    return (host, port) if 0 < port < 65536 else None


@dataclass(frozen=True)
class Route:
    """What the proxy knows about one request's way out."""

    connect: tuple[str, int] | None
    """The CONNECT target (None for plain-HTTP absolute-form requests)."""
    sni: str | None
    """The server name the client sent in its TLS ClientHello."""
    authority: str | None
    """The ``Host`` header (HTTP/1) or ``:authority`` (HTTP/2)."""
    scheme: str
    client_tls: bool
    target: str = ""
    """The authority in an HTTP/1 request line (absolute-form); empty for origin-form.
    A server routes by it rather than by Host, so inside a tunnel it must be empty."""


@dataclass(frozen=True)
class Decision:
    action: Literal["pass", "inject", "refuse"]
    host: str | None = None
    """The configured host whose rule applies (``inject``)."""
    reason: str = ""


def decide(route: Route, configured: frozenset[tuple[str, int]]) -> Decision:
    """``inject`` only if everything agrees on a configured host; ``refuse`` when the
    connection goes to a configured host but the request names another; else ``pass``
    (forwarded without any credential)."""
    if route.connect is None or route.scheme != "https" or not route.client_tls:
        return Decision("pass", reason="not a TLS tunnel: never credentialed")
    target = normalize(route.connect[0])
    if target is None or (target, route.connect[1]) not in configured:
        return Decision("pass", reason="no rule for the CONNECT target")
    port = route.connect[1]
    if route.target:
        return Decision("refuse", target, f"absolute-form request ({route.target}) inside a tunnel")
    if normalize(route.sni) != target:
        return Decision("refuse", target, f"TLS server name {route.sni!r} does not match {target}")
    authority = split_authority(route.authority, port)
    if authority is None or normalize(authority[0]) != target or authority[1] != port:
        return Decision("refuse", target, f"Host {route.authority!r} does not match {target}:{port}")
    return Decision("inject", target)

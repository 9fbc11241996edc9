"""The gateway: its key, its listener, and whom it answers (hosts, origins, organisations' keys)."""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from sbx_api import errors
from shared.contract import ids
from shared.infrastructure.settings import runtime, values
from shared.infrastructure.settings.service import ServiceSettings

API_KEY_MIN_LENGTH = 16


@dataclass(frozen=True)
class GatewaySettings:
    """The gateway: the only service that listens on HTTP."""

    base: ServiceSettings
    api_key: str = field(repr=False)
    """Shared key every REST and MCP call must present (``SANDBOX_API_KEY``).
    Required: the gateway refuses to start without one."""
    host: str = "127.0.0.1"
    """Listen address (``SBX_GATEWAY_HOST``)."""
    port: int = 8080
    """Listen port (``SBX_GATEWAY_PORT``; 0 picks a free one)."""
    org_keys: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    """Keys bound to one organisation, ``(org, key)``, from the file named by
    ``SBX_ORG_KEYS`` (lines ``ORG KEY``; ``#`` starts a comment): a call with such a key
    acts for that organisation only (``X-Org-Id`` is set from it)."""
    mcp_checkpoints: bool = False
    """Two more MCP tools, ``checkpoint`` and ``restore_checkpoint``, for an agent to
    snapshot its own session and go back to one of its own snapshots
    (``SBX_MCP_CHECKPOINTS``, ``on``/``off``; off: the eight tools only)."""
    mcp_job_input: bool = False
    """One more MCP tool, ``shell_input``, and ``shell_async``'s ``stdin`` argument: an agent
    gives a background job input (``SBX_MCP_JOB_INPUT``, ``on``/``off``; off: the eight
    tools as they are)."""
    claim_on_connect: bool = True
    """An MCP ``initialize`` with an ``X-Session-Id`` starts getting that session's sandbox
    at once, so the agent's first tool call finds it ready (``SBX_CLAIM_ON_CONNECT``,
    ``on``/``off``). Off: the first tool call gets it."""
    sandbox_egress: str = "none"
    """What the sandboxes can reach (``SBX_SANDBOX_EGRESS``, as the runtime reads it): the
    tool texts an agent reads say so."""
    cors_origins: tuple[str, ...] = ()
    """Web origins whose pages may call the API from a browser (``SBX_CORS_ORIGINS``,
    comma-separated, e.g. ``https://app.example``); none by default. The key is still needed."""
    allowed_hosts: tuple[str, ...] = ()
    """Names a request's ``Host`` may carry besides loopback's (``SBX_ALLOWED_HOSTS``,
    comma-separated, no port: every port; ``*`` for any): the names clients reach the
    gateway by when it listens beyond loopback (a DNS name, a Kubernetes Service, an
    ingress). Any other ``Host`` is refused (403): DNS-rebinding protection. Listening
    beyond loopback, an IP address in ``Host`` is accepted too."""
    allowed_origins: tuple[str, ...] = ()
    """Web origins whose pages may send requests besides loopback's, the gateway's own and
    ``cors_origins`` (``SBX_ALLOWED_ORIGINS``, comma-separated, ``*`` for any): a request
    with any other ``Origin`` is refused (403), as the MCP spec requires. Requests without
    ``Origin`` (every client but a browser) are not affected."""
    e2b_domain: str = ""
    """The E2B SDK's sandbox domain (``SBX_E2B_DOMAIN``, a host name with an optional port,
    e.g. ``sbx.example.com``): E2B answers name it, so an SDK without ``E2B_SANDBOX_URL``
    sends a sandbox's traffic (and builds its signed file URLs) to
    ``https://49983-{sandboxId}.{domain}``, which wildcard DNS and TLS in front of the gateway
    bring here; the gateway routes such a host to that sandbox's envd. Empty (the default):
    answers name the host the request came to, and only ``E2B_SANDBOX_URL`` reaches envd."""

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> GatewaySettings:
        key = env.get("SANDBOX_API_KEY", "")
        if not key:
            raise errors.ConfigError(
                "SANDBOX_API_KEY is not set; the gateway refuses to start without an API key "
                "(`sbx up` generates one into <state-dir>/api-key)"
            )
        if len(key) < API_KEY_MIN_LENGTH or not key.isascii() or not key.isprintable() or " " in key:
            raise errors.ConfigError(
                f"SANDBOX_API_KEY must be at least {API_KEY_MIN_LENGTH} printable ASCII characters "
                "without spaces"
            )
        return cls(
            base=ServiceSettings.from_env("gateway", env),
            api_key=key,
            host=env.get("SBX_GATEWAY_HOST", cls.host),
            port=values.port(env, "SBX_GATEWAY_PORT", cls.port),
            org_keys=_org_keys(env.get("SBX_ORG_KEYS", ""), key),
            claim_on_connect=values.choice(env, "SBX_CLAIM_ON_CONNECT", "on", ("on", "off")) == "on",
            mcp_checkpoints=values.choice(env, "SBX_MCP_CHECKPOINTS", "off", ("on", "off")) == "on",
            mcp_job_input=values.choice(env, "SBX_MCP_JOB_INPUT", "off", ("on", "off")) == "on",
            sandbox_egress=runtime.egress(env),
            cors_origins=_origins(env.get("SBX_CORS_ORIGINS", "")),
            allowed_hosts=_hosts(env.get("SBX_ALLOWED_HOSTS", "")),
            allowed_origins=_origins(env.get("SBX_ALLOWED_ORIGINS", ""), name="SBX_ALLOWED_ORIGINS"),
            e2b_domain=_e2b_domain(env.get("SBX_E2B_DOMAIN", "")),
        )


def _e2b_domain(text: str) -> str:
    """``SBX_E2B_DOMAIN``: a host name (at least two labels) with an optional port."""
    domain = text.strip().lower().removesuffix(".")
    name, _, port = domain.partition(":")
    if domain and (
        not _HOST_NAME.fullmatch(name) or "." not in name or (port and not re.fullmatch(r"[0-9]{1,5}", port))
    ):
        raise errors.ConfigError(
            f"SBX_E2B_DOMAIN: {domain!r:.80} is not a host name with an optional port, like "
            "sbx.example.com (its subdomains {port}-{sandboxId}.sbx.example.com must reach the gateway)"
        )
    return domain


_ORIGIN = re.compile(r"https?://[A-Za-z0-9.-]+(:[0-9]{1,5})?")


def _origins(text: str, *, name: str = "SBX_CORS_ORIGINS") -> tuple[str, ...]:
    """Exact origins (scheme, host, optional port); ``SBX_ALLOWED_ORIGINS`` also takes ``*``
    alone (any origin), ``SBX_CORS_ORIGINS`` no wildcard."""
    origins = tuple(o.strip().rstrip("/").lower() for o in text.split(",") if o.strip())
    if name != "SBX_CORS_ORIGINS" and "*" in origins:
        if len(origins) > 1:
            raise errors.ConfigError(f"{name}: '*' (any origin) stands alone")
        return origins
    for origin in origins:
        if not _ORIGIN.fullmatch(origin):
            raise errors.ConfigError(
                f"{name}: {origin!r:.80} is not an origin like https://app.example:8443 "
                "(no path, no wildcard)"
            )
    return origins


_HOST_NAME = re.compile(r"[a-z0-9_-]+(\.[a-z0-9_-]+)*")


def _hosts(text: str) -> tuple[str, ...]:
    """``SBX_ALLOWED_HOSTS``: host names or IP addresses without a port, or ``*`` alone."""
    hosts = tuple(h.strip().lower().removesuffix(".") for h in text.split(",") if h.strip())
    if "*" in hosts:
        if len(hosts) > 1:
            raise errors.ConfigError("SBX_ALLOWED_HOSTS: '*' (any Host) stands alone")
        return hosts
    out = []
    for host in hosts:
        bare = host.strip("[]")
        try:
            out.append(str(ipaddress.ip_address(bare)))
            continue
        except ValueError:
            pass
        if not _HOST_NAME.fullmatch(host):
            raise errors.ConfigError(
                f"SBX_ALLOWED_HOSTS: {host!r:.80} is not a host name or IP address "
                "(no scheme, no port: every port of a name is allowed)"
            )
        out.append(host)
    return tuple(out)


def _org_keys(path: str, master: str) -> tuple[tuple[str, str], ...]:
    """Parse the ``SBX_ORG_KEYS`` file; any mistake stops the gateway with its line."""
    if not path:
        return ()
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise errors.ConfigError(f"SBX_ORG_KEYS: cannot read {path}: {exc.strerror}") from None
    out: list[tuple[str, str]] = []
    seen: set[str] = {master}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        where = f"SBX_ORG_KEYS {path}:{number}"
        if len(parts) != 2:
            raise errors.ConfigError(f"{where}: expected 'ORG KEY'")
        org, key = parts
        try:
            ids.validate_attribution(org, what="org id")
        except errors.InvalidInput as exc:
            raise errors.ConfigError(f"{where}: {exc.message}") from None
        if len(key) < API_KEY_MIN_LENGTH or not key.isascii() or not key.isprintable():
            raise errors.ConfigError(
                f"{where}: a key is at least {API_KEY_MIN_LENGTH} printable ASCII characters"
            )
        if key in seen:
            raise errors.ConfigError(f"{where}: this key is used twice (or is SANDBOX_API_KEY)")
        seen.add(key)
        out.append((org, key))
    return tuple(out)

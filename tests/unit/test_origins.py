"""The gateway's Host and Origin rule (services/gateway/origins.py): DNS rebinding and the
MCP spec's "validate Origin, 403 when invalid", its settings, and the guard in front of
everything else."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from starlette.types import Receive, Scope, Send

from sbx_api import errors
from services.gateway import origins
from shared.infrastructure.settings import gateway as gateway_settings

LOOPBACK = origins.Allowed.build("127.0.0.1")
POD = origins.Allowed.build("0.0.0.0", ("gateway.sbx-system.svc", "sbx.example.com"))


def served(allowed: origins.Allowed, host: str | None, origin: str | None = None) -> bool:
    return allowed.refusal([host] if host is not None else [], [origin] if origin is not None else []) is None


@pytest.mark.parametrize(
    "host",
    ["127.0.0.1:8080", "localhost:8080", "LOCALHOST", "localhost.:1", "[::1]:8080", "[::1]", "127.0.0.1"],
)
def test_loopback_hosts_are_served_on_any_port(host):
    assert served(LOOPBACK, host) and served(POD, host)


@pytest.mark.parametrize(
    "host",
    [
        "evil.example.com",
        "evil.example.com:8080",
        "localhost.evil.example",
        "evil.localhost:8080",
        "127.0.0.1.nip.io:8080",
        "2130706433",  # (a browser writes 127.0.0.1: this is a name)
        "10.0.0.5:8080",  # an address, but this gateway listens on loopback only
        "",
        "[::1",
        "[evil]:80",
        "a b",
        "localhost:80:80",
        "localhost:http",
        "user@localhost",
        "localhost/x",
    ],
)
def test_a_foreign_or_malformed_host_is_refused_by_a_loopback_gateway(host):
    why = LOOPBACK.refusal([host], [])
    assert why is not None and "SBX_ALLOWED_HOSTS" in why


def test_a_gateway_listening_beyond_loopback_takes_its_names_and_any_address():
    for host in ("gateway.sbx-system.svc:8080", "SBX.example.com", "10.0.0.5:8080", "[fd00::5]:80"):
        assert served(POD, host), host
    assert not served(POD, "evil.example.com:8080")
    assert not served(POD, "gateway:8080"), "only the names given"
    named = origins.Allowed.build("sbx-host")
    assert served(named, "sbx-host:8080") and not served(named, "other:8080")
    assert served(origins.Allowed.build("127.0.0.1", ("*",)), "anything.example:1")


def test_a_request_without_origin_is_served_and_loopback_origins_are_allowed():
    assert served(LOOPBACK, "127.0.0.1:8080")
    assert served(LOOPBACK, None), "no Host (HTTP/1.0, not a browser): nothing to check"
    for origin in (
        "http://localhost:6274",
        "http://127.0.0.1:3000",
        "https://[::1]:8443",
        "http://localhost",
    ):
        assert served(LOOPBACK, "127.0.0.1:8080", origin), origin


@pytest.mark.parametrize(
    "origin",
    [
        "http://evil.example.com",
        "http://evil.example.com:8080",
        "https://localhost.evil.example",
        "null",
        "file://",
        "chrome-extension://abcdef",
        "http://evil.example/",
        "",
        "http://127.0.0.1.nip.io",
    ],
)
def test_a_foreign_origin_is_refused_naming_the_setting(origin):
    why = LOOPBACK.refusal(["127.0.0.1:8080"], [origin])
    assert why is not None and "SBX_ALLOWED_ORIGINS" in why


def test_a_rebinding_page_is_refused_by_its_host_even_when_its_origin_is_its_own():
    """The attack: same-origin to the page (Host and Origin both the attacker's name)."""
    why = LOOPBACK.refusal(["evil.example.com:8080"], ["http://evil.example.com:8080"])
    assert why is not None and "SBX_ALLOWED_HOSTS" in why


def test_the_gateways_own_pages_and_listed_origins_are_allowed():
    # The console reached by an allowed name, TLS ended at an ingress: Origin https, Host bare.
    assert served(POD, "sbx.example.com", "https://sbx.example.com")
    assert served(POD, "sbx.example.com:8443", "https://sbx.example.com:8443")
    assert not served(POD, "sbx.example.com", "https://sbx.example.com:8443")
    assert not served(POD, "sbx.example.com", "https://app.example")
    listed = origins.Allowed.build("127.0.0.1", (), ("https://app.example", "http://tools.example:8000"))
    assert served(listed, "localhost:8080", "https://app.example")
    assert served(listed, "localhost:8080", "https://APP.example:443"), "the default port is the same origin"
    assert served(listed, "localhost:8080", "http://tools.example:8000")
    assert not served(listed, "localhost:8080", "http://app.example")
    assert not served(listed, "localhost:8080", "http://tools.example:8001")
    anyone = origins.Allowed.build("127.0.0.1", (), ("*",))
    assert served(anyone, "localhost", "null") and not served(anyone, "evil.example", "null")


def test_two_hosts_or_two_origins_are_refused():
    assert LOOPBACK.refusal(["localhost", "evil.example"], []) is not None
    assert LOOPBACK.refusal(["localhost"], ["http://localhost", "http://evil.example"]) is not None


def test_a_refused_value_is_repeated_escaped_and_short():
    why = LOOPBACK.refusal(["evil\x1b[31m" + "x" * 500], [])
    assert why is not None and "\x1b" not in why and len(why) < 300


@given(st.from_regex(r"[a-z][a-z0-9-]{0,20}(\.[a-z][a-z0-9-]{0,20}){1,3}", fullmatch=True))
def test_no_dns_name_but_the_listed_ones_reaches_a_gateway(name):
    """A rebinding page's Host is a DNS name of its own: never served unless listed."""
    for allowed in (LOOPBACK, POD):
        expected = name in allowed.hosts
        assert served(allowed, f"{name}:8080") == expected
        assert served(allowed, "127.0.0.1:8080", f"http://{name}:8080") is False


def test_listening_beyond_loopback():
    assert not origins.listens_beyond_loopback("127.0.0.1")
    assert not origins.listens_beyond_loopback("::1")
    assert not origins.listens_beyond_loopback("localhost")
    assert not origins.listens_beyond_loopback("127.0.0.2")
    for listen in ("0.0.0.0", "::", "10.0.0.5", "sbx-host"):
        assert origins.listens_beyond_loopback(listen)


# ---- settings ------------------------------------------------------------------------


def gateway(**env: str) -> gateway_settings.GatewaySettings:
    return gateway_settings.GatewaySettings.from_env({"SANDBOX_API_KEY": "k" * 32, **env})


def test_settings_take_names_addresses_origins_and_a_lone_star():
    made = gateway(
        SBX_ALLOWED_HOSTS=" Gateway.sbx-system.svc., 10.0.0.5, [fd00::5] ",
        SBX_ALLOWED_ORIGINS="https://App.example, http://tools.example:8000/",
    )
    assert made.allowed_hosts == ("gateway.sbx-system.svc", "10.0.0.5", "fd00::5")
    assert made.allowed_origins == ("https://app.example", "http://tools.example:8000")
    assert gateway(SBX_ALLOWED_HOSTS="*").allowed_hosts == ("*",)
    assert gateway(SBX_ALLOWED_ORIGINS="*").allowed_origins == ("*",)
    assert gateway().allowed_hosts == () and gateway().allowed_origins == ()


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("SBX_ALLOWED_HOSTS", "sbx.example.com:443"),
        ("SBX_ALLOWED_HOSTS", "http://sbx.example.com"),
        ("SBX_ALLOWED_HOSTS", "*.example.com"),
        ("SBX_ALLOWED_HOSTS", "*,localhost"),
        ("SBX_ALLOWED_ORIGINS", "sbx.example.com"),
        ("SBX_ALLOWED_ORIGINS", "https://*.example.com"),
        ("SBX_ALLOWED_ORIGINS", "*,https://app.example"),
        ("SBX_CORS_ORIGINS", "*"),
    ],
)
def test_bad_settings_stop_the_gateway_naming_the_variable(name, value):
    with pytest.raises(errors.ConfigError, match=name):
        gateway(**{name: value})


# ---- the guard -----------------------------------------------------------------------


class Recorder:
    def __init__(self) -> None:
        self.calls: list[str] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.calls.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ran"})


async def test_the_guard_answers_403_json_and_nothing_behind_it_runs():
    inner = Recorder()
    app = origins.Guard(inner, LOOPBACK)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8080") as http:
        refused = await http.post("/mcp", json={}, headers={"Origin": "http://evil.example"})
        assert refused.status_code == 403 and refused.headers["content-type"] == "application/json"
        body = refused.json()
        assert body["error"] == "forbidden" and body["retriable"] is False
        assert "SBX_ALLOWED_ORIGINS" in body["message"]
        assert int(refused.headers["content-length"]) == len(refused.content)
        foreign = await http.get("/v1/sessions", headers={"Host": "evil.example:8080"})
        assert foreign.status_code == 403 and "SBX_ALLOWED_HOSTS" in foreign.json()["message"]
        assert inner.calls == []
        assert (await http.post("/mcp", headers={"Origin": "http://localhost:6274"})).text == "ran"
        assert (await http.post("/mcp")).text == "ran"
    assert inner.calls == ["/mcp", "/mcp"]


async def test_a_websocket_from_a_foreign_origin_is_closed_before_anything_runs():
    inner = Recorder()
    app = origins.Guard(inner, LOOPBACK)
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "websocket.connect"}

    async def send(message: dict) -> None:
        sent.append(message)

    headers = [(b"host", b"127.0.0.1:8080"), (b"origin", b"http://evil.example")]
    await app({"type": "websocket", "path": "/pty", "headers": headers}, receive, send)
    assert inner.calls == [] and sent[0]["type"] == "websocket.close" and sent[0]["code"] == 1008


def test_the_e2b_domain_admits_its_subdomains_only():
    allowed = origins.Allowed.build("127.0.0.1", under=("sbx.example.com",))
    assert allowed.refusal(["49983-e2b0123.sbx.example.com:443"], []) is None
    for host in ("sbx.example.com", "evil-sbx.example.com", "49983-x.sbx.example.com.evil.net"):
        assert allowed.refusal([host], []) is not None, host


def test_the_e2b_domain_setting():
    assert gateway(SBX_E2B_DOMAIN=" Sbx.Example.com:8443 ").e2b_domain == "sbx.example.com:8443"
    assert gateway(SBX_E2B_DOMAIN="sbx.example.com.").e2b_domain == "sbx.example.com"
    assert gateway().e2b_domain == ""
    for bad in ("localhost", "https://sbx.example.com", "*.sbx.example.com", "sbx.example.com:x"):
        with pytest.raises(errors.ConfigError, match="SBX_E2B_DOMAIN"):
            gateway(SBX_E2B_DOMAIN=bad)

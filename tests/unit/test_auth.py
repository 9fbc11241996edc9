"""Bearer-key check (services.gateway.auth.KeyCheck) and the BearerAuth ASGI middleware."""

from __future__ import annotations

import json
import string

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from sbx_api import errors
from services.gateway.auth import BearerAuth, KeyCheck
from shared.infrastructure.settings import gateway

KEY = "Zk3vQ9-Lp_2mX8.tR~5+wY/7nB"
CHECK = KeyCheck(KEY)


def _h(value: str | bytes) -> list[bytes]:
    return [value.encode() if isinstance(value, str) else value]


@pytest.mark.parametrize("value", [f"Bearer {KEY}", f"bearer {KEY}", f"BEARER {KEY}", f"bEaReR {KEY}"])
def test_accepts_the_key_with_any_scheme_case(value: str) -> None:
    assert CHECK.accepts(_h(value)) is True


@pytest.mark.parametrize(
    "headers",
    [
        [],
        [f"Bearer {KEY}".encode()] * 2,
        [f"Bearer {KEY}".encode(), b"Bearer other"],
        _h("Bearer wrong-key-of-some-size"),
        _h(f"Bearer {KEY[:-1]}x"),
        _h(f"Bearer {KEY}x"),
        _h(f"Bearer {KEY[:-1]}"),
        _h(f"Bearer {KEY[:8]}"),
        _h(f"Bearer {KEY}{KEY}"),
        _h(f"Bearer  {KEY}"),
        _h(f"Bearer {KEY} "),
        _h(f" Bearer {KEY}"),
        _h(f"Bearer\t{KEY}"),
        _h(f"Bearer{KEY}"),
        _h(f"Basic {KEY}"),
        _h(f"Token {KEY}"),
        _h("Bearer"),
        _h("Bearer "),
        _h(KEY),
        _h(""),
        _h(f"Bearer {KEY.lower()}"),
        _h(b"Bearer " + KEY.encode() + b"\xc3\xa9"),
        _h(b"Bearer \xff\xfe"),
        _h(f"Bearer {KEY}\r\n"),
    ],
    ids=lambda h: repr(h)[:40],
)
def test_rejects(headers: list[bytes]) -> None:
    assert CHECK.accepts(headers) is False


@given(st.binary(max_size=64))
def test_random_headers_never_pass(value: bytes) -> None:
    assert CHECK.accepts([value]) is False


# A printable-ASCII key without spaces is accepted at start-up by GatewaySettings; the
# gateway must then accept requests that present it.
SETTINGS_KEYS = st.text(
    alphabet=st.sampled_from([c for c in string.printable if c.isprintable() and c != " "]),
    min_size=16,
    max_size=40,
)


@pytest.mark.parametrize("key", ["s3cret!s3cret!s3cret", "abcdefgh=ijklmnopq", "0123456789abcdef,"])
def test_every_key_settings_accept_is_usable(key: str) -> None:
    assert gateway.GatewaySettings.from_env({"SANDBOX_API_KEY": key}).api_key == key
    assert KeyCheck(key).accepts(_h(f"Bearer {key}")), f"gateway would start with {key!r} but reject it"


@given(SETTINGS_KEYS)
def test_settings_and_key_check_agree(key: str) -> None:
    try:
        gateway.GatewaySettings.from_env({"SANDBOX_API_KEY": key})
    except errors.ConfigError:
        return
    assert KeyCheck(key).accepts(_h(f"Bearer {key}"))


# ---- middleware ---------------------------------------------------------------------------


class Recorder:
    """The inner app: a tiny Starlette app that records every call it gets."""

    def __init__(self) -> None:
        self.calls: list[str] = []

        async def hello(request: Request) -> JSONResponse:
            return JSONResponse({"path": request.url.path})

        self.app = Starlette(routes=[Route("/v1/things", hello), Route("/healthz", hello)])

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            self.calls.append(scope["path"])
        await self.app(scope, receive, send)


@pytest.fixture
def inner() -> Recorder:
    return Recorder()


@pytest.fixture
async def client(inner: Recorder):
    app = BearerAuth(inner, KeyCheck(KEY), public=frozenset({"/healthz"}))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        yield c


def _assert_401(response: httpx.Response) -> None:
    assert response.status_code == 401
    assert response.headers["www-authenticate"].startswith("Bearer")
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert body["error"] == "unauthorized" and body["status"] == 401
    assert KEY not in response.text
    assert int(response.headers["content-length"]) == len(response.content)


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer nope"}, {"Authorization": f"Basic {KEY}"}, {"Authorization": KEY}],
    ids=["missing", "wrong", "basic", "bare"],
)
async def test_middleware_refuses_without_calling_the_app(
    client: httpx.AsyncClient, inner: Recorder, headers: dict[str, str]
) -> None:
    _assert_401(await client.get("/v1/things", headers=headers))
    _assert_401(await client.post("/v1/things", headers=headers, content=b"{}"))
    assert inner.calls == []


async def test_middleware_refuses_duplicate_headers(client: httpx.AsyncClient, inner: Recorder) -> None:
    headers = [("Authorization", f"Bearer {KEY}"), ("Authorization", f"Bearer {KEY}")]
    _assert_401(await client.get("/v1/things", headers=headers))
    assert inner.calls == []


async def test_middleware_passes_the_right_key(client: httpx.AsyncClient, inner: Recorder) -> None:
    response = await client.get("/v1/things", headers={"Authorization": f"bearer {KEY}"})
    assert response.status_code == 200
    assert response.json() == {"path": "/v1/things"}
    assert inner.calls == ["/v1/things"]


async def test_public_path_needs_no_key(client: httpx.AsyncClient, inner: Recorder) -> None:
    response = await client.get("/healthz")
    assert response.status_code == 200 and json.loads(response.content) == {"path": "/healthz"}
    assert inner.calls == ["/healthz"]


async def test_public_match_is_exact(client: httpx.AsyncClient, inner: Recorder) -> None:
    _assert_401(await client.get("/healthz/"))
    _assert_401(await client.get("/healthz/../v1/things"))
    assert inner.calls == []


# ---- keys bound to an organisation ------------------------------------------------------------

ACME_KEY = "acme-key-0123456789abcdef"


class OrgEcho:
    """The inner app: answers with the X-Org-Id it was given and the bound org."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        body = {
            "org": request.headers.get("x-org-id"),
            "orgs": request.headers.getlist("x-org-id"),
            "bound": scope.get("sbx.org"),
        }
        await JSONResponse(body)(scope, receive, send)


@pytest.fixture
async def org_client():
    app = BearerAuth(OrgEcho(), KeyCheck(KEY, (("acme", ACME_KEY),)), public=frozenset())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        yield c


def test_identify_tells_the_operator_from_an_organisations_key() -> None:
    check = KeyCheck(KEY, (("acme", ACME_KEY),))
    assert check.identify(_h(f"Bearer {KEY}")) == ""
    assert check.identify(_h(f"Bearer {ACME_KEY}")) == "acme"
    assert check.identify(_h("Bearer acme-key-0123456789abcdeX")) is None


async def test_an_organisations_key_acts_for_that_organisation_only(org_client: httpx.AsyncClient) -> None:
    acme = {"Authorization": f"Bearer {ACME_KEY}"}
    assert (await org_client.get("/x", headers=acme)).json() == {
        "org": "acme",
        "orgs": ["acme"],
        "bound": "acme",
    }
    same = await org_client.get("/x", headers={**acme, "X-Org-Id": "acme"})
    assert same.json()["orgs"] == ["acme"]
    for spoof in ({"X-Org-Id": "globex"}, [("X-Org-Id", "acme"), ("X-Org-Id", "globex")]):
        refused = await org_client.get(
            "/x", headers=[*acme.items(), *(spoof.items() if isinstance(spoof, dict) else spoof)]
        )
        assert refused.status_code == 403 and refused.json()["error"] == "forbidden"
    operator = await org_client.get("/x", headers={"Authorization": f"Bearer {KEY}", "X-Org-Id": "globex"})
    assert operator.json() == {"org": "globex", "orgs": ["globex"], "bound": None}


def test_the_org_keys_file_is_checked_line_by_line(tmp_path) -> None:
    good = tmp_path / "keys"
    good.write_text(f"# org keys\nacme {ACME_KEY}\n\nglobex globex-key-0123456789abc  # the other\n")
    env = {"SANDBOX_API_KEY": KEY, "SBX_ORG_KEYS": str(good)}
    assert gateway.GatewaySettings.from_env(env).org_keys == (
        ("acme", ACME_KEY),
        ("globex", "globex-key-0123456789abc"),
    )
    for text, why in [
        ("acme short", "at least"),
        (f"acme {ACME_KEY} extra", "ORG KEY"),
        (f"acme {ACME_KEY}\nglobex {ACME_KEY}", "twice"),
        (f"acme {KEY}", "twice"),
        ("o" * 300 + " " + ACME_KEY, "longer than"),
    ]:
        good.write_text(text)
        with pytest.raises(errors.ConfigError, match=why):
            gateway.GatewaySettings.from_env(env)
    with pytest.raises(errors.ConfigError, match="cannot read"):
        gateway.GatewaySettings.from_env({**env, "SBX_ORG_KEYS": str(tmp_path / "missing")})

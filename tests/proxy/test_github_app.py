"""GitHub App installation tokens: minted against a local fake of GitHub's token endpoint
that verifies the app's JWT with the app's public key, cached, refreshed before expiry,
and injected by a real proxy as git basic auth or API bearer auth."""

from __future__ import annotations

import base64
import json
import time
from datetime import UTC, datetime

import jwt
import pytest

from sbx_proxy import github_app
from tests.proxy import harness
from tests.proxy.test_injection import ask, auth_of, last

pytestmark = pytest.mark.needs_root("the proxy runs in its own mount namespace (root)")
APP_ID, INSTALLATION = 4242, 777


def fake_github(public_key, lifetime: list[float]):
    class FakeGitHub(harness.Echo):
        minted: list[dict] = []

        def do_POST(self) -> None:
            if not self.path.startswith(f"/app/installations/{INSTALLATION}/access_tokens"):
                return self._answer()
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"{}")
            scheme, _, token = self.headers.get("Authorization", "").partition(" ")
            try:
                # (leeway: the refresh test moves the client's clock an hour ahead)
                claims = jwt.decode(token, public_key, algorithms=["RS256"], leeway=7200)
                assert scheme == "Bearer" and claims["iss"] == str(APP_ID)
                assert claims["exp"] - claims["iat"] <= 600
            except Exception:
                self.send_response(401)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            n = len(FakeGitHub.minted) + 1
            FakeGitHub.minted.append(body)
            expires = datetime.fromtimestamp(time.time() + lifetime[0], UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            data = json.dumps(
                {"token": f"ghs_installation{n:04d}" + "x" * 30, "expires_at": expires}
            ).encode()
            self.send_response(201)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return FakeGitHub


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return harness.PKI(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def app_key():
    return harness.rsa_key_pem()


@pytest.fixture
def github(pki, app_key):
    lifetime = [3600.0]
    handler = fake_github(app_key[1].public_key(), lifetime)
    server = harness.Upstream(pki, handler)
    server.lifetime, server.handler = lifetime, handler
    yield server
    server.close()


async def test_tokens_are_minted_cached_and_refreshed_before_expiry(pki, app_key, github):
    clock = [time.time()]
    tokens = github_app.InstallationTokens(
        app_id=APP_ID,
        installation_id=INSTALLATION,
        private_key=app_key[0],
        api_url=f"https://127.0.0.1:{github.port}",
        repositories=("my-repo",),
        permissions={"contents": "write"},
        ca_file=str(pki.ca_cert),
        clock=lambda: clock[0],
    )
    first = await tokens.token()
    assert first.startswith("ghs_installation0001") and await tokens.token() == first
    assert github.handler.minted == [{"repositories": ["my-repo"], "permissions": {"contents": "write"}}]
    clock[0] += 3600 - github_app.REFRESH_MARGIN + 1  # inside the refresh margin
    second = await tokens.token()
    assert second != first and second.startswith("ghs_installation0002")


async def test_a_wrong_app_key_fails_clearly_without_secrets(pki, github):
    wrong_pem, _ = harness.rsa_key_pem()
    tokens = github_app.InstallationTokens(
        app_id=APP_ID,
        installation_id=INSTALLATION,
        private_key=wrong_pem,
        api_url=f"https://127.0.0.1:{github.port}",
        ca_file=str(pki.ca_cert),
    )
    with pytest.raises(github_app.MintError, match="HTTP 401") as failure:
        await tokens.token()
    assert "PRIVATE KEY" not in str(failure.value)


async def test_the_proxy_injects_installation_tokens_for_git_and_the_api(pki, app_key, github, tmp_path):
    key_file = tmp_path / "app.pem"
    key_file.write_text(app_key[0])
    port = github.port
    config = f"""
[destinations]
allow = ["127.0.0.1/32"]

[[rules]]
name = "github"
kind = "github_app"
hosts = ["github.com:{port}", "api.github.com:{port}"]
app_id = {APP_ID}
installation_id = {INSTALLATION}
private_key_file = "{key_file}"
api_url = "https://api.github.com:{port}"
api_ca_file = "{pki.ca_cert}"
"""
    proxy = harness.Proxy(tmp_path / "proxy", config, pki.ca_cert, {n: "127.0.0.1" for n in harness.NAMES})
    try:
        h = f"github.com:{port}"
        answer = ask(proxy, pki, h, "github.com", h, path="/org/repo.git/info/refs?service=git-upload-pack")
        assert answer.status == 200
        (value,) = auth_of(last(github))
        user, _, token = base64.b64decode(value.removeprefix("Basic ")).decode().partition(":")
        assert user == "x-access-token" and token.startswith("ghs_installation")
        api = f"api.github.com:{port}"
        assert ask(proxy, pki, api, "api.github.com", api, path="/repos/org/repo").status == 200
        assert auth_of(last(github)) == [f"Bearer {token}"]
        assert len(github.handler.minted) == 1, "cached between requests"
    finally:
        proxy.close()
    assert token not in proxy.output() and app_key[0] not in proxy.output()

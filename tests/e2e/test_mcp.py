"""An agent's view: the official MCP client over streamable HTTP against `sbx up`, with real
sandboxes behind it."""

from __future__ import annotations

import asyncio
import os

import httpx2
import pytest
from mcp.client.session import ClientSession
from mcp.client.streamable_http import streamable_http_client

from tests.e2e.agent import TOOLS, Agent
from tests.e2e.stacks import running_stack

pytestmark = [pytest.mark.needs_root("the local runtime needs root"), pytest.mark.slow]


async def test_an_agent_does_everything_the_tools_promise(stack):
    proc, state, url = stack
    key = (state / "api-key").read_text().strip()
    agent = Agent(url, key, "agent-1", **{"X-Org-Id": "acme", "X-User-Id": "ann"})
    assert await agent.tools() == TOOLS

    ok, text = await agent.call("shell", command="cd /tmp && export MODE=test && echo hi")
    assert ok and text.startswith("hi") and "[exit code: 0]" in text
    ok, text = await agent.call("shell", command='pwd; echo "$MODE"; exit 5')
    assert ok and text.splitlines()[:2] == ["/tmp", "test"] and "[exit code: 5]" in text

    ok, text = await agent.call("shell_async", command="echo working; sleep 0.2; echo finished")
    job = next(word for word in text.split() if len(word) == 32)
    ok, text = await agent.call("shell_wait", job_id=job, timeout=30)
    assert ok and "exited" in text and "finished" in text

    ok, _ = await agent.call(
        "str_replace_based_edit_tool", command="create", path="/workspace/a.txt", file_text="x\nsecret-y\n"
    )
    assert ok
    ok, text = await agent.call(
        "str_replace_based_edit_tool",
        command="str_replace",
        path="/workspace/a.txt",
        old_str="nope",
        new_str="z",
    )
    assert not ok and "did not appear" in text and "Traceback" not in text
    ok, text = await agent.call("str_replace_based_edit_tool", command="view", path="/workspace/a.txt")
    assert ok and "     1\tx" in text

    other = Agent(url, key, "agent-2")
    ok, text = await other.call("shell", command='cat /workspace/a.txt 2>&1; echo "[$MODE]"')
    assert "secret-y" not in text and "[]" in text

    ok, text = await agent.call("clear_session")
    assert ok
    ok, text = await agent.call("shell", command="ls /workspace; pwd")
    assert ok and "a.txt" not in text and "/workspace" in text

    await agent.call("shell", command="echo mine > /workspace/keep.txt")
    ok, text = await agent.call("create_sandbox", use_kata=True)
    assert not ok and "not" in text.lower()
    ok, text = await agent.call("shell", command="cat /workspace/keep.txt")
    assert ok and text.startswith("mine"), "a refused create_sandbox leaves the old sandbox intact"
    ok, text = await agent.call("create_sandbox", run_as_root=False)
    assert ok, text
    ok, text = await agent.call("shell", command="id -u; ls /workspace")
    assert ok and text.splitlines()[0] != "0" and "keep.txt" not in text

    # Operators see it in Prometheus metrics; the key never shows there.
    import json

    from tests.e2e.stacks import sbx

    status = json.loads(sbx("status", "--json", state=state).stdout)
    urls = {i["service"]: i["details"].get("metrics") for i in status["services"]}
    async with httpx2.AsyncClient(timeout=10) as http:
        scheduler = (await http.get(urls["scheduler"])).text
        executor = (await http.get(urls["executor"])).text
        gateway = await http.get(f"{url}/metrics")
    assert "sbx_claims_total{kind=" in scheduler and "sbx_claim_seconds_bucket" in scheduler
    assert 'sbx_exec_seconds_count{tool="shell"}' in executor
    assert gateway.status_code == 200 and key not in gateway.text and key not in scheduler


async def test_bad_headers_and_arguments_get_clear_errors(stack):
    proc, state, url = stack
    key = (state / "api-key").read_text().strip()
    async with httpx2.AsyncClient(timeout=30) as http:
        r = await http.post(f"{url}/mcp", json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"})
        assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")
    # A bad or missing X-Session-Id is refused when the agent connects, with the reason.
    for headers in ({"X-Session-Id": "has.dot"}, {}):
        sent = {"Authorization": f"Bearer {key}", **headers}
        async with httpx2.AsyncClient(headers=sent, timeout=30) as http:
            with pytest.raises(Exception) as refused:
                async with streamable_http_client(f"{url}/mcp", http_client=http) as (read, write):
                    async with ClientSession(read, write) as mcp:
                        await mcp.initialize()
            assert "X-Session-Id header" in repr(refused.value), refused.value
        async with httpx2.AsyncClient(timeout=30) as http:  # a client that starts with tools/list
            r = await http.post(
                f"{url}/mcp",
                json={"jsonrpc": "2.0", "id": 2, "method": "tools/list"},
                headers={"Authorization": f"Bearer {key}", "Accept": "application/json, text/event-stream",
                         "MCP-Protocol-Version": "2025-06-18", **headers},
            )  # fmt: skip
            assert "X-Session-Id header" in r.text and '"result"' not in r.text, r.text
    # Arguments that do not fit a tool are told in our words (no validator text, no links).
    agent = Agent(url, key, "args")
    ok, text = await agent.call("shell", command="true", timeout=-1)
    assert not ok and "timeout" in text
    ok, text = await agent.call("shell", command=5)
    assert not ok and text.startswith("Invalid arguments for shell: `command`"), text
    assert "pydantic" not in text and "http" not in text
    ok, text = await agent.call("shell", cmd="true")
    assert not ok and "`command` is required" in text and "`cmd` is not a parameter of shell" in text, text
    ok, text = await agent.call("shell_poll", job_id="not-a-job")
    assert not ok and "job" in text


async def test_the_default_product_routes_sandbox_traffic_through_the_credential_proxy(stack):
    """`sbx up` (as root, with nftables) starts the proxy and gives sandboxes proxy-only
    egress: the proxy answers for them (502 for a refused loopback target), and without it
    there is no way out."""
    proc, state, url = stack
    key = (state / "api-key").read_text().strip()
    agent = Agent(url, key, "egress-1")
    ok, text = await agent.call("shell", command="echo $HTTPS_PROXY; ip -4 -o addr show eth0 | wc -l")
    assert ok and text.splitlines()[:2] == ["http://10.213.255.254:3128", "1"], text
    ok, text = await agent.call(
        "shell", command="curl -sS -o /dev/null -w '%{http_code}' --max-time 10 http://127.0.0.2:9/"
    )
    assert ok and text.startswith("502"), text
    ok, text = await agent.call(
        "shell", command="curl -sS --noproxy '*' --max-time 3 http://10.213.255.254:22/ || echo blocked"
    )
    assert "blocked" in text
    assert (state / "proxy" / "ca" / "mitmproxy-ca.pem").exists()
    ok, text = await agent.call("shell", command="ls /etc/sbx; grep -l 'PRIVATE KEY' /etc/sbx/* || echo none")
    assert "none" in text and "ca-bundle.pem" in text


async def test_a_killed_proxy_is_restarted_and_sandboxes_get_out_again(stack):
    """The proxy is supervised by `sbx up`: SIGKILL it and the sandboxes' way out comes
    back on the same address (their HTTPS_PROXY never changes)."""
    import asyncio
    import signal
    import subprocess

    proc, state, url = stack
    key = (state / "api-key").read_text().strip()
    agent = Agent(url, key, "egress-2")
    probe = "curl -sS -o /dev/null -w '%{http_code}' --max-time 10 http://127.0.0.2:9/ || true"
    ok, text = await agent.call("shell", command=probe)
    assert text.startswith("502"), text
    found = subprocess.run(
        ["pgrep", "-f", f"confdir={state.resolve()}/proxy/ca"], capture_output=True, text=True
    ).stdout.split()
    assert len(found) == 1, found
    os.kill(int(found[0]), signal.SIGKILL)
    for _ in range(100):
        ok, text = await agent.call("shell", command=probe)
        if text.startswith("502"):
            break
        await asyncio.sleep(0.2)
    assert text.startswith("502"), f"the proxy did not come back: {text}"


async def test_connecting_gets_the_sessions_sandbox_before_its_first_call(stack):
    """Claim on connect (SBX_CLAIM_ON_CONNECT, on by default): an agent's `initialize`
    starts getting its session's sandbox, so it is there before any tool call; the first
    call then uses that one (no second claim or provisioning for the session)."""
    import asyncio
    import re
    import subprocess
    import sys

    from tests import support

    proc, state, url = stack
    key = (state / "api-key").read_text().strip()
    headers = {"Authorization": f"Bearer {key}", "X-Session-Id": "early-1"}

    def events() -> str:
        listed = subprocess.run(
            [sys.executable, "-m", "sbx.cli", "events", "--state-dir", str(state)],
            capture_output=True, text=True, timeout=60, cwd=support.ROOT,
        ).stdout  # fmt: skip
        return "\n".join(line for line in listed.splitlines() if "session_id=early-1 " in line)

    async with httpx2.AsyncClient(headers=headers, timeout=120) as http:
        async with streamable_http_client(f"{url}/mcp", http_client=http) as (read, write):
            async with ClientSession(read, write) as mcp:
                await mcp.initialize()
                for _ in range(200):  # no tool call yet
                    if "session.sandbox_assigned" in (before := events()):
                        break
                    await asyncio.sleep(0.1)
                assert "session.sandbox_assigned" in before, before
                result = await mcp.call_tool("shell", {"command": "echo hi"})
                assert not result.is_error and "hi" in result.content[0].text
    after = events()
    assert after.count("session.sandbox_assigned") == 1, after
    assert len(re.findall(r"sandbox\.(?:claimed|requested) ", after)) == 1, after  # one sandbox got
    [assigned] = re.findall(r"sandbox_assigned .*sandbox_id=(\S+)", after)
    assert re.search(rf"exec\.completed .*sandbox_id={assigned} ", after), after


async def test_a_client_that_starts_with_tools_list_is_claimed_for_too(stack):
    """A client of the newer protocol revision may skip `initialize`: its `tools/list`
    starts getting the session's sandbox the same way."""
    import asyncio

    proc, state, url = stack
    key = (state / "api-key").read_text().strip()
    async with httpx2.AsyncClient(timeout=30) as http:
        r = await http.post(
            f"{url}/mcp",
            json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"},
            headers={"Authorization": f"Bearer {key}", "X-Session-Id": "lister",
                     "Accept": "application/json, text/event-stream", "MCP-Protocol-Version": "2025-06-18"},
        )  # fmt: skip
        assert r.status_code == 200 and "shell_async" in r.text, r.text
        for _ in range(200):  # no tool call: the listing alone got the sandbox
            session = await http.get(f"{url}/v1/sessions/lister", headers={"Authorization": f"Bearer {key}"})
            if session.status_code == 200:
                break
            await asyncio.sleep(0.1)
        assert session.status_code == 200 and session.json()["status"] == "active", session.text


async def test_a_first_call_create_sandbox_wins_over_the_sandbox_claimed_at_connect(stack):
    """Connecting claims a warm (root) sandbox for the session; a create_sandbox racing that
    claim as the first call must still return what it asked for, every time."""
    proc, state, url = stack
    key = (state / "api-key").read_text().strip()
    for attempt in range(6):
        agent = Agent(url, key, f"race-{attempt}")
        ok, text = await agent.call("create_sandbox", run_as_root=False)
        assert ok, text
        ok, text = await agent.call("shell", command="id -u; grep CapEff /proc/self/status")
        assert ok and text.split()[:3] == ["1000", "CapEff:", "0000000000000000"], (attempt, text)


async def test_every_create_sandbox_option_holds_inside_the_sandbox_it_returns(stack):
    """Each option, verified from inside (under `sbx up`, so with the proxy's CA mounted)."""
    proc, state, url = stack
    key = (state / "api-key").read_text().strip()
    agent = Agent(url, key, "options")
    ok, text = await agent.call("create_sandbox", run_as_root=False, writable_root=False)
    assert ok, text
    ok, text = await agent.call(
        "shell",
        command="id -u; touch /usr/x 2>&1; touch /workspace/ok && echo workspace-ok; "
        "grep -c 'BEGIN CERTIFICATE' /etc/sbx/proxy-ca.pem",
    )
    lines = text.splitlines()
    assert ok and lines[0] == "1000" and "Read-only file system" in lines[1], text
    assert "workspace-ok" in lines and lines[3] == "1", text
    ok, text = await agent.call("create_sandbox", use_kata=True)
    assert not ok and "not available" in text, text


def test_an_agent_gives_a_background_job_input(tmp_path):
    """With SBX_MCP_JOB_INPUT=on an agent has shell_input and shell_async(stdin=true); the
    eight tools are otherwise as they are."""
    state = tmp_path / "state"
    with running_stack(state, SBX_MCP_JOB_INPUT="on") as (_, url):
        key = (state / "api-key").read_text().strip()
        agent = Agent(url, key, "typist")

        async def go() -> None:
            assert await agent.tools() == TOOLS | {"shell_input"}
            ok, text = await agent.call("shell_async", command="read a; echo got-$a; cat", stdin=True)
            assert ok and "shell_input" in text, text
            job = text.split()[2]
            ok, text = await agent.call("shell_input", job_id=job, input="first\n")
            assert ok and "got-first" in text and "status: running" in text, text
            ok, text = await agent.call("shell_input", job_id=job, input="rest\n", close=True)
            assert ok, text
            ok, text = await agent.call("shell_wait", job_id=job, timeout=30)
            assert ok and "exit code: 0" in text and text.endswith("got-first\nrest\n"), text
            ok, text = await agent.call("shell_input", job_id=job, input="late")
            assert not ok and "takes no more input" in text, text
            ok, text = await agent.call("shell_async", command="sleep 60")
            plain = text.split()[2]
            ok, text = await agent.call("shell_input", job_id=plain, input="x")
            assert not ok and "without input" in text, text
            await agent.call("shell_stop", job_id=plain)

        asyncio.run(go())

"""A `shell` call whose client cancels it (`notifications/cancelled`) or goes away (the HTTP
connection closes) is stopped: its command is killed, the session's lock is released, the
next call runs, and the shell is as it was before the cancelled call; a REST run whose
client goes away is stopped too; a long call tells a client that asks how it is going. A
real `sbx up`, real sandboxes, the official MCP client
over HTTP."""

from __future__ import annotations

import asyncio
import subprocess

import httpx2
import pytest
from mcp.client.session import ClientSession
from mcp.client.streamable_http import streamable_http_client

from tests.e2e.agent import Agent
from tests.e2e.stacks import running_stack

pytestmark = [
    pytest.mark.needs_root("the local runtime needs root"),
    pytest.mark.slow,
    pytest.mark.timeout(300),
]

MARK = 271
LONG = f"z=changed; echo begun; sleep {MARK}; echo never"


def _sleeps() -> int:
    """The long command's processes, seen from the host (a probe through the session
    would wait for the session's lock)."""
    found = subprocess.run(["pgrep", "-f", f"^sleep {MARK}$"], capture_output=True, text=True)
    return len(found.stdout.split())


async def _started() -> None:
    """Until the long command runs in the sandbox."""
    for _ in range(600):
        if _sleeps():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the long command never started")


async def _call_in_background(agent: Agent, mcp_ready: asyncio.Event, holder: dict) -> None:
    async with httpx2.AsyncClient(headers=agent.headers, timeout=120) as http:
        async with streamable_http_client(agent.url, http_client=http) as (read, write):
            async with ClientSession(read, write) as mcp:
                await mcp.initialize()
                holder["http"] = http
                mcp_ready.set()
                await mcp.call_tool("shell", {"command": LONG})


async def _after(agent: Agent) -> None:
    """The command is gone, the next calls run, the state is from before the call."""
    ok, text = await agent.call("shell", command='echo "z=$z"')
    assert ok and text.startswith("z=before\n"), text
    assert _sleeps() == 0
    ok, text = await agent.call("shell", command="echo next")
    assert ok and text.startswith("next") and "timed out" not in text, text


async def _cancelled_by_the_client(url: str, key: str) -> None:
    agent = Agent(url, key, "cancel-client")
    assert (await agent.call("shell", command="z=before"))[0]
    ready = asyncio.Event()
    call = asyncio.create_task(_call_in_background(agent, ready, {}))
    await ready.wait()
    await _started()
    call.cancel()  # the client sends notifications/cancelled for the pending request
    with pytest.raises(asyncio.CancelledError):
        await call
    await _after(agent)


async def _client_gone(url: str, key: str) -> None:
    agent = Agent(url, key, "cancel-gone")
    assert (await agent.call("shell", command="z=before"))[0]
    ready, holder = asyncio.Event(), {}
    call = asyncio.create_task(_call_in_background(agent, ready, holder))
    await ready.wait()
    await _started()
    await holder["http"].aclose()  # the connection closes under the pending request
    with pytest.raises(BaseException):
        await asyncio.wait_for(call, 30)
    await _after(agent)


async def _cancelled_by_notification(url: str, key: str) -> None:
    """A client of the older protocol revision: `notifications/cancelled` for the call's
    request id, as a request of its own (the gateway is stateless)."""
    agent = Agent(url, key, "cancel-notified")
    assert (await agent.call("shell", command="z=before"))[0]
    headers = agent.headers | {
        "Accept": "application/json, text/event-stream",
        "MCP-Protocol-Version": "2025-06-18",
    }
    body = {
        "jsonrpc": "2.0",
        "id": 7,
        "method": "tools/call",
        "params": {"name": "shell", "arguments": {"command": LONG}},
    }
    async with httpx2.AsyncClient(headers=headers, timeout=120) as http:
        call = asyncio.create_task(http.post(agent.url, json=body))
        await _started()
        cancel = {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 7}}
        assert (await http.post(agent.url, json=cancel)).status_code == 202
        answer = await asyncio.wait_for(call, 30)
    assert "cancelled" in answer.text, answer.text
    await _after(agent)


async def _rest_run_abandoned(url: str, key: str) -> None:
    """The REST run (a one-off command, streamed): a client that goes away stops it."""
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx2.AsyncClient(headers=headers, timeout=120) as http:
        run = f"{url}/v1/sessions/cancel-rest/run"
        assert (await http.post(run, json={"command": "true"})).status_code == 200

        async def long_run() -> None:
            async with http.stream("POST", run, json={"command": f"sleep {MARK}"}) as response:
                async for _ in response.aiter_bytes():
                    pass

        call = asyncio.create_task(long_run())
        await _started()
        call.cancel()  # the connection closes under the stream
        with pytest.raises(asyncio.CancelledError):
            await call
    for _ in range(200):
        if not _sleeps():
            break
        await asyncio.sleep(0.05)
    assert _sleeps() == 0, "the abandoned run's command is gone"


async def _progress_of_a_long_call(url: str, key: str) -> None:
    """A client that asks for progress (a progress token) hears, while a long `shell` runs,
    how long it has run and how much output it made so far."""
    agent = Agent(url, key, "progress")
    heard: list[tuple[float, str | None]] = []

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        heard.append((progress, message))

    async with httpx2.AsyncClient(headers=agent.headers, timeout=120) as http:
        async with streamable_http_client(agent.url, http_client=http) as (read, write):
            async with ClientSession(read, write) as mcp:
                await mcp.initialize()
                command = "for i in 1 2 3 4 5 6; do echo tick$i; sleep 1; done"
                result = await mcp.call_tool("shell", {"command": command}, progress_callback=on_progress)
    assert not result.is_error and "tick6" in "".join(getattr(c, "text", "") for c in result.content)
    assert len(heard) >= 2, heard
    assert [p for p, _ in heard] == sorted(p for p, _ in heard)  # it only grows
    assert all(m and m.startswith("running for ") and "bytes of output so far" in m for _, m in heard), heard


def test_a_cancelled_or_abandoned_shell_call_is_stopped(tmp_path):
    with running_stack(tmp_path / "state") as (_, url):
        key = (tmp_path / "state" / "api-key").read_text().strip()
        asyncio.run(_cancelled_by_the_client(url, key))
        asyncio.run(_client_gone(url, key))
        asyncio.run(_cancelled_by_notification(url, key))
        asyncio.run(_rest_run_abandoned(url, key))
        asyncio.run(_progress_of_a_long_call(url, key))

"""Pause and resume as an operator and an agent see them: a real `sbx up`, real sandboxes,
the official MCP client, the REST API and the CLI. A paused sandbox's processes are
frozen (its background counter does not move, its cgroup says FROZEN); the agent's next
call resumes it with its files, shell and background processes as they were; the idle
reaper pauses a session on its own; every transition is in the stream and replay agrees."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest

from shared.contract import ids
from shared.runtime.local import runtime as local
from tests.e2e.agent import Agent
from tests.e2e.stacks import running_stack, sandbox_files, sandbox_root, sbx, support_wait
from tests.e2e.test_stop import leftovers

pytestmark = [
    pytest.mark.needs_root("the local runtime needs root"),
    pytest.mark.slow,
    pytest.mark.timeout(300),
]
COUNTER = (  # (written whole each time: a reader never sees it half written)
    "(i=0; while :; do i=$((i+1)); echo $i > /workspace/.count && mv /workspace/.count /workspace/count; "
    "sleep 0.05; done) >/dev/null 2>&1 </dev/null &"
)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    state = tmp_path_factory.mktemp("pause") / "state"
    with running_stack(state) as (_, url):
        yield state, url, (state / "api-key").read_text().strip()


def sandbox_events(state: Path, session: str) -> list[tuple[str, str]]:
    """The session's sandboxes' pauses and resumes, in stream order."""
    out = sbx("events", "--json", state=state)
    assert out.returncode == 0, out.stderr
    found = []
    for line in out.stdout.splitlines():
        event = json.loads(line)["event"]
        if event["type"] in ("sandbox.paused", "sandbox.resumed") and event["meta"]["session_id"] == session:
            found.append((event["type"], event["reason"]))
    return found


def pause_times(state: Path, session: str) -> list[datetime]:
    """When the session's sandboxes were paused, in stream order."""
    out = sbx("events", "--json", state=state)
    events = [json.loads(line)["event"] for line in out.stdout.splitlines()]
    return [
        datetime.fromisoformat(e["meta"]["time"].replace("Z", "+00:00"))
        for e in events
        if e["type"] == "sandbox.paused" and e["meta"]["session_id"] == session
    ]


def host_count(state: Path, sandbox_id: str) -> int:
    """The counter as the host sees the sandbox's workspace (no command enters it)."""
    root = sandbox_root(state, sandbox_id)
    assert root is not None, sandbox_id
    return int((root / "workspace" / "count").read_text().strip() or 0)


def freezer_state(sandbox_id: str) -> str:
    return Path(f"/sys/fs/cgroup/freezer/sbx/sbx-{ids.token(sandbox_id)}/freezer.state").read_text().strip()


async def test_a_paused_sandbox_is_frozen_and_the_next_call_resumes_it_as_it_was(stack):
    state, url, key = stack
    auth = {"Authorization": f"Bearer {key}"}
    agent = Agent(url, key, "pausee")
    ok, text = await agent.call(
        "shell", command=f"export KEEP=kept; cd /tmp; echo data > /workspace/f; {COUNTER} echo started"
    )
    assert ok and "started" in text, text
    async with httpx.AsyncClient(base_url=url, headers=auth, timeout=60) as rest:
        paused = await rest.post("/v1/sessions/pausee/pause", headers={"Idempotency-Key": "op-1"})
        assert paused.status_code == 200, paused.text
        body = paused.json()
        assert body["status"] == "paused" and body["changed"] is True and body["paused_at"]
        sandbox_id = body["sandbox_id"]
        again = await rest.post("/v1/sessions/pausee/pause", headers={"Idempotency-Key": "op-1"})
        assert again.status_code == 200 and again.json()["changed"] is False  # idempotent
        assert (await rest.post("/v1/sessions/pausee/pause")).json()["changed"] is False  # already paused

        # Frozen: the cgroup says so and the background counter does not move.
        assert freezer_state(sandbox_id) == "FROZEN"
        seen = host_count(state, sandbox_id)
        await asyncio.sleep(0.5)  # (the counter ticks every 50 ms while it runs)
        assert host_count(state, sandbox_id) == seen

        # The agent's next call resumes it: files, shell state and the counter as they were.
        ok, text = await agent.call("shell", command='echo "$KEEP $PWD"; cat /workspace/f /workspace/count')
        assert ok and text.splitlines()[:2] == ["kept /tmp", "data"], text
        assert int(text.splitlines()[2]) >= seen, "the counter went on from where it was (not restarted)"
        assert freezer_state(sandbox_id) == "THAWED"
        support_wait(lambda: host_count(state, sandbox_id) > seen, 30)  # and it goes on

        # A download (a GET never starts a sandbox) resumes a paused one.
        assert (await rest.post("/v1/sessions/pausee/pause")).json()["changed"] is True
        got = await rest.get("/v1/sessions/pausee/archive", params={"root": "/workspace", "path": "f"})
        assert got.status_code == 200 and b"data" in got.content, got.text
        # A host API run resumes it just as well.
        assert (await rest.post("/v1/sessions/pausee/pause")).json()["changed"] is True
        run = await rest.post(
            "/v1/sessions/pausee/run", json={"command": "cat /workspace/f", "cwd": "/workspace"}
        )
        assert run.status_code == 200, run.text
        lines = [json.loads(line) for line in run.text.splitlines() if line.strip()]
        assert any("data" in str(line) for line in lines) and lines[-1].get("exit_code") == 0, lines

        resumed = await rest.post("/v1/sessions/pausee/resume")
        assert resumed.status_code == 200 and resumed.json() == {**resumed.json(), "status": "running"}
        assert resumed.json()["changed"] is False  # running already

        # Operators' errors: unknown session 404; a session with no sandbox yet 409.
        assert (await rest.post("/v1/sessions/ghost/pause")).status_code == 404
        await rest.post("/v1/sessions", json={"session_id": "empty"})
        assert (await rest.post("/v1/sessions/empty/pause")).status_code == 409
        nothing = await rest.get("/v1/sessions/empty/archive", params={"root": "/workspace"})
        assert nothing.status_code == 404  # a download still never starts a sandbox

    # The CLI, then the stream and the projections.
    out = sbx("pause", "pausee", "--json", state=state)
    assert out.returncode == 0, out.stderr
    assert (
        json.loads(out.stdout)["changed"] is True and json.loads(out.stdout)["sandbox"]["status"] == "paused"
    )
    out = sbx("resume", "pausee", state=state)
    assert out.returncode == 0 and "resumed" in out.stdout, out
    assert sbx("pause", "ghost", state=state).returncode != 0
    assert sandbox_events(state, "pausee") == [
        ("sandbox.paused", "requested"),
        ("sandbox.resumed", "call"),
        ("sandbox.paused", "requested"),
        ("sandbox.resumed", "call"),  # the download
        ("sandbox.paused", "requested"),
        ("sandbox.resumed", "call"),  # the run
        ("sandbox.paused", "requested"),
        ("sandbox.resumed", "requested"),
    ]
    verified = sbx("replay", "--verify", state=state)
    assert verified.returncode == 0, verified.stdout + verified.stderr


def test_the_reaper_pauses_an_idle_session_and_its_next_call_resumes_it(tmp_path):
    state = tmp_path / "state"
    settings = {"SBX_PAUSE_TIMEOUT": "1", "SBX_REAPER_INTERVAL": "0.5", "SBX_POOL_MIN_IDLE": "1"}
    with running_stack(state, **settings) as (_, url):
        key = (state / "api-key").read_text().strip()
        agent = Agent(url, key, "dozer")
        ok, text = asyncio.run(agent.call("shell", command="x=41; echo set"))
        assert ok, text
        support_wait(lambda: ("sandbox.paused", "idle") in sandbox_events(state, "dozer"), 60)
        started = time.monotonic()
        ok, text = asyncio.run(agent.call("shell", command="echo $((x+1))"))
        assert ok and text.startswith("42"), text
        took = 1000 * (time.monotonic() - started)
        print(f"\nfirst call after an idle pause: {took:.0f} ms (MCP connect included)")
        assert ("sandbox.resumed", "call") in sandbox_events(state, "dozer")
        verified = sbx("replay", "--verify", state=state)
        assert verified.returncode == 0, verified.stdout + verified.stderr

        # An async job that runs keeps its session from being paused, however idle...
        jobber = Agent(url, key, "jobber")
        ok, text = asyncio.run(jobber.call("shell_async", command="sleep 4; echo done > /workspace/job"))
        assert ok, text
        (done,) = support_wait(lambda: sandbox_files(state, "/workspace/job"), 60)
        # ...and once it has ended, the session is paused as any idle one: not before (the
        # reaper asked every 0.5 s meanwhile; a job frozen mid-way would never have ended).
        first = support_wait(lambda: pause_times(state, "jobber"), 60)[0]
        assert first >= datetime.fromtimestamp(done.stat().st_mtime, UTC), (first, done.stat().st_mtime)

        # Stopping the stack stops a paused sandbox as a running one: nothing left behind.
        paused = sbx("pause", "dozer", "--json", state=state)
        assert paused.returncode == 0, paused.stderr
        sandbox_id = json.loads(paused.stdout)["sandbox"]["sandbox_id"]
        assert sbx("down", state=state).returncode == 0
        assert leftovers(state) == {}
        assert asyncio.run(local.LocalRuntime(state).get(sandbox_id)).status == "stopped"  # files kept


def stopped_reasons(state: Path, session: str) -> list[str]:
    out = sbx("events", "--json", state=state)
    events = [json.loads(line)["event"] for line in out.stdout.splitlines()]
    return [
        e["reason"] for e in events if e["type"] == "sandbox.stopped" and e["meta"]["session_id"] == session
    ]


def test_a_hibernated_session_comes_back_after_every_service_restarted(tmp_path):
    """Paused, then hibernated (stopped, files kept, the session active); every service is
    SIGKILLed and restarted by `sbx up`'s supervisor; the next call starts the sandbox
    again with its files, directory and exports."""
    state = tmp_path / "state"
    settings = {
        "SBX_PAUSE_TIMEOUT": "1",
        "SBX_HIBERNATE_TIMEOUT": "2",
        "SBX_REAPER_INTERVAL": "0.5",
        "SBX_POOL_MIN_IDLE": "1",
    }
    with running_stack(state, **settings) as (_, url):
        key = (state / "api-key").read_text().strip()
        agent = Agent(url, key, "bear")
        ok, text = asyncio.run(
            agent.call("shell", command="echo kept > /workspace/file; cd /tmp; export KEPT=yes")
        )
        assert ok, text
        support_wait(lambda: "hibernated" in stopped_reasons(state, "bear"), 60)
        assert ("sandbox.paused", "idle") in sandbox_events(state, "bear")  # paused first

        before = json.loads(sbx("status", "--json", state=state).stdout)["services"]
        for service in before:
            os.kill(service["pid"], signal.SIGKILL)
        old = {s["pid"] for s in before}

        def restarted() -> bool:
            now = json.loads(sbx("status", "--json", state=state).stdout)["services"]
            return {s["service"] for s in now if s["status"] == "ok" and s["pid"] not in old} >= {
                s["service"] for s in before
            }

        support_wait(restarted, 120)
        text = ""
        for _ in range(100):  # the gateway may still be binding its port
            try:
                ok, text = asyncio.run(agent.call("shell", command='cat /workspace/file; echo "$KEPT $PWD"'))
                break
            except Exception:
                time.sleep(0.2)
        lines = [line for line in text.splitlines() if not line.startswith("[a new shell:")]
        assert ok and lines[:2] == ["kept", "yes /tmp"], text
        verified = sbx("replay", "--verify", state=state)
        assert verified.returncode == 0, verified.stdout + verified.stderr

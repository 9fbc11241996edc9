"""The `shell` tool is one bash session: what an agent does in one call is there in the
next, as in a persistent bash, also when the executor was SIGKILLed between the two calls
(the next call lands on a new executor process with no memory of the session). A real
`sbx up`, real sandboxes, the official MCP client over HTTP; one session per case."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import support
from tests.e2e.bash_cases import CASES, Case, checked
from tests.e2e.test_chaos import children
from tests.e2e.test_mcp import Agent
from tests.e2e.test_sbx_up import running_stack

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="the local runtime needs root"),
    pytest.mark.slow,
    pytest.mark.timeout(600),
]


async def _calls(agent: Agent, case: Case) -> list[tuple[bool, str]]:
    out = []
    for step in case.setup:
        command, timeout = step if isinstance(step, tuple) else (step, None)
        out.append(await agent.call("shell", command=command, **({"timeout": timeout} if timeout else {})))
    return out


async def _until_a_call_works(agent: Agent, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            ok, _ = await agent.call("shell", command="true")
            if ok:
                return
        except Exception:  # the executor restarting
            pass
        await asyncio.sleep(0.2)
    raise AssertionError("no call worked after the executor's restart")


MODES = ("nothing", "executor SIGKILL", "two executors")
"""What happens between a case's calls: nothing; the executor is SIGKILLed (the next call
lands on a new executor process with no memory of the session); a second executor
instance serves too (each call lands on either, at random)."""


def test_the_shell_keeps_everything_a_bash_session_keeps(tmp_path):
    """Every case in each mode on one stack (new sessions per mode)."""
    state = tmp_path / "state"
    with running_stack(state, SBX_POOL_MIN_IDLE="8") as (proc, url):
        key = (state / "api-key").read_text().strip()
        wrong = {}
        for between in MODES:
            second = _second_executor(state) if between == "two executors" else None
            try:
                wrong[between] = asyncio.run(_run_cases(proc, url, key, between))
            finally:
                if second is not None:
                    second.terminate()
                    second.wait(30)
            passed = len(CASES) - len(wrong[between])
            print(f"\nbash session, {between} between the calls: {passed}/{len(CASES)} cases")
    assert not any(wrong.values()), wrong


def _second_executor(state: Path) -> subprocess.Popen[bytes]:
    """Another executor instance on the stack's bus, sharing its runtime (as a second
    replica would); serving once it reports healthy."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SBX_", "NATS_", "SANDBOX_"))}
    env |= {
        "NATS_URL": json.loads((state / "stack.json").read_text())["nats_url"],
        "NATS_TOKEN": (state / "nats-token").read_text().strip(),
        "SBX_STATE_DIR": str(state.resolve()),
        "SBX_METRICS_PORT": "0",
    }
    proc = subprocess.Popen([sys.executable, "-m", "services.executor"], env=env, cwd=support.ROOT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        report = subprocess.run(
            [sys.executable, "-m", "sbx.cli", "status", "--json", "--state-dir", str(state)],
            capture_output=True, text=True, cwd=support.ROOT,
        )  # fmt: skip
        services = json.loads(report.stdout or "{}").get("services", [])
        if sum(s["service"] == "executor" and s["status"] == "ok" for s in services) >= 2:
            return proc
        time.sleep(0.5)
    proc.kill()
    raise AssertionError("the second executor did not come up")


async def _run_cases(proc, url: str, key: str, between: str) -> list[str]:
    """Every case's first calls, then (after ``between``) its check; what went wrong."""
    mode = {"nothing": "n", "executor SIGKILL": "k", "two executors": "t"}[between]
    agents = {c.name: Agent(url, key, f"{mode}-" + c.name.replace(" ", "-")) for c in CASES}
    limit = asyncio.Semaphore(12)

    async def setup(case: Case) -> None:
        async with limit:
            await _calls(agents[case.name], case)

    started = time.monotonic()
    await asyncio.gather(*(setup(c) for c in CASES))
    print(f"\nsetup {time.monotonic() - started:.1f}s")
    if between == "executor SIGKILL":
        executor = children(proc.pid)["executor"]
        os.kill(executor, signal.SIGKILL)
        await _until_a_call_works(Agent(url, key, f"probe-{mode}"))
        assert children(proc.pid)["executor"] != executor

    async def check(case: Case) -> str | None:
        async with limit:
            agent = agents[case.name]
            ok, text = await agent.call("shell", command=case.check)
            wrong = checked(case, ok, text)
            ok, alive = await agent.call("shell", command="echo alive")  # and the session goes on
            return wrong or (None if ok and "alive" in alive else f"{case.name}: unusable after: {alive}")

    started = time.monotonic()
    found = [w for w in await asyncio.gather(*(check(c) for c in CASES)) if w]
    print(f"checks {time.monotonic() - started:.1f}s")
    return found

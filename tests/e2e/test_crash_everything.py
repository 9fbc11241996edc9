"""The whole stack SIGKILLed at once (NATS, supervisor, every service), sandboxes left
running behind it, then `sbx up` again on the same state: nothing leaks, no session is
lost, workspaces and shell state are intact, and the projections still equal the stream."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest

from tests import support
from tests.e2e.agent import Agent
from tests.e2e.stacks import read_until, sbx, support_wait

pytestmark = [pytest.mark.needs_root("the local runtime needs root"), pytest.mark.slow]


def start(state, nats_port, log=None, **settings: str):
    """A real `sbx up` on ``state`` (a pool of 2, the reaper every second, ``settings``);
    its stderr (the services' logs) appended to ``log`` if given. (process, gateway URL)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SBX_", "NATS_", "SANDBOX_"))}
    env.update({"SBX_POOL_MIN_IDLE": "2", "SBX_REAPER_INTERVAL": "1", **settings})
    with open(log or os.devnull, "a") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sbx.cli", "up", "--state-dir", str(state), "--port", "0",
             "--nats-port", str(nats_port)],
            env=env, cwd=support.ROOT, stdout=subprocess.PIPE, stderr=stderr, text=True,
        )  # fmt: skip
    banner = read_until(proc, r"Stop with Ctrl-C")
    return proc, re.search(r"REST API\s+(http://\S+)/v1/sessions", banner).group(1)


def runtime_sandboxes(state) -> set[str]:
    root = state / "sandboxes"
    return {
        json.loads((d / "spec.json").read_text())["spec"]["sandbox_id"]
        for d in root.iterdir()
        if (d / "spec.json").exists()
    }


async def test_sigkill_everything_then_restart(tmp_path):
    state, nats_port = tmp_path / "state", support.free_port()
    proc, url = start(state, nats_port)
    try:
        key = (state / "api-key").read_text().strip()
        agent = Agent(url, key, "survivor")
        ok, text = await agent.call(
            "shell", command="echo precious > /workspace/data; cd /tmp; export MARK=kept"
        )
        assert ok, text
        status = support_wait(
            lambda: (
                (s := json.loads(sbx("status", "--json", state=state).stdout)) and s["pool_idle"] >= 2 and s
            ),
            timeout=60,
        )
        pids = [i["pid"] for i in status["services"]]
        nats_pids = subprocess.run(
            ["pgrep", "-f", "nats.conf"], capture_output=True, text=True
        ).stdout.split()
        for pid in [*pids, proc.pid, *map(int, nats_pids)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(10)
        before = runtime_sandboxes(state)
        assert len(before) >= 3  # the session's sandbox and the warm pool survive the crash
    finally:
        if proc.poll() is None:
            proc.kill()

    proc, url = start(state, nats_port)
    try:
        key = (state / "api-key").read_text().strip()
        agent = Agent(url, key, "survivor")
        ok, text = await agent.call("shell", command='cat /workspace/data; pwd; echo "$MARK"')
        # (The sandbox was restarted: a new shell, which says so, with the directory and exports.)
        lines = [line for line in text.splitlines() if not line.startswith("[a new shell:")]
        assert ok and lines[:3] == ["precious", "/tmp", "kept"], text

        # The pool is reused, not duplicated: no more sandboxes than records say should exist.
        def settled():
            status = json.loads(sbx("status", "--json", state=state).stdout)
            live = sum(n for k, n in status["sandboxes"].items() if k in ("requested", "running", "stopped"))
            return status["pool_idle"] >= 2 and live == len(runtime_sandboxes(state)) and status

        settled_status = support_wait(settled, timeout=60)
        assert settled_status["pool_idle"] <= 3
        verify = sbx("replay", "--verify", state=state)
        assert verify.returncode == 0, verify.stdout + verify.stderr
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        from shared.runtime import backends

        await backends.purge("local", state)

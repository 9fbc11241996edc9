"""Stopping a stack as an operator does: Ctrl-C on `sbx up`, `sbx down` on a running stack
and on one that crashed, `sbx down --purge`. Real `sbx up`, real sandboxes, proxies and
mounts; afterwards nothing of the stack is left on the machine, and sessions resume with
their files on the next `sbx up`."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
from pathlib import Path

import pytest

from shared.runtime import backends
from shared.runtime.local import mounts, network, sandboxdirs
from shared.runtime.local import runtime as local
from tests import support
from tests.e2e.agent import Agent
from tests.e2e.stacks import sbx, support_wait
from tests.e2e.test_crash_everything import runtime_sandboxes, start

pytestmark = [pytest.mark.needs_root("the local runtime needs root"), pytest.mark.slow]


def network_links(state: Path) -> set[int]:
    """The host-side interface indexes of the veths the stack's sandboxes on disk were given."""
    found = set()
    for net in (state / "sandboxes").glob("*/net.json"):
        found.add(json.loads(net.read_text())["ifindex"])
    return found


def _routed() -> set[int]:
    """Interface indexes in the host's sandbox → proxy map (nftables)."""
    out = subprocess.run(
        ["nft", "-j", "list", "map", "inet", network.NAT_TABLE, "proxy_of_link"],
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        return set()
    return {
        int(key)
        for item in json.loads(out.stdout).get("nftables", [])
        for key, _ in item.get("map", {}).get("elem", [])
        if str(key).isdigit()
    }


def leftovers(state: Path, links: set[int] = frozenset()) -> dict[str, list[str]]:
    """What of the stack under ``state`` is still on the machine: processes naming it
    (sandboxes, proxies, NATS, services), mounts below it, its sandboxes' cgroups, and of
    ``links`` (veths its sandboxes had, see :func:`network_links`) those still present or
    still routed by nftables."""
    root = os.path.realpath(state)
    processes = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if root in cmdline and int(pid) != os.getpid():
            processes.append(f"{pid} {cmdline[:120]}")
    rt = local.LocalRuntime(state) if state.exists() else None
    cgroups = [
        str(d)
        for sandbox in (runtime_sandboxes(state) if rt else ())
        for d in rt.cgroups.dirs(sandboxdirs.cgroup_name(sandbox))
        if d.exists()
    ]
    found = {
        "processes": processes,
        "mounts": [str(p) for p in mounts.mounts_under(Path(root))] if state.exists() else [],
        "cgroups": cgroups,
        "links": sorted(links & {index for index, _ in socket.if_nameindex()}),
        "routes": sorted(links & _routed()),
    }
    return {k: v for k, v in found.items() if v}


def events_of(state: Path) -> list[dict]:
    out = sbx("events", "--json", state=state)
    assert out.returncode == 0, out.stderr
    return [json.loads(line)["event"] for line in out.stdout.splitlines()]


def stop(proc: subprocess.Popen[str], sig: int = signal.SIGINT) -> None:
    proc.send_signal(sig)
    proc.wait(120)


async def test_ctrl_c_stops_every_sandbox_and_sessions_resume_after_the_next_up(tmp_path):
    state, nats_port = tmp_path / "state", support.free_port()
    proc, url = start(state, nats_port)
    try:
        key = (state / "api-key").read_text().strip()
        agent = Agent(url, key, "keeper")
        ok, text = await agent.call(
            "shell", command="echo precious > /workspace/data; cd /tmp; export MARK=kept"
        )
        assert ok, text
        support_wait(lambda: json.loads(sbx("status", "--json", state=state).stdout)["pool_idle"] >= 2, 60)
        assert len(runtime_sandboxes(state)) >= 3
        stop(proc)
        assert proc.returncode == 0
        assert leftovers(state) == {}
        # Only the session's sandbox is kept (stopped, its files on disk); the pool's are gone.
        assert len(runtime_sandboxes(state)) == 1
    finally:
        if proc.poll() is None:
            proc.kill()

    proc, url = start(state, nats_port)
    try:
        # Recorded, with the reason: the session and its sandbox stopped, the pool deleted.
        recorded = events_of(state)
        stops = [e for e in recorded if e["type"] in ("session.stopped", "sandbox.stopped")]
        assert {e["type"] for e in stops if e["reason"] == "shutdown"} == {
            "session.stopped",
            "sandbox.stopped",
        }
        assert sum(e["type"] == "sandbox.deleted" for e in recorded) >= 2

        ok, text = await Agent(url, key, "keeper").call(
            "shell", command='cat /workspace/data; pwd; echo "$MARK"'
        )
        # (The sandbox was stopped: a new shell, which says so, with the directory and exports.)
        lines = [line for line in text.splitlines() if not line.startswith("[a new shell:")]
        assert ok and lines[:3] == ["precious", "/tmp", "kept"], text
        verify = sbx("replay", "--verify", state=state)
        assert verify.returncode == 0, verify.stdout + verify.stderr

        # `sbx down` stops a running stack the same way (it tells `sbx up` to stop).
        down = sbx("down", state=state)
        assert down.returncode == 0, down.stderr
        proc.wait(30)
        assert proc.returncode == 0 and leftovers(state) == {}

        purged = sbx("down", "--purge", state=state)
        assert purged.returncode == 0, purged.stderr
        assert not state.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
        if state.exists():
            await backends.purge("local", state)


async def test_sbx_down_cleans_up_after_a_stack_that_was_killed(tmp_path):
    state, nats_port = tmp_path / "state", support.free_port()
    proc, url = start(state, nats_port)
    try:
        key = (state / "api-key").read_text().strip()
        ok, text = await Agent(url, key, "orphaned").call("shell", command="echo mine > /workspace/f")
        assert ok, text
        status = support_wait(
            lambda: (
                (s := json.loads(sbx("status", "--json", state=state).stdout)) and s["pool_idle"] >= 2 and s
            ),
            60,
        )
        for pid in [i["pid"] for i in status["services"]] + [proc.pid]:
            os.kill(pid, signal.SIGKILL)
        proc.wait(10)
        nats = subprocess.run(["pgrep", "-f", str(state / "nats.conf")], capture_output=True, text=True)
        for pid in nats.stdout.split():
            os.kill(int(pid), signal.SIGKILL)
        support_wait(lambda: not [p for p in leftovers(state).get("processes", []) if "nats" in p], 10)
        assert leftovers(state).get("processes")  # the sandboxes and the proxy outlive it

        down = sbx("down", state=state)
        assert down.returncode == 0, down.stderr
        assert "1 session sandbox(es) stopped (files kept)" in down.stderr, down.stderr
        assert leftovers(state) == {}
    finally:
        if proc.poll() is None:
            proc.kill()

    proc, url = start(state, nats_port)
    try:
        ok, text = await Agent(url, key, "orphaned").call("shell", command="cat /workspace/f")
        assert ok and "mine\n" in text, text  # (after a note that the shell is new)
        verify = sbx("replay", "--verify", state=state)
        assert verify.returncode == 0, verify.stdout + verify.stderr
    finally:
        stop(proc, signal.SIGTERM)
        await backends.purge("local", state)
        assert leftovers(state) == {}

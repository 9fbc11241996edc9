"""Chaos: agents keep working over MCP while every process of `sbx up` dies.

A real `sbx up` (embedded NATS, six supervised services, real sandboxes and proxies). Three
agents, each in its own session, append sequence-numbered lines with `shell`, write files
with the edit tool and start jobs with `shell_async`, without pause. Meanwhile every service
and then NATS is SIGKILLed once, in turn; `sbx up` restarts each, and a new session is
opened right after each kill. An agent whose call fails does what a careful agent does: it
looks whether the write landed before writing again.

Afterwards: every acknowledged line is in its file exactly once and in order (a command is
never run twice, nothing acknowledged is lost), every acknowledged edit is there, every job
started finished with its output, each session still has its shell state, `replay
--verify` passes. Then every session is deleted and the stack stopped: no sandbox process,
veth, nftables route, cgroup or mount of the stack is left.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests import support
from tests.e2e.agent import Agent
from tests.e2e.stacks import sbx
from tests.e2e.test_crash_everything import runtime_sandboxes, start
from tests.e2e.test_stop import events_of, leftovers, network_links

pytestmark = [
    pytest.mark.needs_root("the local runtime needs root"),
    pytest.mark.slow,
    pytest.mark.timeout(420),
]

AGENTS = 3
VICTIMS = ("gateway", "executor", "scheduler", "pool-manager", "reaper", "proxy-scaler", "nats-server")
CALL_LIMIT = 60.0
"""A single call that takes longer than this is a hang, not a slow call."""
RECOVERY_LIMIT = 90.0
"""How long a session may stay unusable after a kill before the test gives up."""


def children(parent: int) -> dict[str, int]:
    """The processes `sbx up` (``parent``) runs, by name: the services and nats-server."""
    found: dict[str, int] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) != parent:
            continue
        words = [w.decode(errors="replace") for w in cmdline]
        if "-m" in words and words[words.index("-m") + 1].startswith("services."):
            found[words[words.index("-m") + 1].removeprefix("services.").replace("_", "-")] = int(pid)
        elif any("nats" in w for w in words):
            found["nats-server"] = int(pid)
    return found


@dataclass
class Worker:
    """One agent's session and what the stack acknowledged to it."""

    agent: Agent
    lines: list[int] = field(default_factory=list)  # acknowledged (or found landed) appends
    edits: list[int] = field(default_factory=list)
    jobs: dict[int, str] = field(default_factory=dict)  # step -> job id
    failed_calls: int = 0
    duplicates: list[int] = field(default_factory=list)

    async def call(self, tool: str, **arguments) -> tuple[bool, str] | None:
        """The call's result, or None if it raised (the gateway away, a dropped stream)."""
        try:
            async with asyncio.timeout(CALL_LIMIT):
                result = await self.agent.call(tool, **arguments)
        except TimeoutError:
            raise AssertionError(f"{tool} hung for {CALL_LIMIT}s") from None
        except Exception:  # connection refused or reset while a process restarts
            result = None
        if not (result and result[0]):
            self.failed_calls += 1
        return result

    async def until_ok(self, tool: str, **arguments) -> str:
        """Repeat a call that is safe to repeat (a read) until it works."""
        deadline = time.monotonic() + RECOVERY_LIMIT
        while time.monotonic() < deadline:
            result = await self.call(tool, **arguments)
            if result and result[0]:
                return result[1]
            await asyncio.sleep(0.2)
        raise AssertionError(f"session {self.agent.session} unusable for {RECOVERY_LIMIT}s")

    async def append(self, step: int) -> None:
        while True:
            result = await self.call("shell", command=f"echo {step} >> /workspace/seq")
            if result and result[0] and "[exit code: 0]" in result[1]:
                self.lines.append(step)
                return
            # Unknown outcome: look before writing again, as a careful agent would.
            seen = await self.until_ok("shell", command=f"grep -cx {step} /workspace/seq || true")
            count = int(seen.split()[0])
            if count:
                self.lines.append(step)
                if count > 1:
                    self.duplicates.append(step)
                return
            await asyncio.sleep(0.2)

    async def edit(self, step: int) -> None:
        result = await self.call(
            "str_replace_based_edit_tool",
            command="create",
            path=f"/workspace/edits/{step}.txt",
            file_text=f"edit {step}\n",
        )
        if result and result[0]:
            self.edits.append(step)

    async def start_job(self, step: int) -> None:
        result = await self.call("shell_async", command=f"sleep 1; echo job-{step}-done")
        if result and result[0]:
            self.jobs[step] = next(word for word in result[1].split() if len(word) == 32)

    async def work(self, stop: asyncio.Event) -> None:
        await self.until_ok(
            "shell", command=f"mkdir -p /workspace/edits; cd /tmp; export AGENT={self.agent.session}"
        )
        step = 0
        while not stop.is_set():
            step += 1
            await self.append(step)
            if step % 3 == 0:
                await self.edit(step)
            if step % 4 == 0:
                await self.start_job(step)

    async def check(self) -> None:
        """Everything acknowledged is there, once."""
        text = await self.until_ok("shell", command='cat /workspace/seq; echo "state: $(pwd) $AGENT"')
        *lines, state = text.split("\n[exit code")[0].splitlines()
        assert [int(n) for n in lines] == sorted(set(self.lines)) == self.lines, (
            f"{self.agent.session}: the file has {lines}, acknowledged {self.lines}"
        )
        assert state == f"state: /tmp {self.agent.session}", state
        text = await self.until_ok("shell", command="cat /workspace/edits/*.txt")
        assert {f"edit {n}" for n in self.edits} <= set(text.splitlines()), text
        for step, job in self.jobs.items():
            text = await self.until_ok("shell_wait", job_id=job, timeout=30)
            assert "exited" in text and f"job-{step}-done" in text, (step, text)


async def test_agents_lose_nothing_while_every_process_of_the_stack_is_killed(tmp_path):
    state, log = tmp_path / "state", tmp_path / "stack.log"
    proc, url = start(state, support.free_port(), log)
    key = (state / "api-key").read_text().strip()
    workers = [Worker(Agent(url, key, f"chaos-{n}")) for n in range(AGENTS)]
    newcomers: list[Worker] = []  # one session opened right after each kill
    stop = asyncio.Event()
    links: set[int] = set()
    try:
        work = [asyncio.create_task(w.work(stop)) for w in workers]
        await support.eventually(lambda: all(len(w.lines) >= 3 for w in workers), timeout=120, interval=0.2)
        recovery: dict[str, float] = {}
        for victim in VICTIMS:
            before = {id(w): len(w.lines) for w in workers}
            pid = children(proc.pid)[victim]
            killed = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            newcomer = Worker(Agent(url, key, f"after-{victim}"))
            await newcomer.until_ok("shell", command="echo here")
            newcomers.append(newcomer)
            # Back: restarted, and every agent has had two more writes acknowledged.
            await support.eventually(
                lambda: (
                    children(proc.pid).get(victim, pid) != pid
                    and all(len(w.lines) >= before[id(w)] + 2 for w in workers)
                ),
                timeout=RECOVERY_LIMIT,
                interval=0.1,
            )
            recovery[victim] = time.monotonic() - killed
            assert any(t.done() for t in work) is False, [t.exception() for t in work if t.done()]
        stop.set()
        await asyncio.gather(*work)
        print(
            "\nchaos: back to work after each kill (s):",
            ", ".join(f"{v} {t:.1f}" for v, t in recovery.items()),
            f"\nchaos: {sum(len(w.lines) for w in workers)} lines, "
            f"{sum(len(w.edits) for w in workers)} edits, "
            f"{sum(len(w.jobs) for w in workers)} jobs acknowledged; "
            f"{sum(w.failed_calls for w in workers)} calls failed",
        )

        for w in workers:
            assert not w.duplicates, f"{w.agent.session}: ran twice: {w.duplicates}"
            await w.check()
        for w in newcomers:
            assert "here" in await w.until_ok("shell", command="echo here")
        verify = sbx("replay", "--verify", state=state)
        assert verify.returncode == 0, verify.stdout + verify.stderr

        # Delete every session: its sandbox and everything it held on the host go.
        links = network_links(state)
        owned = {
            e["session_id"]: e["sandbox_id"]
            for e in events_of(state)
            if e.get("session_id") and e.get("sandbox_id")
        }
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {key}"}) as rest:
            for w in workers + newcomers:
                response = await rest.delete(f"/v1/sessions/{w.agent.session}")
                assert response.status_code == 204, response.text
        theirs = {owned[w.agent.session] for w in workers + newcomers}
        await support.eventually(lambda: not theirs & runtime_sandboxes(state), timeout=60, interval=0.2)
        down = sbx("down", state=state)
        assert down.returncode == 0, down.stderr
        proc.wait(60)
        assert leftovers(state, links) == {}
    except BaseException:
        print(log.read_text()[-20000:])
        raise
    finally:
        stop.set()
        if proc.poll() is None:
            proc.kill()
        if state.exists():
            from shared.runtime import backends

            await backends.purge("local", state)
        assert leftovers(state, links) == {}

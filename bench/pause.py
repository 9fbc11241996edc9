"""Pause, resume and hibernate: how long they take, and what they add to the session's next call.

Three parts, figures only (nothing is asserted; needs root):

1. **Runtime** (the local backend alone, no services): ``pause`` and ``resume`` of one
   sandbox that holds a bash, a Python process with ``--mib`` MiB of memory touched and a
   background loop; each ``--rounds`` times, and the pause→resume round trip.
2. **Stack** (a real `sbx up`, one session, one MCP connection kept open as an agent
   keeps it): in the same run, alternately, a `shell true` call on a running sandbox and
   the first `shell true` call after a REST pause (the call resumes it:
   EnsureSession → pool-manager Start → thaw → ``sandbox.resumed``); their p50s side by
   side, the added latency and the ratio. Also REST pause and REST resume round trips.
3. **Hibernate** (same stack): the reaper's ``session.hibernate`` (stop, files kept, the
   session active), then the first `shell true`, which starts the sandbox again, against a
   normal call in the same run.

    .venv/bin/python bench/pause.py [--rounds 100] [--mib 64]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common
from bench.agents import Agent, start_stack, stop_stack
from sbx import observe, stack
from shared.contract import commands, ids
from shared.infrastructure import rpc
from shared.runtime import api
from shared.runtime.local import runtime as local
from shared.runtime.local import sandboxdirs

HOLDER = (
    "import time; b = bytearray({mib} * 1024 * 1024); b[::4096] = b'x' * len(b[::4096]); time.sleep(86400)"
)


async def runtime_part(rounds: int, mib: int) -> None:
    with tempfile.TemporaryDirectory(prefix="sbx-pause-bench-") as work:
        rt = local.LocalRuntime(Path(work) / "state")
        if not rt.pausable:
            print("runtime: this machine has no cgroup freezer; nothing to measure")
            return
        await rt.create(api.SandboxSpec(sandbox_id="bench-pause"))
        await rt.start("bench-pause")
        try:
            holder = HOLDER.format(mib=mib)
            await rt.run(
                "bench-pause",
                ["sh", "-c", f"(python3 -c '{holder}' &) ; (while :; do sleep 0.01; done &) >/dev/null 2>&1"],
            )
            processes = len(rt.cgroups.pids(sandboxdirs.cgroup_name("bench-pause")))
            pauses: list[float] = []
            resumes: list[float] = []
            trips: list[float] = []
            started = time.perf_counter()
            for _ in range(rounds):
                t0 = time.perf_counter()
                await rt.pause("bench-pause")
                t1 = time.perf_counter()
                await rt.resume("bench-pause")
                t2 = time.perf_counter()
                pauses.append(t1 - t0)
                resumes.append(t2 - t1)
                trips.append(t2 - t0)
            seconds = time.perf_counter() - started
            print(f"runtime (local, cgroup freezer; {processes} processes, {mib} MiB held)")
            print(common.row("  pause", pauses, seconds))
            print(common.row("  resume", resumes, seconds))
            print(common.row("  pause -> resume", trips, seconds))
        finally:
            await rt.delete("bench-pause")


async def stack_part(rounds: int) -> None:
    work = Path(tempfile.mkdtemp(prefix="sbx-pause-bench-"))
    state = work / "state"
    # The reaper must not pause anything on its own while this measures.
    proc, url = start_stack(state, 1, SBX_PAUSE_TIMEOUT="0")
    try:
        key = (state / "api-key").read_text().strip()
        rest = httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60)
        async with Agent(f"{url}/mcp", key, "pause-bench") as agent:
            await agent.shell("true")  # the session and its sandbox exist from here on
            for _ in range(10):  # warm up both paths
                await agent.shell("true")
                assert (await rest.post("/v1/sessions/pause-bench/pause")).status_code == 200
                await agent.shell("true")
            normal: list[float] = []
            after: list[float] = []
            pauses: list[float] = []
            resumes: list[float] = []
            started = time.perf_counter()
            for n in range(rounds):
                t0 = time.perf_counter()
                await agent.shell("true")
                normal.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                answer = await rest.post("/v1/sessions/pause-bench/pause")
                pauses.append(time.perf_counter() - t0)
                assert answer.json()["status"] == "paused", answer.text
                if n % 2:  # every other pause is undone by REST, the rest by the next call
                    t0 = time.perf_counter()
                    await rest.post("/v1/sessions/pause-bench/resume")
                    resumes.append(time.perf_counter() - t0)
                    await rest.post("/v1/sessions/pause-bench/pause")
                t0 = time.perf_counter()
                await agent.shell("true")  # resumes it
                after.append(time.perf_counter() - t0)
            seconds = time.perf_counter() - started
        await rest.aclose()
        p50_normal, p50_after = statistics.median(normal) * 1000, statistics.median(after) * 1000
        print("\nstack (sbx up, one MCP connection kept open, alternating in the same run)")
        print(common.row("  shell `true`, running sandbox", normal, seconds))
        print(common.row("  shell `true`, first after a pause", after, seconds))
        print(
            f"  added by the pause to the next call: p50 {p50_after - p50_normal:+.2f} ms "
            f"(ratio {p50_after / p50_normal:.2f}x)"
        )
        print(common.row("  REST pause (freeze + record)", pauses, seconds))
        print(common.row("  REST resume (thaw + record)", resumes, seconds))
        await hibernate_part(state, url, key, max(10, rounds // 5))
    finally:
        stop_stack(proc, state)


async def hibernate_part(state: Path, url: str, key: str, rounds: int) -> None:
    """Hibernation (the sandbox stopped, files kept, the session active) by the command the
    reaper sends, then the first call, which starts the sandbox again: against a normal
    call, alternating in the same run."""
    nc, topology = await observe.connect(stack.bus_settings(state, os.environ))
    scheduler = rpc.SessionClient(nc, topology)
    normal: list[float] = []
    after: list[float] = []
    hibernations: list[float] = []
    try:
        async with Agent(f"{url}/mcp", key, "hibernate-bench") as agent:
            await agent.shell("true")
            started = time.perf_counter()
            for _ in range(rounds):
                t0 = time.perf_counter()
                await agent.shell("true")
                normal.append(time.perf_counter() - t0)
                command = commands.HibernateSession(command_id=ids.new_id(), session_id="hibernate-bench")
                t0 = time.perf_counter()
                reply = await scheduler.call(command)
                hibernations.append(time.perf_counter() - t0)
                assert reply.sandbox is not None and reply.sandbox.status == "stopped", reply
                t0 = time.perf_counter()
                await agent.shell("true")  # starts it again
                after.append(time.perf_counter() - t0)
            seconds = time.perf_counter() - started
    finally:
        await nc.close()
    print("\nhibernate (stop, files kept, the session active), alternating in the same run")
    print(common.row("  shell `true`, running sandbox", normal, seconds))
    print(common.row("  shell `true`, first after hibernation", after, seconds))
    print(common.row("  hibernate (stop + record)", hibernations, seconds))


async def main(rounds: int, mib: int) -> None:
    await runtime_part(rounds, mib)
    await stack_part(rounds)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--mib", type=int, default=64)
    args = parser.parse_args()
    asyncio.run(main(args.rounds, args.mib))

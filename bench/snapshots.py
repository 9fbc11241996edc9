"""Snapshots and forks, in one `sbx up` run beside a cold start, a pause and a hibernation.

Figures only (nothing is asserted; needs root). One stack, no warm pool (so that a new
session's first call is a cold start, the baseline a fork is measured against):

1. **Cold start**: ``--cold`` new sessions, each timed from its first REST run request
   to its answer (the sandbox made and started on the way).
2. **Pause → resume**: a REST pause, then the session's next run (which thaws it),
   against a run just after the same pause request to another session (what the resume
   adds), and against a run right after a run, alternating.
3. **Hibernate → resume**: the reaper's ``session.hibernate`` (stopped, files kept), then
   the next run (which starts it again), against a normal run.
4. **Snapshot time against size**: the origin's workspace holds ``--sizes`` MiB of
   random data in turn; each snapshot timed (REST round trip) with how long its processes
   were frozen and what it added on disk.
5. **Forks to first command**: ``POST /v1/snapshots/{id}/forks`` with count 10 and 100,
   then every fork's first command at once (``--first``: an agent's MCP connection and
   ``shell`` call, and/or a REST ``run``, each reading a file of the snapshot); the time
   from the fork request until the last first command answered, per fork, and the CPU
   each service of the stack spent per fork (its deletion included; the bench's own
   MCP clients are not in it).
6. **Forks of a snapshot kept warm**: the same, after ``PUT /v1/snapshots/{id}/warm``
   with the fork count and waiting until that many idle sandboxes are ready (how long
   that took is printed): the forks claim them; the pool refills meanwhile.

    .venv/bin/python bench/snapshots.py [--cold 10] [--rounds 30] [--sizes 1,16,128] [--forks 10,100]
        [--first shell,run]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common
from bench.agents import Agent, start_stack, stop_stack
from sbx import observe, stack
from shared.contract import commands, ids
from shared.infrastructure import rpc


async def run(rest: httpx.AsyncClient, session: str, command: str) -> str:
    """One command through the host API's run; its output (raises unless it exited 0)."""
    answer = await rest.post(f"/v1/sessions/{session}/run", json={"command": command, "cwd": "/workspace"})
    lines = [json.loads(line) for line in answer.text.splitlines() if line.strip()]
    if answer.status_code != 200 or lines[-1].get("exit_code") != 0:
        raise RuntimeError(f"{session}: {answer.status_code} {answer.text[:500]}")
    return "".join(str(line.get("data", "")) for line in lines)


def summary(label: str, samples: list[float]) -> str:
    return (
        f"{label:44} n={len(samples):4}  p50 {statistics.median(samples) * 1000:8.1f} ms  "
        f"max {max(samples) * 1000:8.1f} ms"
    )


async def cold(rest: httpx.AsyncClient, n: int) -> list[float]:
    took = []
    for i in range(n):
        t0 = time.perf_counter()
        await run(rest, f"cold-{i}", "true")
        took.append(time.perf_counter() - t0)
        await rest.delete(f"/v1/sessions/cold-{i}")
    return took


async def pause_resume(rest: httpx.AsyncClient, rounds: int) -> tuple[list[float], list[float], list[float]]:
    """(hot runs, runs just after another session was paused, first runs after a pause).
    The middle ones are the fair baseline: the same pause request came just before, to
    another session, so only the resume differs (a run right after a run is faster on a
    small machine whatever came before)."""
    await run(rest, "pauser", "true")
    await run(rest, "bystander", "true")
    hot, beside, after = [], [], []
    for _ in range(rounds):
        assert (await rest.post("/v1/sessions/bystander/pause")).json()["status"] == "paused"
        t0 = time.perf_counter()
        await run(rest, "pauser", "true")
        beside.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        await run(rest, "pauser", "true")
        hot.append(time.perf_counter() - t0)
        assert (await rest.post("/v1/sessions/pauser/pause")).json()["status"] == "paused"
        t0 = time.perf_counter()
        await run(rest, "pauser", "true")
        after.append(time.perf_counter() - t0)
        await run(rest, "bystander", "true")  # (resumed for the next round)
    return hot, beside, after


async def hibernate_resume(
    rest: httpx.AsyncClient, state: Path, rounds: int
) -> tuple[list[float], list[float]]:
    nc, topology = await observe.connect(stack.bus_settings(state, os.environ))
    scheduler = rpc.SessionClient(nc, topology)
    await run(rest, "sleeper", "echo kept > /workspace/k")
    normal, after = [], []
    try:
        for _ in range(rounds):
            t0 = time.perf_counter()
            await run(rest, "sleeper", "true")
            normal.append(time.perf_counter() - t0)
            reply = await scheduler.call(
                commands.HibernateSession(command_id=ids.new_id(), session_id="sleeper")
            )
            assert reply.sandbox is not None and reply.sandbox.status == "stopped", reply
            t0 = time.perf_counter()
            assert "kept" in await run(rest, "sleeper", "cat /workspace/k")
            after.append(time.perf_counter() - t0)
    finally:
        await nc.close()
    return normal, after


async def snapshots_by_size(rest: httpx.AsyncClient, sizes: list[int]) -> str:
    """The origin's snapshots at each size; returns the last snapshot's id (forks start there)."""
    await run(rest, "origin", "echo v1 > /workspace/f")
    snapshot_id = ""
    for mib in sizes:
        await run(rest, "origin", f"head -c {mib}M /dev/urandom > /workspace/blob")
        t0 = time.perf_counter()
        answer = await rest.post("/v1/sessions/origin/snapshots")
        took = time.perf_counter() - t0
        body = answer.json()
        assert answer.status_code == 201, answer.text
        snapshot_id = body["snapshot_id"]
        print(
            f"  {mib:5} MiB workspace: snapshot {took * 1000:8.1f} ms (REST round trip), processes frozen "
            f"{body['frozen_ms']:7.1f} ms, {body['size'] / 1024**2:7.1f} MiB added, {body['files']} entries"
        )
    return snapshot_id


First = Callable[[str], Awaitable[None]]
"""A fork's first command, given its session id."""


def first_run(rest: httpx.AsyncClient) -> First:
    """The host API's ``run`` (a streamed process the executor starts in the sandbox)."""

    async def first(session: str) -> None:
        assert (await run(rest, session, "cat /workspace/f")).startswith("v1")

    return first


def first_shell(url: str, key: str) -> First:
    """An agent's first MCP ``shell`` call: its connection, ``initialize``, ``tools/list``
    and the call (the session's bash, through the executor's shell helper)."""

    async def first(session: str) -> None:
        async with Agent(f"{url}/mcp", key, session) as agent:
            await agent.shell("grep -q v1 /workspace/f")

    return first


async def forks(
    rest: httpx.AsyncClient, snapshot_id: str, count: int, first_command: First
) -> tuple[float, float, list[float]]:
    """(fork request seconds, fork request → last first command, per fork fork→first command)."""
    t0 = time.perf_counter()
    answer = await rest.post(f"/v1/snapshots/{snapshot_id}/forks", json={"count": count}, timeout=600)
    forked = time.perf_counter() - t0
    body = answer.json()
    assert answer.status_code == 201, answer.text[:1000]
    if body["failed"]:
        reasons = sorted({f"{f['error']}: {f['message']}" for f in body["failed"]})
        print(f"  {len(body['failed'])} of {count} forks not made: {reasons[:3]}")
    done: list[float] = []

    async def first(session: str) -> None:
        await first_command(session)
        done.append(time.perf_counter() - t0)

    await asyncio.gather(*(first(s["session_id"]) for s in body["sessions"]))
    whole = time.perf_counter() - t0
    for s in body["sessions"]:
        await rest.delete(f"/v1/sessions/{s['session_id']}")
    return forked, whole, done


async def kept_warm(rest: httpx.AsyncClient, snapshot_id: str, count: int) -> float:
    """Keep ``count`` sandboxes of the snapshot warm; seconds until exactly that many are
    ready (more are removed: a lower count)."""
    t0 = time.perf_counter()
    answer = await rest.put(f"/v1/snapshots/{snapshot_id}/warm", json={"count": count})
    assert answer.status_code == 200, answer.text[:1000]
    while (await rest.get(f"/v1/snapshots/{snapshot_id}")).json()["warm_ready"] != count:
        await asyncio.sleep(0.05)
    took = time.perf_counter() - t0
    await asyncio.sleep(1.0)  # each is offered once its shell is started, a moment after it runs
    return took


async def settle(
    root: int, quiet: float = 0.1, every: float = 0.5, windows: int = 4, most: float = 120.0
) -> None:
    """Wait until the stack under ``root`` used less than ``quiet`` CPU seconds in each of
    ``windows`` windows of ``every`` seconds in a row (what the last section left, say
    deletions or a held refill, is done), at most ``most`` seconds."""
    until = time.monotonic() + most
    before, calm = common.process_tree_cpu(root), 0
    while time.monotonic() < until and calm < windows:
        await asyncio.sleep(every)
        now = common.process_tree_cpu(root)
        calm = calm + 1 if sum(common.cpu_delta(before, now).values()) < quiet else 0
        before = now


def print_forks(count: int, forked: float, whole: float, done: list[float], used: dict[str, float]) -> None:
    print(
        f"  {count:4} forks: fork request {forked * 1000:8.1f} ms; all {count} first commands "
        f"answered {whole * 1000:8.1f} ms after it ({count / whole:.1f} forks/s)"
    )
    print(summary("    per fork, request -> its first command", done))
    shares = ", ".join(f"{k} {v * 1000 / count:.0f}" for k, v in sorted(used.items(), key=lambda kv: -kv[1]))
    total = sum(used.values()) * 1000 / count
    print(f"    CPU per fork (ms; its deletion and the pool's refill included): {total:.0f} ({shares})")


async def main(cold_n: int, rounds: int, sizes: list[int], fork_counts: list[int], firsts: list[str]) -> None:
    if max(fork_counts) > 450:
        raise SystemExit("at most 450 forks: the stack runs with SBX_MAX_RUNNING=500")
    work = Path(tempfile.mkdtemp(prefix="sbx-snapshot-bench-"))
    state = work / "state"
    proc, url = start_stack(
        state,
        0,
        SBX_PAUSE_TIMEOUT="0",
        SBX_SNAPSHOTS_PER_SESSION="0",
    )
    try:
        key = (state / "api-key").read_text().strip()
        async with httpx.AsyncClient(
            base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=120
        ) as rest:
            await cold(rest, 2)  # warm up the services' paths
            print(f"one `sbx up`, no warm pool, {os.cpu_count()} cores\n")
            print(summary("cold start: new session's first run", await cold(rest, cold_n)))
            hot, beside, after = await pause_resume(rest, rounds)
            print(summary("run on a running sandbox, right after a run", hot))
            print(summary("run just after another session's pause", beside))
            print(summary("first run after a pause (resumes it)", after))
            added = (statistics.median(after) - statistics.median(beside)) * 1000
            vs_hot = (statistics.median(after) - statistics.median(hot)) * 1000
            print(
                f"  resume adds {added:+.1f} ms to the call (p50; {vs_hot:+.1f} ms against a run after a run)"
            )
            normal, after = await hibernate_resume(rest, state, max(5, rounds // 3))
            print(summary("run on a running sandbox", normal))
            print(summary("first run after hibernation (starts it)", after))
            print("\nsnapshot time against size")
            snapshot_id = await snapshots_by_size(rest, sizes)
            kinds = {
                "shell": ("an MCP shell call", first_shell(url, key)),
                "run": ("a REST run", first_run(rest)),
            }
            for kind in firsts:
                label, first = kinds[kind]
                for warm in (False, True):
                    how = "kept warm (PUT .../warm with the count)" if warm else "not kept warm"
                    print(f"\nforks of the last snapshot, {how}; first command: {label}")
                    for count in fork_counts:
                        if warm:
                            filled = await kept_warm(rest, snapshot_id, count)
                            print(f"  {count:4} sandboxes of the snapshot ready {filled:.2f} s after PUT")
                        await settle(proc.pid)
                        cpu_before, own_before = common.process_tree_cpu(proc.pid), time.process_time()
                        forked, whole, done = await forks(rest, snapshot_id, count, first)
                        used = common.cpu_delta(cpu_before, common.process_tree_cpu(proc.pid))
                        print_forks(count, forked, whole, done, used)
                        own = (time.process_time() - own_before) * 1000 / count
                        print(f"    CPU per fork of this benchmark's own clients (ms, not above): {own:.0f}")
                    if warm:  # none kept for the next section (which then starts as it would alone)
                        await kept_warm(rest, snapshot_id, 0)
    finally:
        stop_stack(proc, state)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cold", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--sizes", default="1,16,128")
    parser.add_argument("--forks", default="10,100")
    parser.add_argument(
        "--first", default="shell,run", help="a fork's first command: shell (MCP), run (REST)"
    )
    args = parser.parse_args()
    asyncio.run(
        main(
            args.cold,
            args.rounds,
            [int(x) for x in args.sizes.split(",")],
            [int(x) for x in args.forks.split(",")],
            args.first.split(","),
        )
    )

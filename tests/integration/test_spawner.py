"""The spawner that starts every command of the local runtime (``spawnd.py``), attacked
and broken with real sandboxes: a sandbox cannot see or reach it, a request with a bad
entry is refused, it dies with its executor and takes what it started along, and one
that crashed is replaced."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shared.infrastructure import processes
from shared.runtime import api
from shared.runtime.local import bwrap, enter, sandboxdirs, seccomp, spawner
from tests.integration import test_local_isolation as isolation

rt, sandbox, sh = isolation.rt, isolation.sandbox, isolation.sh  # the runtime fixture and helpers
pytestmark = [
    pytest.mark.needs_root("the local runtime needs root"),
    pytest.mark.slow,
]
ROOT = Path(__file__).resolve().parents[2]


def sockets_of(pid: int) -> set[str]:
    found = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        target = os.readlink(fd)
        if target.startswith("socket:"):
            found.add(target.removeprefix("socket:[").removesuffix("]"))
    return found


async def gone(pid: int, within: float = 10.0) -> bool:
    """Whether ``pid`` ends (or is a zombie) before ``within`` seconds pass."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state in ("Z", "X"):
            return True
        await asyncio.sleep(0.02)
    return False


async def running_inside(rt, sid: str, pattern: str) -> list[str]:
    _, out, _ = await sh(rt, sid, f"ps -e -o args= | grep -e '{pattern}' | grep -v grep || true")
    return out.split("\n") if out.strip() else []


@pytest.mark.parametrize("root", [True, False], ids=["root", "uid1000"])
async def test_a_sandbox_cannot_see_or_reach_the_spawner(rt, root):
    sid = await sandbox(rt, run_as_root=root)
    code, out, _ = await sh(rt, sid, "ls /proc/$$/fd; echo ppid=$PPID")
    assert code == 0
    assert out.split() == ["0", "1", "2", "ppid=0"], "only its pipes; its parent is outside the namespace"
    spawner = rt.spawner.pid
    assert spawner is not None
    its_sockets = sockets_of(spawner)
    assert its_sockets, "the spawner holds its socketpair"
    script = (
        "cat /proc/net/unix; for p in /proc/[0-9]*; do cat $p/cmdline | tr '\\0' ' '; echo; "
        "for f in $p/fd/*; do readlink $f; done; done 2>/dev/null; true"
    )
    code, out, _ = await sh(rt, sid, script)
    assert code == 0 and out.startswith("Num") and "/.sbx-hold" in out, "it read what it can see"
    assert "spawnd" not in out, "no process of the spawner's is in the sandbox's pid namespace"
    for inode in its_sockets:
        assert inode not in out, "its socket is neither held nor listed inside"
    # Many commands later the spawner holds what it held: nothing leaks to or from it.
    held = len(list(Path(f"/proc/{spawner}/fd").iterdir()))
    for _ in range(10):
        await sh(rt, sid, "true")
    assert len(list(Path(f"/proc/{spawner}/fd").iterdir())) == held


async def test_a_request_with_a_bad_entry_is_refused(rt):
    sid = await sandbox(rt)
    info = rt.dirs.running(rt.dirs.dir(sid))
    procs = [d / "cgroup.procs" for d in rt.cgroups.dirs(sandboxdirs.cgroup_name(sid))]
    good = dict(
        pid=info.pid,
        starttime=info.starttime,
        uid=0,
        keep_caps=frozenset(),
        nofile=1024,
        bpf=seccomp.compile_bpf(),
    )
    env = {"PATH": bwrap.PATH}

    async def attempt(entry: dict, files: list[Path] = procs) -> str:
        with pytest.raises(OSError) as refused:
            await rt.spawner.spawn(["/bin/sh", "-c", "touch /tmp/entered"], env, enter.Entry(**entry), files)
        return str(refused.value)

    # Host processes (with their true start times): this test's, its parent's and (once it
    # runs) the spawner's own.
    for host in (os.getpid(), os.getppid()):
        refused = await attempt({**good, "pid": host, "starttime": processes.start_time(host)})
        assert "not a sandbox's init" in refused
    spawner = rt.spawner.pid
    refused = await attempt({**good, "pid": spawner, "starttime": processes.start_time(spawner)})
    assert "not a sandbox's init" in refused
    # The init's pid with another start time: a pid reused since the sandbox was looked up.
    assert "has ended" in await attempt({**good, "starttime": info.starttime + 1})
    assert "pid must be" in await attempt({**good, "pid": 1})  # the host's init
    assert "seccomp filter" in await attempt({**good, "bpf": b""})
    assert "seccomp filter" in await attempt({**good, "bpf": b"\0" * 12})
    assert "caps must be a subset" in await attempt({**good, "keep_caps": frozenset({21})})  # CAP_SYS_ADMIN
    assert "uid must be" in await attempt({**good, "uid": -1})
    assert "nofile must be" in await attempt({**good, "nofile": 0})
    assert "pid must be" in await attempt({**good, "pid": 1 << 30})
    outside = [Path("/tmp/cgroup.procs")]
    assert "not a cgroup.procs under" in await attempt(good, outside)
    sneaky = [procs[0].parent / ".." / ".." / "cgroup.procs"]
    assert "not a cgroup.procs under" in await attempt(good, sneaky)
    assert "not a cgroup.procs under" in await attempt(good, [procs[0].parent / "tasks"])
    with pytest.raises(OSError, match="argv must hold strings without NUL"):
        await rt.spawner.spawn(["/bin/sh", "-c", "touch /tmp/entered\0"], env, enter.Entry(**good), procs)
    with pytest.raises(OSError, match="env must hold strings without NUL"):
        await rt.spawner.spawn(["/bin/true"], {"A": "b\0c"}, enter.Entry(**good), procs)
    assert rt.spawner.started == 1, "a refused request does not end the spawner"
    code, out, _ = await sh(rt, sid, "ls /tmp/entered 2>&1 || echo nothing")
    assert out.strip().endswith("nothing"), "nothing that was refused ran"
    process = await rt.spawner.spawn(["/bin/true"], env, enter.Entry(**good), procs)
    assert await process.wait() == 0


async def test_a_crashed_spawner_is_replaced_and_what_it_started_ends(rt):
    sid = await sandbox(rt)
    long = await rt.exec(sid, ["sleep", "300"])
    first = rt.spawner.pid
    assert await running_inside(rt, sid, "^sleep 300")
    os.kill(first, signal.SIGKILL)
    result = await long.wait()
    assert result.exit_code == 128 + signal.SIGKILL, "its command ends as killed"
    code, out, _ = await sh(rt, sid, "echo back")
    assert (code, out) == (0, "back\n"), "the next command starts a new spawner"
    assert rt.spawner.started == 2 and rt.spawner.pid not in (None, first)
    deadline = time.monotonic() + 10
    while await running_inside(rt, sid, "^sleep 300") and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert not await running_inside(rt, sid, "^sleep 300"), "the old spawner's command died with it"


EXECUTOR = """
import asyncio, sys
from pathlib import Path
from shared.runtime.local import runtime as local

async def main():
    rt = local.LocalRuntime(Path(sys.argv[1]))
    await rt.exec(sys.argv[2], ["sleep", "301"])
    print(rt.spawner.pid, flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""


async def test_the_spawner_and_its_commands_die_with_the_executor(rt):
    sid = await sandbox(rt)
    executor = subprocess.Popen(
        [sys.executable, "-c", EXECUTOR, str(rt.state_dir), sid],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert executor.stdout is not None
        spawner = int(await asyncio.to_thread(executor.stdout.readline))
        assert await running_inside(rt, sid, "^sleep 301")
    finally:
        executor.kill()
        executor.wait()
    assert await gone(spawner), "the spawner ended with its executor"
    deadline = time.monotonic() + 10
    while await running_inside(rt, sid, "^sleep 301") and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert not await running_inside(rt, sid, "^sleep 301"), "and so did the command it started"


async def test_a_command_that_ends_at_once_and_a_caller_that_goes_away(rt):
    """Exit statuses are not lost to a race with the start's answer, and a start whose
    caller stopped waiting leaves nothing running."""
    sid = await sandbox(rt)
    results = await asyncio.gather(*(rt.run(sid, ["sh", "-c", f"exit {n}"]) for n in range(20)))
    assert [r.exit_code for r, _, _ in results] == list(range(20))
    short = await rt.exec(sid, ["sleep", "0.3"])  # a waiter that gives up, then one that does not
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(short.wait(), 0.01)
    assert (await short.wait()).exit_code == 0
    starting = asyncio.create_task(rt.exec(sid, ["sleep", "302"]))
    while not rt.spawner._link.starting:  # until its request is on its way
        await asyncio.sleep(0)
    await asyncio.sleep(0)
    starting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await starting
    deadline = time.monotonic() + 10
    while await running_inside(rt, sid, "^sleep 302") and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert not await running_inside(rt, sid, "^sleep 302")
    assert isinstance(await rt.get(sid), api.SandboxInfo)


def children_of(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def links_of(pid: int) -> list[str]:
    found = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(FileNotFoundError):
            found.append(os.readlink(fd))
    return found


async def held_start(rt, tmp_path: Path, deadline: float):
    """A spawner of the test's own whose cgroup root is ``tmp_path``, and a start held
    before its exec: its cgroup file is a FIFO nobody reads, so the child blocks in its
    open, after it opened the sandbox's namespaces (as a sandbox that stopped it there
    would hold it). Returns the spawner, the start's task, its child's pid and what to
    start a command with."""
    sid = await sandbox(rt)
    info = rt.dirs.running(rt.dirs.dir(sid))
    entry = enter.Entry(
        pid=info.pid, starttime=info.starttime, uid=0, keep_caps=frozenset(), nofile=1024,
        bpf=seccomp.compile_bpf(),
    )  # fmt: skip
    held, plain = tmp_path / "held" / "cgroup.procs", tmp_path / "plain" / "cgroup.procs"
    held.parent.mkdir()
    plain.parent.mkdir()
    os.mkfifo(held)
    plain.touch()
    ours = spawner.Spawner(tmp_path, frozenset(), start_deadline=deadline)
    env = {"PATH": bwrap.PATH}
    start = asyncio.create_task(ours.spawn(["/bin/echo", "ran"], env, entry, [held]))
    child = None
    until = time.monotonic() + 10
    while time.monotonic() < until and child is None:
        await asyncio.sleep(0.02)
        for pid in children_of(ours.pid) if ours.pid else []:
            if sum(link.startswith("mnt:[") for link in links_of(pid)) == 1:
                child = pid
    assert child is not None, "the start reached the sandbox's namespaces and blocked"

    async def run(argv: list[str]) -> int:
        return await (await ours.spawn(argv, env, entry, [plain])).wait()

    return ours, start, child, run


async def test_a_start_held_before_its_exec_holds_its_own_pipes_only_and_is_killed(rt, tmp_path):
    """A sandbox can stop a command between its entry and its exec (it is in the sandbox's
    pid namespace by then). What such a child holds is its own stdio and report pipe: not
    the spawner's socket, not other commands' pipes; the spawner goes on serving, and kills
    and refuses the start at its deadline."""
    ours, start, child, run = await held_start(rt, tmp_path, deadline=3.0)
    try:
        spawner_pid = ours.pid
        assert spawner_pid is not None
        its_sockets = sockets_of(spawner_pid)
        links = links_of(child)
        assert not [link for link in links if link.startswith("socket:")], links
        assert not its_sockets & sockets_of(child)
        assert sum(link.startswith("pipe:") for link in links) <= 4, "its stdin, stdout, stderr and report"
        assert await run(["/bin/true"]) == 0, "other commands start while it is held"
        with pytest.raises(OSError) as late:
            await start
        assert late.value.errno == errno.ETIMEDOUT and "did not start within 3 s" in str(late.value)
        assert await gone(child), "it was killed"
        assert await run(["/bin/true"]) == 0 and ours.started == 1, "and the spawner is the same"
        cmdline = Path(f"/proc/{spawner_pid}/cmdline").read_bytes()
        assert str(ROOT).encode() not in cmdline and str(tmp_path).encode() not in cmdline, (
            "what a command shows between fork and exec names no host path"
        )
    finally:
        ours.close()


async def test_a_caller_that_stops_waiting_for_a_held_start_has_it_killed(rt, tmp_path):
    ours, start, child, _ = await held_start(rt, tmp_path, deadline=120.0)
    try:
        start.cancel()
        with pytest.raises(asyncio.CancelledError):
            await start
        assert await gone(child), "killed long before its deadline"
    finally:
        ours.close()


async def test_a_spawner_out_of_descriptors_refuses_that_command_and_goes_on(rt, tmp_path):
    """Descriptors that do not fit (MSG_CTRUNC) fail the request they came with, not the
    spawner and every sandbox's commands with it."""
    ours, start, child, run = await held_start(rt, tmp_path, deadline=120.0)
    try:
        spawner_pid = ours.pid
        assert spawner_pid is not None
        limits = resource.prlimit(spawner_pid, resource.RLIMIT_NOFILE)
        held = {int(fd.name) for fd in Path(f"/proc/{spawner_pid}/fd").iterdir()}
        free = [fd for fd in range(max(held) + 3) if fd not in held]
        # One free descriptor below the limit: the first of a command's three fits, not the rest.
        resource.prlimit(spawner_pid, resource.RLIMIT_NOFILE, (free[1], limits[1]))
        with pytest.raises(OSError) as refused:
            await run(["/bin/true"])
        assert refused.value.errno == errno.EMFILE and "out of descriptors" in str(refused.value)
        resource.prlimit(spawner_pid, resource.RLIMIT_NOFILE, limits)
        assert await run(["/bin/true"]) == 0 and ours.started == 1 and ours.pid == spawner_pid
    finally:
        start.cancel()
        ours.close()

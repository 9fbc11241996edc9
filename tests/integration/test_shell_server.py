"""The executor's persistent shell servers in real sandboxes: the fast path of `shell` must
behave exactly like the one-off path, and nothing a command does may confuse it for
later calls."""

from __future__ import annotations

import asyncio

import pytest

from services.executor import bashsession, output, shells
from shared.runtime import api
from shared.runtime.local import runtime as local
from tests import support
from tests.integration.test_local_images import minimal_rootfs

pytestmark = pytest.mark.needs_root("the local runtime needs root")


@pytest.fixture
async def rt(tmp_path):
    runtime = local.LocalRuntime(tmp_path / "state")
    yield runtime
    for info in await runtime.list():
        await runtime.delete(info.sandbox_id)


@pytest.fixture
async def sandbox(rt):
    await rt.create(api.SandboxSpec(sandbox_id="sh-1"))
    await rt.start("sh-1")
    return "sh-1"


@pytest.fixture
async def servers(rt):
    pool = shells.ShellServers(rt)
    yield pool
    await pool.close()


async def fast(servers: shells.ShellServers, sandbox: str, command: str, timeout: float = 30):
    server = await servers.get(sandbox)
    assert server is not None
    capture = output.Capture(4096)
    result = await server.run(command, capture, timeout)
    return result, capture.render()


async def helpers(rt, sandbox: str) -> int:
    _, out, _ = await rt.run(sandbox, ["/bin/sh", "-c", "pgrep -fc 'sbx-shell-serve[r]' || true"])
    return int(out.strip())


async def test_the_state_lives_in_the_sandbox_not_in_a_helper(rt, sandbox, servers):
    """All of bash's state carries over, through another executor's helper and after
    every helper is gone (the session's bash belongs to the sandbox)."""
    first = "mkdir -p /workspace/a && cd /workspace/a && x=1; f() { echo f$x; }"
    result, text = await fast(servers, sandbox, first)
    assert result.exit_code == 0 and text == ""
    other = shells.ShellServers(rt)
    try:
        _, text = await fast(other, sandbox, "pwd; f; cd /tmp; y=2")
        assert text == "/workspace/a\nf1\n"
    finally:
        await other.close()
    await servers.close()
    again = shells.ShellServers(rt)
    try:
        result, text = await fast(again, sandbox, 'pwd; echo "$x$y"; exit 4')
        assert (result.exit_code, text) == (4, "/tmp\n12\n")
        _, text = await fast(again, sandbox, 'echo "$x$y"')
        assert text == "12\n", "the call that ended the shell left the state from before it"
    finally:
        await again.close()


async def test_output_is_exact_and_large_output_is_bounded(rt, sandbox, servers):
    _, text = await fast(servers, sandbox, "printf 'no newline'; printf ' err' >&2")
    assert text == "no newline err"
    result, text = await fast(servers, sandbox, "seq 1 200000")
    assert "output truncated" in text and text.rstrip().endswith("200000") and result.exit_code == 0
    _, text = await fast(servers, sandbox, "echo after")
    assert text == "after\n"


async def test_background_processes_neither_hold_the_call_nor_leak_into_later_ones(rt, sandbox, servers):
    result, text = await fast(servers, sandbox, "(sleep 0.3; echo late) & echo now", timeout=10)
    assert text == "now\n" and not result.timed_out
    await asyncio.sleep(0.6)
    _, text = await fast(servers, sandbox, "echo next")
    assert text == "next\n"
    # A writer still running across later calls: none of its output appears in them.
    await fast(servers, sandbox, "(for i in $(seq 40); do echo tick$i; sleep 0.05; done) & echo started")
    for _ in range(5):
        _, text = await fast(servers, sandbox, "sleep 0.2; echo mine")
        assert text == "mine\n", text


async def test_output_goes_to_the_sandbox_not_the_host_disk(rt, sandbox, servers, tmp_path):
    """Command output is staged in the sandbox's own output tmpfs (/.sbx-out), never
    under the host's state directory nor in /tmp, and nothing is left there after the call."""
    _, text = await fast(servers, sandbox, "head -c 300000 /dev/zero | tr '\\0' x; echo")
    assert "output truncated" in text
    control = tmp_path / "state" / "sandboxes"
    big = [p for p in control.rglob("*") if p.is_file() and p.stat().st_size > 100_000]
    assert big == []
    _, text = await fast(servers, sandbox, "ls -a /.sbx-out | grep -c sbx-out; ls -a /tmp | grep -c sbx-out")
    assert text == "1\n0\n", "only this very call's own file, and none in /tmp"


async def test_a_busy_server_leaves_the_call_to_a_helper_of_its_own(rt, sandbox, servers):
    server = await servers.get(sandbox)
    long = asyncio.create_task(server.run("sleep 1", output.Capture(4096), 10))
    await asyncio.sleep(0.2)
    assert server.lock.locked(), "the executor then starts a helper for the call (test_executor covers it)"
    await long


async def test_a_timeout_kills_that_call_only_and_the_server_goes_on(rt, sandbox, servers):
    await fast(servers, sandbox, "sleep 300 > /dev/null 2>&1 &")  # a server the agent started earlier
    result, text = await fast(servers, sandbox, "echo begun; sleep 30 & sleep 40", timeout=0.5)
    assert result.timed_out and result.exit_code == -1 and text == "begun\n"
    _, text = await fast(servers, sandbox, "ps -e -o args= | grep -c '^sleep [0-9]' || true")
    assert text == "1\n", "the timed-out call's sleeps are gone, the earlier server remains"


async def test_a_command_that_kills_the_server_gets_a_clear_error_and_the_next_call_works(
    rt, sandbox, servers
):
    server = await servers.get(sandbox)
    with pytest.raises(shells.ServerGone) as gone:
        await server.run("pkill -KILL -f sbx-shell-server; sleep 5", output.Capture(4096), 30)
    assert gone.value.started
    result, text = await fast(servers, sandbox, "echo back")
    assert text == "back\n" and result.exit_code == 0
    assert await servers.get(sandbox) is not server


async def test_a_command_cannot_forge_the_end_of_its_call(rt, sandbox, servers):
    """The executor's end marker carries a nonce that never enters the sandbox's shell."""
    result, text = await fast(servers, sandbox, 'echo "$__sbx_nonce exited 9"; echo shown')
    assert result.exit_code == 0 and text.endswith(" exited 9\nshown\n")
    result, text = await fast(servers, sandbox, "echo clean")
    assert (result.exit_code, text) == (0, "clean\n")


async def test_two_executors_on_one_session_are_serialized(rt, sandbox, servers):
    """Each executor has its own server; the session's lock file still orders the calls,
    so concurrent exports are both kept."""
    other = shells.ShellServers(rt)
    try:
        await asyncio.gather(
            fast(servers, sandbox, "sleep 0.3; export FIRST=1"),
            fast(other, sandbox, "export SECOND=2"),
        )
        _, text = await fast(servers, sandbox, 'echo "$FIRST$SECOND"')
        assert text == "12\n"
        assert await helpers(rt, sandbox) == 2
    finally:
        await other.close()


async def test_idle_servers_are_closed_and_leave_nothing_behind(rt, sandbox):
    pool = shells.ShellServers(rt, idle_close=0.2)
    try:
        await fast(pool, sandbox, "true")
        assert len(pool) == 1 and await helpers(rt, sandbox) == 1
        await asyncio.sleep(0.3)
        await pool.sweep()
        assert len(pool) == 0
        for _ in range(50):
            if await helpers(rt, sandbox) == 0:
                break
            await asyncio.sleep(0.1)
        assert await helpers(rt, sandbox) == 0
    finally:
        await pool.close()


async def test_the_first_call_does_not_wait_for_a_server(rt, sandbox, servers):
    assert servers.ready(sandbox) is None  # starting in the background
    for _ in range(100):
        if servers.ready(sandbox) is not None:
            break
        await asyncio.sleep(0.05)
    assert servers.ready(sandbox) is not None


async def test_an_image_without_bash_uses_the_sh_path(rt, servers, tmp_path):
    rt.images.add_rootfs("minimal", minimal_rootfs(tmp_path / "rootfs"))
    await rt.create(api.SandboxSpec(sandbox_id="no-bash", image="minimal"))
    await rt.start("no-bash")
    assert await servers.get("no-bash") is None
    assert servers.ready("no-bash") is None  # remembered: no new attempt per call


async def test_a_stopped_sandbox_retires_its_server(rt, sandbox, servers):
    server = await servers.get(sandbox)
    await rt.stop(sandbox)
    for _ in range(100):
        if not server.alive:
            break
        await asyncio.sleep(0.05)
    assert not server.alive
    await rt.start(sandbox)
    _, text = await fast(servers, sandbox, "echo again")
    assert text == "again\n"


async def test_a_prepared_server_outlives_the_idle_rule_until_its_first_call(rt, sandbox):
    """A pool sandbox's helper is started before any session has it and must still be
    there when the session's first call comes, however long the sandbox waited."""
    pool = shells.ShellServers(rt, idle_close=0.1)
    try:
        assert await pool.prepare(sandbox) is True
        await asyncio.sleep(0.2)
        await pool.sweep()
        assert pool.ready(sandbox) is not None and await helpers(rt, sandbox) == 1
        _, text = await fast(pool, sandbox, "echo claimed")  # the first call: no longer kept
        assert text == "claimed\n"
        await asyncio.sleep(0.2)
        await pool.sweep()
        assert len(pool) == 0
    finally:
        await pool.close()


async def test_at_most_half_the_servers_are_kept_for_pool_sandboxes(rt):
    """Pool sandboxes' helpers never crowd out the helpers of sessions being served, and
    a session's helper evicted beyond the limit is the least recently used one, not a
    kept pool helper."""
    for name in ("p-1", "p-2", "p-3"):
        await rt.create(api.SandboxSpec(sandbox_id=name))
        await rt.start(name)
    pool = shells.ShellServers(rt, limit=2)
    try:
        assert await pool.prepare("p-1") is True
        assert await pool.prepare("p-2") is False  # 1 of 2 is already kept
        await fast(pool, "p-3", "true")
        await fast(pool, "p-2", "true")  # a third helper: the oldest session helper goes
        assert len(pool) == 2
        assert pool.ready("p-1") is not None and pool.ready("p-2") is not None
    finally:
        await pool.close()


async def test_a_prepared_server_whose_first_call_never_comes_is_closed_in_the_end(rt, sandbox, monkeypatch):
    """(With several executors, the session's calls may all go to another one.)"""
    monkeypatch.setattr(shells, "PINNED_FOR", 0.2)
    pool = shells.ShellServers(rt, idle_close=0.1)
    try:
        assert await pool.prepare(sandbox) is True
        await pool.sweep()
        assert len(pool) == 1
        await asyncio.sleep(0.3)
        await pool.sweep()
        assert len(pool) == 0
    finally:
        await pool.close()


async def test_a_shell_killed_from_inside_is_replaced_and_says_what_was_lost(rt, sandbox, servers):
    """A command that kills the session's bash and its backup (here: each of their
    processes, once the call has returned): the next call runs in a new shell that keeps
    the directory and exports, says so, and the restart is recorded in the sandbox for
    whoever looks into it."""
    _, text = await fast(servers, sandbox, "cd /tmp; export KEPT=1; LOST=1")
    await fast(servers, sandbox, "(sleep 0.3; kill -9 $(pgrep -f __sbx_hold)) >/dev/null 2>&1 &")
    await asyncio.sleep(1)
    _, text = await fast(servers, sandbox, 'pwd; echo "$KEPT[$LOST]"; cat /.sbx/shell/restarts')
    note, pwd, values, recorded = text.splitlines()
    assert note.startswith("[a new shell: the sandbox was restarted or its shell was killed;")
    assert (pwd, values) == ("/tmp", "1[]")
    assert recorded.endswith(" the sandbox was restarted or its shell was killed")


async def test_a_helper_that_floods_the_executor_is_retired_and_memory_stays_flat(rt, sandbox, servers):
    """The helper runs the sandbox's own bash, which root inside can replace: one that
    greets, then writes 300 MB nobody asked for, is retired and killed once it has written
    ``shells.BUFFER_MAX``; the executor's memory stays flat, and a real bash works again."""
    hello = bashsession.HELLO.decode().strip()  # (it greets as the helper of this version does)
    fake = (
        f"printf '#!/bin/sh\\nprintf \"{hello}\\\\n\"\\nexec head -c 300000000 /dev/zero\\n' "
        "> /usr/local/bin/bash && chmod +x /usr/local/bin/bash"
    )
    result, _, err = await rt.run(sandbox, ["/bin/sh", "-c", fake])
    assert result.exit_code == 0, err
    support.reset_peak_memory()
    before = support.peak_memory()
    server = await servers.get(sandbox)
    assert server is not None, "it greeted like a helper"
    await support.eventually(lambda: not server.alive, timeout=30)

    async def killed() -> bool:
        _, out, _ = await rt.run(sandbox, ["/bin/sh", "-c", "pgrep -fc 'head -c 30000000[0]' || true"])
        return out.strip() == b"0"

    await support.eventually(killed, timeout=30)  # (a bound on a hang, not a timing assertion)
    grown = support.peak_memory() - before
    assert grown < 64 * 1024**2, f"the executor's memory grew by {grown / 1024**2:.0f} MiB"
    await rt.run(sandbox, ["rm", "/usr/local/bin/bash"])
    result, text = await fast(servers, sandbox, "echo back")
    assert (result.exit_code, text) == (0, "back\n")


async def test_a_helper_that_ends_leaves_no_reader_of_output_behind(rt, sandbox):
    """Each helper keeps a reader ready for its next call's output; ending right after a
    call (its executor closing it) ends that reader too."""
    for _ in range(3):
        pool = shells.ShellServers(rt)
        await fast(pool, sandbox, "echo hi")
        await pool.close()
    count = "pgrep -fc '^cat -- /.sbx/shell/ou[t]-' || true"
    for _ in range(50):
        _, out, _ = await rt.run(sandbox, ["/bin/sh", "-c", count])
        if out.strip() == b"0":
            break
        await asyncio.sleep(0.1)
    assert out.strip() == b"0", "readers left behind"

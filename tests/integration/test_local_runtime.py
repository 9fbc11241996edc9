"""The runtime contract against the local bubblewrap runtime, with real sandboxes."""

from __future__ import annotations

import asyncio

import pytest

from shared.runtime.local import runtime as local
from shared.runtime.local import sandboxdirs
from tests.contract.runtime_contract import RuntimeContract

pytestmark = pytest.mark.needs_root("the local runtime's cgroup limits need root")


class TestLocalRuntime(RuntimeContract):
    @pytest.fixture
    def make_runtime(self, tmp_path):
        return lambda: local.LocalRuntime(tmp_path / "state")

    @pytest.fixture
    async def runtime(self, make_runtime):
        rt = make_runtime()
        yield rt
        for info in await rt.list():
            await rt.delete(info.sandbox_id)


async def test_a_sandbox_stopped_while_a_command_enters_it_is_not_running_not_a_crash(tmp_path, monkeypatch):
    """Entering runs after the sandbox was looked up; if it stopped or was deleted in
    between (a delete racing a run), the caller gets NotRunning, never a server error."""
    from shared.runtime import api

    rt = local.LocalRuntime(tmp_path / "state")
    await rt.create(api.SandboxSpec(sandbox_id="racy"))
    await rt.start("racy")
    real = rt.spawner.spawn

    async def stopped_meanwhile(*args, **kwargs):
        await rt.stop("racy")  # as a delete would, between the lookup and the entering
        return await real(*args, **kwargs)  # the spawner finds no init (or not a sandbox's)

    monkeypatch.setattr(rt.spawner, "spawn", stopped_meanwhile)
    with pytest.raises(api.SandboxNotRunning, match="is stopped, not running"):
        await rt.exec("racy", ["true"])
    monkeypatch.undo()
    await rt.start("racy")  # and the same spawner enters it again
    result, out, _ = await rt.run("racy", ["echo", "back"])
    assert (result.exit_code, out) == (0, b"back\n")
    await rt.delete("racy")


async def test_a_paused_sandbox_is_frozen_by_its_cgroup_and_uses_no_cpu(tmp_path):
    """Every process of a paused sandbox is in its frozen freezer group, and a busy loop
    in it gains no CPU time while paused (read from the host: /proc/<pid>/stat)."""
    from pathlib import Path

    from shared.runtime import api

    rt = local.LocalRuntime(tmp_path / "state")
    if not rt.pausable:
        pytest.skip("no cgroup freezer here")
    await rt.create(api.SandboxSpec(sandbox_id="frozen"))
    await rt.start("frozen")
    try:
        await rt.run("frozen", ["sh", "-c", "(while :; do :; done) >/dev/null 2>&1 </dev/null &"])
        name = sandboxdirs.cgroup_name("frozen")
        busy = 0
        while not busy:  # the loop: the one process that keeps using CPU time
            await asyncio.sleep(0.05)
            busy = next((pid for pid in rt.cgroups.pids(name) if _cpu_ticks(pid) > 2), 0)
        members = set(rt.cgroups.pids(name))
        await rt.pause("frozen")
        freezer = rt.cgroups._freezer(name)
        if rt.cgroups.version == 1:
            assert (freezer / "freezer.state").read_text().strip() == "FROZEN"
            assert members <= set(rt.cgroups.pids_in(freezer)), "every process is in the frozen group"
        else:
            assert "frozen 1" in (freezer / "cgroup.events").read_text()
        before = _cpu_ticks(busy)
        await asyncio.sleep(0.5)  # (a spinning loop gains ~50 ticks in this time when it runs)
        assert _cpu_ticks(busy) == before, "a paused process used CPU time"
        await rt.resume("frozen")
        assert (
            (freezer / "freezer.state").read_text().strip() == "THAWED" if rt.cgroups.version == 1 else True
        )
        deadline = asyncio.get_running_loop().time() + 10
        while _cpu_ticks(busy) == before and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        assert _cpu_ticks(busy) > before, "the loop runs again after resume"
        assert Path(f"/proc/{busy}").exists()
    finally:
        await rt.delete("frozen")
    assert not any(d.exists() for d in rt.cgroups.dirs(sandboxdirs.cgroup_name("frozen")))


def _cpu_ticks(pid: int) -> int:
    """User plus system CPU time of a host process, in clock ticks."""
    from pathlib import Path

    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:  # (gone)
        return 0
    return int(fields[11]) + int(fields[12])


async def test_usage_reads_the_sandbox_filesystem_and_a_paused_sandbox(tmp_path):
    """Disk use is its own filesystem's (statfs of the runtime's detached mount): a file
    written inside shows; a paused sandbox is read without being resumed (its memory kept,
    no CPU)."""
    from shared.runtime import api
    from shared.runtime.local import disk

    if problem := disk.Disk.unavailable():
        pytest.skip(problem)
    rt = local.LocalRuntime(tmp_path / "state")
    limits = api.Limits(disk_bytes=128 * 1024**2, disk_inodes=4096)
    await rt.create(api.SandboxSpec(sandbox_id="measured", limits=limits))
    await rt.start("measured")
    try:
        before = await rt.usage("measured", window=0)
        assert 0 < before.disk_bytes < before.disk_limit <= limits.disk_bytes
        result, _, _ = await rt.run(
            "measured", ["dd", "if=/dev/zero", "of=/workspace/blob", "bs=1M", "count=16", "conv=fsync"]
        )
        assert result.exit_code == 0
        after = await rt.usage("measured", window=0)
        assert after.disk_bytes - before.disk_bytes >= 16 * 1024**2
        if rt.pausable:
            await rt.pause("measured")
            paused = await rt.usage("measured", window=0.2)
            assert paused.cpu_percent == 0 and paused.memory_bytes > 0
            assert (await rt.get("measured")).status == "paused"
    finally:
        await rt.delete("measured")

"""Snapshots and forks on the local runtime, with real sandboxes: what a snapshot holds,
that forks see it and nothing of each other, that a snapshot taken while a writer runs is
consistent, that layers are shared and reference counted, and the store's budget."""

from __future__ import annotations

import asyncio
import os
import subprocess

import pytest

from sbx_api import errors
from shared.runtime import api
from shared.runtime.local import disk, fdtree
from shared.runtime.local import runtime as local

pytestmark = pytest.mark.needs_root("the local runtime's cgroup limits need root")


@pytest.fixture
async def rt(tmp_path):
    runtime = local.LocalRuntime(tmp_path / "state", snapshot_budget=512 * 1024**2)
    yield runtime
    for info in await runtime.list():
        await runtime.delete(info.sandbox_id)


async def sh(rt: local.LocalRuntime, sandbox_id: str, command: str) -> str:
    result, out, err = await rt.run(sandbox_id, ["sh", "-c", command])
    assert result.exit_code == 0, (command, out, err)
    return out.decode()


async def started(rt: local.LocalRuntime, sandbox_id: str, **spec: object) -> str:
    await rt.create(api.SandboxSpec(sandbox_id=sandbox_id, **spec))  # type: ignore[arg-type]
    await rt.start(sandbox_id)
    return sandbox_id


async def test_a_fork_starts_with_the_snapshots_files_and_forks_are_isolated(rt):
    await started(rt, "origin")
    await sh(
        rt,
        "origin",
        "echo v1 > /workspace/f; echo doomed > /workspace/gone; mkdir -p /workspace/d/e; "
        "mkdir -p /usr/local/share/sbx && echo installed > /usr/local/share/sbx/marker; "
        "mkdir -p /.sbx/shell && echo /tmp > /.sbx/shell/cwd && echo 'export MODE=one' > /.sbx/shell/env",
    )
    first = await rt.snapshot("origin", "snap-1")
    assert first.layers and first.size > 0 and first.parent is None and first.digest.startswith("sha256:")
    assert first.frozen_seconds > 0 and first.files >= 5
    assert (await rt.get("origin")).status == "running"  # thawed after the copy
    assert await rt.snapshot("origin", "snap-1") == first  # the same id again: the same snapshot
    with pytest.raises(errors.Conflict):
        await rt.snapshot(await started(rt, "other"), "snap-1")

    await sh(rt, "origin", "echo v2 > /workspace/f; rm /workspace/gone")
    for fork in ("fork-a", "fork-b"):
        await started(rt, fork, snapshot="snap-1")
        out = await sh(
            rt, fork, "cat /workspace/f /workspace/gone /usr/local/share/sbx/marker /.sbx/shell/cwd"
        )
        assert out.split() == ["v1", "doomed", "installed", "/tmp"]
    await sh(rt, "fork-a", "echo mine > /workspace/only-a; rm /workspace/gone; echo a > /workspace/d/e/x")
    assert "only-a" not in await sh(rt, "fork-b", "ls /workspace")
    assert (await sh(rt, "fork-b", "cat /workspace/gone")).strip() == "doomed"
    assert (await sh(rt, "origin", "cat /workspace/f")).strip() == "v2"
    assert "only-a" not in await sh(rt, "origin", "ls /workspace")

    # A fork of a fork: the fork's own writes (a deletion too) over the first snapshot's.
    second = await rt.snapshot("fork-a", "snap-2")
    assert second.parent == "snap-1" and second.layers[:-1] == first.layers and len(second.layers) == 2
    await started(rt, "grandchild", snapshot="snap-2")
    out = await sh(rt, "grandchild", "cat /workspace/only-a /workspace/f /workspace/d/e/x; ls /workspace")
    assert out.split()[:3] == ["mine", "v1", "a"] and "gone" not in out.split()[3:]

    # The spec of a fork must be its snapshot's; an unknown snapshot is said so.
    with pytest.raises(errors.InvalidInput, match="run_as_root"):
        await rt.create(api.SandboxSpec(sandbox_id="wrong", snapshot="snap-1", run_as_root=False))
    with pytest.raises(errors.NotFound, match="snapshot 'nope' does not exist"):
        await rt.create(api.SandboxSpec(sandbox_id="wrong", snapshot="nope"))


async def test_a_snapshot_taken_while_a_writer_runs_is_consistent(rt):
    """The writer writes b then a, each the same counter, each file whole (written, then
    renamed over): at any instant b >= a, and a frozen copy keeps that."""
    await started(rt, "busy")
    await sh(
        rt,
        "busy",
        "mkdir -p /workspace/many /workspace/churn; "
        "for i in $(seq 2000); do echo $i > /workspace/many/$i; done",
    )
    await sh(
        rt,
        "busy",
        "(i=0; while :; do i=$((i+1)); echo $i > /workspace/.b; mv /workspace/.b /workspace/b; "
        "echo $i > /workspace/.a; mv /workspace/.a /workspace/a; "
        ": > /workspace/churn/$i; rm -f /workspace/churn/$((i-1)); done) >/dev/null 2>&1 &",
    )
    await asyncio.sleep(0.3)
    for n in range(5):
        snap = await rt.snapshot("busy", f"busy-{n}")
        assert snap.frozen_seconds > 0
        await started(rt, f"busy-fork-{n}", snapshot=f"busy-{n}")
        out = await sh(
            rt,
            f"busy-fork-{n}",
            "cat /workspace/a /workspace/b; ls /workspace/churn; ls /workspace/many | wc -l",
        )
        a, b, *churn, many = out.split()
        assert int(b) >= int(a) >= 1, (a, b)
        # churn holds the file of the round in flight, and maybe the one before (created, not yet removed)
        ticks = sorted(int(c) for c in churn)
        assert 1 <= len(ticks) <= 2 and ticks[-1] - ticks[0] <= 1 and ticks[-1] >= int(b) - 1, (ticks, a, b)
        assert many == "2000"
        await rt.delete(f"busy-fork-{n}")
    assert int((await sh(rt, "busy", "cat /workspace/a")).strip()) > int(a)  # it went on after the thaw


async def test_layers_are_shared_counted_and_freed_with_the_last_user(rt):
    await started(rt, "src")
    await sh(rt, "src", "head -c 4000000 /dev/urandom > /workspace/blob")
    one = await rt.snapshot("src", "one")
    held = rt.snapshot_bytes()
    assert held >= 4_000_000 and one.size == held
    two = await rt.snapshot("src", "two")  # nothing changed: the same layer
    assert two.size == 0 and two.layers == one.layers and two.digest == one.digest
    assert rt.snapshot_bytes() == held

    await started(rt, "user", snapshot="one")
    assert await rt.delete_snapshot("one") and await rt.delete_snapshot("two")
    assert not await rt.delete_snapshot("two")
    assert rt.snapshot_bytes() == held  # a sandbox still stands on the layer
    await rt.stop("user")
    await rt.start("user")  # started again after its snapshot's deletion: files intact
    assert (await sh(rt, "user", "wc -c < /workspace/blob")).strip() == "4000000"
    await rt.delete("user")
    assert rt.snapshot_bytes() == 0 and await rt.list_snapshots() == []

    # A new runtime over the same state finds what there is.
    three = await rt.snapshot("src", "three")
    again = local.LocalRuntime(rt.state_dir)
    assert await again.list_snapshots() == [three] and again.snapshot_bytes() == rt.snapshot_bytes()


async def test_the_budget_refuses_a_snapshot_and_leaves_nothing(tmp_path):
    rt = local.LocalRuntime(tmp_path / "state", snapshot_budget=1024**2)
    try:
        await started(rt, "big")
        await sh(rt, "big", "head -c 3000000 /dev/urandom > /workspace/blob")
        with pytest.raises(errors.LimitExceeded, match="SBX_SNAPSHOT_BUDGET"):
            await rt.snapshot("big", "too-big")
        assert await rt.list_snapshots() == [] and rt.snapshot_bytes() == 0
        assert list((tmp_path / "state" / "snapshots" / "tmp").iterdir()) == []
        assert (await rt.get("big")).status == "running"
    finally:
        await rt.delete("big")


async def test_a_sparse_file_stays_sparse_and_costs_what_was_written(rt):
    """2 GiB of holes would fill a small store if copied as bytes: the copy keeps the holes,
    and the snapshot's size (and budget) count the blocks really written."""
    await started(rt, "holes")
    await sh(rt, "holes", "truncate -s 2G /workspace/sparse && printf data >> /workspace/sparse")
    snap = await rt.snapshot("holes", "holes-1")
    assert snap.size < 4 * 1024**2 and rt.snapshot_bytes() < 4 * 1024**2  # (the budget is 512 MiB)
    await started(rt, "holes-fork", snapshot="holes-1")
    assert (await sh(rt, "holes-fork", "wc -c < /workspace/sparse; tail -c 4 /workspace/sparse")).split() == [
        str(2 * 1024**3 + 4),
        "data",
    ]


@pytest.fixture
def small_fs(tmp_path):
    """A 400 MiB ext4 filesystem of its own (never the machine's disk), unmounted after."""
    image, mount = tmp_path / "fs.img", tmp_path / "fs"
    subprocess.run(["truncate", "-s", "400M", str(image)], check=True)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-N", "40000", str(image)], check=True)
    mount.mkdir()
    subprocess.run(["mount", "-o", "loop", str(image), str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


async def test_snapshots_keep_the_filesystems_reserve_of_bytes_and_inodes(small_fs):
    """The budget is not the only bound: a snapshot that would leave the state filesystem
    below its reserve (bytes or inodes) is refused before anything is copied, and a copy
    that reaches the reserve while it writes is stopped; either leaves nothing behind."""
    rt = local.LocalRuntime(
        small_fs / "state",
        snapshot_budget=10 * 1024**3,
        disk_reserve=200 * 1024**2,
        disk_reserve_inodes=20_000,
    )
    tmp = small_fs / "state" / "snapshots" / "tmp"
    try:
        await started(rt, "filler")
        await sh(rt, "filler", "head -c 120000000 /dev/urandom > /workspace/blob")
        with pytest.raises(errors.LimitExceeded, match="no room for this snapshot.*SBX_DISK_RESERVE"):
            await rt.snapshot("filler", "too-big")
        assert await rt.list_snapshots() == [] and list(tmp.iterdir()) == []
        await sh(
            rt,
            "filler",
            "rm /workspace/blob; mkdir /workspace/many; cd /workspace/many; seq 15000 | xargs touch",
        )
        with pytest.raises(errors.LimitExceeded, match="inodes free.*SBX_DISK_RESERVE_INODES"):
            await rt.snapshot("filler", "too-many")
        assert await rt.list_snapshots() == [] and list(tmp.iterdir()) == []
        await sh(rt, "filler", "rm -r /workspace/many")
        # A copy that reaches the reserve while it writes (the filesystem filled meanwhile
        # by someone else: here, before it starts) is stopped within a look's worth.
        source = small_fs / "source"
        source.mkdir()
        for n in range(40):
            (source / f"f{n}").write_bytes(os.urandom(1024**2))
        free = os.statvfs(small_fs).f_bavail * os.statvfs(small_fs).f_frsize
        reserve = disk.Disk(reserve_bytes=free - 20 * 1024**2)
        room = disk.Headroom(small_fs, reserve, lambda why: f"the copy was stopped: {why}")
        with pytest.raises(errors.LimitExceeded, match="the copy was stopped: .*SBX_DISK_RESERVE"):
            fdtree.sync(source, small_fs / "copy", guard=room)
        assert room.size <= 20 * 1024**2
        assert (await rt.get("filler")).status == "running"
    finally:
        await rt.delete("filler")


async def test_paused_stopped_and_disk_limited_sandboxes_can_be_snapshotted(rt):
    limits = api.Limits(disk_bytes=128 * 1024**2, disk_inodes=4096)
    await started(rt, "limited", limits=limits)
    await sh(rt, "limited", "echo kept > /workspace/k")
    await rt.pause("limited")
    paused = await rt.snapshot("limited", "while-paused")
    assert paused.frozen_seconds == 0 and (await rt.get("limited")).status == "paused"
    await rt.resume("limited")
    await rt.stop("limited")
    stopped = await rt.snapshot("limited", "while-stopped")  # its filesystem mounted for the copy
    assert stopped.layers == paused.layers  # the same files: the same layer
    assert (await rt.get("limited")).status == "stopped"
    await started(rt, "limited-fork", snapshot="while-stopped", limits=limits)
    assert (await sh(rt, "limited-fork", "cat /workspace/k; echo more > /workspace/m")).strip() == "kept"


@pytest.mark.parametrize("link", ["file", "directory"])
async def test_a_shell_file_linked_to_a_host_path_is_never_read_on_the_host(rt, tmp_path, link):
    """The snapshot reads the shell's saved state as the host: a sandbox that makes
    ``/.sbx/shell/cwd`` (or ``/.sbx/shell``) a link to a host path it cannot see must not
    get that file into a fork."""
    secret = tmp_path / "host-only"
    secret.mkdir()
    (secret / "cwd").write_text("host secret\n")
    await started(rt, "sneaky")
    if link == "file":
        attack = f"mkdir -p /.sbx/shell && ln -sf {secret}/cwd /.sbx/shell/cwd"
    else:
        attack = f"rm -rf /.sbx/shell && ln -s {secret} /.sbx/shell"
    await sh(rt, "sneaky", attack)
    await rt.snapshot("sneaky", f"sneaky-{link}")
    await started(rt, f"sneaky-fork-{link}", snapshot=f"sneaky-{link}")
    out = await sh(rt, f"sneaky-fork-{link}", "cat /.sbx/shell/cwd 2>/dev/null; true")
    assert "host secret" not in out
    store = rt.state_dir / "snapshots" / "layers"
    assert not any(
        b"host secret" in p.read_bytes() for p in store.rglob("*") if p.is_file() and not p.is_symlink()
    )


SWAPPER = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
AT_FDCWD, RENAME_EXCHANGE = -100, 2
pairs = [(os.path.join(top, 'd').encode(), os.path.join(top, 'l').encode()) for top in sys.argv[2:]]
open(sys.argv[1], 'w').close()
while True:
    for real, link in pairs:
        libc.renameat2(AT_FDCWD, real, AT_FDCWD, link, RENAME_EXCHANGE)
"""


async def test_a_sandbox_swapping_directories_for_host_links_during_a_copy_gets_no_host_byte(rt, tmp_path):
    """The attack of a sandbox on a snapshot's copy: while the host copies its files, it
    swaps directories with symbolic links to host directories it cannot see, as fast as it
    can (``renameat2(RENAME_EXCHANGE)``, several processes, in ``/workspace`` and in its
    copy-on-write root). No byte of the host's files may reach any layer, whichever
    snapshot, fork or restore."""
    marker = "HOST-ONLY-" + os.urandom(8).hex()
    host = tmp_path / "host-secrets"
    for sub in ("", "deeper"):
        (host / sub).mkdir(exist_ok=True)
        for n in range(50):
            (host / sub / f"s{n}").write_text(f"{marker} {n}\n")
    await started(rt, "swapper")
    tops = [f"/workspace/t{n}" for n in range(6)] + ["/usr/local/t0", "/root/t0"]
    setup = " ".join(
        f"mkdir -p {top}/d/sub && ln -s {host} {top}/l && "
        f"for i in $(seq 100); do echo mine > {top}/d/f$i; echo mine > {top}/d/sub/f$i; done;"
        for top in tops
    )
    await sh(rt, "swapper", setup)
    await sh(rt, "swapper", f"cat > /tmp/swap.py <<'EOF'\n{SWAPPER}\nEOF")
    for n in range(3):  # three racers, each over every pair
        await sh(rt, "swapper", f"python3 /tmp/swap.py /tmp/ready{n} {' '.join(tops)} >/dev/null 2>&1 &")
    await sh(rt, "swapper", "while [ ! -e /tmp/ready0 ] || [ ! -e /tmp/ready2 ]; do sleep 0.01; done")
    for n in range(8):
        await rt.snapshot("swapper", f"swap-{n}")
    store = rt.state_dir / "snapshots"
    leaked = [
        str(path)
        for path in store.rglob("*")
        if path.is_file() and not path.is_symlink() and marker.encode() in path.read_bytes()
    ]
    assert leaked == []
    # What a fork of the last one shows: the sandbox's files, and links that lead nowhere.
    await started(rt, "swap-fork", snapshot="swap-7")
    out = await sh(rt, "swap-fork", "cat /workspace/t*/d/f1 /workspace/t*/l/f1 2>/dev/null; true")
    assert marker not in out and "mine" in out


async def test_a_pause_or_resume_waits_for_a_snapshots_frozen_instant(rt):
    """A snapshot's frozen instant holds the sandbox's freezer: a resume (or a pause) that
    comes meanwhile waits for it, so the snapshot never thaws what a pause just froze."""
    await started(rt, "held")
    d = rt.dirs.dir("held")
    await rt.pause("held")
    with rt.freezer.lock(d):  # as a snapshot's instant does
        resuming = asyncio.create_task(rt.resume("held"))
        await asyncio.sleep(0.2)
        assert not resuming.done() and (await rt.get("held")).status == "paused"
    assert (await resuming).status == "running"
    with rt.freezer.lock(d):
        pausing = asyncio.create_task(rt.pause("held"))
        await asyncio.sleep(0.2)
        assert not pausing.done() and (await rt.get("held")).status == "running"
    assert (await pausing).status == "paused"
    await rt.resume("held")

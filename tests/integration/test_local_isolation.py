"""Attacks from inside a real local sandbox (security checklist, isolation section): each
probe runs as the sandbox's root and must fail or stay contained."""

from __future__ import annotations

import asyncio
import os
import socket
import uuid

import pytest

from shared.runtime import api
from shared.runtime.local import runtime as local
from shared.runtime.local import sandboxdirs

pytestmark = [
    pytest.mark.needs_root("the local runtime's cgroup limits need root"),
    pytest.mark.slow,
]


@pytest.fixture
async def rt(tmp_path):
    runtime = local.LocalRuntime(tmp_path / "state")
    yield runtime
    for info in await runtime.list():
        await runtime.delete(info.sandbox_id)


async def sandbox(rt, **kw) -> str:
    spec = api.SandboxSpec(sandbox_id="iso-" + uuid.uuid4().hex[:10], **kw)
    await rt.create(spec)
    await rt.start(spec.sandbox_id)
    return spec.sandbox_id


async def sh(rt, sid, script, **kw):
    result, out, err = await rt.run(sid, ["sh", "-c", script], **kw)
    return result.exit_code, out.decode(errors="replace"), err.decode(errors="replace")


async def test_host_files_are_invisible(rt, tmp_path):
    secret = tmp_path / "host-secret.txt"
    secret.write_text("TOPSECRET")
    sid = await sandbox(rt)
    for path in (str(secret), "/etc/shadow", "/root/.bashrc", str(rt.state_dir), "/home", "/etc/ssh"):
        code, out, _ = await sh(rt, sid, f"cat {path} 2>&1; ls -A {path} 2>&1")
        assert "TOPSECRET" not in out and "api-key" not in out, path
    code, out, _ = await sh(
        rt,
        sid,
        "ls -A /root /home/sandbox; grep -rl TOPSECRET /etc /root /home /workspace /tmp /var 2>/dev/null",
    )
    assert "TOPSECRET" not in out and "host-secret" not in out


async def test_host_and_other_sandboxes_processes_are_invisible(rt):
    first, second = await sandbox(rt), await sandbox(rt)
    await rt.exec(second, ["sh", "-c", "exec sleep 300"])
    _, out, _ = await sh(rt, first, "ps -e -o pid=,comm=")
    comms = [line.split()[1] for line in out.strip().splitlines()]
    assert "sleep" not in comms and "python" not in " ".join(comms) and len(comms) <= 6, comms
    code, _, err = await sh(rt, first, f"kill -9 {os.getpid()}")
    assert code != 0
    _, out, _ = await sh(rt, first, "ls /workspace; cat /proc/1/cmdline | tr '\\0' ' '")
    assert "sleep" not in out


async def test_no_network_at_all(rt):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    try:
        sid = await sandbox(rt)
        code, out, _ = await sh(rt, sid, "ip -o link | awk '{print $2}'")
        assert out.split() == ["lo:"]
        script = f"timeout 5 bash -c 'echo hi > /dev/tcp/127.0.0.1/{port}' 2>&1; echo rc=$?"
        _, out, _ = await sh(rt, sid, script)
        assert "rc=0" not in out
        _, out, _ = await sh(
            rt, sid, "timeout 5 bash -c 'echo > /dev/tcp/169.254.169.254/80' 2>&1; echo rc=$?"
        )
        assert "rc=0" not in out
        _, out, _ = await sh(rt, sid, "getent hosts example.com; echo rc=$?")
        assert "rc=0" not in out
    finally:
        listener.close()


async def test_sandboxes_do_not_share_workspaces(rt):
    first, second = await sandbox(rt), await sandbox(rt)
    await sh(rt, first, "echo mine > /workspace/private")
    code, out, _ = await sh(rt, second, "cat /workspace/private 2>&1; find / -name private 2>/dev/null")
    assert "mine" not in out


async def test_memory_limit_kills_the_hog_not_the_sandbox(rt):
    sid = await sandbox(rt, limits=api.Limits(memory_bytes=128 * 1024**2))
    code, _, _ = await sh(rt, sid, "python3 -c 'b = bytearray(512 * 1024 * 1024); print(len(b))'", timeout=60)
    assert code != 0
    code, out, _ = await sh(rt, sid, "echo alive")
    assert (code, out) == (0, "alive\n")


async def test_pids_limit_contains_a_fork_bomb(rt):
    sid = await sandbox(rt, limits=api.Limits(pids=64))
    bomb = await rt.exec(sid, ["sh", "-c", "b() { b | b & }; b"])
    await asyncio.sleep(1.0)
    assert 0 < len(rt.cgroups.pids(sandboxdirs.cgroup_name(sid))) <= 64
    await bomb.kill()
    await rt.stop(sid)  # stopping kills everything left in the group
    assert rt.cgroups.pids(sandboxdirs.cgroup_name(sid)) == []
    await rt.start(sid)
    code, out, _ = await sh(rt, sid, "echo ok")
    assert out == "ok\n"


async def test_cpu_limit_is_applied(rt):
    sid = await sandbox(rt, limits=api.Limits(cpus=0.5))
    name = sandboxdirs.cgroup_name(sid)
    quota = (
        (rt.cgroups.dirs(name)[1] / "cpu.cfs_quota_us").read_text().strip()
        if rt.cgroups.version == 1
        else (rt.cgroups.dirs(name)[0] / "cpu.max").read_text().split()[0]
    )
    assert quota == "50000"
    spin = await rt.exec(sid, ["sh", "-c", "while :; do :; done"])
    await asyncio.sleep(1.0)
    await spin.kill()
    await spin.wait()


async def test_sandbox_root_has_no_host_privileges(rt):
    sid = await sandbox(rt)
    for attempt in (
        "mount -t tmpfs x /mnt 2>&1 || mount -t proc proc /proc 2>&1",
        "echo 1 > /proc/sys/kernel/sysrq",
        "ip link add dummy0 type dummy",
        "unshare -U true",
        "mknod /tmp/sda b 8 0 && cat /tmp/sda | head -c1",
    ):
        code, out, err = await sh(rt, sid, attempt)
        if attempt.startswith("mount"):
            continue  # mounting inside its own namespaces is allowed and harmless
        assert code != 0, (attempt, out, err)

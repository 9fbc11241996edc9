"""Filling the disk from inside a sandbox (security checklist, "Disk and inodes").

A real `sbx up` runs with its state directory on a small filesystem this test makes (a
loop-mounted image: the machine's own disk is never filled). One sandbox fills its
workspace, its copy-on-write root, ``/tmp`` and its inodes; each stops at the sandbox's
own limit, and another session, a new session, the audit stream and ``sbx replay
--verify`` are unaffected. Then the state filesystem itself is filled from the host:
new sandboxes are refused with a clear error while running ones keep working, and
everything resumes once space is back.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.e2e import stacks
from tests.e2e.agent import Agent

pytestmark = [pytest.mark.needs_root("the local runtime needs root"), pytest.mark.slow]
MiB = 1024**2
FILLS = "/workspace/fill /usr/local/fill /var/fill /root/fill /tmp/fill /.sbx/cache/fill"


EXTRA = {
    "SBX_SANDBOX_DISK": "96m",
    "SBX_SANDBOX_INODES": "4000",
    "SBX_SANDBOX_MEMORY": "256m",  # /tmp: a 128 MiB tmpfs
    "SBX_DISK_RESERVE": "200m",
    "SBX_POOL_MIN_IDLE": "1",
}


@pytest.fixture
def small_stack(tmp_path):
    """`sbx up` with its state directory on a 1.2 GB filesystem of its own; stopped, its
    sandboxes removed and the filesystem unmounted afterwards."""
    image, mount = tmp_path / "state.img", tmp_path / "statefs"
    subprocess.run(["truncate", "-s", "1200M", str(image)], check=True)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True)
    mount.mkdir()
    subprocess.run(["mount", "-o", "loop", str(image), str(mount)], check=True)
    state = mount / "state"
    try:
        with stacks.running_stack(state, **EXTRA) as (_proc, url):
            yield state, url
        mounts = Path("/proc/self/mountinfo").read_text()
        assert str(state / "sandboxes") not in mounts, "a sandbox filesystem was left mounted"
    finally:
        subprocess.run(["umount", str(mount)], check=False)


async def test_a_sandbox_filling_its_disk_stops_at_its_own_limit(small_stack):
    small_state, url = small_stack
    if True:
        key = (small_state / "api-key").read_text().strip()
        filler, other = Agent(url, key, "filler"), Agent(url, key, "other")
        ok, text = await other.call("shell", command="echo before > /workspace/note && cat /workspace/note")
        assert ok and "before" in text, text

        attacks = {
            "workspace": "dd if=/dev/zero of=/workspace/fill bs=1M count=400",
            "root": "dd if=/dev/zero of=/usr/local/fill bs=1M count=400",
            "var": "dd if=/dev/zero of=/var/fill bs=1M count=400",
            "home": "dd if=/dev/zero of=/root/fill bs=1M count=400",
            "tmp": "dd if=/dev/zero of=/tmp/fill bs=1M count=400",
            "own package cache": "dd if=/dev/zero of=/.sbx/cache/fill bs=1M count=400",
        }
        for where, command in attacks.items():
            ok, text = await filler.call(
                "shell",
                command=f"{command} 2>&1 | head -1; rm -f {FILLS}",
                timeout=120,
            )
            assert ok and "No space left on device" in text, (where, text)
        ok, text = await filler.call(
            "shell",
            command="mkdir -p /workspace/many && cd /workspace/many && i=0; "
            "while [ $i -lt 31597 ]; do : > f$i 2>/dev/null || break; i=$((i+1)); done; echo made $i",
            timeout=120,
        )
        assert ok and "made" in text, text
        made = int(text.split("made")[1].split()[0])
        assert 3000 < made < 4000, made  # stopped by the sandbox's inode limit
        ok, text = await filler.call("shell", command="rm -rf /workspace/many; echo cleaned")
        assert ok and "cleaned" in text, text

        # Nothing else noticed: the other session, a new one, the audit, the projections.
        ok, text = await other.call(
            "shell", command="cat /workspace/note; echo after >> /workspace/note; tail -1 /workspace/note"
        )
        assert ok and "before" in text and "after" in text, text
        ok, text = await Agent(url, key, "newcomer").call("shell", command="echo fresh")
        assert ok and "fresh" in text, text
        events = stacks.sbx("events", "--json", "--session", "filler", state=small_state).stdout
        assert events.count("dd if=/dev/zero") == len(attacks), "a command went unaudited"
        verify = stacks.sbx("replay", "--verify", state=small_state)
        assert verify.returncode == 0 and "projections match" in verify.stdout, verify.stdout + verify.stderr

        # The state filesystem itself nearly full (from the host): no new sandbox, a clear
        # reason, running sessions unaffected; back to normal once space is freed.
        ballast = small_state.parent / "ballast"
        free = os.statvfs(small_state).f_bavail * os.statvfs(small_state).f_frsize
        with open(ballast, "wb") as f:
            f.truncate(0)
            os.posix_fallocate(f.fileno(), 0, max(free - 100 * MiB, 1))
        try:
            # A cold start (no pool serves uid 1000): the pool-manager must start one.
            ok, text = await Agent(url, key, "refused").call("create_sandbox", run_as_root=False)
            assert not ok and "MiB free" in text and "SBX_DISK_RESERVE" in text, text
            ok, text = await other.call("shell", command="echo still > /workspace/s && cat /workspace/s")
            assert ok and "still" in text, text
        finally:
            ballast.unlink()
        ok, text = await Agent(url, key, "refused").call("shell", command="echo back")
        assert ok and "back" in text, text

"""The kernel surface of a local sandbox (security checklist, "Kernel surface"): every
system call the seccomp filter must refuse is called from inside real sandboxes, as root
and as uid 1000, in processes the runtime entered and under bwrap's own init; then real
toolchains run under the same filter."""

from __future__ import annotations

import asyncio
import os
import uuid
from pathlib import Path

import pytest

from shared.runtime import api
from shared.runtime.local import bwrap, seccomp
from tests.integration import test_local_isolation as isolation

rt, sandbox, sh = isolation.rt, isolation.sandbox, isolation.sh  # the runtime fixture and helpers
pytestmark = [
    pytest.mark.needs_root("the local runtime needs root"),
    pytest.mark.slow,
]

# x86_64 numbers and arguments that would succeed (or fail otherwise than EPERM) without
# the filter: each line is one attack from the checklist.
PROBES = r"""
import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)
buf = ctypes.create_string_buffer(4096)
CALLS = {
    "io_uring_setup": (425, 8, ctypes.addressof(buf)),
    "keyctl": (250, 0, 0),  # KEYCTL_GET_KEYRING_ID
    "add_key": (248, ctypes.c_char_p(b"user"), ctypes.c_char_p(b"k"), ctypes.c_char_p(b"v"), 1, -3),
    "request_key": (249, ctypes.c_char_p(b"user"), ctypes.c_char_p(b"k"), None, 0),
    "bpf": (321, 0, ctypes.addressof(buf), 48),
    "perf_event_open": (298, ctypes.addressof(buf), 0, -1, -1, 0),
    "userfaultfd": (323, 1),  # UFFD_USER_MODE_ONLY
    "userfaultfd(0)": (323, 0),
    "unshare(NEWUSER)": (272, 0x10000000),
    "unshare(NEWNS)": (272, 0x00020000),
    "unshare(NEWNET)": (272, 0x40000000),
    "unshare(NEWPID)": (272, 0x20000000),
    "unshare(NEWIPC)": (272, 0x08000000),
    "unshare(NEWUTS)": (272, 0x04000000),
    "unshare(NEWCGROUP)": (272, 0x02000000),
    "unshare(NEWTIME)": (272, 0x00000080),
    "clone(NEWNET)": (56, 0x40000000 | 17, 0, 0, 0, 0),
    "clone(NEWUSER)": (56, 0x10000000 | 17, 0, 0, 0, 0),
    "mount": (165, ctypes.c_char_p(b"none"), ctypes.c_char_p(b"/tmp"), ctypes.c_char_p(b"tmpfs"), 0, 0),
    "umount2": (166, ctypes.c_char_p(b"/tmp"), 2),
    "pivot_root": (155, ctypes.c_char_p(b"/tmp"), ctypes.c_char_p(b"/tmp")),
    "fsopen": (430, ctypes.c_char_p(b"tmpfs"), 0),
    "open_tree": (428, -100, ctypes.c_char_p(b"/tmp"), 1),
    "kexec_load": (246, 0, 0, 0, 0),
    "kexec_file_load": (320, -1, -1, 0, 0, 0),
    "init_module": (175, ctypes.addressof(buf), 16, ctypes.c_char_p(b"")),
    "finit_module": (313, 0, ctypes.c_char_p(b""), 0),
    "delete_module": (176, ctypes.c_char_p(b"x"), 0),
    "open_by_handle_at": (304, -100, ctypes.addressof(buf), 0),
    "personality(ADDR_NO_RANDOMIZE)": (135, 0x0040000),
    "personality(READ_IMPLIES_EXEC)": (135, 0x0400000),
    "kcmp": (312, os.getpid(), os.getpid(), 0, 0, 0),
    "ptrace(ATTACH init)": (101, 16, 1, 0, 0),
    "ptrace(TRACEME)": (101, 0, 0, 0, 0),
    "process_vm_readv": (310, 1, ctypes.addressof(buf), 1, ctypes.addressof(buf), 1, 0),
    "setns": (308, os.open("/proc/self/ns/net", os.O_RDONLY), 0),
    "sethostname": (170, ctypes.c_char_p(b"x"), 1),
    "swapon": (167, ctypes.c_char_p(b"/tmp/x"), 0),
    "reboot": (169, 0xFEE1DEAD, 672274793, 0x4321FEDC, 0),
    "quotactl": (179, 0, ctypes.c_char_p(b"/"), 0, 0),
    "clock_settime": (227, 0, ctypes.addressof(buf)),
    "set_mempolicy": (238, 0, 0, 0),
    "socket(AF_PACKET)": (41, 17, 3, 0),
    "socket(AF_VSOCK)": (41, 40, 1, 0),
    "socket(AF_ALG)": (41, 38, 5, 0),
    "socket(NETLINK_NETFILTER)": (41, 16, 3, 12),
    "socket(NETLINK_GENERIC)": (41, 16, 3, 16),
}
for name, (nr, *args) in CALLS.items():
    result = libc.syscall(nr, *args)
    print(name, "ok" if result >= 0 else errno.errorcode[ctypes.get_errno()])
print("clone3", errno.errorcode[ctypes.get_errno()] if libc.syscall(435, 0, 0) < 0 else "ok")
print("socket(AF_INET)", "ok" if libc.syscall(41, 2, 1, 0) >= 0 else "refused")
print("socket(NETLINK_ROUTE)", "ok" if libc.syscall(41, 16, 3, 0) >= 0 else "refused")
print("unshare(FILES)", "ok" if libc.syscall(272, 0x400) >= 0 else "refused")
"""


@pytest.mark.parametrize("root", [True, False], ids=["root", "uid1000"])
async def test_every_dangerous_system_call_is_refused(rt, root):
    sid = await sandbox(rt, run_as_root=root)
    code, out, err = await sh(rt, sid, f"python3 - <<'EOF'\n{PROBES}\nEOF")
    assert code == 0, err
    results = dict(line.rsplit(" ", 1) for line in out.strip().splitlines())
    refused = {name for name, verdict in results.items() if verdict == "EPERM"}
    wrong = {name: verdict for name, verdict in results.items() if verdict != "EPERM"}
    assert wrong == {
        "clone3": "ENOSYS",  # libc falls back to clone, whose flags the filter reads
        "socket(AF_INET)": "ok",
        "socket(NETLINK_ROUTE)": "ok",
        "unshare(FILES)": "ok",
    }, wrong
    assert len(refused) >= 45
    for name in ("io_uring_setup", "keyctl", "bpf", "perf_event_open", "userfaultfd", "ptrace(ATTACH init)"):
        assert name in refused


@pytest.mark.parametrize("root", [True, False], ids=["root", "uid1000"])
async def test_every_process_is_filtered_and_root_keeps_only_a_few_capabilities(rt, root):
    sid = await sandbox(rt, run_as_root=root)
    code, out, _ = await sh(
        rt, sid, "for p in /proc/[0-9]*; do echo $p $(grep -E '^(Seccomp|CapBnd|CapEff):' $p/status); done"
    )
    assert code == 0
    lines = [line.split() for line in out.strip().splitlines()]
    assert {line[0] for line in lines} >= {"/proc/1", "/proc/2"}  # bwrap's init and main process
    mask = sum(1 << cap for cap in bwrap.ROOT_CAPS.values()) if root else 0
    for path, _, eff, _, bnd, _, mode in lines:
        assert mode == "2", f"{path} runs without the filter"
        assert int(bnd, 16) == mask, path
        assert int(eff, 16) & ~mask == 0, path
    code, out, _ = await sh(rt, sid, "ulimit -n; ulimit -Hn; wc -c < /proc/1/environ")
    assert out.split() == [str(rt.nofile(api.SandboxSpec(sandbox_id="x")))] * 2 + ["0"]


async def test_toolchains_still_work_under_the_filter(rt, tmp_path):
    sid = await sandbox(rt)
    script = r"""
set -e
cd /workspace
cat > hello.c <<'EOF'
#include <stdio.h>
#include <pthread.h>
static void *run(void *arg) { return arg; }
int main(void) { pthread_t t; pthread_create(&t, 0, run, 0); pthread_join(t, 0); puts("compiled"); return 0; }
EOF
printf 'hello: hello.c\n\tcc -O1 -pthread -o hello hello.c\n' > Makefile
make -s && ./hello
python3 -m venv /tmp/venv && /tmp/venv/bin/python -m pip --version | cut -c1-3
/tmp/venv/bin/python -m pip install -q --no-index --disable-pip-version-check /workspace/*.whl
/tmp/venv/bin/python -c 'import sbxdemo; print("pip installed")'
python3 -c 'import multiprocessing as m; print(sum(m.Pool(2).map(abs, [-1, -2])), "pool")'
git init -q repo && cd repo && git -c user.name=a -c user.email=a@b commit -q --allow-empty -m x
git log --oneline | wc -l && cd ..
git clone -q repo copy && echo cloned
node -e 'require("child_process").execSync("true"); console.log("node", typeof require("fs").watch)'
mkdir pkg && cd pkg && npm init -y >/dev/null && npm pack -s >/dev/null && ls *.tgz | wc -l
apt-get --version | head -1 | cut -d' ' -f1
"""
    _with_wheel(rt, sid, tmp_path)
    code, out, err = await sh(rt, sid, script, timeout=300)
    assert code == 0, out + err
    lines = out.split("\n")
    for expected in ("compiled", "pip", "pip installed", "3 pool", "1", "cloned", "node function", "apt"):
        assert expected in lines, (expected, out, err)


def _with_wheel(rt, sid, tmp_path) -> None:
    """A wheel in the workspace, built on the host (pip installs it offline inside)."""
    from tests.proxy import harness

    name, data = harness.demo_wheel()
    (rt.dirs.dir(sid) / "workspace" / name).write_bytes(data)


def test_the_filter_denies_what_the_checklist_names():
    """The policy itself, without a sandbox: nothing on the must-deny list is allowed,
    and the compiled program is what bwrap and the entry load."""
    assert not set(seccomp.MUST_DENY) & seccomp.ALLOWED
    program = seccomp.compile_bpf()
    assert len(program) % 8 == 0 and len(program) > 8 * 100


async def test_per_user_kernel_counters_of_host_root_are_out_of_reach(rt):
    """inotify instances (like every counter the kernel keeps per user namespace owner)
    taken in one sandbox count against that sandbox's own host uid: host root and another
    sandbox can still make theirs."""
    import ctypes

    first, second = await sandbox(rt), await sandbox(rt)
    hold = (
        "import ctypes, time\nl = ctypes.CDLL(None)\n"
        "print(sum(l.inotify_init() >= 0 for _ in range(300)), flush=True)\ntime.sleep(30)"
    )
    holder = await rt.exec(first, ["python3", "-c", hold])
    async for _, data in holder.chunks():
        assert int(data) >= 128  # the host's max_user_instances, all of it
        break
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init()
    assert fd >= 0, "host root can no longer make an inotify instance"
    os.close(fd)
    code, out, _ = await sh(
        rt, second, "python3 -c 'import ctypes; print(ctypes.CDLL(None).inotify_init() >= 0)'"
    )
    assert out.strip() == "True"
    await holder.kill()


@pytest.mark.parametrize("root", [True, False], ids=["root", "uid1000"])
async def test_host_kernel_settings_cannot_be_written_from_inside(rt, root):
    """Sandbox processes are host uid 0 on files, so root-owned /proc entries would be
    writable: core_pattern runs any program as host root (found by an attacker review),
    any sysctl retunes the host. They are read-only (or masked) inside."""
    before = Path("/proc/sys/kernel/core_pattern").read_text()
    sid = await sandbox(rt, run_as_root=root)
    targets = ["/proc/sys/kernel/core_pattern", "/proc/sys/vm/swappiness", "/proc/sys/kernel/pid_max"]
    script = "; ".join(f"(printf '|/workspace/x' > {t}) 2>&1 | head -1" for t in targets)
    try:
        code, out, _ = await sh(rt, sid, script)
        assert out.count("Read-only file system") == len(targets), out
    finally:
        after = Path("/proc/sys/kernel/core_pattern").read_text()
        if after != before:  # the attack worked: undo it before failing
            Path("/proc/sys/kernel/core_pattern").write_text(before)
    assert after == before
    code, out, _ = await sh(rt, sid, "cat /proc/sys/vm/swappiness /proc/sys/kernel/pid_max")
    assert code == 0 and len(out.split()) == 2  # still readable: tools look at them


async def test_many_sandboxes_with_disks_of_their_own_start_at_once(rt):
    """A pool refill creates sandboxes concurrently: the first ones all make the shared
    disk template at once (a race once corrupted it and every later sandbox failed)."""
    limits = api.Limits(disk_bytes=128 * 1024**2, disk_inodes=4096)
    specs = [api.SandboxSpec(sandbox_id="par-" + uuid.uuid4().hex[:10], limits=limits) for _ in range(8)]
    await asyncio.gather(*(rt.create(spec) for spec in specs))
    await asyncio.gather(*(rt.start(spec.sandbox_id) for spec in specs))
    for spec in specs:
        code, out, _ = await sh(rt, spec.sandbox_id, "df -k /workspace | tail -1")
        assert code == 0 and "/dev/loop" in out, out

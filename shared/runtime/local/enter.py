"""Entering a running sandbox from the host: what runs between fork and exec of a
command of ``runtime.exec``, in place of ``nsenter``. It runs in a child of the spawner
(``spawnd.py``), a small process of the executor's, never in a fork of the executor.

The child opens the init's namespaces, root and working directory, and refuses an entry
whose pid is no longer the sandbox's init (its start time, read after those opens) or
whose namespaces are the host's. It joins the sandbox's cgroup and its namespaces (the
user namespace last), takes the init's root and working directory, drops every
capability a coding sandbox does not need from its bounding set (which setns into a
user namespace resets to full), becomes the sandbox user, lowers its file limit, sets
no-new-privileges and loads the sandbox's seccomp filter, all after the entry so that
the filter can refuse ``setns`` and ``chroot`` to what runs inside. It then forks once
more, because joining a pid namespace only places one's children in it: the first
child stays outside, invisible to the sandbox, and mirrors the second's exit status;
both are in one process group, so killing the group kills both. Neither outlives the
executor: the first child gets SIGKILL when the spawner dies (which dies with the
executor), the second SIGTERM when the first does (``PR_SET_PDEATHSIG``), so a command
whose caller is gone does not keep running and holding the session's lock (what a
command starts in the background is not affected: the signal is not inherited).

Only ctypes calls to libc and ``os`` calls without locks run here; everything that needs
memory is prepared before the fork by ``prepare``. The module imports little (no
dataclasses, no typing): the spawner that imports it forks for every command, and a fork
costs what the address space holds.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import resource
import signal
from collections.abc import Callable, Sequence

NAMESPACES = ("mnt", "uts", "ipc", "net", "pid", "cgroup", "user")
"""The user namespace last: host root may join the others, which bwrap's outer user
namespace owns; joining the inner one first would leave no capability over them."""
PR_SET_PDEATHSIG = 1
PR_SET_NO_NEW_PRIVS = 38
PR_CAPBSET_DROP = 24
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
SYS_CLOSE_RANGE = 436  # x86_64 and aarch64 alike


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


HOST_ONLY = ("user", "mnt", "pid")
"""Namespaces a sandbox's init never shares with the host: an entry into any of the
host's own is refused."""


class Entry:
    """Where and how a command enters: the sandbox init's host ``pid`` and its start time
    (``starttime``, clock ticks after boot: a reused pid is refused), the ``uid`` it runs
    as, the capabilities left in its bounding set (``keep_caps``: root sandboxes; a
    non-root user has none), its file limit and its seccomp filter (``bpf``)."""

    __slots__ = ("bpf", "keep_caps", "nofile", "pid", "starttime", "uid")

    def __init__(
        self, pid: int, starttime: int, uid: int, keep_caps: frozenset[int], nofile: int, bpf: bytes
    ) -> None:
        self.pid, self.starttime, self.uid = pid, starttime, uid
        self.keep_caps, self.nofile, self.bpf = keep_caps, nofile, bpf

    def __repr__(self) -> str:
        return (
            f"Entry(pid={self.pid}, uid={self.uid}, keep_caps={sorted(self.keep_caps)}, nofile={self.nofile})"
        )


_libc = ctypes.CDLL(None, use_errno=True)


@functools.cache
def _last_cap() -> int:
    try:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 40


def prepare(entry: Entry, before: Callable[[], None]) -> Callable[[], None]:
    """The ``preexec_fn`` that enters ``entry``'s sandbox; ``before`` runs first (on the
    host: joining the cgroup)."""
    libc = _libc
    buffer = ctypes.create_string_buffer(entry.bpf, len(entry.bpf))
    fprog = _SockFprog(len(entry.bpf) // 8, ctypes.cast(buffer, ctypes.c_void_p))
    paths = [f"/proc/{entry.pid}/ns/{ns}".encode() for ns in NAMESPACES]
    stat = f"/proc/{entry.pid}/stat".encode()
    root, cwd = f"/proc/{entry.pid}/root".encode(), f"/proc/{entry.pid}/cwd".encode()
    drop = [cap for cap in range(_last_cap() + 1) if cap not in entry.keep_caps]
    uid = entry.uid
    parent = os.getpid()
    host = {ns: os.stat(f"/proc/self/ns/{ns}").st_ino for ns in HOST_ONLY}

    def check(result: int, what: str) -> None:
        if result != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what}: {os.strerror(err)}")

    def child() -> None:
        _keep = (buffer, fprog)  # alive until the filter is loaded
        fds = [os.open(path, os.O_RDONLY | os.O_CLOEXEC) for path in paths]
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        cwd_fd = os.open(cwd, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        _check_init(entry, stat, fds, host)
        before()
        for fd, ns in zip(fds, NAMESPACES, strict=True):
            check(libc.setns(fd, 0), f"setns({ns})")
        os.fchdir(root_fd)
        os.chroot(".")
        os.fchdir(cwd_fd)
        for cap in drop:
            check(libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), "prctl(PR_CAPBSET_DROP)")
        with contextlib.suppress(PermissionError):  # refused where bwrap wrote "deny" to setgroups
            os.setgroups([uid])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
        resource.setrlimit(resource.RLIMIT_NOFILE, (entry.nofile, entry.nofile))
        check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
        check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0), "seccomp")
        check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
        if os.getppid() != parent:  # it died before the line above
            libc._exit(137)
        pid = libc.fork()
        if pid < 0:
            check(-1, "fork")
        if pid > 0:
            _mirror(libc, pid)
        # The second child (the command): its parent is outside its pid namespace, where
        # getppid() says 0 while that parent lives; anything else means it died first.
        check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
        if os.getppid() != 0:
            libc._exit(143)

    return child


def _check_init(entry: Entry, stat: bytes, fds: list[int], host: dict[str, int]) -> None:
    """That what was opened by ``entry.pid`` is its sandbox's init's: the pid was not
    reused since (the start time, read after the opens) and is not a host process."""
    if _start_time(stat) != entry.starttime:
        raise ProcessLookupError(errno.ESRCH, f"the sandbox's init (pid {entry.pid}) has ended")
    for fd, ns in zip(fds, NAMESPACES, strict=True):
        if host.get(ns) == os.fstat(fd).st_ino:
            raise PermissionError(
                errno.EPERM, f"pid {entry.pid} is not a sandbox's init: its {ns} namespace is the host's"
            )


def _start_time(stat: bytes) -> int:
    """Field 22 of ``/proc/<pid>/stat`` (its start time), -1 if the process is gone."""
    try:
        fd = os.open(stat, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return -1
    try:
        return int(os.read(fd, 4096).rsplit(b")", 1)[1].split()[19])
    finally:
        os.close(fd)


def _mirror(libc: ctypes.CDLL, pid: int) -> None:
    """The first child: wait for the one inside and end as it did (never returns). It
    holds no file: the pipes and the exec-error pipe are the second child's alone."""
    if libc.syscall(SYS_CLOSE_RANGE, 0, 0xFFFFFFFF, 0) != 0:
        os.closerange(0, 65536)
    status = ctypes.c_int(0)
    while libc.waitpid(pid, ctypes.byref(status), 0) < 0:
        if ctypes.get_errno() != 4:  # EINTR
            libc._exit(127)
    code = status.value
    if os.WIFSIGNALED(code):
        sig = os.WTERMSIG(code)
        libc.signal(sig, signal.SIG_DFL)
        libc.kill(os.getpid(), sig)
        libc._exit(128 + sig)
    libc._exit(os.WEXITSTATUS(code))


def argv(command: Sequence[str], cwd: str | None) -> list[str]:
    """The command as exec'd inside: through ``sh`` to change to ``cwd`` first, if given."""
    return [*(["/bin/sh", "-c", 'cd -- "$0" && exec "$@"', cwd] if cwd else []), *command]

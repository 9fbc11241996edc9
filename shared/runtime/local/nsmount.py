"""Mounting into a running sandbox's own mount namespace, never the host's.

``bind_into`` clones a host mount (``open_tree``: a detached copy with the same flags,
so a ``nosuid,nodev`` source stays so) and, in a forked child that has joined the
sandbox's mount namespace (``setns`` needs a single-threaded caller), moves the clone
onto a directory there (``move_mount``). The host's mount table never changes, and no
other sandbox's namespace sees the mount.

The target is resolved inside the sandbox, whose files it controls: it must be a path
whose every directory is a mount point the sandbox cannot rename or replace (bwrap's
binds, e.g. ``/.sbx/cache``), and its last component is opened without following a
link, as a directory.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

from sbx_api import errors
from shared.infrastructure import processes

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.syscall.restype = ctypes.c_long
SYS_OPEN_TREE, SYS_MOVE_MOUNT = 428, 429  # the same on every architecture (new syscall table)
AT_FDCWD = -100
AT_EMPTY_PATH = 0x1000
OPEN_TREE_CLONE = 1
OPEN_TREE_CLOEXEC = os.O_CLOEXEC
MOVE_MOUNT_F_EMPTY_PATH = 0x4
MOVE_MOUNT_T_EMPTY_PATH = 0x40
CLONE_NEWNS = 0x00020000


def _open_tree(source: str) -> int:
    fd = _libc.syscall(SYS_OPEN_TREE, AT_FDCWD, os.fsencode(source), OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC)
    if fd < 0:
        code = ctypes.get_errno()
        raise errors.InfrastructureError(f"cannot clone the mount of {source}: {os.strerror(code)}")
    return int(fd)


def bind_into(pid: int, source: os.PathLike[str] | str, target: str) -> None:
    """Show the host mount ``source`` at ``target`` (absolute, inside) in the mount
    namespace of process ``pid`` (a sandbox's init). NotRunning if it is gone."""
    if not target.startswith("/") or ".." in target.split("/"):
        raise errors.InvalidInput(f"not an absolute inside path: {target!r}")
    started = processes.start_time(pid)
    tree = _open_tree(os.fspath(source))
    try:
        try:
            ns = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise errors.NotRunning(f"the sandbox is not running: {exc.strerror}") from None
        try:
            if started is None or processes.start_time(pid) != started:
                raise errors.NotRunning("the sandbox is not running")
            code = _in_namespace(ns, tree, target)
        finally:
            os.close(ns)
    finally:
        os.close(tree)
    if code:
        raise errors.InfrastructureError(f"cannot mount into the sandbox at {target}: {os.strerror(code)}")


def _in_namespace(ns: int, tree: int, target: str) -> int:
    """In a forked child: join namespace ``ns``, move ``tree`` onto ``target``; the errno
    of the step that failed (0: done). The child runs only system calls, then exits."""
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover (a child process)
        code = 0
        try:
            os.close(read_end)
            if _libc.setns(ns, CLONE_NEWNS) != 0:
                code = ctypes.get_errno()
            else:
                # setns put this process at the namespace's root (the sandbox's /).
                flags = os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC
                at = os.open(target, flags)
                empty = MOVE_MOUNT_F_EMPTY_PATH | MOVE_MOUNT_T_EMPTY_PATH
                if _libc.syscall(SYS_MOVE_MOUNT, tree, b"", at, b"", empty) != 0:
                    code = ctypes.get_errno()
        except OSError as exc:
            code = exc.errno or 5
        except BaseException:
            code = 5
        finally:
            try:
                os.write(write_end, code.to_bytes(4, "little"))
            finally:
                os._exit(0)
    os.close(write_end)
    try:
        got = os.read(read_end, 4)
    finally:
        os.close(read_end)
        os.waitpid(child, 0)
    return int.from_bytes(got, "little") if len(got) == 4 else 5

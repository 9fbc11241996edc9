"""The sandbox's user namespace, owned by a host uid of its own.

The kernel charges per-user counters (inotify instances and watches, pending signals,
message queues, processes: its "ucounts") up the user-namespace tree to each
namespace's *owner*. A namespace bwrap creates as root is owned by root, so 128 inotify
instances held in one sandbox left host root unable to make any. So the runtime makes
the namespace itself, owned by a host uid of the sandbox's own (``owner_uid``: derived
from its directory, stable across restarts, far above any real user), and hands it to
bwrap (``--userns``). The mapping inside stays what bwrap would write (the sandbox's uid
to host root), so files and caches are unchanged; only what is counted moves.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import shutil
import signal
import subprocess
from pathlib import Path

from shared.contract import errors

OWNER_BASE = 1_000_000_000
OWNER_SPAN = 1_000_000_000
CLONE_NEWUSER = 0x10000000
_libc = ctypes.CDLL(None, use_errno=True)


@functools.cache
def _sleep() -> str:
    return shutil.which("sleep") or "/bin/sleep"


def owner_uid(directory: Path) -> int:
    """The host uid that owns the namespace of the sandbox whose directory this is."""
    return OWNER_BASE + directory.stat().st_ino % OWNER_SPAN


def create(owner: int, inside: int) -> int:
    """A new user namespace owned by ``owner`` in which ``inside`` is host root (uid and
    gid; setgroups denied): an fd to it, for bwrap's ``--userns``."""
    sleep = _sleep()

    def child() -> None:  # between fork and exec: become the owner, then make the namespace
        os.setgroups([])
        os.setresgid(owner, owner, owner)
        os.setresuid(owner, owner, owner)
        if _libc.unshare(CLONE_NEWUSER) != 0:
            raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWUSER)")

    holder = subprocess.Popen(
        [sleep, "60"], env={}, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, preexec_fn=child
    )
    try:
        proc = Path(f"/proc/{holder.pid}")
        (proc / "uid_map").write_text(f"{inside} 0 1\n")
        (proc / "setgroups").write_text("deny")
        (proc / "gid_map").write_text(f"{inside} 0 1\n")
        return os.open(proc / "ns" / "user", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise errors.InfrastructureError(f"cannot make the sandbox's user namespace: {exc}") from exc
    finally:
        with contextlib.suppress(ProcessLookupError):
            holder.send_signal(signal.SIGKILL)
        holder.wait()

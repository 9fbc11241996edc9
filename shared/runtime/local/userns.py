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
import functools
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from sbx_api import errors

OWNER_BASE = 1_000_000_000
OWNER_SPAN = 1_000_000_000


@functools.cache
def _tools() -> tuple[str, str, str]:
    setpriv, unshare, sleep = (shutil.which(t) or f"/usr/bin/{t}" for t in ("setpriv", "unshare", "sleep"))
    return setpriv, unshare, sleep


def owner_uid(directory: Path) -> int:
    """The host uid that owns the namespace of the sandbox whose directory this is."""
    return OWNER_BASE + directory.stat().st_ino % OWNER_SPAN


def create(owner: int, inside: int) -> int:
    """A new user namespace owned by ``owner`` in which ``inside`` is host root (uid and
    gid; setgroups denied): an fd to it, for bwrap's ``--userns``.

    The holder becomes the owner (``setpriv``), makes the namespace (``unshare``) and
    sleeps: three programs run, but no Python between fork and exec, so the service is
    not copied (``vfork``): a few times cheaper than a ``preexec_fn`` in a large process."""
    setpriv, unshare, sleep = _tools()
    holder = subprocess.Popen(
        [setpriv, f"--reuid={owner}", f"--regid={owner}", "--clear-groups", "--",
         unshare, "--user", "--", sleep, "60"],
        env={}, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        proc = Path(f"/proc/{holder.pid}")
        _wait_for_namespace(holder, proc)
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
        assert holder.stderr is not None
        holder.stderr.close()


def _wait_for_namespace(holder: subprocess.Popen[bytes], proc: Path, timeout: float = 10.0) -> None:
    """Until the holder is in a user namespace other than this process's (it has become
    the owner and unshared); OSError if it ended first (its error said)."""
    ours = os.stat("/proc/self/ns/user").st_ino
    deadline = time.monotonic() + timeout
    while True:
        try:
            if os.stat(proc / "ns" / "user").st_ino != ours:
                return
        except FileNotFoundError:
            pass
        if holder.poll() is not None or time.monotonic() > deadline:
            assert holder.stderr is not None
            said = holder.stderr.read().decode(errors="replace").strip() if holder.poll() is not None else ""
            raise OSError(f"the namespace's holder did not make it: {said or 'no answer'}")
        time.sleep(0.0002)

"""Disk limits for local sandboxes: each sandbox's writable space is a filesystem of its own.

A sandbox writes to disk in ``/workspace``, its copy-on-write root and ``/.sbx``. With
limits on (the services' default), those live on an ext4 filesystem made for that
sandbox alone: a sparse image file ``<sandbox dir>/disk.img`` of ``disk_bytes``, with
``disk_inodes`` inodes and no reserved blocks, loop-mounted on ``<sandbox dir>/rw``. A
sandbox that fills it gets ENOSPC; no other sandbox, no service and not the event store
notice, since the image only grows as far as its size. (This machine's kernel has no
quota support, so project quotas on one shared filesystem are not an option; an image
costs ~40 ms at create and ~230 KiB of disk when empty.)

Images are sparse, so many sandboxes together could still take more than the state
filesystem has: the runtime also refuses to start a sandbox when less than
``reserve_bytes`` are free there (``space_problem``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from shared import errors

IMAGE = "disk.img"
MOUNT = "rw"
MNT_DETACH = 2
_libc = ctypes.CDLL(None, use_errno=True)
_libc.umount2.argtypes = (ctypes.c_char_p, ctypes.c_int)


@dataclass(frozen=True)
class Disk:
    """Make, mount and remove sandbox filesystems."""

    reserve_bytes: int = 2 * 1024**3
    """Sandboxes do not start while the state filesystem has less than this free."""

    @staticmethod
    def unavailable() -> str | None:
        """Why sandbox filesystems cannot be made here, or None."""
        if os.geteuid() != 0:
            return "mounting sandbox filesystems needs root"
        for tool in ("mkfs.ext4", "mount"):
            if shutil.which(tool) is None:
                return f"{tool} is missing (install e2fsprogs and mount)"
        return None

    @staticmethod
    def make(directory: Path, *, size: int, inodes: int) -> Path:
        """A new filesystem for the sandbox whose directory is ``directory``: the mount
        point, on which it is mounted when this returns."""
        image, mount = directory / IMAGE, directory / MOUNT
        with open(image, "wb") as f:
            f.truncate(size)
        _run(
            "mkfs.ext4", "-q", "-F", "-m", "0", "-N", str(inodes),
            "-O", "^has_journal,^resize_inode", "-E", "nodiscard,lazy_itable_init=1,root_owner=0:0",
            str(image),
        )  # fmt: skip
        mount.mkdir(mode=0o700, exist_ok=True)
        Disk.mount(directory)
        return mount

    @staticmethod
    def mount(directory: Path) -> None:
        """Mount the sandbox's filesystem if it is not (after a host restart)."""
        mount = directory / MOUNT
        if os.path.ismount(mount) or not (directory / IMAGE).exists():
            return
        _run("mount", "-o", "loop,nodev,nosuid", str(directory / IMAGE), str(mount))

    @staticmethod
    def unmount(directory: Path) -> None:
        """Detach the sandbox's filesystem (its processes are gone: nothing holds it)."""
        mount = directory / MOUNT
        if os.path.ismount(mount) and _libc.umount2(os.fsencode(mount), MNT_DETACH) != 0:
            code = ctypes.get_errno()
            raise errors.InfrastructureError(f"umount {mount} failed: {os.strerror(code)}")

    @staticmethod
    def root(directory: Path) -> Path:
        """Where the sandbox's writable directories are: on its own filesystem if it has one."""
        return directory / MOUNT if (directory / IMAGE).exists() else directory

    def space_problem(self, state_dir: Path) -> str | None:
        """Why no sandbox may start now (the state filesystem is nearly full), or None."""
        with contextlib.suppress(OSError):
            st = os.statvfs(state_dir)
            free = st.f_bavail * st.f_frsize
            if free < self.reserve_bytes:
                return (
                    f"the state filesystem ({state_dir}) has {free // 1024**2} MiB free, less than the "
                    f"{self.reserve_bytes // 1024**2} MiB kept for the event store (SBX_DISK_RESERVE): "
                    "clear sessions you no longer need"
                )
        return None


def _run(*argv: str) -> None:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    if result.returncode != 0:
        out = (result.stderr or result.stdout).strip()
        raise errors.InfrastructureError(f"{argv[0]} failed: {out[-500:]}")

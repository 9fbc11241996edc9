"""Disk limits for local sandboxes: each sandbox's writable space is a filesystem of its own.

A sandbox writes to disk in ``/workspace``, its copy-on-write root and ``/.sbx``. With
limits on (the services' default), those live on an ext4 filesystem made for that
sandbox alone: a sparse image file ``<sandbox dir>/disk.img`` of ``disk_bytes``, with
``disk_inodes`` inodes and no reserved blocks, loop-mounted on ``<sandbox dir>/rw``. A
sandbox that fills it gets ENOSPC; no other sandbox, no service and not the event store
notice, since the image only grows as far as its size. (This machine's kernel has no
quota support, so project quotas on one shared filesystem are not an option; an image
costs a few ms at create, a sparse copy of a template formatted once per size, and
~230 KiB of disk when empty.)

Images are sparse, so many sandboxes together could still take more than the state
filesystem has: the runtime also refuses to start a sandbox when less than
``reserve_bytes`` are free there (``space_problem``).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import functools
import os
import shutil
import struct
import subprocess
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from sbx_api import errors

IMAGE = "disk.img"
MOUNT = "rw"
MNT_DETACH = 2
_libc = ctypes.CDLL(None, use_errno=True)
_libc.umount2.argtypes = (ctypes.c_char_p, ctypes.c_int)


@dataclass(frozen=True)
class Disk:
    """Make, mount and remove sandbox filesystems."""

    reserve_bytes: int = 2 * 1024**3
    """Sandboxes do not start while the state filesystem has less than this free, and
    snapshots and image pulls stop before they would leave less."""
    reserve_inodes: int = 10_000
    """The same for free inodes (``SBX_DISK_RESERVE_INODES``)."""

    @staticmethod
    @functools.cache
    def unavailable() -> str | None:
        """Why sandbox filesystems cannot be made here, or None."""
        if os.geteuid() != 0:
            return "mounting sandbox filesystems needs root"
        if shutil.which("mkfs.ext4") is None:
            return "mkfs.ext4 is missing (install e2fsprogs)"
        return None

    @staticmethod
    def make(directory: Path, *, size: int, inodes: int) -> Path:
        """A new filesystem for the sandbox whose directory is ``directory``: the mount
        point, on which it is mounted when this returns. It is a sparse copy of a
        template made once per size and inode count (``templates``), not a new mkfs:
        a few hundred KiB of metadata copied instead of a program run per sandbox."""
        image, mount = directory / IMAGE, directory / MOUNT
        _sparse_copy(_template(directory.parent / TEMPLATES, size, inodes), image)
        mount.mkdir(mode=0o700, exist_ok=True)
        Disk.mount(directory)
        return mount

    @staticmethod
    def mount(directory: Path) -> None:
        """Mount the sandbox's filesystem if it is not (after a host restart): a loop
        device that detaches itself on unmount, set up with ioctls (no program run)."""
        mount = directory / MOUNT
        if os.path.ismount(mount) or not (directory / IMAGE).exists():
            return
        _loop_mount(directory / IMAGE, mount)

    @staticmethod
    def mounted(directory: Path) -> bool:
        """Whether the sandbox's writable directories can be read now: it has no filesystem
        of its own, or that filesystem is mounted."""
        return not (directory / IMAGE).exists() or os.path.ismount(directory / MOUNT)

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

    def space_problem(self, state_dir: Path, *, size: int = 0, entries: int = 0) -> str | None:
        """Why nothing may write ``size`` bytes and ``entries`` files more on the state
        filesystem now (it would go below the reserves kept for the event store), or None."""
        try:
            room = free(state_dir)
        except OSError:
            return None
        why = shortfall(
            room,
            reserve_bytes=self.reserve_bytes,
            reserve_inodes=self.reserve_inodes,
            more_bytes=size,
            more_inodes=entries,
        )
        if why is None:
            return None
        needs = f" (this needs {size // 1024**2} MiB and {entries} files)" if size or entries else ""
        return (
            f"the state filesystem ({state_dir}) has {why} for the event store{needs}: "
            "clear sessions, snapshots or images you no longer need"
        )


@dataclass(frozen=True)
class Free:
    """What a filesystem has free for us (not counting blocks reserved for root)."""

    bytes: int
    inodes: int | None
    """None: the filesystem has no inode limit (btrfs reports none)."""


def free(path: Path) -> Free:
    st = os.statvfs(path)
    return Free(st.f_bavail * st.f_frsize, st.f_favail if st.f_files else None)


def shortfall(
    room: Free, *, reserve_bytes: int, reserve_inodes: int, more_bytes: int = 0, more_inodes: int = 0
) -> str | None:
    """What would be short if ``more_bytes`` and ``more_inodes`` were written now, with the
    reserves kept (pure), or None. The one rule for the state filesystem's reserve."""
    if room.bytes - more_bytes < reserve_bytes:
        return (
            f"{max(room.bytes, 0) // 1024**2} MiB free, {reserve_bytes // 1024**2} MiB kept "
            "(SBX_DISK_RESERVE)"
        )
    if room.inodes is not None and room.inodes - more_inodes < reserve_inodes:
        return f"{max(room.inodes, 0)} inodes free, {reserve_inodes} kept (SBX_DISK_RESERVE_INODES)"
    return None


LOOK_BYTES, LOOK_ENTRIES = 8 * 1024**2, 256
"""How often a ``Headroom`` looks at the filesystem again (bytes, entries written since)."""


class Headroom:
    """A guard (``fdtree.Guard``) for what the host writes on a sandbox's or a tenant's
    behalf (a snapshot's copy, an image pull's downloads and layers): told every write
    before it happens (``(bytes, entries)``, from any thread), it stops it with
    ``LimitExceeded`` once it would pass ``budget`` bytes, or before the filesystem of
    ``root`` goes below the disk's reserves: it looks every :data:`LOOK_BYTES` /
    :data:`LOOK_ENTRIES`, keeping that much room above the reserves in between.
    ``refusal`` says what was stopped, given what is short."""

    def __init__(
        self, root: Path, disk: Disk, refusal: Callable[[str], str], budget: int | None = None
    ) -> None:
        self.root, self.disk, self.refusal, self.budget = root, disk, refusal, budget
        self.size = 0
        self._lock = threading.Lock()
        self._bytes = self._entries = LOOK_BYTES * 2  # look at once

    def __call__(self, more_bytes: int, more_entries: int) -> None:
        with self._lock:
            self.size += max(more_bytes, 0)
            if self.budget is not None and self.size > self.budget:
                raise errors.LimitExceeded(
                    self.refusal(f"it passed the {self.budget // 1024**2} MiB it may take")
                )
            self._bytes += max(more_bytes, 0)
            self._entries += more_entries
            if self._bytes < LOOK_BYTES and self._entries < LOOK_ENTRIES:
                return
            self._bytes = self._entries = 0
        why = shortfall(
            free(self.root),
            reserve_bytes=self.disk.reserve_bytes,
            reserve_inodes=self.disk.reserve_inodes,
            more_bytes=max(more_bytes, 0) + LOOK_BYTES,
            more_inodes=more_entries + LOOK_ENTRIES,
        )
        if why is not None:
            raise errors.LimitExceeded(self.refusal(why))


TEMPLATES = ".disk-templates"
"""Under the sandboxes' directory: one empty formatted image per size and inode count."""
LOOP_CTL_GET_FREE, LOOP_CONFIGURE, LO_FLAGS_AUTOCLEAR = 0x4C82, 0x4C0A, 4
MS_NOSUID, MS_NODEV = 0x2, 0x4
_LOOP_CONFIG = struct.Struct("II" + "QQQQQIIII64s64s32sQQ" + "8Q")  # loop_config with loop_info64
_libc.mount.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p)


def _template(root: Path, size: int, inodes: int) -> Path:
    """The empty filesystem image sandboxes of this size start from (made once)."""
    template = root / f"{size}-{inodes}.img"
    if template.exists():
        return template
    root.mkdir(mode=0o700, exist_ok=True)
    # A name of its own for each maker (threads of one process too): concurrent first
    # creates each format their own and the last rename wins, never a shared half-made file.
    fd, name = tempfile.mkstemp(prefix=f".{template.name}.", dir=root)
    tmp = Path(name)
    os.ftruncate(fd, size)
    os.close(fd)
    _run(
        "mkfs.ext4", "-q", "-F", "-m", "0", "-N", str(inodes),
        "-O", "^has_journal,^resize_inode", "-E", "nodiscard,lazy_itable_init=1,root_owner=0:0",
        str(tmp),
    )  # fmt: skip
    tmp.rename(template)
    return template


def _sparse_copy(source: Path, target: Path) -> None:
    """Copy ``source`` keeping its holes (only its data extents are read and written)."""
    fd_in = os.open(source, os.O_RDONLY)
    fd_out = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        size = os.fstat(fd_in).st_size
        os.ftruncate(fd_out, size)
        offset = 0
        while offset < size:
            try:
                start = os.lseek(fd_in, offset, os.SEEK_DATA)
            except OSError:  # ENXIO: no data after offset
                break
            end = os.lseek(fd_in, start, os.SEEK_HOLE)
            while start < end:
                chunk = os.pread(fd_in, min(end - start, 1 << 20), start)
                os.pwrite(fd_out, chunk, start)
                start += len(chunk)
            offset = end
    finally:
        os.close(fd_in)
        os.close(fd_out)


def _loop_mount(image: Path, target: Path) -> None:
    image_fd = os.open(image, os.O_RDWR | os.O_CLOEXEC)
    try:
        with open("/dev/loop-control", "rb") as control:
            for _ in range(16):  # another process may take the free device first
                number = fcntl.ioctl(control, LOOP_CTL_GET_FREE)
                device = f"/dev/loop{number}"
                dev_fd = os.open(device, os.O_RDWR | os.O_CLOEXEC)
                try:
                    config = bytearray(_LOOP_CONFIG.size)
                    struct.pack_into("II", config, 0, image_fd, 0)
                    struct.pack_into("I", config, 8 + 5 * 8 + 3 * 4, LO_FLAGS_AUTOCLEAR)  # lo_flags
                    try:
                        fcntl.ioctl(dev_fd, LOOP_CONFIGURE, bytes(config))
                    except OSError as exc:
                        if exc.errno == errno.EBUSY:
                            continue
                        raise
                    flags = MS_NOSUID | MS_NODEV
                    if _libc.mount(device.encode(), os.fsencode(target), b"ext4", flags, None) != 0:
                        code = ctypes.get_errno()
                        raise errors.InfrastructureError(f"mount {image} on {target}: {os.strerror(code)}")
                    return
                finally:
                    os.close(dev_fd)  # autoclear: the device goes with the unmount
        raise errors.InfrastructureError("no free loop device for the sandbox's filesystem")
    finally:
        os.close(image_fd)


def _run(*argv: str) -> None:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    if result.returncode != 0:
        out = (result.stderr or result.stdout).strip()
        raise errors.InfrastructureError(f"{argv[0]} failed: {out[-500:]}")

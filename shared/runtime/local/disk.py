"""Disk limits for local sandboxes: each sandbox's writable space is a filesystem of its own.

A sandbox writes to disk in ``/workspace``, its copy-on-write root and ``/.sbx``. With
limits on (the services' default), those live on an ext4 filesystem made for that
sandbox alone: a sparse image file ``<sandbox dir>/disk.img`` of ``disk_bytes``, with
``disk_inodes`` inodes and no reserved blocks. A sandbox that fills it gets ENOSPC; no
other sandbox, no service and not the event store notice, since the image only grows as
far as its size. (This machine's kernel has no quota support, so project quotas on one
shared filesystem are not an option; an image costs a few ms at create, a sparse copy of
a template formatted once per size, and ~230 KiB of disk when empty.)

The filesystem is never mounted in the host's mount table: every mount there makes each
later sandbox start slower (bubblewrap reads the whole table once per bind), so a host
mount per live sandbox made starts grow with the number alive. A running sandbox's
filesystem is mounted (on ``<sandbox dir>/rw``) only in a mount namespace its launcher
makes for it (the runtime's ``LAUNCH``), and bubblewrap binds from there; it goes with the
sandbox's last process. The host reaches the files (to make directories before a start,
to copy them for a snapshot) through a detached mount (``Disk.open``: ``fsmount``, held
by a descriptor, in no namespace). Both go through one loop device per image, recorded
in ``<sandbox dir>/loop`` and checked against the image before use, so a running
sandbox and the host always share one mounted filesystem, never two over one image.

Images are sparse, so many sandboxes together could still take more than the state
filesystem has: the runtime also refuses to start a sandbox when less than
``reserve_bytes`` are free there (``space_problem``).
"""

from __future__ import annotations

import contextlib
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
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from sbx_api import errors

IMAGE = "disk.img"
MOUNT = "rw"
LOOP = "loop"
"""In the sandbox's directory: the number of the loop device its image was last bound to."""
MNT_DETACH = 2
_libc = ctypes.CDLL(None, use_errno=True)
_libc.umount2.argtypes = (ctypes.c_char_p, ctypes.c_int)


@dataclass(frozen=True)
class Opened:
    """A sandbox's writable directories opened by this process (``Disk.open``)."""

    path: Path
    """Where this process reaches them (``/proc/self/fd/N`` for a filesystem of its own)."""
    device: str | None
    """The loop device of its filesystem (to mount it in the sandbox's own namespace), or None."""
    fd: int
    """The detached mount's descriptor (-1: none)."""

    def close(self) -> None:
        """Let go of the files (the filesystem stays while the running sandbox has it)."""
        if self.fd >= 0:
            os.close(self.fd)


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
    def make(directory: Path, *, size: int, inodes: int) -> None:
        """A new filesystem for the sandbox whose directory is ``directory`` (mounted
        nowhere). It is a sparse copy of a template made once per size and inode count
        (``templates``), not a new mkfs: a few hundred KiB of metadata copied instead of
        a program run per sandbox."""
        image, mount = directory / IMAGE, directory / MOUNT
        _sparse_copy(_template(directory.parent / TEMPLATES, size, inodes), image)
        mount.mkdir(mode=0o700, exist_ok=True)

    @staticmethod
    def open(directory: Path) -> Opened:
        """The sandbox's writable directories, reachable by this process (and only it) at
        ``Opened.path`` until ``close``: on its own filesystem, a detached mount (the
        running sandbox's, when it runs); else the directory itself."""
        if not (directory / IMAGE).exists():
            return Opened(directory, None, -1)
        mount = directory / MOUNT
        if os.path.ismount(mount):  # mounted on the host by an earlier version
            fd = _open_tree(mount)
            return Opened(Path(f"/proc/self/fd/{fd}"), None, fd)
        device, fd = _open_image(directory)
        return Opened(Path(f"/proc/self/fd/{fd}"), device, fd)

    @staticmethod
    @contextlib.contextmanager
    def opened(directory: Path) -> Iterator[Path]:
        """``open`` for the block: where the writable directories are reachable."""
        handle = Disk.open(directory)
        try:
            yield handle.path
        finally:
            handle.close()

    @staticmethod
    def used(directory: Path) -> tuple[int, int]:
        """Bytes used on the sandbox's own filesystem and its size, as its superblock
        says (statfs of the detached mount: nothing in it is resolved by path); (0, 0)
        when it has none."""
        if not (directory / IMAGE).exists():
            return 0, 0
        handle = Disk.open(directory)
        try:
            st = os.fstatvfs(handle.fd) if handle.fd >= 0 else os.statvfs(handle.path)
        finally:
            handle.close()
        return (st.f_blocks - st.f_bfree) * st.f_frsize, st.f_blocks * st.f_frsize

    @staticmethod
    def unmount(directory: Path) -> None:
        """Detach the sandbox's filesystem from the host's mount table if an earlier
        version mounted it there (its processes are gone: nothing holds it)."""
        mount = directory / MOUNT
        if os.path.ismount(mount) and _libc.umount2(os.fsencode(mount), MNT_DETACH) != 0:
            code = ctypes.get_errno()
            raise errors.InfrastructureError(f"umount {mount} failed: {os.strerror(code)}")

    @staticmethod
    def root(directory: Path) -> Path:
        """Where the sandbox's writable directories are for its bubblewrap: on its own
        filesystem if it has one (mounted there in the launcher's namespace only)."""
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
_LOOP_CONFIG = struct.Struct("II" + "QQQQQIIII64s64s32sQQ" + "8Q")  # loop_config with loop_info64


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


SYS_OPEN_TREE, SYS_FSOPEN, SYS_FSCONFIG, SYS_FSMOUNT = 428, 430, 431, 432  # (one table on every architecture)
OPEN_TREE_CLONE, FSOPEN_CLOEXEC, FSMOUNT_CLOEXEC = 1, 1, 1
FSCONFIG_SET_STRING, FSCONFIG_CMD_CREATE = 1, 6
MOUNT_ATTR_NOSUID, MOUNT_ATTR_NODEV = 0x2, 0x4
LOOP_GET_STATUS64 = 0x4C05
_LOOP_INFO64_SIZE = 232
_libc.syscall.restype = ctypes.c_long


def _open_image(directory: Path) -> tuple[str, int]:
    """A detached mount of the sandbox's filesystem: its loop device and the mount's
    descriptor. Under the image's lock, the loop device it is bound to (recorded in
    ``LOOP``, checked) is used if there is one, so the running sandbox's filesystem is
    the one opened; else it is bound to a free one (which unbinds itself when the last
    mount of it goes)."""
    image = directory / IMAGE
    # Locked through a descriptor of its own: a loop device bound with ``image_fd`` keeps
    # that open file (and a lock on it) for as long as it is bound.
    lock_fd = os.open(image, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        image_fd = os.open(image, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except BaseException:
        os.close(lock_fd)
        raise
    try:
        identity = os.fstat(image_fd)
        for _ in range(16):
            number, held = _recorded(directory), -1
            if number is None or not _bound_to(number, identity):
                number, held = _bind_loop(image_fd, image)
                (directory / LOOP).write_text(f"{number}\n")
            device = f"/dev/loop{number}"
            try:
                fd = _mount_detached(device)
            except OSError as exc:
                if not _bound_to(number, identity):  # unbound meanwhile: bind it again
                    continue
                raise errors.InfrastructureError(f"mount {image}: {exc.strerror}") from None
            finally:
                if held >= 0:
                    os.close(held)  # (the mount holds it now, or it unbinds)
            if _bound_to(number, identity):  # (held by the mount now: it cannot change)
                return device, fd
            os.close(fd)  # bound to another image between the check and the mount: again
        raise errors.InfrastructureError(f"cannot mount {image}: its loop device kept changing")
    finally:
        os.close(image_fd)
        os.close(lock_fd)  # (and the lock)


def _recorded(directory: Path) -> int | None:
    try:
        text = (directory / LOOP).read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() and len(text) < 8 else None


def _bound_to(number: int, identity: os.stat_result) -> bool:
    """Whether ``/dev/loop<number>`` is bound to the file ``identity`` is of."""
    try:
        fd = os.open(f"/dev/loop{number}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        info = bytearray(_LOOP_INFO64_SIZE)
        fcntl.ioctl(fd, LOOP_GET_STATUS64, info)
    except OSError:  # ENXIO: bound to nothing
        return False
    finally:
        os.close(fd)
    device, inode = struct.unpack_from("QQ", info)  # lo_device, lo_inode
    return (os.major(device), os.minor(device), inode) == (
        os.major(identity.st_dev), os.minor(identity.st_dev), identity.st_ino,
    )  # fmt: skip


def _bind_loop(image_fd: int, image: Path) -> tuple[int, int]:
    """Bind the image to a free loop device (set up with ioctls, no program run), one
    that unbinds itself once nothing has it open or mounted: its number, and a
    descriptor of it that keeps it bound until closed."""
    with open("/dev/loop-control", "rb") as control:
        for _ in range(16):  # another process may take the free device first
            number = fcntl.ioctl(control, LOOP_CTL_GET_FREE)
            dev_fd = os.open(f"/dev/loop{number}", os.O_RDWR | os.O_CLOEXEC)
            config = bytearray(_LOOP_CONFIG.size)
            struct.pack_into("II", config, 0, image_fd, 0)
            struct.pack_into("I", config, 8 + 5 * 8 + 3 * 4, LO_FLAGS_AUTOCLEAR)  # lo_flags
            try:
                fcntl.ioctl(dev_fd, LOOP_CONFIGURE, bytes(config))
            except OSError as exc:
                os.close(dev_fd)
                if exc.errno == errno.EBUSY:
                    continue
                raise errors.InfrastructureError(f"loop device for {image}: {exc.strerror}") from None
            return number, dev_fd
    raise errors.InfrastructureError("no free loop device for the sandbox's filesystem")


def _syscall(number: int, *args: object) -> int:
    result = _libc.syscall(number, *args)
    if result < 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
    return int(result)


def _mount_detached(device: str) -> int:
    """Mount the ext4 filesystem on ``device`` in no namespace (``nosuid,nodev``): a
    descriptor of its root (the mount goes when it is closed). A filesystem mounted
    already is shared, not mounted twice."""
    context = _syscall(SYS_FSOPEN, b"ext4", FSOPEN_CLOEXEC)
    try:
        _syscall(SYS_FSCONFIG, context, FSCONFIG_SET_STRING, b"source", os.fsencode(device), 0)
        _syscall(SYS_FSCONFIG, context, FSCONFIG_CMD_CREATE, None, None, 0)
        return _syscall(SYS_FSMOUNT, context, FSMOUNT_CLOEXEC, MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV)
    finally:
        os.close(context)  # (it holds the filesystem too)


def _open_tree(mount: Path) -> int:
    """A detached copy of the host mount ``mount`` (same filesystem, same flags)."""
    try:
        return _syscall(SYS_OPEN_TREE, -100, os.fsencode(mount), OPEN_TREE_CLONE | os.O_CLOEXEC)  # AT_FDCWD
    except OSError as exc:
        raise errors.InfrastructureError(f"cannot open {mount}: {exc.strerror}") from None


def _run(*argv: str) -> None:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    if result.returncode != 0:
        out = (result.stderr or result.stdout).strip()
        raise errors.InfrastructureError(f"{argv[0]} failed: {out[-500:]}")

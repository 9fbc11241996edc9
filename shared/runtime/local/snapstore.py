"""The local runtime's snapshot store: content-addressed layers of sandbox files, shared
read-only by the sandboxes started from them.

Layout under ``<state>/snapshots/``:

* ``layers/<sha256>/``: one layer, never changed once there: ``workspace/`` (what the
  sandbox had in ``/workspace``, or wrote there over its own base), ``root/<n>/`` (its
  copy-on-write root's changes over image layer ``n``, whiteouts and opaque directories as
  overlayfs keeps them), ``dirs/<top>/`` (``/root``, ``/var``... of an image without a root
  layer), ``shell/cwd`` and ``shell/env`` (where its shell was and what it exported);
* ``records/<token>.json``: a snapshot (its :class:`~shared.runtime.api.SnapshotInfo`):
  the layers it is made of, bottom first (a fork's snapshot: its base's, then its own);
* ``tmp/``: copies being made (anything left there by a crash is removed at start).

A layer's name is the SHA-256 of all it keeps (paths, types, modes, owners, modification
times, sizes, file contents, link targets, devices, ``user.*`` xattrs, each framed, in
sorted order): a copy equal to a layer
that exists is dropped, and its snapshot uses that one. A layer is removed once no record
and no sandbox (``base.json`` in its directory) names it: deleting a snapshot never
breaks a sandbox started from it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import shutil
import stat
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import msgspec

from sbx_api import errors
from shared.contract import ids
from shared.domain import describe
from shared.runtime import api
from shared.runtime.local import fdtree

USER_XATTR = b"user."
READ_SIZE = 1024 * 1024
GROWTH_SLACK = 64 * 1024**2
"""What a snapshot's copy may write beyond what its files measured (they may grow meanwhile),
at least: a quarter more otherwise, within the budget."""
MAX_LAYERS = 16
"""Most layers one snapshot stacks (a fork of a fork of …): each is one more overlay lower
directory of every overlay of a sandbox started from it."""

_record_decoder = msgspec.json.Decoder(api.SnapshotInfo)


@dataclass(frozen=True)
class Added:
    """A layer as ``SnapshotStore.add`` left it: its digest, the bytes it added to the store
    (0: an equal layer was there), and how many entries it holds."""

    digest: str
    size: int
    entries: int


def _alive(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


class SnapshotStore:
    def __init__(self, root: Path, budget: int) -> None:
        self.root = root
        self.budget = budget
        self.layers = root / "layers"
        self.records = root / "records"
        self.tmp = root / "tmp"
        for directory in (self.layers, self.records, self.tmp):
            directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        for left in self.tmp.iterdir():  # copies a crash left half made (their maker is gone)
            if not _alive(left.name.split(".", 1)[0]):
                shutil.rmtree(left, ignore_errors=True)
        self._lock = threading.Lock()
        self._sizes: dict[str, int] = {}
        self._reserved = 0  # bytes held by snapshots being made
        self._sync()

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """The store to oneself, across threads and processes (every service of a machine
        opens it): adding a layer and its record, collecting layers, and a new sandbox
        reading a record and naming its layers each happen whole, so a collection never
        removes a layer that a record or a sandbox is about to name."""
        with open(self.root / "lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _sync(self) -> None:
        """The sizes of the layers there are (another process may have added or removed some)."""
        there = set(os.listdir(self.layers))
        with self._lock:
            for gone in set(self._sizes) - there:
                del self._sizes[gone]
            for new in there - set(self._sizes):
                self._sizes[new] = disk_bytes(self.layers / new)

    # ---- records -----------------------------------------------------------------

    def _record_path(self, snapshot_id: str) -> Path:
        return self.records / f"{ids.token(snapshot_id)}.json"

    def get(self, snapshot_id: str) -> api.SnapshotInfo | None:
        try:
            return _record_decoder.decode(self._record_path(snapshot_id).read_bytes())
        except (OSError, msgspec.DecodeError):
            return None

    def all(self) -> list[api.SnapshotInfo]:
        found = []
        for path in self.records.glob("*.json"):
            with contextlib.suppress(OSError, msgspec.DecodeError):
                found.append(_record_decoder.decode(path.read_bytes()))
        return sorted(found, key=lambda s: (s.created_at, s.snapshot_id))

    def save(self, info: api.SnapshotInfo) -> None:
        path = self._record_path(info.snapshot_id)
        tmp = self.records / f".{path.name}.{os.getpid()}.{threading.get_ident()}"
        tmp.write_bytes(msgspec.json.encode(info))
        tmp.rename(path)

    def forget(self, snapshot_id: str) -> bool:
        try:
            self._record_path(snapshot_id).unlink()
        except FileNotFoundError:
            return False
        return True

    # ---- layers ------------------------------------------------------------------

    def layer(self, digest: str) -> Path:
        return self.layers / digest

    def bytes(self) -> int:
        """Bytes the layers take on disk (every layer once)."""
        self._sync()
        with self._lock:
            return sum(self._sizes.values())

    def size_of(self, digest: str) -> int:
        with self._lock:
            return self._sizes.get(digest, 0)

    @contextlib.contextmanager
    def reserving(self, needed: int) -> Iterator[int]:
        """Hold ``needed`` bytes of the budget while a snapshot is made (snapshots made at the
        same time each count the others'): LimitExceeded if they would take the store past
        it; else yields the bytes the copy may write (``needed`` and some slack for files
        that grow meanwhile, within the budget)."""
        held = self.bytes()
        with self._lock:
            taken = held + self._reserved
            if taken + needed > self.budget:
                raise errors.LimitExceeded(
                    f"the snapshot store holds {describe.size(taken)} of its {describe.size(self.budget)} "
                    f"budget (SBX_SNAPSHOT_BUDGET) and this snapshot needs about {describe.size(needed)}: "
                    "delete snapshots first"
                )
            self._reserved += needed
        try:
            yield min(self.budget - taken, needed + max(needed // 4, GROWTH_SLACK))
        finally:
            with self._lock:
                self._reserved -= needed

    def new_copy(self) -> Path:
        """An empty directory to copy a layer into (``add`` makes it a layer)."""
        path = self.tmp / f"{os.getpid()}.{threading.get_ident()}.{ids.new_id()[:12]}"
        path.mkdir(mode=0o755)
        return path

    def add(self, copy: Path, record: Callable[[Added], api.SnapshotInfo]) -> api.SnapshotInfo:
        """Make the copy a layer (an equal layer already there is kept and the copy dropped),
        then save the record ``record`` makes of it, in one hold of the store."""
        digest, entries = tree_digest(copy)
        target = self.layer(digest)
        with self.locked():
            if target.exists():
                shutil.rmtree(copy, ignore_errors=True)
                added = Added(digest, 0, entries)
            else:
                size = disk_bytes(copy)
                copy.rename(target)
                with self._lock:
                    self._sizes[digest] = size
                added = Added(digest, size, entries)
            info = record(added)
            self.save(info)
            return info

    def collect(self, used_by_sandboxes: Callable[[], Iterable[str]]) -> int:
        """Remove every layer no record and no sandbox (``used_by_sandboxes()``, read while
        the store is held) names; the bytes freed."""
        with self.locked():
            self._sync()
            wanted = set(used_by_sandboxes())
            for info in self.all():
                wanted.update(info.layers)
            freed = 0
            with self._lock:
                for digest in [d for d in self._sizes if d not in wanted]:
                    freed += self._sizes.pop(digest)
                    shutil.rmtree(self.layer(digest), ignore_errors=True)
            return freed


SHELL_FILES = ("cwd", "env")
"""What a snapshot keeps of the shell's saved state (``/.sbx/shell``)."""
SHELL_FILE_MAX = 4 * 1024**2


def copy_shell_file(control: Path, name: str, dest: Path) -> bool:
    """Copy ``shell/<name>`` of the sandbox's control directory (``/.sbx``) as the host,
    by descriptor (``fdtree.read_file``): only a regular file of at most
    ``SHELL_FILE_MAX`` bytes in a real directory, with its owner and mode (and its
    directory's). False (nothing copied) for anything else."""
    found = fdtree.read_file(control, ("shell", name), SHELL_FILE_MAX)
    if found is None:
        return False
    data, st, where = found
    dest.parent.mkdir(exist_ok=True)
    os.chmod(dest.parent, stat.S_IMODE(where.st_mode))
    os.chown(dest.parent, where.st_uid, where.st_gid)
    dest.write_bytes(data)
    os.chown(dest, st.st_uid, st.st_gid)
    os.chmod(dest, stat.S_IMODE(st.st_mode))
    os.utime(dest, ns=(st.st_atime_ns, st.st_mtime_ns))
    return True


HOST_MADE = ("root", "dirs", "shell")
"""Directories of a layer the host makes (not copied): their times are set to 0 once it is
written, so that equal copies have equal digests."""


def settle(copy: Path) -> None:
    """The times of the directories the host made in ``copy`` set to 0 (see HOST_MADE)."""
    for name in HOST_MADE:
        with contextlib.suppress(FileNotFoundError):
            os.utime(copy / name, ns=(0, 0), follow_symlinks=False)


def disk_bytes(top: Path) -> int:
    """Bytes ``top`` (the host's own copy) takes on disk: blocks of everything under it."""
    total = 0
    for _, dirs, files, fd in os.fwalk(top):
        for name in (*dirs, *files):
            with contextlib.suppress(OSError):
                total += os.stat(name, dir_fd=fd, follow_symlinks=False).st_blocks * 512
    return total


def tree_digest(top: Path) -> tuple[str, int]:
    """The SHA-256 of everything under ``top`` (the host's own copy; hex) that a copy keeps,
    each field framed by its length (names, modes, owners, modification times, contents,
    link targets, devices, ``user.*`` attributes), and how many entries it holds. Equal
    digests mean equal layers to the last attribute, so a layer shared by two snapshots
    (size 0 for the second) never shows one sandbox's metadata in another's fork."""
    outer = hashlib.sha256()
    entries = 0

    def field(value: bytes) -> None:
        outer.update(b"%d:" % len(value))
        outer.update(value)

    for directory, dirs, files, fd in os.fwalk(top):
        dirs.sort()
        rel_dir = os.path.relpath(directory, top)
        for name in sorted((*dirs, *files)):
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            entries += 1
            field(os.fsencode(os.path.normpath(os.path.join(rel_dir, name))))
            field(b"%o %d %d %d" % (st.st_mode, st.st_uid, st.st_gid, st.st_mtime_ns))
            if stat.S_ISREG(st.st_mode):
                field(b"%d" % st.st_size)
                field(_file_digest(name, fd))
            elif stat.S_ISLNK(st.st_mode):
                field(os.fsencode(os.readlink(name, dir_fd=fd)))
            elif stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
                field(b"%d" % st.st_rdev)
            if stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode):  # (user.* xattrs live on these alone)
                for attr, value in _user_xattrs(name, fd):
                    field(attr)
                    field(value)
    return outer.hexdigest(), entries


def _file_digest(name: str, dir_fd: int) -> bytes:
    """A file's data extents (offset, length, bytes): its holes are not read, so a sparse
    file costs what was written, and the same bytes with other holes hash otherwise (a
    layer then is not shared, nothing worse)."""
    digest = hashlib.sha256()
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        size, offset = os.fstat(fd).st_size, 0
        while offset < size:
            try:
                start = os.lseek(fd, offset, os.SEEK_DATA)
            except OSError as exc:
                if exc.errno == errno.ENXIO:  # only a hole after offset
                    break
                raise
            end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
            digest.update(b"%d+%d:" % (start, end - start))
            while start < end:
                chunk = os.pread(fd, min(end - start, READ_SIZE), start)
                if not chunk:
                    break
                digest.update(chunk)
                start += len(chunk)
            offset = end
    finally:
        os.close(fd)
    return digest.digest()


def _user_xattrs(name: str, dir_fd: int) -> list[tuple[bytes, bytes]]:
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
    try:
        return sorted(
            (attr.encode(), os.getxattr(fd, attr))
            for attr in os.listxattr(fd)
            if attr.encode().startswith(USER_XATTR)
        )
    except OSError:
        return []
    finally:
        os.close(fd)


def snapshot_digest(layers: Iterable[str]) -> str:
    return "sha256:" + hashlib.sha256("\n".join(layers).encode()).hexdigest()

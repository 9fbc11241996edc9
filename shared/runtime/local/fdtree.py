"""Trees a sandbox writes, read on the host by descriptor, never by path.

Host code runs as root, and a sandbox controls every name below the directories it writes
(``/workspace``, its copy-on-write root, ``/.sbx``) and can change them while the host
reads them: it can swap a directory for a symbolic link to a host directory
(``renameat2(RENAME_EXCHANGE)``) between the host's look at an entry and its open. A copy
that resolves ``source/a/b/c`` as one path then reads host files. So nothing here resolves
a path through a directory the sandbox can write:

* each directory is opened from its parent's descriptor, one name at a time, with
  ``O_NOFOLLOW | O_DIRECTORY``, and each entry opened (a directory, a file) is checked to
  be the one just looked at (same device, inode and type): an entry swapped meanwhile is
  left out of this pass, as changed (the frozen refresh copies what it is then);
* a symbolic link is copied as a link, never followed; nothing on another filesystem than
  the tree's top is entered; an entry that is not a file, directory, link, FIFO or overlay
  whiteout (a character device 0:0) is left out; only ``user.*`` extended attributes (what
  overlayfs keeps in a user namespace) are copied;
* trees deeper than :data:`MAX_DEPTH` are refused (a descriptor is held per level);
* files are copied sparse: a reflink where the filesystem shares blocks, else their data
  extents only (``SEEK_DATA``/``SEEK_HOLE``), never past the size they had when opened; a
  file with holes costs what was written;
* every byte and entry written goes through a guard that may stop the copy (a budget, the
  filesystem's free space and inodes).

Where the copy goes (``dest``) is the host's own directory, out of every sandbox's reach.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from sbx_api import errors

MAX_DEPTH = 256
"""Deepest directory a copy enters (two descriptors are held per level)."""
MAX_ENTRIES = 1_000_000
"""Most entries (names: hard links count once each) one walk of a tree takes."""
LINK_PATH_MAX = 4000
"""Longest path a hard link's first copy is remembered by (a link needs a path)."""
BLOCK = 4096
"""What an entry costs at least on disk (its inode, a directory's block): charged per entry."""
CHUNK = 1 << 20
FICLONE = 0x40049409
XATTR_PREFIX = "user."

Note = tuple[int, int, int]
"""What a copy notes of an entry when it looks at it: inode, ctime (ns) and mode. The ctime
changes with any change of its content, metadata or (a directory) its entries, and cannot
be set back. Notes are keyed by :func:`_key` (the entry's directory and name, hashed: a
few dozen bytes an entry however long its path)."""

CTIME_SLACK_NS = 50_000_000
"""File times come from a coarse clock (a tick of up to 10 ms): an entry changed this
shortly before it was noted may change again without its ctime moving, so a refresh
copies it again whatever its ctime says."""

Guard = Callable[[int, int], None]
"""Called before a copy writes ``bytes`` more and makes ``entries`` more; raises to stop it."""

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY
_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_GONE = (
    errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.EINVAL, errno.ENXIO, errno.EACCES, errno.EAGAIN,
)  # fmt: skip
"""An entry that vanished, changed kind (a whiteout: EACCES on a nodev mount) or is leased
(EAGAIN) between a look and an open: left out of this pass, as changed."""


def _no_guard(size: int, entries: int) -> None:
    return None


def open_dir(path: Path) -> int | None:
    """The top of a tree, opened without following a link; None if it is not a directory."""
    try:
        return os.open(path, _DIR)
    except OSError as exc:
        if exc.errno in _GONE:
            return None
        raise


def _names(dir_fd: int) -> list[str]:
    try:
        return os.listdir(dir_fd)
    except OSError as exc:
        if exc.errno in _GONE:  # (removed after it was opened)
            return []
        raise


def _key(parent: os.stat_result | int, name: str) -> int:
    """An entry's key in the notes: its directory's inode and its name. (A collision could
    only keep a copy whose note is the same inode's: the same file.)"""
    return hash((parent if isinstance(parent, int) else parent.st_ino, name))


def _too_many() -> errors.LimitExceeded:
    return errors.LimitExceeded(f"the tree has more than {MAX_ENTRIES} entries; such a tree is not copied")


def _same(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino, stat.S_IFMT(a.st_mode)) == (b.st_dev, b.st_ino, stat.S_IFMT(b.st_mode))


def _entry(dir_fd: int, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError as exc:
        if exc.errno in _GONE:
            return None
        raise


def _open_checked(dir_fd: int, name: str, flags: int, looked: os.stat_result) -> int | None:
    """``name`` opened without following a link, if it is still the entry ``looked`` at."""
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in _GONE:
            return None
        raise
    if _same(os.fstat(fd), looked):
        return fd
    os.close(fd)
    return None


def _too_deep() -> errors.LimitExceeded:
    return errors.LimitExceeded(
        f"a directory is nested more than {MAX_DEPTH} levels deep; such a tree is not copied"
    )


@dataclass
class Tally:
    """What a tree takes: bytes its entries really hold on disk (holes are free; at least
    :data:`BLOCK` an entry), and entries."""

    bytes: int = 0
    entries: int = 0
    seen: set[tuple[int, int]] = field(default_factory=set, repr=False)


def measure(top: Path) -> Tally:
    """What a copy of the tree at ``top`` needs, read by descriptor (a link is not followed;
    a directory met twice, moved meanwhile, and a file's other names count once)."""
    tally = Tally()
    fd = open_dir(top)
    if fd is None:
        return tally
    try:
        _measure(fd, os.fstat(fd).st_dev, tally, 0)
    finally:
        os.close(fd)
    tally.seen.clear()
    return tally


def _measure(dir_fd: int, dev: int, tally: Tally, depth: int) -> None:
    if depth >= MAX_DEPTH:
        raise _too_deep()
    for name in _names(dir_fd):
        st = _entry(dir_fd, name)
        if st is None or st.st_dev != dev:
            continue
        tally.entries += 1
        if tally.entries > MAX_ENTRIES:
            raise _too_many()
        if (st.st_dev, st.st_ino) in tally.seen:
            continue  # (another name of a file, or a directory moved into what is still to walk)
        if st.st_nlink > 1 or stat.S_ISDIR(st.st_mode):
            tally.seen.add((st.st_dev, st.st_ino))
        tally.bytes += max(st.st_blocks * 512, BLOCK)
        if stat.S_ISDIR(st.st_mode):
            sub = _open_checked(dir_fd, name, _DIR, st)
            if sub is not None:
                try:
                    _measure(sub, dev, tally, depth + 1)
                finally:
                    os.close(sub)


@dataclass
class Copy:
    """What one :func:`sync` did: every entry it left equal to the source (noted as it was
    looked at, for a later refresh), and how many entries it wrote."""

    notes: dict[int, Note] = field(default_factory=dict)
    written: int = 0
    bytes: int = 0


def sync(
    source: Path,
    dest: Path,
    *,
    before: dict[int, Note] | None = None,
    recent_ns: int = 0,
    guard: Guard = _no_guard,
) -> Copy:
    """Make ``dest`` (the host's) what the tree at ``source`` (a sandbox's) is, reading the
    source by descriptor only.

    ``before`` None: ``dest`` must not exist; everything is copied. Otherwise ``dest`` is a
    copy made earlier whose entries were noted in ``before``: an entry whose note is the
    same and whose ctime is older than ``recent_ns`` (file times come from a coarse clock)
    is kept as it is, everything else is copied again, and what the source no longer has
    is removed. A missing source gives an empty directory."""
    refreshing = before is not None
    job = _Sync(before or {}, recent_ns, guard, refreshing)
    if not refreshing:
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.mkdir(dest, 0o700)
    out = os.open(dest, _DIR)
    try:
        top = open_dir(source)
        if top is None:
            if refreshing:
                job.prune(out, set())
            os.fchmod(out, 0o755)
            return job.result
        try:
            looked = os.fstat(top)
            job.dev = looked.st_dev
            job.dest_top = out
            job.directory(top, looked, out, "", 0, placed=True)
            job.finish(out, looked, top)
            job.result.notes[_key(0, ".")] = (looked.st_ino, looked.st_ctime_ns, looked.st_mode)
        finally:
            os.close(top)
    finally:
        os.close(out)
    return job.result


class _Sync:
    def __init__(self, before: dict[int, Note], recent_ns: int, guard: Guard, refreshing: bool) -> None:
        self.before, self.recent_ns, self.guard, self.refreshing = before, recent_ns, guard, refreshing
        self.result = Copy()
        self.dev = 0
        self.dest_top = -1
        self.entries = 0
        self.dirs: set[int] = set()  # directories walked in this pass (one met again moved meanwhile)
        self.linked: dict[int, str] = {}  # inode -> where its first copy is (hard links kept)
        self.reflinks = True

    def directory(
        self, src: int, looked: os.stat_result, out: int, rel: str | None, depth: int, *, placed: bool
    ) -> None:
        """Copy what directory ``src`` holds into ``out``. ``placed``: ``out`` is where the
        earlier pass copied this very directory (else nothing in it is taken as kept)."""
        if depth >= MAX_DEPTH:
            raise _too_deep()
        kept: set[str] = set()
        for name in _names(src):
            st = _entry(src, name)
            if st is None or st.st_dev != self.dev:
                continue
            self.entries += 1
            if self.entries > MAX_ENTRIES:
                raise _too_many()
            key = _key(looked, name)
            note = (st.st_ino, st.st_ctime_ns, st.st_mode)
            same = placed and self.before.get(key) == note and st.st_ctime_ns < self.recent_ns
            path = f"{rel}{name}" if rel is not None and len(rel) + len(name) < LINK_PATH_MAX else None
            if stat.S_ISDIR(st.st_mode):
                done = self.subdirectory(src, out, name, st, path, depth, same)
            elif same:
                done = True
            else:
                done = self.other(src, out, name, st, path)
            if done:
                kept.add(name)
                self.result.notes[key] = note
        if self.refreshing:
            self.prune(out, kept)

    def subdirectory(
        self, src: int, out: int, name: str, st: os.stat_result, path: str | None, depth: int, same: bool
    ) -> bool:
        if st.st_ino in self.dirs:  # met again: moved meanwhile into what was still to walk
            return False
        sub = _open_checked(src, name, _DIR, st)
        if sub is None:
            return False
        self.dirs.add(st.st_ino)
        try:
            if not same:
                self.written(0, 1)
            theirs = self.dest_dir(out, name)
            try:
                self.directory(sub, st, theirs, None if path is None else f"{path}/", depth + 1, placed=same)
                self.finish(theirs, st, sub)
            finally:
                os.close(theirs)
        finally:
            os.close(sub)
        return True

    def dest_dir(self, out: int, name: str) -> int:
        """The copy's directory ``name`` in ``out``: made, or kept if it is one already."""
        there = _entry(out, name)
        if there is not None and not stat.S_ISDIR(there.st_mode):
            _remove(out, name, there)
            there = None
        if there is None:
            os.mkdir(name, 0o700, dir_fd=out)
        return os.open(name, _DIR, dir_fd=out)

    def other(self, src: int, out: int, name: str, st: os.stat_result, path: str | None) -> bool:
        """A file, link, FIFO or whiteout copied in place of what ``out`` has as ``name``."""
        kind = stat.S_IFMT(st.st_mode)
        if kind == stat.S_IFREG:
            return self.file(src, out, name, st, path)
        if kind == stat.S_IFLNK:
            try:
                target = os.readlink(name, dir_fd=src)
            except OSError as exc:
                if exc.errno in _GONE:
                    return False
                raise
            now = _entry(src, name)
            if now is None or not _same(now, st) or now.st_ctime_ns != st.st_ctime_ns:
                return False
            self.replace(out, name)
            self.written(len(target), 1)
            os.symlink(target, name, dir_fd=out)
        elif kind == stat.S_IFIFO or (kind == stat.S_IFCHR and st.st_rdev == 0):
            self.replace(out, name)
            self.written(0, 1)
            os.mknod(name, kind | 0o600, st.st_rdev, dir_fd=out)
        else:  # sockets, devices: nothing a sandbox's files need (it cannot make devices)
            return False
        os.chown(name, st.st_uid, st.st_gid, dir_fd=out, follow_symlinks=False)
        if kind != stat.S_IFLNK:
            os.chmod(name, _mode(st), dir_fd=out)
        os.utime(name, ns=(st.st_atime_ns, st.st_mtime_ns), dir_fd=out, follow_symlinks=False)
        return True

    def file(self, src: int, out: int, name: str, st: os.stat_result, path: str | None) -> bool:
        fd = _open_checked(src, name, _FILE, st)
        if fd is None:
            return False
        try:
            self.replace(out, name)
            if st.st_nlink > 1 and not self.refreshing:
                first = self.linked.get(st.st_ino)
                if first is not None:
                    with contextlib.suppress(OSError):  # (a path too long: copied instead)
                        os.link(first, name, src_dir_fd=self.dest_top, dst_dir_fd=out, follow_symlinks=False)
                        self.result.written += 1
                        return True
                elif path is not None:  # (paths past LINK_PATH_MAX are not kept: copied instead)
                    self.linked[st.st_ino] = path
            self.written(0, 1)
            copy = os.open(name, _NEW, 0o600, dir_fd=out)
            try:
                now = os.fstat(fd)
                self.data(fd, copy, now.st_size, now.st_blocks)
                if os.fstat(copy).st_size != now.st_size:  # (holes at its end, a reflink of more)
                    os.ftruncate(copy, now.st_size)
                self.finish(copy, st, fd, new=True)
            finally:
                os.close(copy)
        finally:
            os.close(fd)
        return True

    def data(self, fd: int, copy: int, size: int, blocks: int) -> None:
        """The file's data up to ``size``: a reflink (no blocks written), or its data
        extents, holes left as holes."""
        if self.reflinks:
            try:
                fcntl.ioctl(copy, FICLONE, fd)
                return
            except OSError:
                self.reflinks = False  # (not on this filesystem pair: not tried again)
        if size <= CHUNK and blocks * 512 >= size:  # small and whole: one read
            chunk = os.pread(fd, size, 0)
            self.written(len(chunk), 0)
            os.pwrite(copy, chunk, 0)
            return
        offset = 0
        while offset < size:
            try:
                start = os.lseek(fd, offset, os.SEEK_DATA)
            except OSError as exc:
                if exc.errno == errno.ENXIO:  # no data after offset
                    return
                raise
            try:
                end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
            except OSError as exc:
                if exc.errno == errno.ENXIO:  # truncated meanwhile: the refresh sees its ctime
                    return
                raise
            while start < end:
                chunk = os.pread(fd, min(end - start, CHUNK), start)
                if not chunk:  # truncated meanwhile: the refresh sees its ctime
                    return
                self.written(len(chunk), 0)
                os.pwrite(copy, chunk, start)
                start += len(chunk)
            offset = end

    def finish(self, fd: int, st: os.stat_result, source_fd: int, *, new: bool = False) -> None:
        """Owner, mode (a file's set-id bits dropped: nothing runs set-id in a sandbox, and a
        copy is host root's), ``user.*`` attributes and times."""
        os.fchown(fd, st.st_uid, st.st_gid)
        os.fchmod(fd, _mode(st))
        theirs = [a for a in _xattrs(source_fd) if a.startswith(XATTR_PREFIX)]
        for attr in () if new else _xattrs(fd):  # (a directory kept by a refresh may have lost one)
            if attr.startswith(XATTR_PREFIX) and attr not in theirs:
                os.removexattr(fd, attr)
        for attr in theirs:
            with contextlib.suppress(OSError):  # removed meanwhile
                os.setxattr(fd, attr, os.getxattr(source_fd, attr))
        os.utime(fd, ns=(st.st_atime_ns, st.st_mtime_ns))

    def written(self, size: int, entries: int) -> None:
        self.guard(size + entries * BLOCK, entries)
        self.result.bytes += size
        self.result.written += entries

    def replace(self, out: int, name: str) -> None:
        if self.refreshing:
            there = _entry(out, name)
            if there is not None:
                _remove(out, name, there)

    def prune(self, out: int, kept: set[str]) -> None:
        for name in os.listdir(out):
            if name not in kept:
                there = _entry(out, name)
                if there is not None:
                    _remove(out, name, there)


def read_file(
    top: Path, names: tuple[str, ...], limit: int
) -> tuple[bytes, os.stat_result, os.stat_result] | None:
    """The file at ``top/names...`` (a sandbox's), each name opened from its parent's
    descriptor without following a link: its bytes, its stat and its directory's; None if
    a step is not a directory, the last is not a regular file, or it has more than
    ``limit`` bytes."""
    fd = open_dir(top)
    for name in names[:-1]:
        if fd is None:
            return None
        try:
            st = _entry(fd, name)
            sub = _open_checked(fd, name, _DIR, st) if st is not None and stat.S_ISDIR(st.st_mode) else None
        finally:
            os.close(fd)
        fd = sub
    if fd is None:
        return None
    try:
        st = _entry(fd, names[-1])
        if st is None or not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            return None
        f = _open_checked(fd, names[-1], _FILE, st)
        if f is None:
            return None
        try:
            data = os.pread(f, limit + 1, 0)
        finally:
            os.close(f)
        return (data, st, os.fstat(fd)) if len(data) <= limit else None
    finally:
        os.close(fd)


def _xattrs(fd: int) -> list[str]:
    try:
        return os.listxattr(fd)
    except OSError as exc:
        if exc.errno in (errno.ENOTSUP, errno.EPERM):
            return []
        raise


def _mode(st: os.stat_result) -> int:
    mode = stat.S_IMODE(st.st_mode)
    return mode if stat.S_ISDIR(st.st_mode) else mode & ~(stat.S_ISUID | stat.S_ISGID)


def _remove(dir_fd: int, name: str, st: os.stat_result) -> None:
    """Remove an entry of the host's own copy (a directory with all it holds)."""
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(name, dir_fd=dir_fd)
    else:
        os.unlink(name, dir_fd=dir_fd)

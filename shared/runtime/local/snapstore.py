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

A layer's name is the SHA-256 of its content (paths, types, modes, owners, sizes, file
contents, link targets, devices, overlay xattrs, in sorted order): a copy equal to a layer
that exists is dropped, and its snapshot uses that one. A layer is removed once no record
and no sandbox (``base.json`` in its directory) names it: deleting a snapshot never
breaks a sandbox started from it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import stat
import subprocess
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import msgspec

from shared.contract import errors, ids
from shared.domain import describe
from shared.runtime import api

OVERLAY_XATTR = b"user.overlay."
READ_SIZE = 1024 * 1024
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

    def check_room(self, needed: int) -> None:
        """Raise LimitExceeded if ``needed`` more bytes would take the store past its budget."""
        held = self.bytes()
        if held + needed > self.budget:
            raise errors.LimitExceeded(
                f"the snapshot store holds {describe.size(held)} of its {describe.size(self.budget)} budget "
                f"(SBX_SNAPSHOT_BUDGET) and this snapshot needs about {describe.size(needed)}: "
                "delete snapshots first"
            )

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


def copy_untrusted_file(source: Path, dest: Path) -> bool:
    """Copy ``source``, a file the sandbox controls (its ``/.sbx/shell/cwd``), as the host:
    only a regular file of at most ``SHELL_FILE_MAX`` bytes in a real directory, never
    through a symbolic link (one pointing at a host path would otherwise be read on the
    host), with its owner and mode. False (nothing copied) for anything else."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        folder = os.open(source.parent, flags | os.O_DIRECTORY)
    except OSError:
        return False
    try:
        try:
            fd = os.open(source.name, flags, dir_fd=folder)
        except OSError:
            return False
        with os.fdopen(fd, "rb") as f:
            st, where = os.fstat(fd), os.fstat(folder)
            if not stat.S_ISREG(st.st_mode) or st.st_size > SHELL_FILE_MAX:
                return False
            data = f.read(SHELL_FILE_MAX + 1)[:SHELL_FILE_MAX]
    finally:
        os.close(folder)
    dest.parent.mkdir(exist_ok=True)
    os.chmod(dest.parent, stat.S_IMODE(where.st_mode))
    os.chown(dest.parent, where.st_uid, where.st_gid)
    dest.write_bytes(data)
    os.chmod(dest, stat.S_IMODE(st.st_mode))
    os.chown(dest, st.st_uid, st.st_gid)
    return True


VANISHED = "No such file or directory"
"""What cp says of an entry removed between listing its directory and copying it."""


def copy_tree(source: Path, dest: Path, *, changing: bool = False) -> None:
    """``source`` as ``dest`` (which must not exist), everything kept: owners, modes, links,
    devices (overlay whiteouts), xattrs (opaque directories); empty if there is no source.
    ``changing``: the source is being written meanwhile, so an entry that vanishes while it
    is copied is no error (``refresh`` settles what the copy missed); any other is."""
    if not source.exists():
        dest.mkdir(parents=True, mode=0o755)
        return
    dest.parent.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["cp", "-a", "--reflink=auto", "--", str(source), str(dest)],
        capture_output=True,
        text=True,
        check=False,
    )
    problems = [line for line in done.stderr.splitlines() if not (changing and VANISHED in line)]
    if done.returncode != 0 and (problems or not done.stderr.strip()):
        said = "\n".join(problems)[-500:] or f"cp exited {done.returncode}"
        raise errors.InfrastructureError(f"copying {source.name} for a snapshot failed: {said}")


Note = tuple[int, int, int]
"""What a scan notes of an entry: inode, ctime (ns) and mode. The ctime changes with any
change of its content, metadata or (a directory) its entries, and cannot be set back."""


def scan(top: Path) -> dict[str, Note]:
    """Every entry under ``top`` (``.`` for itself), by relative path."""
    found: dict[str, Note] = {}
    if not top.is_dir():
        return found
    for directory, dirs, files in os.walk(top):
        for name in (".", *dirs, *files) if directory == str(top) else (*dirs, *files):
            path = os.path.join(directory, name)
            with contextlib.suppress(FileNotFoundError):
                st = os.lstat(path)
                found[os.path.normpath(os.path.relpath(path, top))] = (st.st_ino, st.st_ctime_ns, st.st_mode)
    return found


CTIME_SLACK_NS = 50_000_000
"""File times come from a coarse clock (a tick of up to 10 ms): an entry changed this
shortly before a scan may change again without its ctime moving, so it is copied again
whatever its ctime says."""


def refresh(source: Path, dest: Path, before: dict[str, Note], scanned_ns: int) -> int:
    """Bring ``dest``, a copy of ``source`` made after ``before`` was scanned (at
    ``scanned_ns``, ``time.time_ns()``), up to what ``source`` is now: what changed since,
    is new, or changed just before the scan is copied again, what is gone is removed. Run
    while nothing writes ``source`` (frozen): its cost is a scan, plus the changes.
    Returns how many entries were copied again."""
    recent = scanned_ns - CTIME_SLACK_NS
    now = scan(source)
    for rel in sorted(set(scan(dest)) - set(now), key=lambda r: -r.count("/")):
        _remove(dest / rel)
    copied = 0
    for rel in sorted(now, key=lambda r: (r.count("/"), r)):  # parents first
        if rel != "." and before.get(rel) == now[rel] and now[rel][1] < recent:
            continue
        target = dest if rel == "." else dest / rel
        if _copy_entry(source if rel == "." else source / rel, target):
            copied += 1
    return copied


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _copy_entry(source: Path, dest: Path) -> bool:
    """One entry as it is (a directory: itself, not what is in it). False if it is gone
    or cannot be copied (a socket)."""
    try:
        st = os.lstat(source)
    except FileNotFoundError:
        return False
    kind = stat.S_IFMT(st.st_mode)
    if kind == stat.S_IFDIR:
        if dest.is_symlink() or (dest.exists() and not dest.is_dir()):
            _remove(dest)
        dest.mkdir(exist_ok=True)
    else:
        _remove(dest)
        if kind == stat.S_IFREG:
            shutil.copyfile(source, dest, follow_symlinks=False)
        elif kind == stat.S_IFLNK:
            os.symlink(os.readlink(source), dest)
        elif kind in (stat.S_IFCHR, stat.S_IFBLK, stat.S_IFIFO):
            os.mknod(dest, st.st_mode, st.st_rdev)
        else:
            return False
    os.lchown(dest, st.st_uid, st.st_gid)
    if kind != stat.S_IFLNK:
        shutil.copystat(source, dest, follow_symlinks=False)  # mode, times, xattrs
    return True


def apparent_bytes(paths: Iterable[Path]) -> int:
    """Bytes of the regular files under ``paths`` (what a copy of them needs, about)."""
    total = 0
    for top in paths:
        for directory, _, files in os.walk(top):
            for name in files:
                with contextlib.suppress(OSError):
                    total += os.lstat(os.path.join(directory, name)).st_size
    return total


def disk_bytes(top: Path) -> int:
    """Bytes ``top`` takes on disk (blocks of everything under it)."""
    total = 0
    for directory, dirs, files in os.walk(top):
        for name in (*dirs, *files):
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(directory, name)).st_blocks * 512
    return total


def tree_digest(top: Path) -> tuple[str, int]:
    """The SHA-256 of everything under ``top`` (hex), and how many entries it holds."""
    outer = hashlib.sha256()
    entries = 0
    for directory, dirs, files in os.walk(top):
        dirs.sort()
        for name in sorted((*dirs, *files)):
            path = os.path.join(directory, name)
            st = os.lstat(path)
            entries += 1
            rel = os.path.relpath(path, top).encode("utf-8", "surrogateescape")
            outer.update(b"%s\0%o\0%d\0%d\0" % (rel, st.st_mode, st.st_uid, st.st_gid))
            if stat.S_ISREG(st.st_mode):
                outer.update(b"f%d\0%s" % (st.st_size, _file_digest(path)))
            elif stat.S_ISLNK(st.st_mode):
                outer.update(b"l" + os.fsencode(os.readlink(path)))
            elif stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
                outer.update(b"d%d" % st.st_rdev)
            for attr in sorted(_overlay_xattrs(path)):
                outer.update(b"x%s=%s" % (attr, os.getxattr(path, attr, follow_symlinks=False)))
            outer.update(b"\n")
    return outer.hexdigest(), entries


def _file_digest(path: str) -> bytes:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(READ_SIZE):
            digest.update(chunk)
    return digest.digest()


def _overlay_xattrs(path: str) -> list[bytes]:
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError:
        return []
    return [n.encode() for n in names if n.encode().startswith(OVERLAY_XATTR)]


def snapshot_digest(layers: Iterable[str]) -> str:
    return "sha256:" + hashlib.sha256("\n".join(layers).encode()).hexdigest()

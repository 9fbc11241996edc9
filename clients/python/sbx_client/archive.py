"""Tar streams between the host and the sandbox.

Up: a tar built from the host's manifest, never following a symlink (files are opened
with ``O_NOFOLLOW``), with no host user or group names in it. Down: the sandbox's tar is
untrusted input: only members the client asked for, each once, and only files,
directories and symlinks become changes, which :func:`sync.apply` then applies with all
its checks.
"""

from __future__ import annotations

import io
import os
import stat
import tarfile
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO

from sbx_client import sync

CHUNK = 1 << 20
SPOOL = 64 << 20
"""A download is kept in memory up to this size, then in a temporary file."""
DOWNLOAD_MAX = 8 << 30
"""The most one pull-back may bring (the sandbox decides what it sends)."""


class TooLarge(Exception):
    pass


class _Chunks(io.RawIOBase):
    """A write-only file whose bytes are collected for a generator to hand out."""

    def __init__(self) -> None:
        self.data = bytearray()

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        self.data += b
        return len(b)

    def take(self) -> bytes:
        out = bytes(self.data)
        self.data.clear()
        return out


def _info(name: str, entry: sync.Entry, mtime: float) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.mtime = int(mtime)
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.mode = entry.mode & 0o7777
    if entry.kind == "dir":
        info.type = tarfile.DIRTYPE
    elif entry.kind == "symlink":
        info.type = tarfile.SYMTYPE
        info.linkname = entry.target
    return info


def pack(
    root: Path,
    upserts: list[str],
    manifest: Mapping[str, sync.Entry],
    extra: Mapping[str, bytes] | None = None,
    skipped: list[tuple[str, str]] | None = None,
) -> Iterator[bytes]:
    """The tar of ``upserts`` (paths of ``manifest`` under ``root``) plus ``extra``
    (path → content, files of mode 0644), in chunks. A path that vanished or became
    something else since the scan is left out and noted in ``skipped``."""
    sink = _Chunks()
    with tarfile.open(fileobj=sink, mode="w|", format=tarfile.PAX_FORMAT) as archive:
        for path in upserts:
            entry = manifest[path]
            try:
                _add(archive, root, path, entry)
            except OSError as exc:
                if skipped is not None:
                    skipped.append((path, f"{type(exc).__name__}: {exc}"))
            if len(sink.data) >= CHUNK:
                yield sink.take()
        for path, content in (extra or {}).items():
            info = _info(path, sync.Entry("file", mode=0o644), 0)
            info.size = len(content)
            archive.addfile(info, io.BytesIO(content))
            if len(sink.data) >= CHUNK:
                yield sink.take()
    yield sink.take()


def _add(archive: tarfile.TarFile, root: Path, path: str, entry: sync.Entry) -> None:
    full = root / path
    if entry.kind == "file":
        fd = os.open(full, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            info_stat = os.fstat(f.fileno())
            if not stat.S_ISREG(info_stat.st_mode):
                raise OSError(f"{path} is no longer a regular file")
            info = _info(path, sync.Entry("file", mode=stat.S_IMODE(info_stat.st_mode)), info_stat.st_mtime)
            info.size = info_stat.st_size
            archive.addfile(info, f)
        return
    info_stat = full.lstat()
    if entry.kind == "symlink":
        if not stat.S_ISLNK(info_stat.st_mode):
            raise OSError(f"{path} is no longer a symlink")
        archive.addfile(_info(path, sync.Entry("symlink", target=os.readlink(full)), info_stat.st_mtime))
    else:
        if not stat.S_ISDIR(info_stat.st_mode):
            raise OSError(f"{path} is no longer a directory")
        archive.addfile(
            _info(path, sync.Entry("dir", mode=stat.S_IMODE(info_stat.st_mode)), info_stat.st_mtime)
        )


class Download:
    """Collects a tar as it streams in; then :meth:`members` reads it."""

    def __init__(self, limit: int = DOWNLOAD_MAX) -> None:
        self.file = tempfile.SpooledTemporaryFile(max_size=SPOOL)
        self.limit = limit
        self.size = 0

    def write(self, data: bytes) -> None:
        self.size += len(data)
        if self.size > self.limit:
            raise TooLarge(f"the sandbox sent more than {self.limit} bytes back")
        self.file.write(data)

    def close(self) -> None:
        self.file.close()

    def members(
        self, wanted: Mapping[str, tuple[str, int | None]]
    ) -> Iterator[tuple[str, sync.Entry, IO[bytes]] | tuple[str, str]]:
        """(path, entry, content) for each wanted member, or (path, why) for a refused one.
        ``wanted`` maps each path asked for to its kind in the listing (``f``, ``d``,
        ``l``) and size: a member must be of that kind, and a file no larger. The content
        is read as it is applied, never held whole in memory. Paths asked for but missing
        from the tar are not reported here."""
        self.file.seek(0)
        seen: set[str] = set()
        try:
            archive = tarfile.open(fileobj=self.file, mode="r|")
        except tarfile.TarError as exc:
            yield ("", f"the sandbox's archive is unreadable: {exc}")
            return
        with archive:
            try:
                for member in archive:
                    name = member.name.rstrip("/") if member.isdir() else member.name
                    if name not in wanted or name in seen:
                        yield (name, "not asked for (or sent twice): ignored")
                        continue
                    seen.add(name)
                    listed_kind, listed = wanted[name]
                    kind = (
                        "f" if member.isreg() else "d" if member.isdir() else "l" if member.issym() else "?"
                    )
                    if member.issparse():
                        yield (name, "a sparse file: not brought back")
                    elif kind != listed_kind:
                        yield (name, f"not the kind its listing said ({kind}, not {listed_kind})")
                    elif member.isreg():
                        if listed is not None and member.size > listed:
                            yield (name, f"larger ({member.size} bytes) than its listing said ({listed})")
                            continue
                        source = archive.extractfile(member)
                        entry = sync.Entry("file", mode=member.mode & 0o777, size=member.size)
                        yield (name, entry, source if source is not None else io.BytesIO())
                    elif member.isdir():
                        yield (name, sync.Entry("dir", mode=member.mode & 0o777), io.BytesIO())
                    elif member.issym():
                        yield (name, sync.Entry("symlink", target=member.linkname), io.BytesIO())
                    else:
                        yield (name, "only files, directories and symlinks come back")
            except tarfile.TarError as exc:
                yield ("", f"the sandbox's archive is broken: {exc}")

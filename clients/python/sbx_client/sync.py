"""Two-way sync of a code dir with its copy in the sandbox: what changed (pure, from
manifests) and applying the sandbox's changes on the host (safely).

A manifest maps each relative path (POSIX, no ``..``) to an :class:`Entry`: a file with
its mode and content digest, a directory, or a symlink with its target. Scanning never
follows symlinks, and digests are cached by (size, mtime, inode), so an unchanged
10k-file tree costs one ``lstat`` per file.

Pull-back (sandbox → host) is filtered:

* inside any ``.git`` directory only history and the index come back (:data:`GIT_BACK`:
  loose objects and packs, refs, logs, HEAD, index, packed-refs, ...): config, hooks,
  info, ``objects/info/alternates``, modules, worktrees and everything else stay as the
  host has them, so nothing built in the sandbox can plant a hook or a config that a
  later host-side git runs; ``.GIT``, ``.git.``, ``git~1`` count as ``.git`` (and never
  come back under another spelling);
* a ``.git`` *file* (a gitfile pointing elsewhere) never comes back;
* a symlink comes back only if its target neither is absolute nor contains ``..``;
* modes come back without setuid/setgid/sticky bits or write bits for others;
* every write goes to a temporary file in the same directory, then is renamed, and no
  directory on the way may be a symlink: nothing is ever written outside the code dir.
"""

from __future__ import annotations

import fnmatch
import functools
import hashlib
import os
import re
import shutil
import stat
import subprocess
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import IO, Literal

import msgspec

GIT_BACK = re.compile(
    r"objects(/[0-9a-f]{2}(/[0-9a-f]{38,62})?|/pack(/pack-[0-9a-f]{40,64}\.(pack|idx|rev|bitmap|mtimes))?)?"
    r"|refs(/[^/]+)*|logs(/[^/]+)*"
    r"|HEAD|ORIG_HEAD|FETCH_HEAD|index|packed-refs|COMMIT_EDITMSG|MERGE_HEAD|MERGE_MSG|MERGE_MODE"
    r"|CHERRY_PICK_HEAD|REVERT_HEAD|shallow"
)
"""What may come back inside a ``.git`` directory: loose objects and packs (never
``objects/info/alternates``, which would lend the repository another one's objects),
refs, logs, HEAD, the index and the merge state files."""
GIT_UP = re.compile(GIT_BACK.pattern + r"|info/exclude|info/attributes|description")
"""What goes up inside a ``.git`` directory: history, the index and the harmless local
files; never its config as it is (the allowlisted rendering goes instead), hooks,
modules (submodules' repositories, with configs of their own) or worktrees."""
GIT_OBJECT = re.compile(r"objects/[0-9a-f]{2}/[0-9a-f]{38,62}|objects/pack/pack-[0-9a-f]{40,64}\.[a-z]+")
"""Objects are named by their content: they come back only when new, never rewritten
or deleted (pruning is the host's git's business)."""
FILE_MODE_MASK = 0o755
"""Modes that come back: no setuid/setgid/sticky bits, nothing writable by others."""
DEFAULT_EXCLUDES = ("node_modules/", ".venv/", "__pycache__/", "*.pyc", ".sbx/")


class Entry(msgspec.Struct, frozen=True, array_like=True):
    """A msgspec struct, not a dataclass: a kept session's record of 10k of them loads
    several times faster."""

    kind: Literal["file", "dir", "symlink"]
    mode: int = 0
    digest: str = ""
    size: int = 0
    target: str = ""


Manifest = dict[str, Entry]


@dataclass
class Changes:
    upsert: list[str] = field(default_factory=list)
    """Paths whose content, mode or kind is new or changed (parents before children)."""
    delete: list[str] = field(default_factory=list)
    """Paths gone (children before parents)."""

    def __bool__(self) -> bool:
        return bool(self.upsert or self.delete)


@dataclass
class Report:
    written: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    refused: list[tuple[str, str]] = field(default_factory=list)
    """(path, why) for changes that were not applied on the host."""


# ---- manifests -----------------------------------------------------------------------------


def excluded(path: str, excludes: Iterable[str], *, fold: bool = False) -> bool:
    """Whether ``path`` matches an exclude. ``fold`` compares case-insensitively, as a
    case-insensitive host file system would (``.VENV`` is ``.venv`` there): what comes
    back from the sandbox is checked that way."""
    if fold:
        path = path.casefold()
        excludes = [p.casefold() for p in excludes]
    parts = PurePosixPath(path).parts
    for pattern in excludes:
        if pattern.endswith("/"):
            if pattern[:-1] in parts:
                return True
        elif fnmatch.fnmatchcase(parts[-1], pattern) or fnmatch.fnmatchcase(path, pattern):
            return True
    return False


def scan(root: Path, *, excludes: Iterable[str] = DEFAULT_EXCLUDES, cache: dict | None = None) -> Manifest:
    """The manifest of ``root`` (symlinks are entries, never followed). ``cache`` (kept
    by the caller between scans) maps path → ((size, mtime_ns, ino), digest)."""
    excludes = tuple(excludes)
    cache = {} if cache is None else cache
    out: Manifest = {}
    dir_names = {p[:-1] for p in excludes if p.endswith("/")}
    name_patterns = [p for p in excludes if not p.endswith("/")]
    by_name = re.compile("|".join(fnmatch.translate(p) for p in name_patterns if "/" not in p) or "(?!)")
    by_path = [p for p in name_patterns if "/" in p]

    def skip(rel: str, name: str) -> bool:
        return bool(by_name.match(name)) or any(fnmatch.fnmatch(rel, p) for p in by_path)

    pending = [("", os.fspath(root))]
    while pending:
        prefix, directory = pending.pop()
        with os.scandir(directory) as entries:
            found = sorted(entries, key=lambda e: e.name)
        for entry in found:
            name = entry.name
            rel = prefix + name
            info = entry.stat(follow_symlinks=False)
            mode = info.st_mode
            if stat.S_ISDIR(mode):
                if name in dir_names or skip(rel, name):
                    continue
                out[rel] = Entry("dir", mode=stat.S_IMODE(mode))
                pending.append((rel + "/", entry.path))
            elif name_patterns and skip(rel, name):
                continue
            elif stat.S_ISLNK(mode):
                out[rel] = Entry("symlink", target=os.readlink(entry.path))
            elif stat.S_ISREG(mode):
                key = (info.st_size, info.st_mtime_ns, info.st_ino)
                known = cache.get(rel)
                digest = known[1] if known and known[0] == key else file_digest(Path(entry.path))
                cache[rel] = (key, digest)
                out[rel] = Entry("file", mode=stat.S_IMODE(mode) & 0o777, digest=digest, size=info.st_size)
    return out


def file_digest(path: Path) -> str:
    h = hashlib.blake2b(digest_size=16)
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def diff(old: Mapping[str, Entry], new: Mapping[str, Entry]) -> Changes:
    changes = Changes()
    for path in sorted(new, key=lambda p: (p.count("/"), p)):
        if old.get(path) != new[path]:
            changes.upsert.append(path)
    for path in sorted(set(old) - set(new), key=lambda p: (-p.count("/"), p)):
        changes.delete.append(path)
    return changes


# ---- what may come back ----------------------------------------------------------------------


def may_come_back(path: str, entry: Entry | None) -> str | None:
    """None if the sandbox's version of ``path`` may be applied on the host, else why not."""
    parts = PurePosixPath(path).parts
    if any(p in ("", ".", "..") for p in parts) or PurePosixPath(path).is_absolute() or "\0" in path:
        return "not a plain relative path"
    git_at = next((i for i, p in enumerate(parts) if is_git_name(p)), None)
    if git_at is not None:
        if parts[git_at] != ".git":
            return f"{parts[git_at]!r} is .git on a case-insensitive or Windows file system"
        inner = "/".join(parts[git_at + 1 :])
        if not inner:
            if entry is None:
                return ".git itself is never deleted from the host (a gitfile would come back as a directory)"
            if entry.kind != "dir":
                return ".git is not a directory (a gitfile or link stays as the host has it)"
            return None
        if entry is not None and entry.kind == "symlink":
            return "no symlinks inside .git"
        if not GIT_BACK.fullmatch(inner):
            return f".git/{inner} stays as the host has it (only history and the index come back)"
    if entry is not None and entry.kind == "symlink":
        target = PurePosixPath(entry.target)
        if target.is_absolute() or ".." in target.parts or "\0" in entry.target:
            return "a symlink that goes up or out (only links into their own directory come back)"
    return None


def git_inner(path: str) -> tuple[str, str] | None:
    """(the ``.git`` directory's path, the path inside it) for a path in a ``.git``
    directory at any depth (look-alike spellings count), else None."""
    if "git" not in path.casefold():
        return None  # every spelling of .git contains it: the common case, cheaply
    parts = PurePosixPath(path).parts
    at = next((i for i, p in enumerate(parts) if is_git_name(p)), None)
    if at is None:
        return None
    return "/".join(parts[: at + 1]), "/".join(parts[at + 1 :])


def is_git_name(name: str) -> bool:
    """``.git`` as git itself guards it: any case, trailing dots or spaces (NTFS), the
    8.3 short name ``git~1``."""
    folded = name.lower().rstrip(". ")
    return folded in (".git", "git~1")


# ---- applying on the host -----------------------------------------------------------------------


def apply(
    root: Path,
    changes: Changes,
    entries: Mapping[str, Entry],
    content: Callable[[str], bytes | IO[bytes]],
) -> Report:
    """Apply the sandbox's changes under ``root``: ``entries`` is the sandbox manifest,
    ``content(path)`` the bytes of a changed file. Refused changes are reported."""
    report = Report()
    root = Path(os.path.realpath(root))
    why: str | None
    for path in changes.delete:
        why = may_come_back(path, None) or _guarded(functools.partial(_delete, root, path))
        (report.refused.append((path, why)) if why else report.deleted.append(path))
    for path in changes.upsert:
        entry = entries.get(path)
        if entry is None:
            why = "not in the sandbox's manifest"
        else:
            write = functools.partial(_write, root, path, entry, content)
            why = may_come_back(path, entry) or _guarded(write)
        (report.refused.append((path, why)) if why else report.written.append(path))
    return report


def constant(content: bytes | IO[bytes]) -> Callable[[str], bytes | IO[bytes]]:
    """A ``content`` for :func:`apply` that gives the same bytes for any path."""
    return lambda _path: content


def _guarded(change: Callable[[], str | None]) -> str | None:
    """One path's change; a failure is that path's refusal, never the end of the round
    (a name too long for the host, a temp name taken, a file vanished meanwhile)."""
    try:
        return change()
    except (OSError, ValueError) as exc:
        return f"could not be applied on the host: {type(exc).__name__}: {exc}"


def _parent_safe(root: Path, path: str) -> str | None:
    """None if every directory from ``root`` to ``path``'s parent is a real directory."""
    probe = root
    for part in PurePosixPath(path).parts[:-1]:
        probe = probe / part
        try:
            info = probe.lstat()
        except FileNotFoundError:
            return None  # created below, as a real directory
        if not stat.S_ISDIR(info.st_mode):
            return f"{probe.relative_to(root)} is not a directory here (a symlink or a file)"
    return None


def _write(root: Path, path: str, entry: Entry, content: Callable[[str], bytes | IO[bytes]]) -> str | None:
    why = _parent_safe(root, path)
    if why:
        return why
    target = root / path
    target.parent.mkdir(parents=True, exist_ok=True)
    why = _parent_safe(root, path)  # mkdir followed nothing: check what it made
    if why:
        return why
    existing = _lstat(target)
    inner = git_inner(path)
    if inner is not None and GIT_OBJECT.fullmatch(inner[1]) and existing is not None:
        return "git objects are never rewritten (named by their content; the host's copy stays)"
    if entry.kind == "dir":
        if existing is not None and not stat.S_ISDIR(existing.st_mode):
            if is_git_name(target.name):
                return "a .git file (gitfile) on the host stays as it is"
            target.unlink()
        target.mkdir(exist_ok=True)
        if not is_git_name(target.name):  # .git keeps the host's own mode
            os.chmod(target, (entry.mode & FILE_MODE_MASK) | 0o700, follow_symlinks=False)
        return None
    if existing is not None and stat.S_ISDIR(existing.st_mode) and not stat.S_ISLNK(existing.st_mode):
        return "a directory on the host where the sandbox has a file"
    temporary = target.with_name(f".{target.name}.sbx-{os.getpid()}")
    if entry.kind == "symlink":
        os.symlink(entry.target, temporary)
    else:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        mode = (entry.mode & FILE_MODE_MASK) | 0o600
        fd = os.open(temporary, flags, mode)
        with os.fdopen(fd, "wb") as f:
            data = content(path)
            if isinstance(data, bytes | bytearray):
                f.write(data)
            else:
                shutil.copyfileobj(data, f, 1 << 20)
        os.chmod(temporary, mode)
    if inner is not None and GIT_OBJECT.fullmatch(inner[1]):
        try:
            why = _verified_object(inner[1], temporary, target)
        finally:
            temporary.unlink(missing_ok=True)
        return why
    os.replace(temporary, target)  # replaces a symlink itself, never what it points to
    return None


LOOSE_MAX = 4 << 30
"""The most a loose object may inflate to (a zlib bomb stops there)."""


def _verified_object(inner: str, temporary: Path, target: Path) -> str | None:
    """Put a git object in place only if its name is its content's hash: a loose object
    is inflated and hashed; a pack is indexed here by git (which hashes every object in
    it) and named by its checksum, and the sandbox's index, reverse index, bitmap or
    mtimes files are never taken. None when it is in place, else why not."""
    parts = inner.split("/")
    if parts[1] != "pack":
        return _verified_loose(parts[1] + parts[2], temporary, target)
    name = parts[2]
    stem, _, suffix = name.rpartition(".")
    if suffix != "pack":
        return ".git pack indexes stay as the host has it (the host indexes packs itself)"
    expected = stem.removeprefix("pack-")
    index = temporary.with_name(temporary.name + ".idx")
    fmt = "sha1" if len(expected) == 40 else "sha256"
    done = subprocess.run(
        ["git", "index-pack", f"--object-format={fmt}", "-o", str(index), str(temporary)],
        capture_output=True, check=False, timeout=600,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "GIT_CONFIG_NOSYSTEM": "1",
             "HOME": "/nonexistent"},
    )  # fmt: skip
    try:
        checksum = (
            done.stdout.decode(errors="replace").split()[-1] if done.returncode == 0 and done.stdout else ""
        )
        if checksum != expected:
            why = (
                done.stderr.decode(errors="replace").strip()[:200]
                or f"its checksum is {checksum or 'unknown'}"
            )
            return f"a pack that git cannot index under its name ({why})"
        os.replace(temporary, target)
        os.replace(index, target.with_suffix(".idx"))
        return None
    finally:
        index.unlink(missing_ok=True)


def _verified_loose(name: str, temporary: Path, target: Path) -> str | None:
    digest = hashlib.sha1() if len(name) == 40 else hashlib.sha256()  # noqa: S324 - git's object names
    inflate = zlib.decompressobj()
    size = 0
    with temporary.open("rb") as f:
        while chunk := f.read(1 << 20):
            try:
                data = inflate.decompress(chunk)
            except zlib.error:
                return "a loose object that is not a zlib stream"
            size += len(data)
            if size > LOOSE_MAX:
                return f"a loose object that inflates beyond {LOOSE_MAX} bytes"
            digest.update(data)
    if not inflate.eof or digest.hexdigest() != name:
        return "a loose object whose content does not hash to its name"
    os.replace(temporary, target)
    return None


def _delete(root: Path, path: str) -> str | None:
    inner = git_inner(path)
    if inner is not None and (inner[1] == "objects" or inner[1].startswith("objects/")):
        return "git objects are never deleted from the host (pruning is the host's git's business)"
    why = _parent_safe(root, path)
    if why:
        return why
    target = root / path
    info = _lstat(target)
    if info is None:
        return None
    if stat.S_ISDIR(info.st_mode):
        try:
            target.rmdir()
        except OSError:
            return "a directory that is not empty on the host"
    else:
        target.unlink()
    return None


def _lstat(path: Path) -> os.stat_result | None:
    try:
        return path.lstat()
    except FileNotFoundError:
        return None

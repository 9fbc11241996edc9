"""What a round of sync moves, decided from manifests and listings (pure).

Up (host → sandbox): the host's manifest now against the one recorded at the last sync
of the same sandbox; with no record (a fresh sandbox, another client), everything.

Back (sandbox → host): the sandbox's listing after the command against its listing
before it (right after the upload, or recorded at the last sync). A listing holds no
digests, only what shows a change (kind, mode, size, mtime, ctime, inode, link
target), so the sandbox never hashes the tree; a directory counts as changed only when
its kind or mode does (its times change with every child).
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from sbx_api import errors, hostapi
from sbx_client import sync

SANDBOX_BASE = hostapi.WORKSPACE
HOST_DIR = f"{SANDBOX_BASE}/.sbx-host"
"""Where the client puts what is not the code dir: the allowlisted host git config, task files."""
REFUSED = sync.Entry("file", digest="!refused")
"""Recorded for a path whose sandbox version was refused: the next round sends the host's."""


@dataclass
class PullBack:
    upsert: list[str] = field(default_factory=list)
    delete: list[str] = field(default_factory=list)


def sandbox_root(code_dir: Path, taken: Iterable[str] = ()) -> str:
    """``/workspace/<name of the code dir>``, made unique among ``taken``."""
    name = code_dir.name if code_dir.name not in ("", ".", "..") else "code"
    name = "".join(c if c.isalnum() or c in "._-" else "_" for c in name).lstrip(".") or "code"
    candidate, n = name, 1
    taken = set(taken)
    while candidate in taken:
        n += 1
        candidate = f"{name}-{n}"
    return f"{SANDBOX_BASE}/{candidate}"


def sandbox_cwd(code_dir: Path, root: str, cwd: Path) -> str:
    """The sandbox directory for the host's ``cwd`` inside ``code_dir``."""
    relative = cwd.resolve().relative_to(code_dir.resolve()).as_posix()
    return root if relative == "." else posixpath.join(root, relative)


def sendable(path: str, *, checked: bool = False) -> bool:
    """Whether a path can travel at all: a plain relative path, valid UTF-8, no newline,
    no NUL. ``checked``: it comes from a host scan, already plain and relative."""
    try:
        if checked:
            if "\n" in path or "\0" in path:
                return False
        else:
            hostapi.validate_relative(path)
        path.encode()
    except (errors.InvalidInput, UnicodeEncodeError):
        return False
    return True


def for_upload(manifest: Mapping[str, sync.Entry]) -> tuple[dict[str, sync.Entry], list[str]]:
    """(what goes up as it is, the paths left out because they cannot travel). Inside
    any ``.git`` directory, at any depth, only :data:`sync.GIT_UP` goes: never a config
    (the allowlisted rendering of each goes instead, see :func:`git_dirs`), hooks,
    modules or worktrees; a look-alike ``.GIT`` never goes."""
    out: dict[str, sync.Entry] = {}
    unsendable: list[str] = []
    for path, entry in manifest.items():
        inner = sync.git_inner(path)
        if inner is not None:
            name = inner[0].rsplit("/", 1)[-1]
            if name != ".git" or (inner[1] and not sync.GIT_UP.fullmatch(inner[1])):
                continue
        if not sendable(path, checked=True):
            unsendable.append(path)
            continue
        out[path] = entry
    return out, unsendable


def git_dirs(manifest: Mapping[str, sync.Entry]) -> list[str]:
    """The ``.git`` directories in a manifest (the code dir's and nested repositories')."""
    return sorted(
        p
        for p, e in manifest.items()
        if e.kind == "dir" and p.rsplit("/", 1)[-1] == ".git" and sync.git_inner(p) == (p, "")
    )


def collapse(paths: Iterable[str]) -> list[str]:
    """Deletions without the ones inside another deleted directory."""
    out: list[str] = []
    for path in sorted(paths):
        if out and path.startswith(out[-1] + "/"):
            continue
        out.append(path)
    return out


def _same(a: hostapi.Stat, b: hostapi.Stat) -> bool:
    if a.kind != b.kind or a.mode != b.mode:
        return False
    if a.kind == "d":
        return True
    return a == b


def pull_back(
    before: Mapping[str, hostapi.Stat],
    after: Mapping[str, hostapi.Stat],
    *,
    excludes: Iterable[str],
    deletions: bool = True,
) -> PullBack:
    """What the sandbox created, changed or deleted between two listings. Excluded paths,
    repository configs and paths that are not text stay out. ``deletions`` is False when
    the after-listing is incomplete (missing paths then prove nothing)."""
    excludes = tuple(excludes)
    result = PullBack()

    def wanted(path: str) -> bool:
        # Folded: on a case-insensitive host, .VENV/ is .venv/ and .SBX/ is .sbx/.
        if sync.excluded(path, excludes, fold=True):
            return False
        inner = sync.git_inner(path)
        if inner is not None and inner[1] in ("config", "config.worktree"):
            return False  # the rendered copy the client sent: never comes back
        return sendable(path)  # the caller reports the others

    for path in sorted(after, key=lambda p: (p.count("/"), p)):
        old = before.get(path)
        if (old is None or not _same(old, after[path])) and wanted(path):
            result.upsert.append(path)
    if deletions:
        gone = [p for p in before if p not in after and wanted(p)]
        result.delete = sorted(gone, key=lambda p: (-p.count("/"), p))
    return result


def merge_listing(
    known: Mapping[str, hostapi.Stat],
    listed_paths: Iterable[str],
    deleted: Iterable[str],
    listed: Mapping[str, hostapi.Stat],
) -> dict[str, hostapi.Stat]:
    """The whole tree's listing from the last one known, after an upload that deleted
    ``deleted`` (with what was under them) and listed only ``listed_paths``: a listed
    path missing from ``listed`` is gone."""
    out = dict(known)
    for path in deleted:
        prefix = path + "/"
        for other in [p for p in out if p == path or p.startswith(prefix)]:
            del out[other]
    for path in listed_paths:
        if path in listed:
            out[path] = listed[path]
        else:
            out.pop(path, None)
    return out


def not_text(listing: Mapping[str, hostapi.Stat]) -> list[str]:
    """Paths that cannot come back (not UTF-8, a newline in the name), printable."""
    return [
        path.encode(errors="surrogateescape").decode(errors="replace").replace("\n", "\\n")
        for path in listing
        if not sendable(path)
    ]


def host_after(
    synced: Mapping[str, sync.Entry],
    written: Mapping[str, sync.Entry],
    deleted: Iterable[str],
    refused: Iterable[str],
) -> dict[str, sync.Entry]:
    """The record of what host and sandbox share after a round: the host manifest that
    went up, with what came back applied and refused paths marked for the next round."""
    out = dict(synced)
    out.update(written)
    for path in deleted:
        out.pop(path, None)
        prefix = path + "/"
        for other in [p for p in out if p.startswith(prefix)]:
            del out[other]
    for path in refused:
        if path:
            out[path] = REFUSED
    return out

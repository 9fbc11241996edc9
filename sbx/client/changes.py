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

from sbx.client import sync
from shared import hostapi

SANDBOX_BASE = hostapi.WORKSPACE
HOST_DIR = f"{SANDBOX_BASE}/.sbx-host"
"""Where the client puts what is not the code dir: the allowlisted host git config, task files."""
GIT_CONFIGS = (".git/config", ".git/config.worktree")
"""Never sent as they are: the sandbox gets the allowlisted rendering instead."""
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


def for_upload(manifest: Mapping[str, sync.Entry]) -> dict[str, sync.Entry]:
    """The manifest without what never goes up as it is (repository configs)."""
    return {p: e for p, e in manifest.items() if p not in GIT_CONFIGS}


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
        if path in GIT_CONFIGS or sync.excluded(path, excludes):
            return False
        try:
            path.encode()
        except UnicodeEncodeError:
            return False  # a name that is not UTF-8: reported by the caller, never applied
        return True

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
    """Paths whose names are not UTF-8 (they cannot come back)."""
    out = []
    for path in listing:
        try:
            path.encode()
        except UnicodeEncodeError:
            out.append(path.encode(errors="surrogateescape").decode(errors="replace"))
    return out


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

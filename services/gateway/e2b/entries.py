"""Pure: envd's view of paths and files. A path the SDK names is resolved as envd does,
but against this stack's home (``/workspace``), and only as text: the sandbox resolves
it (its symlinks, its mounts), never the host. An executor's :class:`Entry` becomes
envd's ``EntryInfo`` JSON (protobuf's JSON mapping: camelCase, enums by name, int64 as
text, times in RFC 3339)."""

from __future__ import annotations

import posixpath
from datetime import UTC, datetime
from typing import Any

from sbx_api import errors, hostapi
from shared.contract import checks, execution

HOME = hostapi.WORKSPACE
"""Where relative paths and ``~`` point (E2B's user home; here the workspace)."""
_TYPES = {"file": "FILE_TYPE_FILE", "dir": "FILE_TYPE_DIRECTORY", "symlink": "FILE_TYPE_SYMLINK"}
# Go's os.FileMode type bits, which envd reports in ``mode``.
_MODE_DIR = 1 << 31
_MODE_SYMLINK = 1 << 27


def resolve(path: str) -> str:
    """An absolute, normalised path: relative ones (and ``~``) under :data:`HOME`."""
    if path == "~" or path.startswith("~/"):
        path = HOME + path[1:]
    elif path and not path.startswith("/"):
        path = f"{HOME}/{path}"
    return checks.path(path)


def _kind(entry: execution.Entry) -> str:
    """What envd's ``type`` says: a symlink's target type (the link itself is ``isSymlink``)."""
    if entry.kind == "symlink":
        return entry.target_kind if entry.target_kind in ("file", "dir") else "symlink"
    return entry.kind


def permissions(entry: execution.Entry) -> str:
    """Go's ``FileMode.String()`` as envd reports it: ``drwxr-xr-x``, ``Lrwxrwxrwx``."""
    kind = {"dir": "d", "symlink": "L"}.get(entry.kind, "-")
    bits = "".join(letter if entry.mode & (1 << (8 - i)) else "-" for i, letter in enumerate("rwxrwxrwx"))
    return kind + bits


def timestamp(seconds: float) -> str:
    moment = datetime.fromtimestamp(max(0.0, min(seconds, 253402300799.0)), UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def entry_info(entry: execution.Entry) -> dict[str, Any]:
    mode = entry.mode & 0o777
    if entry.kind == "dir":
        mode |= _MODE_DIR
    elif entry.kind == "symlink":
        mode |= _MODE_SYMLINK
    info: dict[str, Any] = {
        "name": posixpath.basename(entry.path) or "/",
        "type": _TYPES.get(_kind(entry), "FILE_TYPE_UNSPECIFIED"),
        "path": entry.path,
        "size": str(entry.size),
        "mode": mode,
        "permissions": permissions(entry),
        "owner": entry.owner,
        "group": entry.group,
        "modifiedTime": timestamp(entry.mtime),
    }
    if entry.kind == "symlink":
        info["isSymlink"] = True
        info["symlinkTarget"] = entry.target or ""
    return info


def only(entries: list[execution.Entry] | None, path: str) -> execution.Entry:
    """The one entry a stat or a move answers."""
    if not entries:
        raise errors.NotFound(f"{path} does not exist")
    return entries[0]


def write_info(path: str) -> dict[str, str]:
    """One written file, as ``POST /files`` answers it."""
    return {"name": posixpath.basename(path), "type": "file", "path": path}

"""Watching a directory in a sandbox (``watch``, ``watch_dir``): listings taken in the
sandbox by its own ``find`` and compared on the host, so the same thing works in every
image with GNU findutils (which ``files`` needs already), inotify or not.

A listing is one NUL-terminated record per entry (inode, type, mode, size, mtime, path
relative to the directory); two listings give the changes: a path that appears is
``create`` (or, when it is the entry that left another path (same inode, type, size and
mtime), ``rename`` of that path and ``create`` of this one, as inotify reports a move),
one that goes is ``remove``, a file whose size or mtime changed is ``write``, a mode that
changed is ``chmod``. What happens between two listings is seen as its net result (a
file made and removed in between is not seen; many writes are one). Everything the
sandbox answers is bounded: :data:`ENTRIES_MAX` entries and :data:`LISTING_BYTES` a
listing (past them the watch ends with an error), at most :data:`CHANGES_MAX` changes a
batch, names cut at ``checks.MAX_PATH_CHARS``.

The polling watcher keeps its last listing in the sandbox (``/.sbx/watch/ID``), so no
executor holds state between polls and nothing runs in between; a streamed watch is one
process in the sandbox listing twice a second, killed when the caller goes away."""

from __future__ import annotations

import secrets

from sbx_api import errors
from services.executor import output, scripts
from shared.contract import checks, execution
from shared.runtime import api

RECORD = "%i\\0%y\\0%m\\0%s\\0%T@\\0%P\\0"
"""``find -printf`` of one entry: inode, type, mode, size, mtime, path below the
directory; each field ends with NUL (find turns ``\\0`` into NUL)."""
FIELDS = 6
END = b"E"
"""Ends a listing in a stream of them (an inode is a number: never this)."""
ENTRIES_MAX = 10_000
LISTING_BYTES = 4 * 1024 * 1024
CHANGES_MAX = 1_000
INTERVAL = "0.5"
"""Seconds between two listings of a streamed watch."""
WATCHERS_MAX = 64
"""Most polling watchers a sandbox keeps at once."""
WATCH_DIR = "/.sbx/watch"
MISSING, NOT_DIR, TOO_MANY = 44, 45, 48

_DIR = '[ -d "$1" ] || { [ -e "$1" ] && exit 45; exit 44; }'
_LIST = 'find "$1" -mindepth 1 -maxdepth "$2" -printf "$3" 2>/dev/null'
#: $1 directory, $2 depth, $3 record, $4 interval: a listing, END, every $4 s while $1 is a directory.
STREAM = f'{_DIR}; while [ -d "$1" ]; do {_LIST}; printf "E\\0"; sleep "$4"; done; exit 44'
#: $1 directory, $2 depth, $3 record, $4 the watcher's directory, $5 the most watchers.
CREATE = (
    f"{_DIR}; mkdir -p {WATCH_DIR} || exit 3; "
    f'[ "$(ls {WATCH_DIR} | wc -l)" -lt "$5" ] || exit 48; '
    'mkdir "$4" && printf "%s" "$1" > "$4/path" && printf "%s" "$2" > "$4/depth" && '
    f'{_LIST} > "$4/listing"'
)
#: $1 the watcher's directory, $2 record: the last listing, END, a new one (kept), END.
POLL = (
    '[ -f "$1/listing" ] || exit 44; d=$(cat "$1/path"); n=$(cat "$1/depth"); '
    'cat "$1/listing"; printf "E\\0"; '
    'find "$d" -mindepth 1 -maxdepth "$n" -printf "$2" 2>/dev/null > "$1/next"; '
    'cat "$1/next"; printf "E\\0"; mv -f "$1/next" "$1/listing"'
)
REMOVE = '[ -d "$1" ] || exit 44; exec rm -rf -- "$1"'

Entry = tuple[int, str, int, int, str]
"""(inode, type, mode, size, mtime) of one path."""
Listing = dict[str, Entry]


def depth(recursive: bool) -> str:
    return str(execution.DEPTH_MAX) if recursive else "1"


def stream_args(recursive: bool) -> tuple[str, str, str]:
    """:data:`STREAM`'s arguments after the directory."""
    return depth(recursive), RECORD, INTERVAL


def parse(fields: list[bytes]) -> Listing:
    """One listing's fields (its END not included) as path → entry; bounded."""
    if len(fields) % FIELDS:
        raise errors.InfrastructureError("the sandbox's listing ended in the middle of a record")
    if len(fields) > ENTRIES_MAX * FIELDS:
        raise errors.LimitExceeded(
            f"the watched directory has more than {ENTRIES_MAX} entries: watch a smaller one"
        )
    listing: Listing = {}
    for i in range(0, len(fields), FIELDS):
        inode, kind, mode, size, mtime, path = fields[i : i + FIELDS]
        try:
            name = path[: checks.MAX_PATH_CHARS].decode(errors="replace")
            listing[name] = (
                int(inode),
                kind[:1].decode(errors="replace"),
                int(mode, 8),
                int(size),
                mtime[:40].decode(errors="replace"),
            )
        except ValueError:
            raise errors.InfrastructureError("the sandbox's listing has a malformed record") from None
    return listing


def split(raw: bytes) -> tuple[list[Listing], bytes]:
    """The complete listings in ``raw`` (each ended by END) and what is left after them."""
    fields = raw.split(b"\0")
    rest = fields.pop()  # after the last NUL: a field not finished yet
    listings: list[Listing] = []
    start = 0
    for i, field in enumerate(fields):
        if field == END and (i - start) % FIELDS == 0:
            listings.append(parse(fields[start:i]))
            start = i + 1
    left = b"\0".join(fields[start:])
    return listings, (left + b"\0" + rest if start < len(fields) else rest)


def changes(before: Listing, after: Listing) -> list[execution.Change]:
    """What changed from one listing to the next (pure; at most :data:`CHANGES_MAX`)."""
    gone = {path: entry for path, entry in before.items() if path not in after}
    # A move keeps the inode, type, size and mtime; a new file given a freed inode has
    # another mtime (nanoseconds), so it is not taken for a move.
    by_identity = {(e[0], e[1], e[3], e[4]): path for path, e in gone.items()}
    out: list[execution.Change] = []
    for path in sorted(after.keys() - before.keys()):
        e = after[path]
        moved = by_identity.pop((e[0], e[1], e[3], e[4]), None)
        if moved is not None:
            out.append(execution.Change(kind="rename", name=moved))
            gone.pop(moved)
        out.append(execution.Change(kind="create", name=path))
    out += [execution.Change(kind="remove", name=path) for path in sorted(gone)]
    for path in sorted(after.keys() & before.keys()):
        (inode, kind, mode, size, mtime), old = after[path], before[path]
        if inode != old[0]:
            out.append(execution.Change(kind="create", name=path))  # replaced (moved over)
            continue
        if kind == "f" and (size, mtime) != (old[3], old[4]):
            out.append(execution.Change(kind="write", name=path))
        if mode != old[2]:
            out.append(execution.Change(kind="chmod", name=path))
    return out[:CHANGES_MAX]


def _failed(code: int | None, path: str) -> errors.SandboxError:
    match code:
        case 44:
            return errors.NotFound(f"{path} does not exist")
        case 45:
            return errors.InvalidInput(f"{path} is not a directory")
        case 48:
            return errors.LimitExceeded(
                f"this sandbox has {WATCHERS_MAX} watchers already: remove one (stop its handle) first"
            )
    return errors.InfrastructureError(f"the watcher failed in the sandbox (exit status {code})")


async def run(runtime: api.Runtime, request: execution.Watch) -> execution.Reply:
    """``create``, ``poll`` or ``remove`` a polling watcher."""
    if request.action == "create":
        path = checks.path(request.path)
        watcher = secrets.token_hex(16)
        argv = scripts.argv(
            CREATE, path, depth(request.recursive), RECORD, f"{WATCH_DIR}/{watcher}", str(WATCHERS_MAX)
        )
        result, _, _ = await runtime.run(request.sandbox_id, argv, timeout=scripts.QUICK, max_bytes=4096)
        if result.exit_code != 0:
            raise _failed(result.exit_code, path)
        return execution.Reply(ok=True, watcher_id=watcher)
    where = f"{WATCH_DIR}/{checks.job_id(request.watcher_id)}"
    if request.action == "remove":
        result, _, _ = await runtime.run(
            request.sandbox_id, scripts.argv(REMOVE, where), timeout=scripts.QUICK
        )
        if result.exit_code == MISSING:
            raise errors.NotFound(f"no watcher {request.watcher_id} in this sandbox")
        if result.exit_code != 0:
            raise _failed(result.exit_code, where)
        return execution.Reply(ok=True)
    result, out, err = await runtime.run(
        request.sandbox_id,
        scripts.argv(POLL, where, RECORD),
        timeout=scripts.QUICK,
        max_bytes=2 * LISTING_BYTES + 4096,
    )
    if result.exit_code == MISSING:
        raise errors.NotFound(f"no watcher {request.watcher_id} in this sandbox")
    if result.exit_code != 0:
        detail = output.text(err).strip()[:300] or f"exit status {result.exit_code}"
        raise errors.InfrastructureError(f"the watcher's poll failed in the sandbox: {detail}")
    listings, _ = split(out)
    if len(listings) != 2:
        raise errors.InfrastructureError("the watcher's poll answered no pair of listings")
    return execution.Reply(ok=True, changes=changes(*listings))

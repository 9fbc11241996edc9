"""Filesystem operations on any absolute path in a sandbox (``files``): stat, list, make
a directory, move, remove. Each is one POSIX sh script run in the sandbox, so paths are
resolved by the sandbox's kernel (its symlinks, its mounts), never on the host; the host
only parses what ``find -printf`` answered, bounded in bytes and entries.

Used by the E2B envd filesystem API (``services.gateway.e2b``) and open to any caller of
the executor, as the other operations are."""

from __future__ import annotations

from sbx_api import errors
from services.executor import output, scripts
from shared.contract import checks, execution
from shared.runtime import api

RECORD = "%y\\0%Y\\0%m\\0%s\\0%T@\\0%u\\0%g\\0%p\\0%l\\0"
"""``find -printf`` of one entry: its type, what a symlink points to, mode, size, mtime,
owner, group, path, link target; each field ends with NUL (find turns ``\\0`` into NUL)."""
FIELDS = 9
LISTING_BYTES = 16 * 1024 * 1024
"""Most bytes a script may answer (past it, it is killed and the call refused as too
large: list less deep)."""

MISSING, NOT_DIR, IS_DIR, EXISTS = 44, 45, 46, 47
"""Exit codes of the scripts: no such path, not a directory, a directory, a non-directory
already there."""

_EXISTS = '[ -e "$1" ] || [ -L "$1" ] || exit 44'
STAT = f'{_EXISTS}; exec find "$1" -maxdepth 0 -printf "$2"'
LIST = f'{_EXISTS}; [ -d "$1" ] || exit 45; exec find "$1" -mindepth 1 -maxdepth "$3" -printf "$2"'
MKDIR = '[ -d "$1" ] && exit 46; [ -e "$1" ] || [ -L "$1" ] && exit 47; exec mkdir -p -- "$1"'
MOVE = (
    f'{_EXISTS}; mkdir -p -- "$(dirname -- "$3")" && mv -T -- "$1" "$3" && '
    'exec find "$3" -maxdepth 0 -printf "$2"'
)
REMOVE = f'{_EXISTS}; exec rm -rf -- "$1"'

_KINDS: dict[bytes, execution.EntryKind] = {b"f": "file", b"d": "dir", b"l": "symlink"}
_TARGETS: dict[bytes, execution.EntryKind] = {**_KINDS, b"N": "missing", b"L": "symlink"}


def parse_entries(raw: bytes, limit: int = execution.LIST_MAX) -> list[execution.Entry]:
    """:data:`RECORD` records as entries: at most ``limit``, paths and link targets cut at
    :data:`~shared.contract.checks.MAX_PATH_CHARS`; a malformed record is an error."""
    fields = raw.split(b"\0")
    if fields and fields[-1] == b"":
        fields.pop()
    if len(fields) % FIELDS:
        raise errors.InfrastructureError("the sandbox's listing ended in the middle of a record")
    entries: list[execution.Entry] = []
    for i in range(0, min(len(fields), limit * FIELDS), FIELDS):
        kind, target_kind, mode, size, mtime, owner, group, path, target = fields[i : i + FIELDS]
        try:
            entry_kind = _KINDS.get(kind, "other")
            entries.append(
                execution.Entry(
                    path=_text(path),
                    kind=entry_kind,
                    target_kind=_TARGETS.get(target_kind, "other") if entry_kind == "symlink" else None,
                    mode=int(mode, 8) & 0o7777,
                    size=int(size),
                    mtime=float(mtime),
                    owner=_text(owner[:64]),
                    group=_text(group[:64]),
                    target=_text(target) if entry_kind == "symlink" else None,
                )
            )
        except ValueError:
            raise errors.InfrastructureError("the sandbox's listing has a malformed record") from None
    return entries


def _text(raw: bytes) -> str:
    return raw[: checks.MAX_PATH_CHARS].decode(errors="replace")


def validate(request: execution.Files) -> tuple[str, str | None]:
    """The request's paths, normalised; bad input refused before anything runs (pure)."""
    path = checks.path(request.path)
    destination = None
    if request.action == "move":
        if request.destination is None:
            raise errors.InvalidInput("move needs a destination")
        destination = checks.path(request.destination, what="destination")
    if request.action == "list" and not 1 <= request.depth <= execution.DEPTH_MAX:
        raise errors.InvalidInput(f"depth must be 1 to {execution.DEPTH_MAX}, got {request.depth}")
    if request.action in ("remove", "move") and path == "/":
        raise errors.InvalidInput(f"cannot {request.action} /")
    return path, destination


def _failed(code: int, path: str, said: bytes) -> errors.SandboxError:
    match code:
        case 45:
            return errors.InvalidInput(f"{path} is not a directory")
        case 47:
            return errors.InvalidInput(f"{path} exists and is not a directory")
    detail = output.text(said).strip()[:300] or f"exit status {code}"
    return errors.InvalidInput(f"the operation on {path} failed: {detail}")


async def run(runtime: api.Runtime, request: execution.Files) -> execution.Reply:
    path, destination = validate(request)
    match request.action:
        case "stat":
            argv = scripts.argv(STAT, path, RECORD)
        case "list":
            argv = scripts.argv(LIST, path, RECORD, str(request.depth))
        case "mkdir":
            argv = scripts.argv(MKDIR, path)
        case "move":
            assert destination is not None
            argv = scripts.argv(MOVE, path, RECORD, destination)
        case _:
            argv = scripts.argv(REMOVE, path)
    result, out, err = await runtime.run(
        request.sandbox_id, argv, timeout=scripts.QUICK, max_bytes=LISTING_BYTES
    )
    if request.action == "mkdir" and result.exit_code == IS_DIR:
        return execution.Reply(ok=True, created=False)
    if result.exit_code == MISSING:
        return execution.Reply(ok=True, exists=False)
    if result.timed_out:
        raise errors.Timeout(f"the {request.action} of {path} took longer than {scripts.QUICK:g} s")
    if result.exit_code != 0:
        raise _failed(result.exit_code or 0, path, err)
    if request.action in ("stat", "list", "move"):
        return execution.Reply(ok=True, entries=parse_entries(out))
    return execution.Reply(ok=True, created=True if request.action == "mkdir" else None)

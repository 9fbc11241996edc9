"""The host API's wire contract: what the agent-host client and the gateway exchange.
The gateway and the clients import this one module: one definition of the frames,
bodies, limits and checks for both sides.

Three streamed operations on a session's sandbox (``/v1/sessions/{id}/run``, ``/files/put``,
``/files/get``). Their bodies and answers are *frames*: one channel byte, a 4-byte
big-endian length, the payload. Channels:

==========  =========================================================================
``o``/``e`` the command's stdout/stderr, as it comes
``t``       tar bytes (the upload's body; the download's answer)
``l``       a tree listing (:data:`LIST_FORMAT`, see :func:`parse_listing`)
``j``       JSON parameters (the first frame of an upload's body)
``x``       the end: JSON :class:`End`; nothing follows
``!``       an error: JSON ``{"error", "message", "status", "retriable"}``; nothing follows
``h``       keepalive (empty), sent while nothing else is; readers skip it
==========  =========================================================================

The frame format is what the agent-host client asks for (``Accept:`` :data:`MEDIA_TYPE`):
it carries output bytes exactly and the binary listing. Everyone else gets standard media
types: a run's output as NDJSON (:data:`NDJSON`, the default) or server-sent events
(:data:`EVENT_STREAM`), one :data:`RunEvent` per line or event, and plain tar bodies for
``/archive`` (:data:`TAR_MEDIA_TYPE`).

Paths the sandbox reports are relative to the operation's ``root``, which is always an
absolute directory under ``/workspace``.
"""

from __future__ import annotations

import posixpath
import struct
from collections.abc import Iterator
from typing import Annotated

import msgspec

from sbx_api import errors

STDOUT, STDERR, TAR, LISTING, PARAMS, END, ERROR = b"o", b"e", b"t", b"l", b"j", b"x", b"!"
KEEPALIVE = b"h"
CHANNELS = frozenset((STDOUT, STDERR, TAR, LISTING, PARAMS, END, ERROR, KEEPALIVE))
MEDIA_TYPE = "application/vnd.sbx.frames"
NDJSON = "application/x-ndjson"
EVENT_STREAM = "text/event-stream"
TAR_MEDIA_TYPE = "application/x-tar"
MAX_TIMEOUT = 3600.0
"""The longest a command may run, in seconds (MCP tools and the host API alike)."""
KEEPALIVE_EVERY = 15.0
"""Seconds of silence on an answer stream after which a keepalive is sent (a quiet command
must not look like a dead connection to a client's or a proxy's read timeout)."""
FRAME_MAX = 4 * 1024 * 1024
WORKSPACE = "/workspace"
MAX_DELETES = 20_000
MAX_PRUNE = 64
MAX_LIST_PATHS = 2000
LISTING_MAX = 512 * 1024 * 1024
"""The most listing bytes one answer carries: the executor stops a listing (kills what
writes it, in the sandbox) before it sends more, and the client refuses more."""
_HEADER = struct.Struct(">cI")

LIST_FORMAT = "%y %m %s %T@ %C@ %i %P\\0%l\\0"
"""``find -printf`` format of a listing record: type, mode, size, mtime, ctime, inode and
the path, NUL, the link target, NUL."""


_NAME = r"(?:[^/\x00.\n][^/\x00\n]*|\.[^/\x00.\n][^/\x00\n]*|\.\.[^/\x00\n]+)"
"""A path component other than ``.`` and ``..``, without NUL or newline."""
ROOT_PATTERN = f"^{WORKSPACE}(?:/{_NAME})*/?$"
"""The rules of :func:`validate_root` and :func:`validate_relative` as JSON-schema
patterns, for the OpenAPI document; the checks give the errors."""
RELATIVE_PATTERN = f"^{_NAME}(?:/{_NAME})*$"
PRUNE_NAME_PATTERN = f"^{_NAME}$"
ENV_NAME_PATTERN = "^[A-Za-z_][A-Za-z0-9_]{0,127}$"
NO_NUL = r"^[^\x00]*$"

Command = Annotated[str, msgspec.Meta(extra_json_schema={"pattern": r"^[^\x00]*[^\x00\s][^\x00]*$"})]
AbsolutePath = Annotated[str, msgspec.Meta(extra_json_schema={"pattern": r"^/[^\x00]*$", "maxLength": 4096})]
Root = Annotated[str, msgspec.Meta(extra_json_schema={"pattern": ROOT_PATTERN})]
Relative = Annotated[str, msgspec.Meta(extra_json_schema={"pattern": RELATIVE_PATTERN})]
PruneNames = Annotated[
    list[Annotated[str, msgspec.Meta(extra_json_schema={"pattern": PRUNE_NAME_PATTERN})]],
    msgspec.Meta(extra_json_schema={"maxItems": MAX_PRUNE}),
]
Env = Annotated[
    dict[str, Annotated[str, msgspec.Meta(extra_json_schema={"pattern": NO_NUL})]],
    msgspec.Meta(extra_json_schema={"propertyNames": {"pattern": ENV_NAME_PATTERN}}),
]
EnvNames = list[Annotated[str, msgspec.Meta(extra_json_schema={"pattern": ENV_NAME_PATTERN})]]
Timeout = Annotated[float, msgspec.Meta(extra_json_schema={"exclusiveMinimum": 0, "maximum": MAX_TIMEOUT})]


class RunBody(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    command: Command
    cwd: AbsolutePath = WORKSPACE
    env: Env = {}
    unset: EnvNames = []
    timeout: Timeout | None = None
    list_root: Root | None = None
    """List this tree after the command (on channel ``l``), before the end frame."""
    prune: PruneNames = []
    """Directory names the listing skips (``node_modules``, ``.venv``, ...)."""
    sandbox_id: str | None = None
    """The sandbox the caller synced with: if the session now has another, nothing runs
    (409 ``sandbox_changed``)."""


class PutParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    root: str
    delete: list[str] = []
    """Relative paths removed (recursively) before the tar is extracted."""
    prune: list[str] = []
    listing: bool = True
    """Answer with the tree's listing after the upload."""
    list_paths: list[str] | None = None
    """List only these paths (the ones uploaded or deleted), not the whole tree: a path
    missing from the answer is gone. At most :data:`MAX_LIST_PATHS`."""
    sandbox_id: str | None = None
    """As for :class:`RunBody`: the upload is a difference against that sandbox's copy."""


class GetBody(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    root: Root
    paths: list[Relative]


class End(msgspec.Struct, frozen=True, kw_only=True):
    exit_code: int | None = None
    timed_out: bool = False
    duration: float = 0.0
    sandbox_id: str = ""
    message: str = ""
    """What the sandbox's side said when it did not fully succeed (tar's complaints), or
    a note (processes the command left running kept its output)."""
    listing_error: str = ""
    """Why the listing that came with the answer is incomplete ('' when it is whole)."""


# ---- run events (NDJSON and server-sent events) --------------------------------------------------


class Stdout(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="stdout"):
    """Output, decoded as UTF-8 (a character split between chunks is kept whole; bytes that
    are not UTF-8 become U+FFFD: for exact bytes, write to a file and download it)."""

    data: str


class Stderr(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="stderr"):
    """As :class:`Stdout`, for standard error."""

    data: str


class Listing(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="listing"):
    """Part of the tree's listing (``list_root``), before the exit: the concatenated
    ``data`` of every listing event is :data:`LIST_FORMAT` records (base64 in JSON: paths
    are bytes)."""

    data: bytes


class Exit(End, frozen=True, kw_only=True, tag_field="type", tag="exit"):
    """The last event of a run that ran: its :class:`End`."""


class Failed(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="error"):
    """The last event of a run that failed (the REST problem's fields)."""

    error: str
    message: str
    status: int
    retriable: bool = False


class Keepalive(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="keepalive"):
    """Sent while the command is quiet (every :data:`KEEPALIVE_EVERY` s); skip it."""


RunEvent = Stdout | Stderr | Listing | Exit | Failed | Keepalive


class ArchiveWritten(msgspec.Struct, frozen=True, kw_only=True):
    """The answer to a tar upload (``PUT /archive``): it was extracted."""

    sandbox_id: str
    duration: float


# ---- frames -------------------------------------------------------------------------------------


def frame(channel: bytes, data: bytes = b"") -> bytes:
    return _HEADER.pack(channel, len(data)) + data


class FrameReader:
    """Incremental decoder: ``feed`` bytes, get whole frames."""

    def __init__(self, limit: int = FRAME_MAX) -> None:
        self.limit = limit
        self._buffer = bytearray()

    def feed(self, data: bytes) -> Iterator[tuple[bytes, bytes]]:
        self._buffer += data
        while len(self._buffer) >= _HEADER.size:
            channel, size = _HEADER.unpack_from(self._buffer)
            if channel not in CHANNELS:
                raise errors.InvalidInput(f"unknown frame channel {channel!r}")
            if size > self.limit:
                raise errors.InvalidInput(f"a frame of {size} bytes is larger than {self.limit}")
            if len(self._buffer) < _HEADER.size + size:
                return
            payload = bytes(self._buffer[_HEADER.size : _HEADER.size + size])
            del self._buffer[: _HEADER.size + size]
            yield channel, payload

    @property
    def pending(self) -> int:
        return len(self._buffer)


# ---- validation (both sides) ---------------------------------------------------------------------


def validate_root(root: str) -> str:
    """An absolute, normalized directory under /workspace."""
    if not isinstance(root, str) or "\0" in root or not root.startswith("/"):
        raise errors.InvalidInput("root must be an absolute path under /workspace")
    normal = posixpath.normpath(root)
    if normal != root.rstrip("/") or not (normal == WORKSPACE or normal.startswith(WORKSPACE + "/")):
        raise errors.InvalidInput(f"root must be a normalized path under {WORKSPACE}, not {root!r}")
    return normal


def validate_timeout(value: float | None, *, what: str = "timeout") -> float | None:
    """A timeout in seconds: more than 0, at most :data:`MAX_TIMEOUT` (None: the default
    applies)."""
    # Written so that NaN fails too.
    if value is not None and not 0 < value <= MAX_TIMEOUT:
        raise errors.InvalidInput(
            f"{what} must be more than 0 and at most {MAX_TIMEOUT:g} seconds, got {value!r}"
        )
    return value


def validate_relative(path: str) -> str:
    """A relative path with no ``.``/``..`` parts, no NUL, no newline."""
    if (
        not path
        or path.startswith("/")
        or "\0" in path
        or "\n" in path
        or any(part in ("", ".", "..") for part in path.split("/"))
    ):
        raise errors.InvalidInput(f"not a plain relative path: {path[:200]!r}")
    return path


def validate_prune(names: list[str]) -> list[str]:
    if len(names) > MAX_PRUNE:
        raise errors.InvalidInput(f"at most {MAX_PRUNE} prune names")
    for name in names:
        if not name or "/" in name or "\0" in name or name in (".", ".."):
            raise errors.InvalidInput(f"a prune name is a single directory name, not {name[:100]!r}")
    return names


# ---- listings ------------------------------------------------------------------------------------


class Stat(msgspec.Struct, frozen=True, array_like=True):
    """What a listing says of one path: enough to see that it changed, not its content."""

    kind: str  # "f" file, "d" directory, "l" symlink, anything else: another kind
    mode: int
    size: int
    mtime: str
    ctime: str
    inode: str
    target: str = ""


def parse_listing(data: bytes) -> dict[str, Stat]:
    """Parse :data:`LIST_FORMAT` records; malformed records raise InvalidInput."""
    out: dict[str, Stat] = {}
    fields = data.split(b"\0")
    if fields and fields[-1] == b"":
        fields.pop()
    if len(fields) % 2:
        raise errors.InvalidInput("a listing ended in the middle of a record")
    for i in range(0, len(fields), 2):
        head, target = fields[i], fields[i + 1]
        parts = head.split(b" ", 6)
        if len(parts) != 7:
            raise errors.InvalidInput("a listing record is malformed")
        kind, mode, size, mtime, ctime, inode, path = parts
        try:
            name = path.decode(errors="surrogateescape")  # the caller decides what to do with it
            out[name] = Stat(
                kind.decode(),
                int(mode, 8),
                int(size),
                mtime.decode(),
                ctime.decode(),
                inode.decode(),
                target.decode(errors="surrogateescape"),
            )
        except ValueError as exc:
            raise errors.InvalidInput(f"a listing record is malformed: {exc}") from None
    return out

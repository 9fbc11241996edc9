"""Requests to the executor and its replies: the contract between gateway and executor.

Requests travel by NATS request/reply on ``<ns>.exec`` (queue group ``executor``).
The gateway fills ``session_id`` from the ``X-Session-Id`` header and ``sandbox_id``
from the scheduler's answer, never from tool arguments, so one session can never
reach another session's sandbox.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

import msgspec

from sbx_api import hostapi
from shared.contract import commands

JobStatus = Literal["running", "exited", "stopped", "lost"]
EditCommand = Literal["view", "create", "str_replace", "insert"]
FileAction = Literal["stat", "list", "mkdir", "move", "remove"]
EntryKind = Literal["file", "dir", "symlink", "other", "missing"]
JobSignal = Literal["TERM", "KILL", "INT", "HUP"]
WatchAction = Literal["create", "poll", "remove"]
ChangeKind = Literal["create", "write", "remove", "rename", "chmod"]

#: Defaults an operator can change through the executor's settings.
DEFAULT_TIMEOUT = 120.0
MAX_TIMEOUT = hostapi.MAX_TIMEOUT


class Request(msgspec.Struct, frozen=True, kw_only=True, tag_field="op"):
    session_id: str
    sandbox_id: str
    actor: commands.Actor = commands.Actor()
    correlation_id: str | None = None
    call_id: str | None = None
    """Names the call for a cancellation (``subjects.exec_cancel``): the gateway's client
    cancelled or went away, so the executor stops it."""


class Shell(Request, frozen=True, kw_only=True, tag="shell"):
    command: str
    timeout: float | None = None


class ShellAsync(Request, frozen=True, kw_only=True, tag="shell_async"):
    """Start a job (the reply names it and its process group's id, ``pid``). By default it
    starts from the session shell's saved directory and exports, reads nothing and writes
    stdout and stderr together; the options below change that (the E2B processes use them)."""

    command: str
    job_id: str | None = None
    """The job's id, chosen by the caller (32 lower-case hex; refused if it is taken), so it
    can follow the job (``shell_follow``) while it starts; default: a new one."""
    cwd: str | None = None
    """Start there, with the sandbox's environment and ``env``, not the session shell's
    saved directory and exports."""
    env: dict[str, str] = {}
    """Exported for the job (over the session's exports)."""
    stdin: bool = False
    """Keep the job's standard input open: ``shell_input`` writes to it and closes it.
    Without it the job reads nothing (``/dev/null``)."""
    split: bool = False
    """Keep stderr apart from stdout (``shell_follow`` streams them apart)."""
    label: str = ""
    """The caller's note, kept with the job and listed by ``shell_jobs`` (at most
    :data:`LABEL_MAX` bytes)."""


class ShellPoll(Request, frozen=True, kw_only=True, tag="shell_poll"):
    job_id: str


class ShellWait(Request, frozen=True, kw_only=True, tag="shell_wait"):
    job_id: str
    timeout: float | None = None


class ShellStop(Request, frozen=True, kw_only=True, tag="shell_stop"):
    job_id: str


class ShellInput(Request, frozen=True, kw_only=True, tag="shell_input"):
    """Write ``data`` to the standard input of a job started with ``stdin``, or, with
    ``close``, close it (the job reads the end of its input)."""

    job_id: str
    data: bytes = b""
    close: bool = False


class ShellSignal(Request, frozen=True, kw_only=True, tag="shell_signal"):
    """Send ``signal`` to a running job's process group (TERM and KILL mark it stopped)."""

    job_id: str
    signal: JobSignal


class ShellJobs(Request, frozen=True, kw_only=True, tag="shell_jobs"):
    """The session's running jobs, with their pids and labels (a read: not audited)."""


class Edit(Request, frozen=True, kw_only=True, tag="edit"):
    command: EditCommand
    path: str
    view_range: list[int] | None = None
    file_text: str | None = None
    old_str: str | None = None
    new_str: str | None = None
    insert_line: int | None = None
    insert_text: str | None = None


class Streamed(Request, frozen=True, kw_only=True):
    """An operation whose result is a stream (:mod:`shared.infrastructure.streams`) to ``inbox``; the
    reply only says it started (and, for uploads, where to send the input). Publishing
    anything to ``stop`` ends it: the command is killed, the transfer abandoned."""

    inbox: str
    stop: str


class Run(Streamed, frozen=True, kw_only=True, tag="run"):
    """A one-off ``bash -c`` (not the session's persistent shell): output streamed as it
    comes, then optionally the listing of ``list_root``, then the exit code."""

    command: str
    cwd: str
    env: dict[str, str] = {}
    unset: list[str] = []
    timeout: float | None = None
    list_root: str | None = None
    prune: list[str] = []


class PutFiles(Streamed, frozen=True, kw_only=True, tag="put_files"):
    """Remove ``delete`` under ``root``, extract the tar sent to the reply's ``input``,
    then stream the tree's listing (when ``listing``)."""

    root: str
    delete: list[str] = []
    prune: list[str] = []
    listing: bool = True
    list_paths: list[str] | None = None
    """List only these paths after the upload (None: the whole tree)."""


class GetFiles(Streamed, frozen=True, kw_only=True, tag="get_files"):
    """Read NUL-separated relative paths from the input; stream a tar of them."""

    root: str
    recursive: bool = False
    """Directories with everything under them (a plain download); without it, only the
    paths named (the host client names every file it wants)."""


class ShellFollow(Streamed, frozen=True, kw_only=True, tag="shell_follow"):
    """Stream a job's output as it is written (stdout, and stderr apart if the job was
    started with ``split``) until the job ends; from its start, or (``from_start`` false)
    only what comes from now on. Ending the stream leaves the job running. The end's
    ``exit_code`` is the job's, its ``message`` the job's status (``exited``, ``stopped``,
    ``lost``; ``nojob``: there is no such job). A read: not audited."""

    job_id: str
    from_start: bool = True


class Files(Request, frozen=True, kw_only=True, tag="files"):
    """A filesystem operation on an absolute path in the sandbox (resolved there, by the
    sandbox's own kernel, never on the host): ``stat`` it, ``list`` what is under it (to
    ``depth`` levels, at most :data:`LIST_MAX` entries), ``mkdir`` it (with its parents;
    ``created`` is false if it was a directory already), ``move`` it to ``destination``
    (parents made; a file there is replaced), ``remove`` it (recursively). The reply's
    ``entries`` describe the path (stat, move: where it went) or its contents (list); a
    path that does not exist is not an error: the reply says ``exists`` false."""

    action: FileAction
    path: str
    destination: str | None = None
    depth: int = 1


class Watch(Request, frozen=True, kw_only=True, tag="watch"):
    """A polling watcher of a directory, kept in the sandbox (``/.sbx/watch/ID``: the last
    listing it saw), so any executor serves it: ``create`` one on ``path`` (its id in the
    reply's ``watcher_id``), ``poll`` it for the ``changes`` since the last poll (or its
    creation), ``remove`` it. A watcher runs nothing between polls: it is two listings
    compared (see ``services/executor/watch.py``); it goes with the sandbox."""

    action: WatchAction
    path: str = ""
    """``create``: the directory (an absolute path in the sandbox)."""
    recursive: bool = False
    watcher_id: str = ""
    """``poll``, ``remove``: the watcher (32 lower-case hex)."""


class WatchDir(Streamed, frozen=True, kw_only=True, tag="watch_dir"):
    """Stream the changes under the directory ``path`` (``recursive``: at every depth) as
    they are seen (the sandbox lists it twice a second; each batch of changes is one
    stdout frame, a JSON list of :class:`Change`; the first, empty, once the watch has
    begun), until the caller stops it, the
    directory goes (exit code 44) or the sandbox does."""

    path: str
    recursive: bool = False


class Change(msgspec.Struct, frozen=True, kw_only=True):
    """One change seen in a watched directory: ``name`` is relative to it."""

    kind: ChangeKind
    name: str


class SandboxUsage(Request, frozen=True, kw_only=True, tag="usage"):
    """What the session's sandbox uses now (CPU over a short window, memory, disk, and
    its limits), read by the runtime from the kernel's accounting, never from inside the
    sandbox. A read: not audited. A paused sandbox answers without being resumed."""


class ReadFile(Streamed, frozen=True, kw_only=True, tag="read_file"):
    """Stream the bytes of the file at ``path`` (an absolute path in the sandbox) on the
    stdout channel; the end's exit code says why there are none (see ``files``)."""

    path: str


class WriteFile(Streamed, frozen=True, kw_only=True, tag="write_file"):
    """Write the bytes sent to the reply's ``input`` to the file at ``path`` (created with
    its parent directories, or replaced); the end's exit code 0 when it was written."""

    path: str


AnyRequest = (
    Shell
    | ShellAsync
    | ShellPoll
    | ShellWait
    | ShellStop
    | ShellInput
    | ShellSignal
    | ShellJobs
    | ShellFollow
    | Edit
    | Run
    | PutFiles
    | GetFiles
    | Files
    | SandboxUsage
    | Watch
    | WatchDir
    | ReadFile
    | WriteFile
)
REQUEST_TYPES = (
    Shell,
    ShellAsync,
    ShellPoll,
    ShellWait,
    ShellStop,
    ShellInput,
    ShellSignal,
    ShellJobs,
    ShellFollow,
    Edit,
    Run,
    PutFiles,
    GetFiles,
    Files,
    SandboxUsage,
    Watch,
    WatchDir,
    ReadFile,
    WriteFile,
)

LABEL_MAX = 16 * 1024
INPUT_MAX = 1024 * 1024
"""Most bytes one ``shell_input`` writes."""
LIST_MAX = 10_000
"""Most entries a ``files`` listing answers."""
DEPTH_MAX = 64
"""Deepest a ``files`` listing goes."""


class JobInfo(msgspec.Struct, frozen=True, kw_only=True):
    job_id: str
    pid: int
    label: str = ""


class Entry(msgspec.Struct, frozen=True, kw_only=True):
    """One path as the sandbox describes it (from ``find -printf``, parsed and bounded by
    the executor; the texts are the sandbox's, untrusted)."""

    path: str
    kind: EntryKind
    """What the path is; for a symlink, ``target_kind`` is what it points to."""
    target_kind: EntryKind | None = None
    mode: int = 0
    """Permission bits (``st_mode & 0o7777``)."""
    size: int = 0
    mtime: float = 0.0
    owner: str = ""
    group: str = ""
    target: str | None = None
    """A symlink's target, as written in the link."""


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    """What a running sandbox uses, read by its runtime where the kernel counts it (the
    sandbox's cgroup, its own filesystem), never from inside the sandbox."""

    at: datetime
    cpus: float
    """Its CPU limit in cores."""
    cpu_seconds: float
    """CPU time its processes used since it started."""
    cpu_percent: float
    """CPU time used over the sampling window, in percent of its limit (0-100)."""
    memory_bytes: int
    """Memory charged to it now, page cache included."""
    memory_cache_bytes: int
    memory_limit: int
    disk_bytes: int
    """Bytes used on its own filesystem (0 when it has none: ``disk_limit`` 0)."""
    disk_limit: int


class Reply(msgspec.Struct, frozen=True, kw_only=True):
    ok: bool
    error: commands.ErrorInfo | None = None
    output: str = ""
    """Combined stdout and stderr (shell), the job's output so far, or the edit tool's text."""
    exit_code: int | None = None
    timed_out: bool = False
    truncated: bool = False
    """Output was longer than the cap; the text says where it was cut."""
    job_id: str | None = None
    status: JobStatus | None = None
    duration: float | None = None
    input: str | None = None
    """Streamed operations that read input: the subject to stream it to."""
    entries: list[Entry] | None = None
    """``files``: the path (stat, move) or what is under it (list)."""
    created: bool | None = None
    """``files`` mkdir: whether the directory was made (false: it was one already)."""
    exists: bool | None = None
    """``files``: false when the path (a move's source) does not exist; nothing was done."""
    pid: int | None = None
    """``shell_async``: the job's process group id in the sandbox."""
    jobs: list[JobInfo] | None = None
    """``shell_jobs``: the running jobs."""
    usage: Usage | None = None
    """``usage``: what the sandbox uses now."""
    changes: list[Change] | None = None
    """``watch`` poll: the changes since the last poll."""
    watcher_id: str | None = None
    """``watch`` create: the new watcher's id."""


class Prepare(msgspec.Struct, frozen=True, kw_only=True):
    """Pool-manager → executor on ``<ns>.exec.prepare``: start the shell server of a pool
    sandbox that is ready to be claimed, so its first ``shell`` call skips starting one.
    Only for an unclaimed running pool sandbox; answered with a ``Reply``."""

    sandbox_id: str


class Jobs(msgspec.Struct, frozen=True, kw_only=True):
    """Scheduler → executor on ``<ns>.exec.jobs``: which async jobs of the session's
    sandbox are running (before an idle pause: a running job counts as activity). Not a
    tool call: it is neither activity nor audited. Answered with a ``Reply`` whose
    ``status`` is ``running`` when one runs (``output``: their ids, one a line)."""

    session_id: str
    sandbox_id: str


_request_decoder = msgspec.json.Decoder(AnyRequest)
_reply_decoder = msgspec.json.Decoder(Reply)


def decode_request(data: bytes) -> AnyRequest:
    return _request_decoder.decode(data)


def decode_reply(data: bytes) -> Reply:
    return _reply_decoder.decode(data)

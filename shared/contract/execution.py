"""Requests to the executor and its replies: the contract between gateway and executor.

Requests travel by NATS request/reply on ``<ns>.exec`` (queue group ``executor``).
The gateway fills ``session_id`` from the ``X-Session-Id`` header and ``sandbox_id``
from the scheduler's answer, never from tool arguments, so one session can never
reach another session's sandbox.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from sbx_api import hostapi
from shared.contract import commands

JobStatus = Literal["running", "exited", "stopped", "lost"]
EditCommand = Literal["view", "create", "str_replace", "insert"]

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
    command: str


class ShellPoll(Request, frozen=True, kw_only=True, tag="shell_poll"):
    job_id: str


class ShellWait(Request, frozen=True, kw_only=True, tag="shell_wait"):
    job_id: str
    timeout: float | None = None


class ShellStop(Request, frozen=True, kw_only=True, tag="shell_stop"):
    job_id: str


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


AnyRequest = Shell | ShellAsync | ShellPoll | ShellWait | ShellStop | Edit | Run | PutFiles | GetFiles
REQUEST_TYPES = (Shell, ShellAsync, ShellPoll, ShellWait, ShellStop, Edit, Run, PutFiles, GetFiles)


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

"""Argument rules, each in one place with one wording, for every side that checks them:
the gateway (before anything is sent), the executor (never trusting the bus) and the
host client. Each returns the value (normalised where said) or raises
:class:`~sbx_api.errors.InvalidInput` with a message an agent can act on.
Session ids are in :mod:`shared.contract.ids`; host API paths in
:mod:`sbx_api.hostapi`."""

from __future__ import annotations

import posixpath
import re
from collections.abc import Mapping, Sequence
from typing import Protocol

from sbx_api import errors, hostapi

timeout = hostapi.validate_timeout
"""A timeout in seconds: more than 0, at most ``hostapi.MAX_TIMEOUT`` (None: the default)."""

MAX_PATH_CHARS = 4096
_JOB_ID = re.compile(r"[0-9a-f]{32}")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")


def command(text: str) -> str:
    """A shell command: not blank, no NUL (bash would cut it there)."""
    if not text.strip():
        raise errors.InvalidInput("command is empty; give a shell command, e.g. 'ls -la'")
    if "\0" in text:
        raise errors.InvalidInput("command must not contain a NUL byte")
    return text


def job_id(value: str) -> str:
    """The id ``shell_async`` returned."""
    if not isinstance(value, str) or not _JOB_ID.fullmatch(value):
        raise errors.InvalidInput(
            f"job_id {value!r:.60} is not a job id: it must be the 32 lower-case hex characters "
            "that shell_async returned"
        )
    return value


def path(value: str, *, what: str = "path") -> str:
    """An absolute path inside the sandbox, returned normalised: ``posixpath.normpath``
    plus collapsing the leading ``//`` POSIX lets it keep (``//x/./y/../z`` is ``/x/z``)."""
    if not isinstance(value, str):
        raise errors.InvalidInput(f"{what} must be a string, got {type(value).__name__}")
    if not value:
        raise errors.InvalidInput(f"{what} must not be empty; give an absolute path, e.g. /workspace/app.py")
    if "\0" in value:
        raise errors.InvalidInput(f"{what} must not contain a NUL byte")
    if len(value) > MAX_PATH_CHARS:
        raise errors.InvalidInput(f"{what} is {len(value)} characters long; the limit is {MAX_PATH_CHARS}")
    if not value.startswith("/"):
        raise errors.InvalidInput(f"{what} must be absolute, e.g. /workspace/app.py", path=value[:200])
    normalised = posixpath.normpath(value)
    if normalised.startswith("//"):
        normalised = "/" + normalised.lstrip("/")
    return normalised


def env_name(name: str) -> str:
    """An environment variable's name."""
    if not isinstance(name, str) or not _ENV_NAME.fullmatch(name):
        raise errors.InvalidInput(f"not a variable name: {str(name)[:100]!r}")
    return name


def env_value(name: str, value: str) -> str:
    """An environment variable's value: no NUL (the kernel would cut it there)."""
    if "\0" in value:
        raise errors.InvalidInput(f"the value of {name[:100]} contains a NUL byte")
    return value


class RunArgs(Protocol):
    """What a run carries (``hostapi.RunBody`` and ``execution.Run`` both do)."""

    @property
    def command(self) -> str: ...
    @property
    def cwd(self) -> str: ...
    @property
    def env(self) -> Mapping[str, str]: ...
    @property
    def unset(self) -> Sequence[str]: ...
    @property
    def timeout(self) -> float | None: ...
    @property
    def list_root(self) -> str | None: ...
    @property
    def prune(self) -> list[str]: ...


def run(args: RunArgs) -> None:
    """A host API run (``POST /v1/sessions/{id}/run``, the executor's ``Run``)."""
    command(args.command)
    path(args.cwd, what="cwd")
    for name in [*args.env, *args.unset]:
        env_name(name)
    for name, value in args.env.items():
        env_value(name, value)
    timeout(args.timeout)
    if args.list_root is not None:
        hostapi.validate_root(args.list_root)
    hostapi.validate_prune(args.prune)
